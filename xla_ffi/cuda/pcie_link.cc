#include "xla_ffi/cuda/pcie_link.h"

#include <algorithm>

namespace flexlink::gpu {

Status PcieLink::FromSpec(const plan::LinkSpec& spec, DeviceApi* api, std::unique_ptr<GpuLink>* out) {
  FLEXLINK_RETURN_IF_ERROR(plan::CheckParamKeys(spec, {"slot_mib"}));
  double mib = 0;
  FLEXLINK_RETURN_IF_ERROR(plan::GetDoubleParam(spec, "slot_mib", 8, 0.0625, 1024, &mib));
  PcieOptions options;
  options.slot_bytes = static_cast<size_t>(mib * (1 << 20)) / 64 * 64;
  *out = std::make_unique<PcieLink>(spec.name, api, options);
  return Status::Ok();
}

std::unique_ptr<GpuChannel> PcieLink::Open(const GroupInfo& group) {
  return std::make_unique<PcieChannel>(name_, api_, group, options_);
}

PcieChannel::PcieChannel(std::string name, DeviceApi* api, GroupInfo group, PcieOptions options)
    : name_(std::move(name)), api_(*api), group_(std::move(group)), options_(options),
      ranks_(group_.size()), gate_(group_.size(), group_.spin) {}

Status PcieChannel::Setup() {
  const int n = group_.size();
  const std::string where = "flexlink: setting up the " + name_ + " link for group " + FormatIds(group_.ids) + ": ";
  if (PcieMaxChunkUnits(Kind::kReduceScatter, 16, n, options_.slot_bytes) == 0)
    return Status::InvalidArgument(where + "slot_mib is too small for " + std::to_string(n) +
                                   " ranks (a slot holds one cell per pair of ranks)");
  auto check = [&](Status s) { return s.ok() ? s : Status::Internal(where + s.message()); };
  for (int round = 0; round < 2; ++round)
    for (int p = 0; p < 2; ++p) FLEXLINK_RETURN_IF_ERROR(check(ledger_.AllocPinnedHost(options_.slot_bytes, &host_[round][p])));
  for (int r = 0; r < n; ++r) {
    Rank& k = ranks_[r];
    k.device = group_.devices[r];
    FLEXLINK_RETURN_IF_ERROR(check(api_.SetDevice(k.device)));
    for (Stream* s : {&k.d2h, &k.h2d, &k.comp}) FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateStream(k.device, s)));
    std::vector<Event*> events = {&k.fork, &k.join[0], &k.join[1], &k.join[2], &k.d2h_end};
    for (auto& kind : k.ring)
      for (Event& e : kind) events.push_back(&e);
    for (int p = 0; p < 2; ++p) {
      for (Event* e : {&k.h2d_done[p], &k.kernel_done[p], &k.packed[p], &k.sent[p]}) events.push_back(e);
      FLEXLINK_RETURN_IF_ERROR(check(ledger_.AllocDevice(k.device, options_.slot_bytes, &k.recv[p])));
      FLEXLINK_RETURN_IF_ERROR(check(ledger_.AllocDevice(k.device, options_.slot_bytes, &k.send[p])));
    }
    for (Event* e : events) FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateEvent(k.device, /*timing=*/false, e)));
  }
  return Status::Ok();
}

Status PcieChannel::Release(double) {
  (void)breaker_.Break(Status::Internal("it was released by the engine's shutdown"));
  return ledger_.Release();
}

std::vector<int> PcieChannel::Others(int r) const {
  std::vector<int> v;
  for (int q = 0; q < group_.size(); ++q)
    if (q != r) v.push_back(q);
  return v;
}

Status PcieChannel::Enqueue(const GpuWork& work) {
  FLEXLINK_RETURN_IF_ERROR(breaker_.Check(name_));
  Call c{&work, &ranks_[work.rank], work.rank, group_.size(), {}};
  c.chunks = PcieChunks(*work.desc, c.n, options_.slot_bytes, work.pieces);
  Status s = EnqueueOrFail(c);
  if (!s.ok()) {
    gate_.Abort("rank " + std::to_string(work.rank) + " (device " + std::to_string(group_.devices[work.rank]) +
                ") could not enqueue its copies");
    const bool prefixed = s.message().rfind("flexlink:", 0) == 0;
    return breaker_.Break(
        prefixed ? s : Status(s.code(), LinkWhere(work.label, work.desc->kind, group_.ids, name_) + s.message()));
  }
  return s;
}

void PcieChannel::Forsake(const std::string& why) {
  (void)breaker_.Break(Status::Internal(why));
  gate_.Abort(why);
}

Status PcieChannel::EnqueueOrFail(Call& c) {
  Rank& k = *c.rank;
  const Stream stream = c.work->stream;
  const Stream own[3] = {k.d2h, k.h2d, k.comp};
  // Fork the link's streams from the caller's stream, run the schedule, join them back: every
  // stream forked is joined also when the schedule fails half way (a gate timed out or aborted by a
  // failed peer, a refused copy), so that the caller's stream never runs past copies already
  // enqueued into its buffers. Such a join waits for nothing unbounded: every wait on these streams
  // was issued after the record it binds to (the gate), so it refers to work already submitted.
  FLEXLINK_RETURN_IF_ERROR(api_.Record(k.fork, stream));
  bool forked[3] = {false, false, false};
  Status s;
  for (int i = 0; i < 3 && s.ok(); ++i) {
    s = api_.Wait(own[i], k.fork);
    forked[i] = s.ok();
  }
  if (s.ok()) {
    switch (c.work->desc->kind) {
      case Kind::kAllReduce: s = AllReduce(c); break;
      case Kind::kAllGather: s = AllGather(c); break;
      case Kind::kReduceScatter:
      case Kind::kAllToAll: s = ReduceScatterOrAllToAll(c); break;
      case Kind::kPpermute: s = Ppermute(c); break;
    }
  }
  for (int i = 0; i < 3; ++i) {
    if (!forked[i]) continue;
    Status j = api_.Record(k.join[i], own[i]);
    if (j.ok()) j = api_.Wait(stream, k.join[i]);
    if (s.ok()) s = j;  // the first error is the call's
  }
  return s;
}

Status PcieChannel::CopyRows(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows,
                             Stream s) {
  if (rows == 0 || width == 0) return Status::Ok();
  if (rows == 1) return api_.Copy(dst, src, width, s);
  return api_.Copy2D(dst, dpitch, src, spitch, width, rows, s);
}

// Producer side of chunk `s` of `round`: this rank is about to copy into host slot s % 2, which
// every rank (itself included) must have finished copying out of for chunk s - 2. Every rank, not
// only this rank's readers: cells are laid out by each chunk's own size (and the previous user of
// the slot may have been another call, of another kind), so this rank's cells of chunk s can cover
// any rank's cells of chunk s - 2. The sim test caught the narrower wait as corrupted ppermutes.
Status PcieChannel::ProduceBegin(Call& c, int round, uint64_t s) {
  Rank& k = *c.rank;
  const PcieGate::Kind consumed = PcieGate::Consumed(round);
  if (s >= 2) {
    for (int q = 0; q < c.n; ++q) {
      FLEXLINK_RETURN_IF_ERROR(gate_.AwaitRecorded(q, consumed, s - 2));
      FLEXLINK_RETURN_IF_ERROR(api_.Wait(k.d2h, ranks_[q].ring[consumed][(s - 2) % kRing]));
    }
    gate_.PublishWaited(c.r, consumed, s - 2);
  }
  return Status::Ok();
}

Status PcieChannel::ProduceEnd(Call& c, int round, uint64_t s) {
  const PcieGate::Kind posted = PcieGate::Posted(round);
  // The ring slot's previous record (s - kRing) must have been waited on by everyone who needed it.
  if (s >= kRing) FLEXLINK_RETURN_IF_ERROR(gate_.AwaitWaitedByAll(posted, s - kRing));
  FLEXLINK_RETURN_IF_ERROR(api_.Record(c.rank->ring[posted][s % kRing], c.rank->d2h));
  gate_.PublishRecorded(c.r, posted, s);
  return Status::Ok();
}

Status PcieChannel::ConsumeBegin(Call& c, int round, uint64_t s, const std::vector<int>& producers, bool after_own) {
  const PcieGate::Kind posted = PcieGate::Posted(round);
  for (int p : producers) {
    FLEXLINK_RETURN_IF_ERROR(gate_.AwaitRecorded(p, posted, s));
    FLEXLINK_RETURN_IF_ERROR(api_.Wait(c.rank->h2d, ranks_[p].ring[posted][s % kRing]));
  }
  // This rank's own copy out of chunk s, recorded by this thread just before: in place, the copies
  // in write the units that copy reads.
  if (after_own) FLEXLINK_RETURN_IF_ERROR(api_.Wait(c.rank->h2d, c.rank->ring[posted][s % kRing]));
  gate_.PublishWaited(c.r, posted, s);
  return Status::Ok();
}

Status PcieChannel::ConsumeEnd(Call& c, int round, uint64_t s) {
  const PcieGate::Kind consumed = PcieGate::Consumed(round);
  if (s >= kRing) FLEXLINK_RETURN_IF_ERROR(gate_.AwaitWaitedByAll(consumed, s - kRing));
  FLEXLINK_RETURN_IF_ERROR(api_.Record(c.rank->ring[consumed][s % kRing], c.rank->h2d));
  gate_.PublishRecorded(c.r, consumed, s);
  return Status::Ok();
}

}  // namespace flexlink::gpu
