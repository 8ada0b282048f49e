#include "xla_ffi/cuda/gpu_executor.h"

#include <algorithm>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/failover.h"
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
  for (const auto& link : links_->links)
    channels_.push_back(std::make_unique<FaultyGpuChannel>(link->Open(group_), group_.size()));
  // Health, as on CPU, is reported for groups with a link to fail over to; a one-link group keeps
  // only its call numbers (for error messages).
  health_ = std::make_shared<GroupHealth>(FormatIds(group_.ids), names_);
  if (names_.size() > 1) RegisterGroupHealth(health_, links_->version);
}

Status GpuExecutor::Run(CallContext& ctx, int rank, const CallDesc& desc, Stream stream) {
  const auto start = Clock::now();
  const int n = group_.size();
  const size_t links = names_.size();
  const uint64_t bytes = MessageBytes(desc, n);
  if (ready_.load(std::memory_order_acquire)) {
    PollTimings(rank);
    profiler_.Poll(rank);
  }
  CallState* state = ctx.ExecutorState<CallState>([&] {
    auto s = std::make_shared<CallState>();
    s->plan = balancer_.PlanFor(desc.kind, bytes);
    s->profile = profiler_.Decide(desc.kind, bytes, &s->plan);
    s->shares = s->plan->shares;
    s->call = health_->NextCall();
    s->unhealthy.assign(links, 0);
    if (links > 1) {
      s->shares = health_->Effective(s->plan->shares, s->call, desc.virtual_bytes(), &s->masked, &s->probe);
      for (size_t i = 0; i < links; ++i) s->unhealthy[i] = health_->Unhealthy(i);
    }
    s->faults = CurrentFaults();
    s->failed.assign(links, std::vector<char>(links, 0));
    s->errors.assign(links, "");
    // Every rank's parts have the shapes of this one's, or the arrival fails them all.
    s->ranges = plan::CutRanges(desc.virtual_bytes(), 1, s->shares);
    std::vector<uint64_t> link_bytes;
    for (const auto& r : s->ranges) link_bytes.push_back(desc.InputBytes(UnitRange{r.begin, r.end}, n));
    s->record = timings_.Open(s->plan, bytes, std::move(link_bytes));
    return s;
  });
  Assignment work(links);
  for (size_t i = 0; i < links; ++i)
    if (!state->ranges[i].empty()) work[i].push_back(state->ranges[i]);
  Status status = ctx.Arrive(rank, desc, names_[0]);
  if (status.ok()) status = EnsureSetup(rank, ctx.label());
  if (status.ok() && state->faults) status = Agree(ctx, rank, desc, *state, &work);
  if (status.ok()) status = Enqueue(ctx, rank, desc, stream, *state, work);
  if (rank == 0) RecordHealth(*state, desc, status.ok(), Since(start));
  // A call whose shares are not the plan's teaches stage 2 nothing (as on CPU), so its times go.
  bool moved = false;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    for (const std::string& e : state->errors) moved |= !e.empty();
  }
  if (!status.ok() || state->masked || moved) timings_.Lose(state->record);
  return status;
}

Status GpuExecutor::Agree(CallContext& ctx, int rank, const CallDesc& desc, CallState& state, Assignment* work) {
  const size_t links = names_.size();
  auto publish = [&](size_t round, size_t source, size_t link, const Status& s) {
    std::lock_guard<std::mutex> lock(state.mu);
    state.failed[round][source] = 1;
    if (state.errors[link].empty()) state.errors[link] = s.message();
  };
  // Round 0: each link's own range; round r: the ranges still without a link, on their carriers.
  for (size_t i = 0; i < links; ++i) {
    if (state.ranges[i].empty()) continue;
    Status s = channels_[i]->Admit(rank, *state.faults, ctx.label());
    if (!s.ok()) publish(0, i, i, s);
  }
  FLEXLINK_RETURN_IF_ERROR(ctx.Barrier(rank, 0, "agree on refused links", "executor"));
  std::vector<size_t> pending;
  std::vector<char> bad(links, 0);
  {
    std::lock_guard<std::mutex> lock(state.mu);
    for (size_t i = 0; i < links; ++i)
      if (state.failed[0][i]) pending.push_back(i), bad[i] = 1;
  }
  for (size_t round = 1; round < links && !pending.empty(); ++round) {
    // From the call's shared state only, so every rank chooses the same carriers: the healthy link
    // not failed in this call with the largest share (ties: the lower index), as on CPU.
    std::vector<size_t> carrier(links, links);
    for (size_t i : pending)
      carrier[i] = FailoverCarrier(bad, state.shares, [&](size_t j) { return state.unhealthy[j] != 0; });
    if (std::any_of(pending.begin(), pending.end(), [&](size_t i) { return carrier[i] == links; })) break;
    for (size_t i : pending) {
      Status s = channels_[carrier[i]]->Admit(rank, *state.faults, ctx.label());
      if (!s.ok()) publish(round, i, carrier[i], s);
    }
    FLEXLINK_RETURN_IF_ERROR(ctx.Barrier(rank, 0, "agree on refused links", "executor"));
    std::vector<size_t> still;
    std::lock_guard<std::mutex> lock(state.mu);
    for (size_t i : pending) {
      if (state.failed[round][i]) {
        still.push_back(i);
        bad[carrier[i]] = 1;
      } else {
        (*work)[carrier[i]].push_back(state.ranges[i]);
        (*work)[i].clear();
        if (rank == 0) state.moves.emplace_back(i, carrier[i]);
      }
    }
    pending = std::move(still);
  }
  if (pending.empty()) return Status::Ok();
  std::lock_guard<std::mutex> lock(state.mu);
  return Status::Internal(NoCarrierMessage(ctx.label(), desc.kind, FormatIds(group_.ids), state.call, names_,
                                           state.errors, [&](size_t j) { return state.unhealthy[j] != 0; }));
}

void GpuExecutor::RecordHealth(CallState& state, const CallDesc& desc, bool enqueued, double seconds) {
  if (names_.size() < 2) return;
  std::lock_guard<std::mutex> lock(state.mu);
  if (state.recorded) return;
  state.recorded = true;
  const int n = group_.size();
  for (size_t j = 0; j < names_.size(); ++j) {
    if (state.errors[j].empty()) continue;
    if (static_cast<int>(j) == state.probe) health_->Probed(j, state.call, false, state.errors[j]);
    else health_->Failed(j, state.call, state.errors[j]);
  }
  const std::string group = FormatIds(group_.ids);
  for (const auto& [from, to] : state.moves) {
    health_->FailedOver(from);
    const auto& r = state.ranges[from];
    RecordFailover(FailoverRecord{group, std::string(Name(desc.kind)), names_[from], names_[to], state.errors[from],
                                  state.call, desc.InputBytes(UnitRange{r.begin, r.end}, n), seconds, UnixNow()});
  }
  if (!enqueued) return;
  for (size_t i = 0; i < names_.size(); ++i) {
    if (state.ranges[i].empty() || !state.errors[i].empty()) continue;
    // Enqueued is all the host knows of a GPU range in its call: no bandwidth evidence here.
    health_->Observed(i, state.call, 0, -1, -1);
    if (static_cast<int>(i) == state.probe || state.unhealthy[i]) health_->Probed(i, state.call, true, "");
  }
}

Status GpuExecutor::Enqueue(CallContext& ctx, int rank, const CallDesc& desc, Stream stream, const CallState& state,
                            const Assignment& work) {
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
  for (size_t i = 0; i < work.size(); ++i)
    if (!work[i].empty()) slot.used.push_back(i);

  const std::string where = ErrorPrefix(ctx.label()) + std::string(Name(desc.kind)) + " on group " +
                            FormatIds(group_.ids) + ": ";
  auto check = [&](Status s) { return s.ok() || s.message().rfind("flexlink:", 0) == 0 ? s : Status(s.code(), where + s.message()); };
  FLEXLINK_RETURN_IF_ERROR(check(api_.Record(slot.start, stream)));
  thread_local std::vector<Piece> pieces;
  const bool alone = slot.used.size() == 1;  // one link: on XLA's stream itself, no fork or join
  for (size_t i : slot.used) {
    const Stream on = alone ? stream : k.side[i];
    if (!alone) FLEXLINK_RETURN_IF_ERROR(check(api_.Wait(on, slot.start)));
    // Its own range, then the ranges it carries for failed links, in the same order on every rank.
    for (const plan::UnitRange& r : work[i]) {
      desc.PiecesOf(UnitRange{r.begin, r.end}, &pieces);
      FLEXLINK_RETURN_IF_ERROR(channels_[i]->Enqueue(GpuWork{&desc, rank, pieces, on, ctx.label()}));
    }
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
