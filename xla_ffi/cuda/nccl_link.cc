#include "xla_ffi/cuda/nccl_link.h"

#include <algorithm>
#include <cstdint>

#include "xla_ffi/core/deadline.h"

namespace flexlink::gpu {
namespace {

uint8_t* Bytes(const void* p) { return static_cast<uint8_t*>(const_cast<void*>(p)); }

// How a staged piece runs, per chunk: which NCCL operation, and whether rows are packed before it
// and/or a kernel reads what it received.
enum class Staged {
  kGather,           // all_gather: NCCL gathers the chunk, a kernel unpacks the n rows
  kGatherReduce,     // all_reduce NCCL cannot reduce: gather, then reduce the n rows
  kPackScatter,      // reduce_scatter: pack the n rows, NCCL reduce-scatters into the output
  kPackSwapReduce,   // reduce_scatter NCCL cannot reduce: pack, exchange rows, reduce
  kPackSwap,         // all_to_all with outer > 1 or in place: pack, exchange rows, unpack
  kPermute,          // ppermute in place: receive into scratch, then copy into the output
};

}  // namespace

Status NcclLink::FromSpec(const plan::LinkSpec& spec, DeviceApi* api, CommApi* comm, std::unique_ptr<GpuLink>* out) {
  FLEXLINK_RETURN_IF_ERROR(plan::CheckParamKeys(spec, {"staging_mib"}));
  double mib = 0;
  FLEXLINK_RETURN_IF_ERROR(plan::GetDoubleParam(spec, "staging_mib", 8, 0.0625, 1024, &mib));
  NcclOptions options;
  options.staging_bytes = static_cast<size_t>(mib * (1 << 20)) / 64 * 64;
  *out = std::make_unique<NcclLink>(spec.name, api, comm, options);
  return Status::Ok();
}

std::unique_ptr<GpuChannel> NcclLink::Open(const GroupInfo& group) {
  return std::make_unique<NcclChannel>(name_, api_, comm_, group, options_);
}

NcclChannel::NcclChannel(std::string name, DeviceApi* api, CommApi* comm, GroupInfo group, NcclOptions options)
    : name_(std::move(name)), api_(*api), comm_(*comm), group_(std::move(group)), options_(options),
      ranks_(group_.size()) {}

Status NcclChannel::Setup() {
  const int n = group_.size();
  const std::string where = "flexlink: setting up the " + name_ + " link for group " + FormatIds(group_.ids) + ": ";
  for (int a = 0; a < n; ++a)
    for (int b = a + 1; b < n; ++b)
      if (group_.devices[a] == group_.devices[b])
        return Status::InvalidArgument(where + "ranks " + std::to_string(a) + " and " + std::to_string(b) +
                                       " are both on CUDA device " + std::to_string(group_.devices[a]) +
                                       "; NCCL puts at most one rank of a communicator on a GPU (the pcie "
                                       "link can run ranks that share one)");
  if (options_.staging_bytes < static_cast<size_t>(n) * 16)
    return Status::InvalidArgument(where + "staging_mib is too small for " + std::to_string(n) + " ranks");
  std::vector<Comm> comms;
  Status s = comm_.InitAll(group_.devices, &comms);
  if (!s.ok()) return Status::Internal(where + s.message());
  // Kept before any rank's set-up can fail, so that the shutdown destroys every one of them (NCCL
  // frees an in-process clique at its last rank's destroy).
  for (int r = 0; r < n; ++r) ranks_[r].comm = comms[r];
  for (int r = 0; r < n; ++r) FLEXLINK_RETURN_IF_ERROR(SetupRank(r, comms[r], where));
  return Status::Ok();
}

Status NcclChannel::SetupRank(int r, Comm comm, const std::string& where) {
  auto check = [&](Status st) { return st.ok() ? st : Status::Internal(where + st.message()); };
  Rank& k = ranks_[r];
  const int dev = group_.devices[r];
  k.comm = comm;
  FLEXLINK_RETURN_IF_ERROR(check(api_.SetDevice(dev)));
  FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateStream(dev, &k.comp)));
  for (Event* e : {&k.fork, &k.join, &k.nccl_done[0], &k.nccl_done[1], &k.packed[0], &k.packed[1],
                   &k.kernel_done[0], &k.kernel_done[1]})
    FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateEvent(dev, /*timing=*/false, e)));
  for (int p = 0; p < 2; ++p) {
    FLEXLINK_RETURN_IF_ERROR(check(ledger_.AllocDevice(dev, options_.staging_bytes, &k.send[p])));
    FLEXLINK_RETURN_IF_ERROR(check(ledger_.AllocDevice(dev, options_.staging_bytes, &k.recv[p])));
  }
  return Status::Ok();
}

Status NcclChannel::SetupAcrossProcesses(const CommId& id, std::span<const int> local,
                                         const CommApi::JoinWatch& watch) {
  const int n = group_.size();
  const std::string where = "flexlink: setting up the " + name_ + " link for group " + FormatIds(group_.ids) +
                            " across processes: ";
  // Two local ranks on one GPU are refused here, as NCCL would; ranks of other processes on the same
  // GPU as ours are NCCL's to refuse (ncclCommInitRank: "Duplicate GPU detected").
  for (size_t a = 0; a < local.size(); ++a)
    for (size_t b = a + 1; b < local.size(); ++b)
      if (group_.devices[local[a]] == group_.devices[local[b]])
        return Status::InvalidArgument(where + "ranks " + std::to_string(local[a]) + " and " + std::to_string(local[b]) +
                                       " are both on CUDA device " + std::to_string(group_.devices[local[a]]) +
                                       "; NCCL puts at most one rank of a communicator on a GPU");
  if (options_.staging_bytes < static_cast<size_t>(n) * 16)
    return Status::InvalidArgument(where + "staging_mib is too small for " + std::to_string(n) + " ranks");
  std::vector<int> devices;
  for (int r : local) devices.push_back(group_.devices[r]);
  std::vector<Comm> comms;
  Status s = comm_.InitRanks(id, n, local, devices, watch, &comms);
  // A join that gave up (a dead peer, the deadline) keeps its code and reason as they are: the
  // caller words them with the group, the collective and the missing ranks.
  if (!s.ok()) return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded
                          ? s
                          : Status(s.code(), where + s.message());
  for (size_t i = 0; i < local.size(); ++i) ranks_[local[i]].comm = comms[i];  // as in Setup
  for (size_t i = 0; i < local.size(); ++i) FLEXLINK_RETURN_IF_ERROR(SetupRank(local[i], comms[i], where));
  return Status::Ok();
}

Status NcclChannel::Abort() {
  if (aborted_) return Status::Ok();
  aborted_ = true;
  // Later enqueues (there should be none: the group is broken) are refused, not run on freed comms.
  (void)breaker_.Break(Status::Internal("its communicators were aborted after a hang"));
  Status first;
  for (Rank& k : ranks_) {
    if (!k.comm) continue;
    Status s = comm_.Abort(k.comm);
    if (!s.ok() && first.ok()) first = s;
    k.comm = nullptr;
  }
  return first;
}

Status NcclChannel::Release(double timeout_s) {
  (void)breaker_.Break(Status::Internal("it was released by the engine's shutdown"));
  // One deadline for all the ranks' communicators, not `timeout_s` each.
  const auto deadline = DeadlineAfter(timeout_s);
  Status first;
  for (Rank& k : ranks_) {  // an aborted group's are gone already (null)
    if (!k.comm) continue;
    Status s = comm_.Destroy(k.comm, SecondsLeft(deadline));
    if (!s.ok() && first.ok()) first = s;
    k.comm = nullptr;
  }
  Status s = ledger_.Release();
  return first.ok() ? s : first;
}

bool NcclChannel::Direct(const CallDesc& d, const Piece& piece) const {
  const Part& p = d.parts[piece.part];
  const bool whole = piece.units.begin == 0 && piece.units.end == p.units && p.outer == 1;
  switch (d.kind) {
    case Kind::kAllReduce: return NcclReductionOf(p.dtype, d.op).native;
    case Kind::kAllGather: return whole;
    case Kind::kReduceScatter: return whole && NcclReductionOf(p.dtype, d.op).native;
    // In place (the output is the input buffer), NCCL's receive would overwrite what its send of
    // the same group still reads: staged through scratch instead. The staged chunks keep every
    // read of a unit range before the write of that range (pack, or the send, then the copy).
    case Kind::kAllToAll: return p.outer == 1 && p.in != p.out;
    case Kind::kPpermute: return p.in != p.out;
  }
  return false;
}

Status NcclChannel::Enqueue(const GpuWork& work) {
  FLEXLINK_RETURN_IF_ERROR(breaker_.Check(name_));
  Call c{&work, &ranks_[work.rank], work.rank, group_.size()};
  const CallDesc& d = *work.desc;
  std::vector<const Piece*> direct, staged;
  for (const Piece& piece : work.pieces) (Direct(d, piece) ? direct : staged).push_back(&piece);
  Status s = EnqueueDirect(c, direct);
  for (const Piece* piece : staged)
    if (s.ok()) s = EnqueueStaged(c, *piece);
  // The kernel stream, once forked, is joined back into the call's stream also when a staged chunk
  // failed half way, so that the caller's stream never runs past kernels already enqueued into its
  // buffers. The join adds no unbounded wait of its own: the kernel stream waits only on NCCL
  // operations already enqueued (nccl_done: this call's, on the call's stream, which runs them
  // before the join anyway, or an earlier call's), and an NCCL operation whose peer gave up is the
  // hang detector's to release (it watches every call's ranges, failed ones too: gpu_executor.h).
  if (c.forked) {
    Status j = api_.Record(c.rank->join, c.rank->comp);
    if (j.ok()) j = api_.Wait(work.stream, c.rank->join);
    if (s.ok()) s = j;  // the first error is the call's
  }
  if (!s.ok()) {
    const bool prefixed = s.message().rfind("flexlink:", 0) == 0;
    return breaker_.Break(prefixed ? s : Status(s.code(), LinkWhere(work.label, d.kind, group_.ids, name_) + s.message()));
  }
  return s;
}

Status NcclChannel::Fork(Call& c) {
  if (c.forked) return Status::Ok();
  FLEXLINK_RETURN_IF_ERROR(api_.Record(c.rank->fork, c.work->stream));
  FLEXLINK_RETURN_IF_ERROR(api_.Wait(c.rank->comp, c.rank->fork));
  c.forked = true;
  return Status::Ok();
}

Status NcclChannel::EnqueueDirect(Call& c, const std::vector<const Piece*>& pieces) {
  if (pieces.empty()) return Status::Ok();
  const CallDesc& d = *c.work->desc;
  const Stream st = c.work->stream;
  const int r = c.r, n = c.n;
  const int src = d.kind == Kind::kPpermute ? d.sources[r] : -1;
  const int dst = d.kind == Kind::kPpermute ? d.DestinationOf(r) : -1;
  // The local parts first (a rank's own block, a ppermute to itself or from nobody): plain stream work.
  for (const Piece* piece : pieces) {
    const Part& p = d.parts[piece->part];
    const size_t w = p.width(), b = piece->units.begin, len = piece->units.size();
    if (d.kind == Kind::kAllToAll) {
      const size_t off = (r * p.inner + b) * w;
      FLEXLINK_RETURN_IF_ERROR(api_.Copy(Bytes(p.out) + off, Bytes(p.in) + off, len * w, st));
    } else if (d.kind == Kind::kPpermute && src == r) {
      FLEXLINK_RETURN_IF_ERROR(api_.Copy(Bytes(p.out) + b * w, Bytes(p.in) + b * w, len * w, st));
    } else if (d.kind == Kind::kPpermute && src < 0) {
      FLEXLINK_RETURN_IF_ERROR(api_.Zero(Bytes(p.out) + b * w, len * w, st));
    }
  }
  // Then every NCCL operation of these pieces in one group: NCCL issues them together.
  FLEXLINK_RETURN_IF_ERROR(comm_.GroupStart());
  Status s;
  Comm comm = c.rank->comm;
  for (const Piece* piece : pieces) {
    const Part& p = d.parts[piece->part];
    const size_t w = p.width(), b = piece->units.begin, len = piece->units.size();
    const uint8_t* x = Bytes(p.in);
    uint8_t* y = Bytes(p.out);
    switch (d.kind) {
      case Kind::kAllReduce: {
        const NcclReduction red = NcclReductionOf(p.dtype, d.op);
        s = comm_.AllReduce(x + b * w, y + b * w, len * red.lanes, red.type, red.op, comm, st);
        break;
      }
      case Kind::kAllGather: s = comm_.AllGather(x, y, p.units * w, CommType::kUint8, comm, st); break;
      case Kind::kReduceScatter: {
        const NcclReduction red = NcclReductionOf(p.dtype, d.op);
        s = comm_.ReduceScatter(x, y, p.units * red.lanes, red.type, red.op, comm, st);
        break;
      }
      case Kind::kAllToAll:
        for (int j = 0; j < n && s.ok(); ++j) {
          if (j == r) continue;
          const size_t off = (j * p.inner + b) * w;
          s = comm_.Send(x + off, len * w, CommType::kUint8, j, comm, st);
          if (s.ok()) s = comm_.Recv(y + off, len * w, CommType::kUint8, j, comm, st);
        }
        break;
      case Kind::kPpermute:
        if (dst >= 0 && dst != r) s = comm_.Send(x + b * w, len * w, CommType::kUint8, dst, comm, st);
        if (s.ok() && src >= 0 && src != r) s = comm_.Recv(y + b * w, len * w, CommType::kUint8, src, comm, st);
        break;
    }
    if (!s.ok()) break;
  }
  Status end = comm_.GroupEnd();  // always closes the group, also after an error
  return s.ok() ? end : s;
}

Status NcclChannel::EnqueueStaged(Call& c, const Piece& piece) {
  FLEXLINK_RETURN_IF_ERROR(Fork(c));
  Rank& k = *c.rank;
  const CallDesc& d = *c.work->desc;
  const Part& p = d.parts[piece.part];
  const int r = c.r, n = c.n;
  const size_t w = p.width(), nn = static_cast<size_t>(n);
  const Stream st = c.work->stream;
  const NcclReduction red = Reduces(d.kind) ? NcclReductionOf(p.dtype, d.op) : NcclReduction{};
  Staged mode = Staged::kPackSwap;
  switch (d.kind) {
    case Kind::kAllGather: mode = Staged::kGather; break;
    case Kind::kAllReduce: mode = Staged::kGatherReduce; break;
    case Kind::kReduceScatter: mode = red.native ? Staged::kPackScatter : Staged::kPackSwapReduce; break;
    case Kind::kPpermute: mode = Staged::kPermute; break;
    default: mode = Staged::kPackSwap; break;
  }
  const int src = d.kind == Kind::kPpermute ? d.sources[r] : -1;
  const int dst = d.kind == Kind::kPpermute ? d.DestinationOf(r) : -1;
  const bool pack = mode == Staged::kPackScatter || mode == Staged::kPackSwapReduce || mode == Staged::kPackSwap;
  const bool kernel = mode != Staged::kPackScatter;
  const size_t step = std::max<size_t>(1, options_.staging_bytes / ((mode == Staged::kPermute ? 1 : nn) * w));
  std::vector<std::pair<size_t, size_t>> chunks;  // (first unit, units)
  for (size_t b = piece.units.begin; b < piece.units.end; b += step)
    chunks.emplace_back(b, std::min(step, piece.units.end - b));

  // g: the chunk's index among the rank's staged chunks, across calls (scratch parity; Rank::staged).
  const uint64_t base = k.staged;
  auto pack_chunk = [&](size_t ci) -> Status {
    const uint64_t g = base + ci;
    const int lp = static_cast<int>(g % 2);
    // send[lp]'s last reader, NCCL's op of chunk g - 2 (maybe of an earlier call, on another stream).
    FLEXLINK_RETURN_IF_ERROR(api_.Wait(k.comp, k.nccl_done[lp]));
    LayoutArgs a{LayoutArgs::kPack, w, nn, p.inner, chunks[ci].first, chunks[ci].second, 0, nn, chunks[ci].second,
                 k.send[lp], Bytes(p.in)};
    FLEXLINK_RETURN_IF_ERROR(api_.Layout(a, k.comp));
    return api_.Record(k.packed[lp], k.comp);
  };
  if (pack && !chunks.empty()) FLEXLINK_RETURN_IF_ERROR(pack_chunk(0));
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const auto [cb, cu] = chunks[ci];
    const uint64_t g = base + ci;
    const int lp = static_cast<int>(g % 2);
    uint8_t* send = Bytes(k.send[lp]);
    uint8_t* recv = Bytes(k.recv[lp]);
    const size_t row = cu * w;
    // NCCL's part, on the link's stream.
    if (pack) FLEXLINK_RETURN_IF_ERROR(api_.Wait(st, k.packed[lp]));
    // recv[lp]'s last reader, the kernel of chunk g - 2 (maybe of an earlier call, on another stream).
    if (kernel) FLEXLINK_RETURN_IF_ERROR(api_.Wait(st, k.kernel_done[lp]));
    switch (mode) {
      case Staged::kGather:
      case Staged::kGatherReduce:
        FLEXLINK_RETURN_IF_ERROR(comm_.AllGather(Bytes(p.in) + cb * w, recv, row, CommType::kUint8, k.comm, st));
        break;
      case Staged::kPackScatter:
        FLEXLINK_RETURN_IF_ERROR(
            comm_.ReduceScatter(send, Bytes(p.out) + cb * w, cu * red.lanes, red.type, red.op, k.comm, st));
        break;
      case Staged::kPermute: {
        FLEXLINK_RETURN_IF_ERROR(comm_.GroupStart());
        Status s;
        if (dst >= 0 && dst != r) s = comm_.Send(Bytes(p.in) + cb * w, row, CommType::kUint8, dst, k.comm, st);
        if (s.ok() && src >= 0 && src != r) s = comm_.Recv(recv, row, CommType::kUint8, src, k.comm, st);
        Status end = comm_.GroupEnd();
        FLEXLINK_RETURN_IF_ERROR(s);
        FLEXLINK_RETURN_IF_ERROR(end);
        break;
      }
      case Staged::kPackSwapReduce:
      case Staged::kPackSwap: {
        FLEXLINK_RETURN_IF_ERROR(comm_.GroupStart());
        Status s;
        for (int j = 0; j < n && s.ok(); ++j) {
          if (j == r) continue;
          s = comm_.Send(send + j * row, row, CommType::kUint8, j, k.comm, st);
          if (s.ok()) s = comm_.Recv(recv + j * row, row, CommType::kUint8, j, k.comm, st);
        }
        Status end = comm_.GroupEnd();
        FLEXLINK_RETURN_IF_ERROR(s);
        FLEXLINK_RETURN_IF_ERROR(end);
        break;
      }
    }
    FLEXLINK_RETURN_IF_ERROR(api_.Record(k.nccl_done[lp], st));
    if (pack && ci + 1 < chunks.size()) FLEXLINK_RETURN_IF_ERROR(pack_chunk(ci + 1));
    if (!kernel) continue;
    // The kernel's part, on the kernel stream.
    FLEXLINK_RETURN_IF_ERROR(api_.Wait(k.comp, k.nccl_done[lp]));
    if (mode == Staged::kPermute) {
      // After NCCL's group (this rank's send of these units included): the received chunk, zeros
      // where no rank sends here, nothing for the pair (r, r) (the buffer already holds it).
      if (src >= 0 && src != r) FLEXLINK_RETURN_IF_ERROR(api_.Copy(Bytes(p.out) + cb * w, recv, row, k.comp));
      if (src < 0) FLEXLINK_RETURN_IF_ERROR(api_.Zero(Bytes(p.out) + cb * w, row, k.comp));
    } else if (mode == Staged::kGatherReduce || mode == Staged::kPackSwapReduce) {
      ReduceArgs a;
      a.dtype = p.dtype;
      a.op = d.op;
      a.dst = Bytes(p.out) + cb * w;
      a.rows = recv;
      a.row_stride = cu;
      a.nrows = n;
      a.own = mode == Staged::kPackSwapReduce ? r : -1;  // the gather holds every rank's row, own too
      a.own_src = send + r * row;
      a.count = cu;
      FLEXLINK_RETURN_IF_ERROR(api_.Reduce(a, k.comp));
    } else {
      // all_gather: every row came through NCCL; all_to_all: rows j != r did, row r is still in send.
      const struct { uint8_t* src; size_t first, count; } parts[] = {
          {recv, 0, mode == Staged::kGather ? nn : static_cast<size_t>(r)},
          {recv + (r + 1) * row, static_cast<size_t>(r + 1), mode == Staged::kGather ? 0 : nn - r - 1},
          {send + r * row, static_cast<size_t>(r), mode == Staged::kGather ? size_t{0} : size_t{1}}};
      for (const auto& q : parts) {
        if (!q.count) continue;
        LayoutArgs a{LayoutArgs::kUnpack, w, nn, p.inner, cb, cu, q.first, q.count, cu, q.src, p.out};
        FLEXLINK_RETURN_IF_ERROR(api_.Layout(a, k.comp));
      }
    }
    FLEXLINK_RETURN_IF_ERROR(api_.Record(k.kernel_done[lp], k.comp));
  }
  k.staged += chunks.size();
  return Status::Ok();
}

}  // namespace flexlink::gpu
