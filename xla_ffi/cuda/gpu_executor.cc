#include "xla_ffi/cuda/gpu_executor.h"

#include <algorithm>
#include <atomic>
#include <cstdio>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/failover.h"
#include "xla_ffi/core/spin.h"
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
      spin_(group_.spin),
      comm_(group_.ids),
      balancer_(names_, options),
      ranks_(group_.size()),
      timings_(group_.size(), spin_),
      profiler_(this),
      board_(group_.size()),
      absent_calls_(group_.size()),
      clean_rate_(names_.size(), 0.0) {
  comm_.SetSpin(spin_);
  for (const auto& link : links_->links)
    channels_.push_back(std::make_unique<FaultyGpuChannel>(link->Open(group_), group_.size()));
  // Health, as on CPU, is reported for groups with a link to fail over to (the engine registers
  // those of the current links); a one-link group keeps only its call numbers (error messages).
  health_ = std::make_shared<GroupHealth>(FormatIds(group_.ids), names_);
}

using plan::RangeMessageBytes;

double GpuExecutor::Predict(const CallState& state, size_t link, double message_bytes) {
  if (!state.fits.empty()) return state.fits[link].Predict(message_bytes);
  {
    const std::unique_lock<std::mutex> lock = LockSpinning(rate_mu_, spin_);
    if (clean_rate_[link] > 0) return clean_rate_[link] * message_bytes;
  }
  return plan::UnfittedSeconds(message_bytes);
}

Status GpuExecutor::Run(CallContext& ctx, int rank, const CallDesc& desc, Stream stream) {
  const auto start = Clock::now();
  const int n = group_.size();
  const size_t links = names_.size();
  const uint64_t bytes = MessageBytes(desc, n);
  if (setup_.ready()) {
    PollTimings(rank);
    profiler_.Poll(rank);
  }
  uint64_t absent = 0;  // injected rank:absent: the group's call this rank stays away from
  if (std::shared_ptr<const FaultSet> faults = CurrentFaults()) {
    const uint64_t c = absent_calls_.Next(rank, *faults);
    if (faults->AbsentAt(rank, c)) absent = c;
  }
  CallState* state = ctx.ExecutorState<CallState>([&] {
    auto s = std::make_shared<CallState>();
    {
      // A call begun after the break enqueues nothing; one begun before is counted until all its
      // ranks have left, so that the communicators are aborted only once no rank can touch them.
      std::lock_guard<std::mutex> lock(broken_mu_);
      s->broken = broken_;
      if (s->broken.empty()) ++host_calls_;
    }
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
    (void)balancer_.FitsFor(desc.kind, &s->fits);
    // Every rank's parts have the shapes of this one's, or the arrival fails them all.
    s->ranges = plan::CutRanges(desc.virtual_bytes(), 1, s->shares);
    std::vector<uint64_t> link_bytes, link_message;
    for (const auto& r : s->ranges) {
      link_bytes.push_back(desc.InputBytes(UnitRange{r.begin, r.end}, n));
      link_message.push_back(RangeMessageBytes(bytes, r, desc.virtual_bytes()));
    }
    s->record = timings_.Open(s->plan, bytes, std::move(link_bytes), s->call, std::move(link_message));
    return s;
  });
  // A rank leaves the call's host part once (the hang detector waits for every rank of a call begun
  // before a break to have left before it aborts the communicators).
  auto leave = [&] {
    if (state->left.fetch_add(1) + 1 == n) {
      std::lock_guard<std::mutex> lock(broken_mu_);
      --host_calls_;
    }
  };
  if (absent) {
    // It takes part in the call's state (so that the call is accounted for) but never arrives; the
    // others fail at the arrival's deadline naming it, before anything is enqueued.
    Status s = state->broken.empty() ? StayAway(ctx, ctx.label(), rank, group_.ids[rank], absent)
                                     : Status::Unavailable(ErrorPrefix(ctx.label()) + state->broken);
    if (state->broken.empty()) leave();
    return s;
  }
  Status status;
  if (!state->broken.empty()) {
    status = Status::Unavailable(ErrorPrefix(ctx.label()) + std::string(Name(desc.kind)) + " on group " +
                                 FormatIds(group_.ids) + ": " + state->broken);
    timings_.Lose(state->record);
    return status;
  }
  Assignment work(links);
  for (size_t i = 0; i < links; ++i)
    if (!state->ranges[i].empty()) work[i].push_back(state->ranges[i]);
  Effects effects(links);
  status = ctx.Arrive(rank, desc, names_[0]);
  if (status.ok()) status = EnsureSetup(rank, ctx.label());
  if (status.ok() && state->faults) status = Agree(ctx, rank, desc, *state, &work, &effects);
  ProfileScratch scratch;
  bool profile = false;
  if (status.ok() && state->profile.session) status = AgreeProfile(ctx, rank, stream, *state, &scratch, &profile);
  if (status.ok())
    status = Enqueue(ctx, rank, desc, stream, *state, work, effects, profile ? &scratch : nullptr);
  else
    GaveUp(rank, state->call);  // nothing of the call goes on this rank's stream: no peer waits for it
  // A phase this rank did not enqueue never completes: the kind's next call ends the profile.
  if (state->profile.session && !status.ok() && !profile)
    profiler_.Abandon(state->profile, RankName(rank) + " did not reach it: " + status.message());
  if (rank == 0) RecordHealth(*state, desc, status.ok(), Since(start));
  // A call whose shares are not the plan's teaches stage 2 nothing (as on CPU), so its times go.
  bool moved = false;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    for (const std::string& e : state->errors) moved |= !e.empty();
  }
  if (!status.ok() || state->masked || moved) timings_.Lose(state->record);
  leave();
  return status;
}

Status GpuExecutor::AgreeProfile(CallContext& ctx, int rank, Stream stream, CallState& state,
                                 ProfileScratch* scratch, bool* run) {
  Status made = profiler_.Prepare(state.profile, rank, stream, scratch);
  if (!made.ok()) {
    std::lock_guard<std::mutex> lock(state.mu);
    state.unprepared.push_back(RankName(rank) + " could not make its scratch: " + made.message());
  }
  Status met = ctx.Barrier(rank, 0, "agree on stage 1's scratch", "executor");
  std::string why;  // every rank sees the same list: the first to abandon names them all
  {
    std::lock_guard<std::mutex> lock(state.mu);
    *run = met.ok() && state.unprepared.empty();
    if (met.ok())
      for (const std::string& u : state.unprepared) why += (why.empty() ? "" : "; ") + u;
  }
  if (*run) return met;
  if (made.ok()) (void)ReleaseProfile(api_, ranks_[rank].profile, *scratch, stream);
  if (met.ok()) profiler_.Abandon(state.profile, why + " (every rank skipped the phase)");
  return met;
}

Status GpuExecutor::Agree(CallContext& ctx, int rank, const CallDesc& desc, CallState& state, Assignment* work,
                          Effects* effects) {
  const size_t links = names_.size();
  auto publish = [&](size_t round, size_t source, size_t link, const Status& s) {
    std::lock_guard<std::mutex> lock(state.mu);
    state.failed[round][source] = 1;
    if (state.errors[link].empty()) state.errors[link] = s.message();
  };
  // Round 0: each link's own range; round r: the ranges still without a link, on their carriers.
  for (size_t i = 0; i < links; ++i) {
    if (state.ranges[i].empty()) continue;
    FaultyGpuChannel::Effect effect;
    Status s = channels_[i]->Admit(rank, *state.faults, ctx.label(), &effect);
    if (!s.ok()) publish(0, i, i, s);
    else (*effects)[i] = effect;
  }
  FLEXLINK_RETURN_IF_ERROR(ctx.Barrier(rank, 0, "agree on refused links", "executor"));
  std::vector<size_t> pending;
  std::vector<char> bad(links, 0);
  {
    std::lock_guard<std::mutex> lock(state.mu);
    for (size_t i = 0; i < links; ++i)
      if (state.failed[0][i]) pending.push_back(i), bad[i] = 1;
  }
  for (size_t i : pending) (*effects)[i] = {};  // a refused range runs nothing on its link
  for (size_t round = 1; round < links && !pending.empty(); ++round) {
    // From the call's shared state only, so every rank chooses the same carriers: the healthy link
    // not failed in this call with the largest share (ties: the lower index), as on CPU.
    std::vector<size_t> carrier(links, links);
    for (size_t i : pending)
      carrier[i] = FailoverCarrier(bad, state.shares, [&](size_t j) { return state.unhealthy[j] != 0; });
    if (std::any_of(pending.begin(), pending.end(), [&](size_t i) { return carrier[i] == links; })) break;
    std::vector<FaultyGpuChannel::Effect> carried(links);
    for (size_t i : pending) {
      Status s = channels_[carrier[i]]->Admit(rank, *state.faults, ctx.label(), &carried[i]);
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
        // A carrier slowed or hung at this call of its own is so for the ranges it carries too.
        auto& e = (*effects)[carrier[i]];
        e.slow = std::max(e.slow, carried[i].slow);
        e.hang = e.hang || carried[i].hang;
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
                            const Assignment& work, const Effects& effects, ProfileScratch* profile) {
  Rank& k = ranks_[rank];
  // This call's timing slot, claimed under the lock (one still in flight from long ago is given
  // up), then filled without it: the links' enqueues below may wait on the host (the pcie gate, up
  // to the deadline; NCCL's host calls), and the poll (stats(), the watchdog's hang detection) must
  // not wait for them. The slot stays unpublished (busy false: PollTimings reads nothing else of
  // it) until its fields are set, under the lock, at the end.
  Slot* claimed = nullptr;
  {
    std::lock_guard<std::mutex> slots_lock(k.slots_mu);
    claimed = &k.slots[k.next_slot];
    k.next_slot = (k.next_slot + 1) % k.slots.size();
    if (claimed->busy) {
      if (ReadSlot(rank, *claimed)) {
        board_.Reach(rank, claimed->call);
      } else {
        timings_.Lose(claimed->record);
        claimed->busy = false;
      }
    }
  }
  Slot& slot = *claimed;
  std::vector<size_t> used;
  for (size_t i = 0; i < work.size(); ++i)
    if (!work[i].empty()) used.push_back(i);
  const int n = group_.size();
  const uint64_t message = MessageBytes(desc, n);
  std::vector<double> budget(work.size(), 0.0);
  std::vector<size_t> begun;  // links whose range was started (and whose stop event was recorded)

  // The message's prefix is made for an error only (every call of every rank passes here).
  auto check = [&](const Status& s) {
    return s.ok() ? s
                  : Located(s, ErrorPrefix(ctx.label()) + std::string(Name(desc.kind)) + " on group " +
                                   FormatIds(group_.ids) + ": ");
  };
  // Stage 1's profile, when this call runs it: before the call's own work on XLA's stream (its
  // timing starts after it), but after the slot's `before` event, from which the hang detector's
  // clock runs: the profile's NCCL operations wait on every peer's as the ranges do, so a hang in
  // them is bounded too, with half the global timeout added to each range's deadline for them.
  Status status;
  double profile_budget = 0;
  if (profile) {
    status = check(api_.Record(slot.before, stream));
    if (status.ok()) {
      status = profiler_.Enqueue(state.profile, rank, *profile, stream, ctx.label());
    } else {
      (void)ReleaseProfile(api_, k.profile, *profile, stream);
      profiler_.Abandon(state.profile, RankName(rank) + " could not mark the call's start: " + status.message());
    }
    if (status.ok()) {
      profile_budget = ProfileAllowanceSeconds();
    } else {
      // Past the agreement (AgreeProfile) every rank enqueues the phase, so the other ranks'
      // profile operations (NCCL's among them) wait for this rank's, which never come, and their
      // XLA streams wait for those: only aborting the communicators releases them, so the group
      // breaks (as a group across processes does when a rank cannot enqueue), and the links wake
      // whoever waits at the host for this rank's enqueue.
      const std::string who = RankName(rank) + " could not enqueue stage 1's profile of call " +
                              std::to_string(state.call) + " (" + std::string(Name(desc.kind)) + ")";
      Break(state.call, who + ", which its peers' profile operations wait for: " + status.message(), std::nullopt);
      for (auto& channel : channels_) channel->Forsake(who);
    }
  }
  if (status.ok()) status = check(api_.Record(slot.start, stream));
  thread_local std::vector<Piece> pieces;
  const bool alone = used.size() == 1;  // one link: on XLA's stream itself, no fork or join
  for (size_t i = 0; i < used.size() && status.ok(); ++i) {
    const size_t l = used[i];
    const Stream on = alone ? stream : k.side[l];
    // The range's deadline first (host arithmetic only), so that a range cut short by an error has
    // one too: the hang detector watches a failed call's ranges as well (below).
    double predicted = 0;
    for (const plan::UnitRange& r : work[l])
      predicted += Predict(state, l, static_cast<double>(RangeMessageBytes(message, r, desc.virtual_bytes())));
    // An injected slow link: (K - 1) x the ranges' predicted time after them, on the device, so
    // that the link's stop event (stage 2, health) shows a K x slower range. Its deadline allows it.
    const double delay = effects[l].slow > 1 ? (effects[l].slow - 1) * predicted : 0;
    budget[l] = LinkBudgetSeconds(predicted) + delay + profile_budget;
    if (!alone) {
      status = check(api_.Wait(on, slot.start));  // fork
      if (!status.ok()) break;                       // nothing of this call is on the side stream
    }
    // From here on the link's stream has work of this call (or is XLA's own): whatever happens
    // below, its stop event is recorded and, on a side stream, XLA's stream waits on it (join), so
    // that XLA never runs past this call's device work, also when the call fails half way: XLA
    // frees or reuses the outputs after a failed execution, while the work already enqueued (an
    // NCCL kernel waiting for its peers, pcie copies) still writes them. The channels join their
    // own streams into `on` the same way. The join never waits on anything unbounded: every wait
    // in the work refers to work already submitted, except a hang flag and an NCCL kernel whose
    // peer gave up, and those are bounded by the hang detector, which watches this call's ranges
    // also when the call failed (the slot is published below either way).
    if (effects[l].hang) {
      // An injected hang: the stream waits on this rank's flag, which only the hang detector sets;
      // the device-side bound is the global timeout, far past the link's deadline.
      status = check(api_.WaitFlag(k.hang_flag, TimeoutSeconds(), on));
    }
    // Its own range, then the ranges it carries for failed links, in the same order on every rank.
    for (const plan::UnitRange& r : work[l]) {
      if (!status.ok()) break;
      desc.PiecesOf(UnitRange{r.begin, r.end}, &pieces);
      status = channels_[l]->Enqueue(GpuWork{&desc, rank, pieces, on, ctx.label()});
    }
    if (status.ok() && delay > 0) {
      status = check(api_.Delay(delay, on));
      // Before this rank's slot is busy, so before the record can be complete (and reported).
      if (status.ok()) timings_.MarkSlowed(state.record, l);
    }
    Status end = check(api_.Record(slot.stop[l], on));
    if (end.ok()) {
      begun.push_back(l);
      if (!alone) end = check(api_.Wait(stream, slot.stop[l]));  // join
    }
    if (status.ok()) status = end;
  }
  {
    // Published under the lock: a completed call for stage 2 and the hang detector; a failed one
    // (no timing record: Run gives its times up) for the hang detector only, which bounds the
    // joins above (its ranges may wait on a peer that gave up).
    std::lock_guard<std::mutex> slots_lock(k.slots_mu);
    slot.used = begun;
    slot.budget = std::move(budget);
    slot.call = state.call;
    slot.kind = desc.kind;
    slot.clock = CallClock{};
    slot.profiled = profile_budget > 0;
    slot.record = status.ok() ? state.record : 0;
    slot.busy = !begun.empty();
    // Nothing of the call is watched on this stream: its peers' clocks must not wait for it.
    if (!slot.busy) k.gave_up = std::max(k.gave_up, state.call);
  }
  if (!status.ok()) return status;
  if (splits_->enabled()) {
    SplitRecord rec{FormatIds(group_.ids), ctx.run_id(), ctx.call_number(), rank, {}};
    for (const auto& r : state.ranges) rec.ranges.emplace_back(r.begin, r.end);
    splits_->Add(std::move(rec));
  }
  return Status::Ok();
}

bool GpuExecutor::ReadSlot(int rank, Slot& slot) {
  std::string error;
  const bool broken = [&] {
    std::lock_guard<std::mutex> lock(broken_mu_);
    return !broken_.empty();
  }();
  for (size_t i : slot.used) {
    const Poll p = api_.Query(slot.stop[i], &error);
    if (p == Poll::kPending) return false;
    if (p == Poll::kError || broken) {
      // After a hang every later time is the hang's or an aborted communicator's: none is evidence.
      if (!broken)
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
  // Skipped while a release holds the lock (it may wait on its device): the poll never blocks.
  std::unique_lock<std::mutex> lock(release_mu_, std::try_to_lock);
  if (lock.owns_lock()) PollAllLocked();
}

void GpuExecutor::PollAllLocked() {
  if (!setup_.ready() || released()) return;
  for (int r = 0; r < group_.size(); ++r) PollTimings(r);
}

void GpuExecutor::GaveUp(int rank, uint64_t call) {
  Rank& k = ranks_[rank];
  std::lock_guard<std::mutex> lock(k.slots_mu);
  k.gave_up = std::max(k.gave_up, call);
}

void GpuExecutor::PollTimings(int rank) {
  Rank& k = ranks_[rank];
  std::lock_guard<std::mutex> lock(k.slots_mu);
  // Oldest first; calls complete in order on XLA's stream, so the first pending one ends the scan.
  const size_t m = k.slots.size();
  uint64_t pending = 0;  // the oldest call still pending on this rank's device (0: none)
  for (size_t j = 0; j < m; ++j) {
    Slot& slot = k.slots[(k.next_slot + j) % m];
    if (!slot.busy) continue;
    if (ReadSlot(rank, slot)) {
      board_.Reach(rank, slot.call);
      continue;
    }
    pending = slot.call;
    // The oldest call not done on this rank: its ranges' clocks start once every rank's device has
    // reached it (they could run from then on; a host far ahead of its device, or a peer's GPU busy
    // with other work before the call, does not count against them).
    const ClockReading clock = TickClock(
        slot.clock,
        [&] {
          std::string error;
          return api_.Query(slot.profiled ? slot.before : slot.start, &error) == Poll::kDone;
        },
        board_, rank, slot.call);
    if (clock.state == ClockReading::kPeersLate) {
      PeersLate(slot, clock);
    } else if (clock.state == ClockReading::kRunning) {
      std::string error;
      for (size_t i : slot.used)
        if (slot.budget[i] > 0 && clock.waited > slot.budget[i] && api_.Query(slot.stop[i], &error) == Poll::kPending) {
          Hung(slot, i, clock.waited);
          break;
        }
    }
    break;
  }
  // A call given up on the host counts as reached once nothing before it is pending on the device.
  if (k.gave_up && (pending == 0 || pending > k.gave_up)) board_.Reach(rank, k.gave_up);
}

std::string GpuExecutor::RankName(int rank) const {
  return "rank " + std::to_string(rank) + " (device " + std::to_string(group_.ids[rank]) + ")";
}

void GpuExecutor::Hung(const Slot& slot, size_t link, double waited) {
  char budget[64];
  std::snprintf(budget, sizeof budget, "%.3g s (waited %.3g s)", slot.budget[link], waited);
  Break(slot.call,
        "call " + std::to_string(slot.call) + "'s " + names_[link] + " range on group " + FormatIds(group_.ids) +
            " (" + std::string(Name(slot.kind)) + ") did not complete on the device within its deadline of " + budget +
            " (the hang detector)",
        link);
}

void GpuExecutor::PeersLate(const Slot& slot, const ClockReading& reading) {
  Break(slot.call,
        PeersLateReason(slot.call, FormatIds(group_.ids), Name(slot.kind), reading.waited, reading.behind,
                        [&](int r) { return RankName(r); }) +
            " (the hang detector)",
        std::nullopt);
}

void GpuExecutor::Break(uint64_t call, const std::string& reason, std::optional<size_t> link) {
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.empty()) return;
    broken_ = "the group is broken: " + reason + "; the results of call " + std::to_string(call) +
              " and of every call enqueued after it cannot be trusted, and the group runs nothing more (" +
              (link ? "its link " + names_[*link] + " is unhealthy, its" : "its") +
              " streams released; configure the links again for new groups)";
    broken_at_ = Clock::now();
    if (link && names_.size() > 1) health_->Failed(*link, call, reason, "missed its deadline");
    LogInfo("group " + FormatIds(group_.ids) + ": " + broken_);
  }
  // Release what an injected hang waits on, now (a host write; WaitFlag's device-side poll sees it).
  for (Rank& k : ranks_)
    if (k.hang_flag) std::atomic_ref<uint32_t>(*k.hang_flag).store(1, std::memory_order_release);
}

void GpuExecutor::Watch() {
  // A group being released is skipped, not waited for: its release may wait on its device, and the
  // watchdog must go on breaking the other groups' hangs meanwhile.
  std::unique_lock<std::mutex> held(release_mu_, std::try_to_lock);
  if (!held.owns_lock() || released()) return;
  PollAllLocked();
  std::unique_lock<std::mutex> lock(broken_mu_);
  if (broken_.empty() || released_) return;
  // The communicators are aborted only when no rank can be enqueuing on them: every call begun
  // before the break has left Run on all its ranks. A rank that never comes back is waited for as
  // long as the rendezvous would (1.5 x the global timeout), then the abort goes ahead anyway.
  if (host_calls_ > 0 && Since(broken_at_) < 1.5 * TimeoutSeconds()) return;
  released_ = true;
  lock.unlock();
  for (auto& channel : channels_) {
    Status s = channel->Abort();
    if (!s.ok()) LogInfo("group " + FormatIds(group_.ids) + ": releasing link " + std::string(channel->link_name()) +
                         " after the hang: " + s.message());
  }
}

void GpuExecutor::Report(const TimingRecord& r) {
  const plan::Balancer::Outcome outcome = balancer_.Report(*r.plan, r.message_bytes, r.link_seconds, r.call_seconds);
  for (size_t i = 0; i < names_.size(); ++i)
    if (r.link_seconds[i] > 0) RecordLinkCall(names_[i], r.link_bytes[i], r.link_seconds[i]);
  // Health from the device's own times, as the CPU executor's Finish does from its host times: the
  // slowest rank's event time of the link's range against stage 1's fit at the range's size.
  std::vector<plan::AlphaBeta> fits;
  const bool fitted = balancer_.FitsFor(r.plan->kind, &fits);
  for (size_t i = 0; i < names_.size() && i < r.link_message_bytes.size(); ++i) {
    const uint64_t b = r.link_message_bytes[i];
    const double t = r.link_seconds[i];
    if (b == 0 || !(t > 0)) continue;
    if (!r.slowed[i]) {
      std::lock_guard<std::mutex> lock(rate_mu_);
      clean_rate_[i] = t / static_cast<double>(b);
    }
    if (names_.size() < 2) continue;
    const double expected = fitted ? b / fits[i].Predict(static_cast<double>(b)) : -1;
    health_->Observed(i, r.call, b, expected, b / t);
  }
  if (outcome.changed) LogInfo("group " + FormatIds(group_.ids) + ": " + outcome.reason);
}

}  // namespace flexlink::gpu
