// The kinds of the tcp link that only move bytes: all_gather (a ring), ppermute and all_to_all
// (point-to-point messages routed along the ring, each rank forwarding what is not for it).
#include "xla_ffi/links/tcp_run.h"

namespace flexlink {

using tcp::Contiguous;
using tcp::Pieces;

// Ring all-gather of the range of every rank's block: receive block r-1, r-2, ... and forward all
// but the last. A block's range lands straight in the output when it is contiguous there, else in
// scratch (packed) and is then copied row piece by row piece.
void TcpRun::AllGather() {
  const size_t w = d_.width(), bytes = range_.size() * w, inner = d_.inner;
  const bool direct = Contiguous(range_.begin, range_.end, inner);
  char* staged = direct ? nullptr : Scratch((n_ - 1) * bytes);
  auto place = [=, this](size_t c, const char* src, size_t j) {  // packed chunk j of block c -> out
    Pieces(ChunkBegin(j), ChunkBegin(j) + ChunkCount(j), n_, c, inner,
           [&](size_t u, size_t e, size_t cnt) { std::memcpy(out_ + e * w, src + u * w, cnt * w); });
  };
  for (size_t j = 0; j < m_; ++j) {
    io_.Send(in_ + ChunkBegin(j) * w, ChunkCount(j) * w);
    place(k_, in_ + ChunkBegin(j) * w, j);
  }
  for (int s = 0; s < n_ - 1; ++s) {
    const size_t c = static_cast<size_t>((k_ - 1 - s + 2 * n_) % n_);
    for (size_t j = 0; j < m_; ++j) {
      char* dst = nullptr;
      if (direct)
        Pieces(ChunkBegin(j), ChunkBegin(j) + 1, n_, c, inner, [&](size_t, size_t e, size_t) { dst = out_ + e * w; });
      else
        dst = staged + s * bytes + (ChunkBegin(j) - range_.begin) * w;
      OnRecv(dst, ChunkCount(j) * w, [=, this] {
        if (!direct) place(c, dst, j);
        if (s < n_ - 2) io_.Send(dst, ChunkCount(j) * w);
      });
    }
  }
}

// ppermute: rank d's range comes from its source s: a message s -> d along the ring (d - s hops);
// an identity pair is a local copy and a rank without a source writes zeros.
void TcpRun::Ppermute() {
  const size_t w = d_.width(), bytes = range_.size() * w;
  const int source = call_.sources[k_];
  Route(1, [this](int origin, std::vector<int>* destinations) {
    destinations->clear();
    const int d = call_.DestinationOf(origin);
    if (d >= 0 && d != origin) destinations->push_back(d);
  });
  // After Route: in place, it has copied what this rank sends out of the buffer these bytes overwrite.
  char* out = out_ + range_.begin * w;
  if (source < 0) std::memset(out, 0, bytes);
  if (source == k_ && out_ != in_) std::memcpy(out, in_ + range_.begin * w, bytes);
}

// all_to_all: block t of rank o's input goes to block o of rank t's output, for every pair o != t;
// block r of this rank's own input stays here.
void TcpRun::AllToAll() {
  const size_t w = d_.width();
  // [outer, n, inner] in and out: block k_'s elements sit at the same offsets in both.
  if (out_ != in_)
    Pieces(range_.begin, range_.end, n_, k_, d_.inner,
           [&](size_t, size_t e, size_t count) { std::memcpy(out_ + e * w, in_ + e * w, count * w); });
  Route(n_, [this](int origin, std::vector<int>* destinations) {
    destinations->clear();
    for (int s = 1; s < n_; ++s) destinations->push_back((origin + s) % n_);
  });
}

// Point-to-point messages on the ring: message (o, t) is the range of block t of rank o's input (block
// 0 when nb == 1), for block o of rank t's output, and travels o -> o+1 -> ... -> t. Bytes move only
// through the sockets, so every rank in between forwards it.
//
// Order is what makes this work without any extra header: a rank sends its own messages first (in
// the order `destinations` gives, which must be the same function on every rank), then forwards the
// others in the order they arrive. So the stream from rank r-1 carries, for s = 1 .. n-1 in turn,
// the messages of origin o = r-s that reach at least as far as r (distance o -> t at least s), in o's
// own order — exactly the receives this rank posts below. Every receive has a destination from the
// start (the output, or scratch for messages passing through or landing in rows), so no rank ever
// stops reading and a ring of device threads cannot deadlock.
//
// In place (the output is the input buffer): receives land in the buffer the own messages come from,
// so those are always packed into scratch, here, before the pump starts; nothing else reads the input.
void TcpRun::Route(size_t nb, const std::function<void(int, std::vector<int>*)>& destinations) {
  const size_t w = d_.width(), inner = d_.inner, bytes = range_.size() * w;
  // A block's range is one row piece (always for ppermute): it goes straight from the input and into
  // the output; else it is packed into scratch for sending and placed row piece by row piece.
  const bool contiguous = Contiguous(range_.begin, range_.end, inner);
  const bool pack = !contiguous || out_ == in_;  // own messages go out of scratch
  auto block = [nb](int rank) { return nb == 1 ? size_t{0} : static_cast<size_t>(rank); };
  auto distance = [this](int o, int t) { return (t - o + n_) % n_; };
  auto offset = [this](size_t j) { return (ChunkBegin(j) - range_.begin) * d_.width(); };

  struct Message {
    int origin, dest;
  };
  std::vector<int> mine;
  destinations(k_, &mine);
  std::vector<Message> incoming;
  std::vector<int> dests;
  for (int s = 1; s < n_; ++s) {
    const int o = (k_ - s + n_) % n_;
    destinations(o, &dests);
    for (int t : dests)
      if (distance(o, t) >= s) incoming.push_back({o, t});
  }
  size_t regions = pack ? mine.size() : 0;
  for (const Message& m : incoming) regions += m.dest != k_ || !contiguous;
  char* next = Scratch(regions * bytes);  // sized once: pointers into it stay valid
  auto region = [&] {
    char* p = next;
    next += bytes;
    return p;
  };

  for (int t : mine) {
    char* packed = pack ? region() : nullptr;
    for (size_t j = 0; j < m_; ++j) {
      const char* src = nullptr;
      Pieces(ChunkBegin(j), ChunkBegin(j) + ChunkCount(j), nb, block(t), inner, [&](size_t u, size_t e, size_t count) {
        if (!pack) src = in_ + e * w;
        else std::memcpy(packed + offset(j) + u * w, in_ + e * w, count * w);
      });
      io_.Send(pack ? packed + offset(j) : src, ChunkCount(j) * w);
    }
  }
  for (const Message& m : incoming) {
    if (m.dest != k_) {  // passing through: received into scratch, sent on as it arrives
      char* through = region();
      for (size_t j = 0; j < m_; ++j)
        OnRecv(through + offset(j), ChunkCount(j) * w,
               [=, this] { io_.Send(through + offset(j), ChunkCount(j) * w); });
      continue;
    }
    if (contiguous) {
      for (size_t j = 0; j < m_; ++j) {
        char* dst = nullptr;
        Pieces(ChunkBegin(j), ChunkBegin(j) + 1, nb, block(m.origin), inner,
               [&](size_t, size_t e, size_t) { dst = out_ + e * w; });
        OnRecv(dst, ChunkCount(j) * w, [] {});
      }
      continue;
    }
    char* rows = region();
    const size_t b = block(m.origin);
    for (size_t j = 0; j < m_; ++j)
      OnRecv(rows + offset(j), ChunkCount(j) * w, [=, this] {
        Pieces(ChunkBegin(j), ChunkBegin(j) + ChunkCount(j), nb, b, inner, [&](size_t u, size_t e, size_t count) {
          std::memcpy(out_ + e * w, rows + offset(j) + u * w, count * w);
        });
      });
  }
}

}  // namespace flexlink
