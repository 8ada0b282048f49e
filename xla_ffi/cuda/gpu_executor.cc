#include "xla_ffi/cuda/gpu_executor.h"

#include <algorithm>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/stats.h"

namespace flexlink::gpu {

void SplitLog::Add(SplitRecord record) {
  std::lock_guard<std::mutex> lock(mu_);
  if (records_.size() < 4096) records_.push_back(std::move(record));
}

std::vector<SplitRecord> SplitLog::Take() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SplitRecord> out;
  out.swap(records_);
  return out;
}

GpuExecutor::GpuExecutor(GroupInfo group, std::shared_ptr<const GpuLinkSet> links, plan::BalancerOptions options,
                         DeviceApi* api, SplitLog* splits)
    : group_(std::move(group)),
      links_(std::move(links)),
      names_(links_->names()),
      api_(*api),
      splits_(splits),
      comm_(group_.ids),
      balancer_(names_, options),
      ranks_(group_.size()),
      timings_(group_.size()),
      profiler_(this) {
  for (const auto& link : links_->links) channels_.push_back(link->Open(group_));
}

Status GpuExecutor::Run(CallContext& ctx, int rank, const CallDesc& desc, Stream stream) {
  const int n = group_.size();
  const uint64_t bytes = MessageBytes(desc, n);
  if (ready_.load(std::memory_order_acquire)) {
    PollTimings(rank);
    profiler_.Poll(rank);
  }
  CallState* state = ctx.ExecutorState<CallState>([&] {
    auto s = std::make_shared<CallState>();
    s->plan = balancer_.PlanFor(desc.kind, bytes);
    s->profile = profiler_.Decide(desc.kind, bytes, &s->plan);
    // Every rank's parts have the shapes of this one's, or the arrival fails them all.
    s->ranges = plan::CutRanges(desc.virtual_bytes(), 1, s->plan->shares);
    std::vector<uint64_t> link_bytes;
    for (const auto& r : s->ranges) link_bytes.push_back(desc.InputBytes(UnitRange{r.begin, r.end}, n));
    s->record = timings_.Open(s->plan, bytes, std::move(link_bytes));
    return s;
  });
  Status status = ctx.Arrive(rank, desc, names_[0]);
  if (status.ok()) status = EnsureSetup(rank, ctx.label());
  if (status.ok()) status = Enqueue(ctx, rank, desc, stream, *state);
  if (!status.ok()) timings_.Lose(state->record);
  return status;
}

Status GpuExecutor::Enqueue(CallContext& ctx, int rank, const CallDesc& desc, Stream stream, const CallState& state) {
  Rank& k = ranks_[rank];
  if (state.profile.session) FLEXLINK_RETURN_IF_ERROR(profiler_.Enqueue(state.profile, rank, stream, ctx.label()));

  // This call's timing slot; one still in flight from long ago is given up.
  std::lock_guard<std::mutex> slots_lock(k.slots_mu);
  Slot& slot = k.slots[k.next_slot];
  k.next_slot = (k.next_slot + 1) % k.slots.size();
  if (slot.busy && !ReadSlot(rank, slot)) {
    timings_.Lose(slot.record);
    slot.busy = false;
  }
  slot.used.clear();
  for (size_t i = 0; i < state.ranges.size(); ++i)
    if (!state.ranges[i].empty()) slot.used.push_back(i);

  const std::string where = ErrorPrefix(ctx.label()) + std::string(Name(desc.kind)) + " on group " +
                            FormatIds(group_.ids) + ": ";
  auto check = [&](Status s) { return s.ok() || s.message().rfind("flexlink:", 0) == 0 ? s : Status(s.code(), where + s.message()); };
  FLEXLINK_RETURN_IF_ERROR(check(api_.Record(slot.start, stream)));
  thread_local std::vector<Piece> pieces;
  const bool alone = slot.used.size() == 1;  // one link: on XLA's stream itself, no fork or join
  for (size_t i : slot.used) {
    desc.PiecesOf(UnitRange{state.ranges[i].begin, state.ranges[i].end}, &pieces);
    const Stream on = alone ? stream : k.side[i];
    if (!alone) FLEXLINK_RETURN_IF_ERROR(check(api_.Wait(on, slot.start)));
    FLEXLINK_RETURN_IF_ERROR(channels_[i]->Enqueue(GpuWork{&desc, rank, pieces, on, ctx.label()}));
    FLEXLINK_RETURN_IF_ERROR(check(api_.Record(slot.stop[i], on)));
    if (!alone) FLEXLINK_RETURN_IF_ERROR(check(api_.Wait(stream, slot.stop[i])));
  }
  slot.record = state.record;
  slot.busy = true;
  if (splits_->enabled()) {
    SplitRecord rec{FormatIds(group_.ids), ctx.run_id(), ctx.call_number(), rank, {}};
    for (const auto& r : state.ranges) rec.ranges.emplace_back(r.begin, r.end);
    splits_->Add(std::move(rec));
  }
  return Status::Ok();
}

bool GpuExecutor::ReadSlot(int rank, Slot& slot) {
  std::string error;
  for (size_t i : slot.used) {
    const Poll p = api_.Query(slot.stop[i], &error);
    if (p == Poll::kPending) return false;
    if (p == Poll::kError) {
      LogInfo("group " + FormatIds(group_.ids) + " rank " + std::to_string(rank) + ": timing of a call lost: " + error);
      timings_.Lose(slot.record);
      slot.busy = false;
      return true;
    }
  }
  std::vector<double> seconds(names_.size(), 0.0);
  double call = 0;
  for (size_t i : slot.used) {
    Status s = api_.ElapsedSeconds(slot.start, slot.stop[i], &seconds[i]);
    if (!s.ok()) {
      timings_.Lose(slot.record);
      slot.busy = false;
      return true;
    }
    call = std::max(call, seconds[i]);
  }
  slot.busy = false;
  if (auto done = timings_.Add(slot.record, seconds, call)) Report(*done);
  return true;
}

void GpuExecutor::PollAll() {
  if (!ready_.load(std::memory_order_acquire)) return;
  for (int r = 0; r < group_.size(); ++r) PollTimings(r);
}

void GpuExecutor::PollTimings(int rank) {
  Rank& k = ranks_[rank];
  std::lock_guard<std::mutex> lock(k.slots_mu);
  // Oldest first; calls complete in order on XLA's stream, so the first pending one ends the scan.
  const size_t m = k.slots.size();
  for (size_t j = 0; j < m; ++j) {
    Slot& slot = k.slots[(k.next_slot + j) % m];
    if (slot.busy && !ReadSlot(rank, slot)) break;
  }
}

void GpuExecutor::Report(const TimingRecord& r) {
  const plan::Balancer::Outcome outcome = balancer_.Report(*r.plan, r.message_bytes, r.link_seconds, r.call_seconds);
  for (size_t i = 0; i < names_.size(); ++i)
    if (r.link_seconds[i] > 0) RecordLinkCall(names_[i], r.link_bytes[i], r.link_seconds[i]);
  if (outcome.changed) LogInfo("group " + FormatIds(group_.ids) + ": " + outcome.reason);
}

}  // namespace flexlink::gpu
