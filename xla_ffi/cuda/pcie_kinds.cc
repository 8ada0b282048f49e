// The pcie link's schedule per collective: which copies and kernels each rank issues for each chunk,
// on which of its three streams, between which events. Host slot layouts are those of pcie_chunks.h;
// "cells" below are regions of a host slot, "rows" regions of a device scratch buffer. Local buffers
// (recv, send, their events) alternate by the rank's chunk count, which continues across calls (lp,
// LocalParity), and every write of one waits on its last reader's event, recorded in this call or an
// earlier one; host slots alternate by the chunk's sequence number in its round (HostSlot), which
// continues across calls too.
#include <algorithm>
#include <cstdint>

#include "xla_ffi/cuda/pcie_link.h"

namespace flexlink::gpu {
namespace {

uint8_t* Bytes(void* p) { return static_cast<uint8_t*>(p); }
uint8_t* Bytes(const void* p) { return static_cast<uint8_t*>(const_cast<void*>(p)); }

}  // namespace

#define PCIE_TRY(expr) FLEXLINK_RETURN_IF_ERROR(expr)

Status PcieChannel::AllReduce(Call& c) {
  Rank& k = *c.rank;
  const int r = c.r, n = c.n;
  const std::vector<int> others = Others(r);
  const CallDesc& d = *c.work->desc;
  const size_t m = c.chunks.size();
  const uint64_t base0 = k.seq[0], base1 = k.seq[1];

  // Round 1 of chunk ci: rank r posts its reduced slice, then copies in everyone else's.
  auto round1 = [&](size_t ci) -> Status {
    const PcieChunk& ch = c.chunks[ci];
    const Part& p = d.parts[ch.part];
    const size_t w = p.width();
    const Slices sl = SlicesOf(ch.units, n);
    uint8_t* y = Bytes(p.out) + ch.begin * w;
    const uint64_t s = base1 + ci;
    uint8_t* host = HostSlot(1, s);  // cells [slice j], laid out as the chunk itself
    PCIE_TRY(ProduceBegin(c, 1, s));
    PCIE_TRY(api_.Wait(k.d2h, k.kernel_done[LocalParity(c, ci)]));
    if (sl.size(r)) PCIE_TRY(api_.Copy(host + sl.begin(r) * w, y + sl.begin(r) * w, sl.size(r) * w, k.d2h));
    PCIE_TRY(ProduceEnd(c, 1, s));
    PCIE_TRY(ConsumeBegin(c, 1, s, others));
    const size_t mine_end = sl.begin(r) + sl.size(r);
    if (sl.begin(r)) PCIE_TRY(api_.Copy(y, host, sl.begin(r) * w, k.h2d));
    if (ch.units > mine_end)
      PCIE_TRY(api_.Copy(y + mine_end * w, host + mine_end * w, (ch.units - mine_end) * w, k.h2d));
    return ConsumeEnd(c, 1, s);
  };

  for (size_t ci = 0; ci < m; ++ci) {
    const PcieChunk& ch = c.chunks[ci];
    const Part& p = d.parts[ch.part];
    const size_t w = p.width();
    const Slices sl = SlicesOf(ch.units, n);
    const size_t cell = sl.len * w;
    const uint8_t* x = Bytes(p.in) + ch.begin * w;
    uint8_t* y = Bytes(p.out) + ch.begin * w;
    const uint64_t s = base0 + ci;
    uint8_t* host = HostSlot(0, s);  // cells [slice j][producer p]
    const int lp = LocalParity(c, ci);

    // Round 0, producer: slice j of this chunk to cell [j][r], for every j but r. Runs of full
    // slices go as one 2-D copy.
    PCIE_TRY(ProduceBegin(c, 0, s));
    for (int j = 0; j < n;) {
      if (j == r || sl.size(j) == 0) {
        ++j;
        continue;
      }
      int e = j;
      while (e < n && e != r && sl.size(e) == sl.len) ++e;
      if (e == j) e = j + 1;  // a short last slice alone
      PCIE_TRY(CopyRows(host + (static_cast<size_t>(j) * n + r) * cell, n * cell, x + sl.begin(j) * w, cell,
                        sl.size(j) * w, e - j, k.d2h));
      j = e;
    }
    PCIE_TRY(ProduceEnd(c, 0, s));

    // Round 0, consumer: cells [r][p] for p != r into recv rows p; then reduce slice r on the GPU.
    PCIE_TRY(ConsumeBegin(c, 0, s, others));
    if (sl.size(r)) {
      PCIE_TRY(api_.Wait(k.h2d, k.kernel_done[lp]));  // recv[lp]'s last reader, maybe of an earlier call
      uint8_t* recv = Bytes(k.recv[lp]);
      const uint8_t* mine = host + static_cast<size_t>(r) * n * cell;
      if (r) PCIE_TRY(api_.Copy(recv, mine, r * cell, k.h2d));
      if (r + 1 < n) PCIE_TRY(api_.Copy(recv + (r + 1) * cell, mine + (r + 1) * cell, (n - r - 1) * cell, k.h2d));
      PCIE_TRY(api_.Record(k.h2d_done[lp], k.h2d));
    }
    PCIE_TRY(ConsumeEnd(c, 0, s));
    if (sl.size(r)) {
      PCIE_TRY(api_.Wait(k.comp, k.h2d_done[lp]));
      ReduceArgs a;
      a.dtype = p.dtype;
      a.op = d.op;
      a.dst = y + sl.begin(r) * w;
      a.rows = k.recv[lp];
      a.row_stride = sl.len;
      a.nrows = n;
      a.own = r;
      a.own_src = x + sl.begin(r) * w;
      a.count = sl.size(r);
      PCIE_TRY(api_.Reduce(a, k.comp));
    }
    PCIE_TRY(api_.Record(k.kernel_done[lp], k.comp));  // round 1 of this chunk waits for it
    if (ci > 0) PCIE_TRY(round1(ci - 1));               // pipelined one chunk behind round 0
  }
  if (m > 0) PCIE_TRY(round1(m - 1));
  k.seq[0] += m;
  k.seq[1] += m;
  k.local += m;
  return Status::Ok();
}

Status PcieChannel::AllGather(Call& c) {
  Rank& k = *c.rank;
  const int r = c.r, n = c.n;
  const std::vector<int> others = Others(r);
  const CallDesc& d = *c.work->desc;
  // Rank r's own block straight from its input, once per piece.
  for (const Piece& piece : c.work->pieces) {
    const Part& p = d.parts[piece.part];
    const size_t w = p.width(), b = piece.units.begin, len = piece.units.size();
    if (!len) continue;
    if (p.outer == 1) {
      PCIE_TRY(api_.Copy(Bytes(p.out) + (r * p.inner + b) * w, Bytes(p.in) + b * w, len * w, k.comp));
    } else {
      LayoutArgs a{LayoutArgs::kUnpack, w, static_cast<size_t>(n), p.inner, b, len, static_cast<size_t>(r), 1, len,
                   Bytes(p.in) + b * w, p.out};
      PCIE_TRY(api_.Layout(a, k.comp));
    }
  }
  const uint64_t base = k.seq[0];
  for (size_t ci = 0; ci < c.chunks.size(); ++ci) {
    const PcieChunk& ch = c.chunks[ci];
    const Part& p = d.parts[ch.part];
    const size_t w = p.width(), cell = ch.units * w, row = p.inner * w;
    const uint64_t s = base + ci;
    uint8_t* host = HostSlot(0, s);  // cells [producer p]
    const int lp = LocalParity(c, ci);
    PCIE_TRY(ProduceBegin(c, 0, s));
    PCIE_TRY(api_.Copy(host + r * cell, Bytes(p.in) + ch.begin * w, cell, k.d2h));
    PCIE_TRY(ProduceEnd(c, 0, s));
    PCIE_TRY(ConsumeBegin(c, 0, s, others));
    uint8_t* y = Bytes(p.out);
    if (p.outer == 1) {  // block p of the output is contiguous: copy cell p straight there
      PCIE_TRY(CopyRows(y + ch.begin * w, row, host, cell, cell, r, k.h2d));
      PCIE_TRY(CopyRows(y + ((r + 1) * p.inner + ch.begin) * w, row, host + (r + 1) * cell, cell, cell, n - r - 1,
                        k.h2d));
      PCIE_TRY(ConsumeEnd(c, 0, s));
      continue;
    }
    PCIE_TRY(api_.Wait(k.h2d, k.kernel_done[lp]));  // recv[lp]'s last reader, maybe of an earlier call
    uint8_t* recv = Bytes(k.recv[lp]);
    if (r) PCIE_TRY(api_.Copy(recv, host, r * cell, k.h2d));
    if (r + 1 < n) PCIE_TRY(api_.Copy(recv + (r + 1) * cell, host + (r + 1) * cell, (n - r - 1) * cell, k.h2d));
    PCIE_TRY(api_.Record(k.h2d_done[lp], k.h2d));
    PCIE_TRY(ConsumeEnd(c, 0, s));
    PCIE_TRY(api_.Wait(k.comp, k.h2d_done[lp]));
    for (auto [first, count] : {std::pair<size_t, size_t>{0, r}, {r + 1, n - r - 1}}) {
      if (!count) continue;
      LayoutArgs a{LayoutArgs::kUnpack, w, static_cast<size_t>(n), p.inner, ch.begin, ch.units, first, count,
                   ch.units, recv + first * cell, p.out};
      PCIE_TRY(api_.Layout(a, k.comp));
    }
    PCIE_TRY(api_.Record(k.kernel_done[lp], k.comp));
  }
  k.seq[0] += c.chunks.size();
  k.local += c.chunks.size();
  return Status::Ok();
}

Status PcieChannel::Ppermute(Call& c) {
  Rank& k = *c.rank;
  const int r = c.r;
  const CallDesc& d = *c.work->desc;
  const int src = d.sources[r], dst = d.DestinationOf(r);
  // The pairs (r, r) and "no source" are local. In place (the output is the input) they wait for
  // this call's copies out, which read the same units.
  auto local = [&]() -> Status {
    for (const Piece& piece : c.work->pieces) {
      const Part& p = d.parts[piece.part];
      const size_t w = p.width(), b = piece.units.begin, len = piece.units.size();
      if (!len) continue;
      if (src == r && p.out != p.in) PCIE_TRY(api_.Copy(Bytes(p.out) + b * w, Bytes(p.in) + b * w, len * w, k.comp));
      if (src < 0) PCIE_TRY(api_.Zero(Bytes(p.out) + b * w, len * w, k.comp));
    }
    return Status::Ok();
  };
  bool in_place = false;
  for (const Piece& piece : c.work->pieces) in_place = in_place || d.parts[piece.part].in == d.parts[piece.part].out;
  if (!in_place) PCIE_TRY(local());
  const bool sends = dst >= 0 && dst != r;
  const std::vector<int> producers = src >= 0 && src != r ? std::vector<int>{src} : std::vector<int>{};
  const uint64_t base = k.seq[0];
  for (size_t ci = 0; ci < c.chunks.size(); ++ci) {
    const PcieChunk& ch = c.chunks[ci];
    const Part& p = d.parts[ch.part];
    const size_t w = p.width(), cell = ch.units * w;
    const uint64_t s = base + ci;
    uint8_t* host = HostSlot(0, s);  // cells [producer p]
    PCIE_TRY(ProduceBegin(c, 0, s));
    if (sends) PCIE_TRY(api_.Copy(host + r * cell, Bytes(p.in) + ch.begin * w, cell, k.d2h));
    PCIE_TRY(ProduceEnd(c, 0, s));
    PCIE_TRY(ConsumeBegin(c, 0, s, producers, /*after_own=*/sends && p.in == p.out));
    if (!producers.empty()) PCIE_TRY(api_.Copy(Bytes(p.out) + ch.begin * w, host + src * cell, cell, k.h2d));
    PCIE_TRY(ConsumeEnd(c, 0, s));
  }
  k.seq[0] += c.chunks.size();
  if (in_place) {
    PCIE_TRY(api_.Record(k.d2h_end, k.d2h));
    PCIE_TRY(api_.Wait(k.comp, k.d2h_end));
    PCIE_TRY(local());
  }
  return Status::Ok();
}

Status PcieChannel::ReduceScatterOrAllToAll(Call& c) {
  Rank& k = *c.rank;
  const int r = c.r, n = c.n;
  const std::vector<int> others = Others(r);
  const CallDesc& d = *c.work->desc;
  const bool reduce = d.kind == Kind::kReduceScatter;
  if (!reduce) {  // all_to_all keeps its own block r; with outer > 1 it is unpacked per chunk below
    for (const Piece& piece : c.work->pieces) {
      const Part& p = d.parts[piece.part];
      const size_t w = p.width(), off = (r * p.inner + piece.units.begin) * w;
      if (p.outer == 1 && piece.units.size() && p.out != p.in)
        PCIE_TRY(api_.Copy(Bytes(p.out) + off, Bytes(p.in) + off, piece.units.size() * w, k.comp));
    }
  }
  const size_t m = c.chunks.size();
  // Rows of the [outer, n, inner] input that are not contiguous (outer > 1) are packed on the GPU
  // first, one chunk ahead, into send[lp]: row j for rank j.
  auto pack = [&](size_t ci) -> Status {
    const PcieChunk& ch = c.chunks[ci];
    const Part& p = d.parts[ch.part];
    if (p.outer == 1) return Status::Ok();
    const int lp = LocalParity(c, ci);
    PCIE_TRY(api_.Wait(k.comp, k.sent[lp]));  // send[lp]'s last copy out, maybe of an earlier call
    LayoutArgs a{LayoutArgs::kPack, p.width(), static_cast<size_t>(n), p.inner, ch.begin, ch.units, 0,
                 static_cast<size_t>(n), ch.units, k.send[lp], Bytes(p.in)};
    PCIE_TRY(api_.Layout(a, k.comp));
    return api_.Record(k.packed[lp], k.comp);
  };
  if (m > 0) PCIE_TRY(pack(0));
  const uint64_t base = k.seq[0];
  for (size_t ci = 0; ci < m; ++ci) {
    const PcieChunk& ch = c.chunks[ci];
    const Part& p = d.parts[ch.part];
    const size_t w = p.width(), cell = ch.units * w, row = p.inner * w;
    const uint64_t s = base + ci;
    uint8_t* host = HostSlot(0, s);  // cells [consumer j][producer p]
    const int lp = LocalParity(c, ci);
    const bool packed = p.outer > 1;
    // Producer: row j (x[o, j, i] over the chunk's units) to cell [j][r], for every j but r.
    const uint8_t* rows = packed ? Bytes(k.send[lp]) : Bytes(p.in) + ch.begin * w;
    const size_t pitch = packed ? cell : row;
    PCIE_TRY(ProduceBegin(c, 0, s));
    if (packed) PCIE_TRY(api_.Wait(k.d2h, k.packed[lp]));
    PCIE_TRY(CopyRows(host + r * cell, n * cell, rows, pitch, cell, r, k.d2h));
    PCIE_TRY(CopyRows(host + ((r + 1) * n + r) * cell, n * cell, rows + (r + 1) * pitch, pitch, cell, n - r - 1, k.d2h));
    if (packed) PCIE_TRY(api_.Record(k.sent[lp], k.d2h));
    PCIE_TRY(ProduceEnd(c, 0, s));
    if (ci + 1 < m) PCIE_TRY(pack(ci + 1));

    // Consumer: cells [r][p], p != r.
    const uint8_t* mine = host + static_cast<size_t>(r) * n * cell;
    // In place, all_to_all's copies in (or its unpack kernel, after them) write the chunk's units of
    // the blocks this rank's copies out read.
    PCIE_TRY(ConsumeBegin(c, 0, s, others, /*after_own=*/!reduce && p.in == p.out));
    if (!reduce && !packed) {  // all_to_all with contiguous blocks: straight into block p
      uint8_t* y = Bytes(p.out) + ch.begin * w;
      PCIE_TRY(CopyRows(y, row, mine, cell, cell, r, k.h2d));
      PCIE_TRY(CopyRows(y + (r + 1) * row, row, mine + (r + 1) * cell, cell, cell, n - r - 1, k.h2d));
      PCIE_TRY(ConsumeEnd(c, 0, s));
      continue;
    }
    PCIE_TRY(api_.Wait(k.h2d, k.kernel_done[lp]));  // recv[lp]'s last reader, maybe of an earlier call
    uint8_t* recv = Bytes(k.recv[lp]);
    if (r) PCIE_TRY(api_.Copy(recv, mine, r * cell, k.h2d));
    if (r + 1 < n) PCIE_TRY(api_.Copy(recv + (r + 1) * cell, mine + (r + 1) * cell, (n - r - 1) * cell, k.h2d));
    PCIE_TRY(api_.Record(k.h2d_done[lp], k.h2d));
    PCIE_TRY(ConsumeEnd(c, 0, s));
    PCIE_TRY(api_.Wait(k.comp, k.h2d_done[lp]));
    const uint8_t* own = packed ? Bytes(k.send[lp]) + r * cell : Bytes(p.in) + (r * p.inner + ch.begin) * w;
    if (reduce) {
      ReduceArgs a;
      a.dtype = p.dtype;
      a.op = d.op;
      a.dst = Bytes(p.out) + ch.begin * w;
      a.rows = recv;
      a.row_stride = ch.units;
      a.nrows = n;
      a.own = r;
      a.own_src = own;
      a.count = ch.units;
      PCIE_TRY(api_.Reduce(a, k.comp));
    } else {
      // Blocks p != r from recv, block r from this rank's own packed row.
      const struct { const uint8_t* src; size_t first, count; } parts[] = {
          {recv, 0, static_cast<size_t>(r)},
          {recv + (r + 1) * cell, static_cast<size_t>(r + 1), static_cast<size_t>(n - r - 1)},
          {own, static_cast<size_t>(r), 1}};
      for (const auto& q : parts) {
        if (!q.count) continue;
        LayoutArgs a{LayoutArgs::kUnpack, w, static_cast<size_t>(n), p.inner, ch.begin, ch.units, q.first, q.count,
                     ch.units, const_cast<uint8_t*>(q.src), p.out};
        PCIE_TRY(api_.Layout(a, k.comp));
      }
    }
    PCIE_TRY(api_.Record(k.kernel_done[lp], k.comp));
  }
  k.seq[0] += m;
  k.local += m;
  return Status::Ok();
}

}  // namespace flexlink::gpu
