#include "xla_ffi/cuda/gpu_xproc.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/deadline.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/failover.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/cuda/gpu_engine.h"
#include "xla_ffi/cuda/gpu_executor.h"
#include "xla_ffi/cuda/nccl_link.h"
#include "xla_ffi/cuda/pcie_link.h"
#include "xla_ffi/cuda/pcie_xproc.h"
#include "xla_ffi/cuda/spin_rule.h"
#include "xla_ffi/plan/link_spec.h"
#include "xla_ffi/plan/ranges.h"
#include "xla_ffi/xproc/layout.h"
#include "xla_ffi/xproc/process_group.h"
#include "xla_ffi/xproc/slot_model.h"
#include "xla_ffi/xproc/xproc_executor.h"

namespace flexlink::gpu {

// `shares` (in `names` order) for the links `group` uses, renormalised over them.
Status SharesForGroup(const GpuXprocGroup& group, const std::vector<std::string>& names,
                      const std::vector<double>& shares, std::vector<double>* out);

GpuXprocLinks GpuXprocLinksOf(const GpuLinkSet& links) {
  GpuXprocLinks out;
  for (size_t i = 0; i < links.links.size(); ++i) {
    const GpuLink* link = links.links[i].get();
    const bool nccl = dynamic_cast<const NcclLink*>(link) != nullptr;
    const bool pcie = dynamic_cast<const PcieLink*>(link) != nullptr;
    if (out.used.size() >= xproc::kMaxXprocLinks) {
      out.left_out.emplace_back(std::string(link->name()), "more than 8 links");
    } else if (pcie && std::any_of(out.used.begin(), out.used.end(), [&](size_t j) {
                 return dynamic_cast<const PcieLink*>(links.links[j].get()) != nullptr;
               })) {
      out.left_out.emplace_back(std::string(link->name()),
                                "a second pcie link (one staging segment and one set of flags per group)");
    } else if (nccl || pcie) {
      out.used.push_back(i);
      if (nccl) out.nccl.push_back(i);
    } else {
      out.left_out.emplace_back(std::string(link->name()), "cannot span processes");
    }
  }
  return out;
}

GpuXprocGroup::GpuXprocGroup(std::unique_ptr<xproc::ProcessGroup> segment, GroupInfo group,
                             std::shared_ptr<const GpuLinkSet> links, std::vector<CommId> comm_ids,
                             plan::BalancerOptions options, DeviceApi* api, SplitLog* splits)
    : segment_(std::move(segment)),
      group_(std::move(group)),
      links_(std::move(links)),
      api_(*api),
      splits_(splits),
      comm_ids_(std::move(comm_ids)),
      balancer_([&] {
        std::vector<std::string> names;
        for (size_t i : GpuXprocLinksOf(*links_).used) names.emplace_back(links_->links[i]->name());
        return names;
      }(), options),
      ranks_(group_.size()),
      absent_calls_(group_.size()),
      board_(std::make_unique<StartBoard>([&] {
        std::vector<std::atomic<uint64_t>*> words;
        for (int r = 0; r < segment_->size(); ++r) words.push_back(segment_->device_reached(r));
        return words;
      }())) {
  const GpuXprocLinks which = GpuXprocLinksOf(*links_);
  left_out_ = which.left_out;
  for (size_t i : which.used) {
    used_names_.emplace_back(links_->links[i]->name());
    if (dynamic_cast<const PcieLink*>(links_->links[i].get()))
      channels_.push_back(std::make_unique<PcieXprocChannel>(used_names_.back(), api, group_, segment_.get()));
    else
      channels_.push_back(links_->links[i]->Open(group_));
  }
  learned_ = plan::CostModel(used_names_);
  static_assert(xproc::kMaxXprocLinks <= 30, "the slot's unhealthy word has its link bits below its flags");
  if (used_names_.size() > 1) {  // one link has nothing to fail over to (as in one process)
    health_ = std::make_shared<GroupHealth>(FormatIds(group_.ids), used_names_);
    RegisterGroupHealth(health_, links_->version);
  }
  for (int r = 0; r < group_.size(); ++r)
    if (segment_->is_local(r)) local_.push_back(r);
  std::vector<plan::LinkSpec> specs, used_specs;
  if (plan::ParseLinkSpecs(links_->spec, {}, &specs).ok() && specs.size() == links_->links.size())
    for (size_t i : which.used) used_specs.push_back(specs[i]);
  profiler_ = std::make_unique<GpuXprocProfiler>(segment_.get(), &balancer_, &group_, used_names_,
                                                 used_specs.empty() ? links_->spec : plan::FormatLinkSpecs(used_specs),
                                                 &api_);
  fault_calls_.assign(used_names_.size(), FaultCounter(group_.size()));
}

GpuXprocGroup::~GpuXprocGroup() = default;

bool GpuXprocGroup::leader() const { return segment_->is_local(0); }

void GpuXprocGroup::ForgetKind(Kind kind) {
  balancer_.ForgetKind(kind);
  std::lock_guard<std::mutex> lock(learned_mu_);
  learned_.ClearKind(kind);  // learned again from the slots once the leader has it again
}

plan::CostModel GpuXprocGroup::Model() const {
  if (leader()) return balancer_.Model();
  std::lock_guard<std::mutex> lock(learned_mu_);
  return learned_;
}

std::optional<std::string> GpuXprocGroup::broken() const { return segment_->broken(); }

Status GpuXprocGroup::Run(int rank, const CallDesc& desc, Stream stream, std::string_view label, int64_t run_id) {
  xproc::ProcessGroup& seg = *segment_;
  if (std::shared_ptr<const FaultSet> faults = CurrentFaults()) {
    const uint64_t c = absent_calls_.Next(rank, *faults);
    if (faults->AbsentAt(rank, c)) return xproc::StayAway(&seg, rank, c, label);
  }
  // Counted from here to the end of the enqueue: the watchdog aborts this process's communicators
  // only when no local rank can be enqueuing on them.
  inside_.fetch_add(1, std::memory_order_acq_rel);
  struct Leave {
    std::atomic<int>& inside;
    ~Leave() { inside.fetch_sub(1, std::memory_order_acq_rel); }
  } leave{inside_};
  const uint64_t call = seg.rank_calls(rank) + 1;  // Arrive counts it
  const size_t links = used_names_.size();
  const auto where = [&] {
    return ErrorPrefix(label) + desc.Describe() + " on group " + FormatIds(group_.ids) + " (" +
           std::string(kGpuXprocLink) + ", run " + std::to_string(run_id) + ", call " + std::to_string(call) +
           " on this group)";
  };
  if (links == 0)
    return Status::FailedPrecondition(where() + ": none of the configured GPU links can span processes "
                                      "(nccl and pcie can)");
  // Stage 2: this rank's latest completed call's event times, for the leader to read after this
  // arrival (a rank not set up yet has none).
  // Stage 1: this rank's times of a profile phase completed on its device, for the leader.
  if (ranks_[rank].ready) {
    WriteTimes(rank, call);
    profiler_->Publish(rank);
  }
  // 1. The leader's plan, written before its arrival: the barrier's release/acquire makes it
  // visible to every rank after the arrival. Rewritten for call + 2 only after the leader passed
  // call + 1's arrival, by which every rank has read it (layout.h, PlanSlot).
  std::shared_ptr<const plan::Plan> planned;
  if (rank == 0) {
    const uint64_t bytes = MessageBytes(desc, group_.size());
    std::shared_ptr<const plan::Plan> plan = balancer_.PlanFor(desc.kind, bytes);
    xproc::PlanSlot& slot = seg.plan_slot(call);
    // A kProfile plan: stage 1's phase for every rank to enqueue in this call, or the plan made
    // from the model it just finished.
    profiler_->Decide(desc.kind, bytes, &plan, &slot);
    planned = plan;
    // The leader's stage-1 fits for the kind, so that every process predicts
    // a range's time from the same numbers. Stage 1's phase 2 carries its own fits there already:
    // the profile's, as good a prediction as any.
    if (slot.profile_phase != 2) xproc::WriteSlotModel(balancer_, desc.kind, links, &slot);
    slot.epoch = plan->epoch;
    slot.mode = static_cast<uint32_t>(plan->mode);
    slot.links = static_cast<uint32_t>(links);
    // Unhealthy links out, or a probe (core/health.h): the leader's health decides for every
    // process, which learns the shares and the unhealthy links from this slot.
    std::vector<double> shares = plan->shares;
    bool masked = false;
    int probe = -1;
    uint32_t flags = 0;
    if (health_ && shares.size() == links) {
      shares = health_->Effective(plan->shares, call, desc.virtual_bytes(), &masked, &probe);
      for (size_t i = 0; i < links; ++i)
        if (health_->Unhealthy(i)) flags |= 1u << i;
    }
    for (size_t i = 0; i < xproc::kMaxXprocLinks; ++i) slot.shares[i] = i < shares.size() ? shares[i] : 0;
    if (masked) {
      flags |= kMaskedBit;
      planned = nullptr;  // not the plan's shares: stage 2 learns nothing from this call
    }
    // The fault agreement runs this call when the leader's process has faults injected.
    const std::shared_ptr<const FaultSet> faults = CurrentFaults();
    if (faults && !faults->faults.empty()) flags |= kAgreeBit;
    slot.unhealthy = flags;
    slot.call = call;
  }
  // 2. Arrival: fingerprints, liveness, deadline, abort; fails the group for every process.
  FLEXLINK_RETURN_IF_ERROR(seg.ArriveWithoutData(rank, desc, label, run_id, kGpuXprocLink));
  // Every process's first local rank reads every rank's times (written before their arrival,
  // visible after it).
  const bool first = rank == local_.front();
  if (first && ranks_[rank].ready) GatherTimes(call);
  // 3. The first call's set-up, then a barrier that turns one process's set-up failure into every
  // process's error.
  FLEXLINK_RETURN_IF_ERROR(EnsureSetup(rank, desc, label, run_id));
  // 4. Every rank cuts the leader's plan.
  const xproc::PlanSlot& slot = seg.plan_slot(call);
  if (slot.call != call || slot.links != links) {
    const std::string message =
        where() + ": processes disagree on the group's calls or on its links (the leader's plan slot holds call " +
        std::to_string(slot.call) + " for " + std::to_string(slot.links) + " links; this process has " +
        std::to_string(links) + " links that can span processes)";
    seg.Abort(rank, message);
    return Status::Internal(message);
  }
  const std::vector<plan::UnitRange> ranges =
      plan::CutRanges(desc.virtual_bytes(), 1, std::span<const double>(slot.shares, links));
  // Copied now: the slot is rewritten for call + 2 once the leader passed call + 1's arrival.
  const uint32_t flags = slot.unhealthy;
  std::array<plan::AlphaBeta, xproc::kMaxXprocLinks> fits;  // no allocation on the call path
  const bool has_fits = xproc::SlotFits(slot, links, fits.data());
  if (first) {
    if (planned_.empty()) planned_.resize(2 * kTimed + 2);
    Planned& p = planned_[call % planned_.size()];
    const uint64_t message = MessageBytes(desc, group_.size());
    p.call = call;
    p.plan = planned;
    p.evidence = !(flags & kMaskedBit);
    p.message_bytes = message;
    p.link_bytes.clear();
    p.link_message.clear();
    for (const auto& r : ranges) {
      p.link_bytes.push_back(desc.InputBytes(UnitRange{r.begin, r.end}, group_.size()));
      p.link_message.push_back(plan::RangeMessageBytes(message, r, desc.virtual_bytes()));
    }
    p.fits.assign(fits.begin(), fits.begin() + (has_fits ? links : 0));
    p.heard = 0;
    p.seconds.assign(links, 0);
    p.call_seconds = 0;
  }
  // This call's timing entry, claimed before stage 1's phase: when the call runs one, the entry's
  // `before` event, recorded ahead of it, starts the hang detector's clock (the phase's NCCL
  // operations wait on every peer's, as the ranges do), and each range's deadline gets half the
  // global timeout more for it.
  Timed& timed = Claim(rank, call);
  timed.profiled = false;
  // Stage 1's phase, on every rank before the call's own work (the same NCCL operations in the same
  // order everywhere, or none: a rank that could not enqueue fails the group for every process).
  bool profile = false;
  if (slot.profile_phase) FLEXLINK_RETURN_IF_ERROR(AgreeProfile(rank, desc, slot, stream, label, call, run_id, &profile));
  if (profile) {
    Status ps = api_.Record(timed.before, stream);
    if (ps.ok())
      ps = profiler_->Enqueue(
          rank, desc.kind, ranks_[rank].side,
          [&](size_t link, const GpuWork& w) { return channels_[link]->Enqueue(w); }, stream, label);
    else
      profiler_->Release(rank, stream);
    if (!ps.ok()) {
      seg.Abort(rank, ps.message());
      return ps;
    }
    timed.profiled = true;
  }
  Assignment work(links);
  for (size_t i = 0; i < links; ++i)
    if (!ranges[i].empty()) work[i].push_back(ranges[i]);
  bool moved = false;
  uint32_t refused = 0;
  Effects effects(links);
  if (flags & kAgreeBit) {
    // Every rank of every process runs the same rounds and ends with the same assignment, or the
    // same error (nothing enqueued anywhere: the group stays usable).
    FLEXLINK_RETURN_IF_ERROR(
        Agree(rank, desc, ranges, flags & kLinkBits, label, call, run_id, &work, &moved, &refused, &effects));
  }
  // Stage 2 and health learn from the plan's own ranges, slowed ones included (stage 2 moves load
  // off a slow link), not from a call whose ranges moved.
  if (moved && first) {
    Planned& p = planned_[call % planned_.size()];
    p.plan = nullptr;
    p.evidence = false;
  }
  // Another process reports the leader's model (group_fits); phase 2's fits are the profile's own.
  if (!leader() && slot.profile_phase == 0 && first) {
    std::lock_guard<std::mutex> lock(learned_mu_);
    xproc::LearnSlotModel(slot, desc.kind, links, &learned_);
  }
  Status s = Enqueue(rank, timed, desc, stream, ranges, work, effects,
                     std::span<const plan::AlphaBeta>(fits.data(), has_fits ? links : 0), label, call, run_id);
  // A rank that could not enqueue its part leaves its peers' NCCL operations without a partner:
  // the group is failed for every process (their next waits report this reason).
  if (!s.ok()) seg.Abort(rank, s.message());
  else if (first) RecordEnqueued(call, ranges, flags & kLinkBits, refused);
  return s;
}

void GpuXprocGroup::RecordEnqueued(uint64_t call, const std::vector<plan::UnitRange>& ranges, uint32_t unhealthy,
                                   uint32_t refused) {
  if (!health_) return;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].empty() || ((refused >> i) & 1)) continue;
    // Enqueued is all the host knows of a GPU range in its call: no bandwidth evidence here (that
    // comes with the event times, GatherTimes), but the link is listed.
    health_->Observed(i, call, 0, -1, -1);
    // Carried everywhere while the leader calls it unhealthy (a probe): re-admitted, from the same
    // slot and the same agreement in every process.
    if ((unhealthy >> i) & 1) health_->Probed(i, call, true, "");
  }
}

Status GpuXprocGroup::EnsureSetup(int rank, const CallDesc& desc, std::string_view label, int64_t run_id) {
  // Every local rank passes the set-up barrier exactly once (its first call), whoever set up.
  if (ranks_[rank].ready) return Status::Ok();
  // The set-up thread is bounded by the deadline itself (its communicator joins give up there and
  // say why); the waiters' margin lets its reason, not their wait's, be every local rank's error.
  const double timeout = TimeoutSeconds();
  const SetupOnce::Outcome o = setup_.Run(
      [&] {
        DeviceGuard guard(api_);
        return SetupLocal(desc, label, run_id);
      },
      timeout + 10, "flexlink: setting up group " + FormatIds(group_.ids) + ": ");
  if (o.timed_out)
    return Status::DeadlineExceeded(ErrorPrefix(label) + "rank " + std::to_string(rank) + " timed out after " +
                                    std::to_string(timeout) + " s waiting for the set-up of group " +
                                    FormatIds(group_.ids) + " (NCCL communicators across processes)");
  const Status& mine = o.status;
  if (!mine.ok()) {
    segment_->Abort(rank, mine.message());
    return mine;
  }
  FLEXLINK_RETURN_IF_ERROR(segment_->SyncWithoutData(rank, desc, label, run_id, kGpuXprocLink,
                                                     "every process's set-up done"));
  ranks_[rank].ready = true;
  return Status::Ok();
}

void GpuXprocGroup::MarkJoining(size_t link) {
  // Parity 0's times slot is free until call 2, which no rank starts before every process passed
  // the set-up barrier: until then its `links` word says which communicator (1-based, link order)
  // this rank started joining, for the deadline's message (NCCL does not say who is missing).
  for (int r : local_)
    __atomic_store_n(&segment_->times_slot(r, 0).links, static_cast<uint32_t>(link + 1), __ATOMIC_RELEASE);
}

std::vector<int> GpuXprocGroup::NotJoining(size_t link) const {
  std::vector<int> out;
  for (int r = 0; r < group_.size(); ++r)
    if (!segment_->is_local(r) &&
        __atomic_load_n(&segment_->times_slot(r, 0).links, __ATOMIC_ACQUIRE) < static_cast<uint32_t>(link + 1))
      out.push_back(r);
  return out;
}

Status GpuXprocGroup::SetupLocal(const CallDesc& desc, std::string_view label, int64_t run_id) {
  const std::string where = "flexlink: setting up group " + FormatIds(group_.ids) + " across processes: ";
  auto check = [&](Status s) { return s.ok() ? s : Status(s.code(), where + s.message()); };
  size_t nccl_links = 0;
  for (const auto& c : channels_) nccl_links += dynamic_cast<NcclChannel*>(c.get()) != nullptr;
  if (comm_ids_.size() != nccl_links)
    return Status::FailedPrecondition(where + "the leader made " + std::to_string(comm_ids_.size()) +
                                      " NCCL identities for " + std::to_string(nccl_links) +
                                      " nccl links here (processes configured different links)");
  std::vector<int> loaded;
  for (int r : local_) {
    const int dev = group_.devices[r];
    FLEXLINK_RETURN_IF_ERROR(check(api_.SetDevice(dev)));
    if (std::find(loaded.begin(), loaded.end(), dev) == loaded.end()) {
      FLEXLINK_RETURN_IF_ERROR(check(api_.PreloadKernels(dev)));
      loaded.push_back(dev);
    }
  }
  // NCCL first: every process joins each communicator in the same (link) order. The joins are
  // non-blocking (CommApi::InitRanks) and share one deadline, the group's timeout from here: a peer
  // that died before or while joining, or another process's failure, ends them within ~10 ms, and a
  // peer that never comes ends them at the deadline, instead of a hang inside ncclCommInitRank.
  xproc::ProcessGroup& seg = *segment_;
  const double timeout = TimeoutSeconds();
  const auto deadline = DeadlineAfter(timeout);
  auto names = [&](const std::vector<int>& ranks) {
    std::string out;
    for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + seg.DescribeRank(ranks[i]);
    return out;
  };
  const std::string call = ErrorPrefix(label) + desc.Describe() + " on group " + FormatIds(group_.ids) + " (" +
                           std::string(kGpuXprocLink) + ", run " + std::to_string(run_id) +
                           ", the group's first call)";
  size_t next_id = 0;
  for (size_t i = 0; i < channels_.size(); ++i) {
    if (auto* nccl = dynamic_cast<NcclChannel*>(channels_[i].get())) {
      const size_t k = next_id++;
      MarkJoining(k);
      std::vector<int> exited;
      CommApi::JoinWatch watch;
      watch.timeout_s = SecondsLeft(deadline);
      watch.check = [&]() -> std::string {
        if (std::optional<std::string> b = seg.broken()) return "the group failed in another process: " + *b;
        exited = seg.LeftRanks();
        return exited.empty() ? std::string() : seg.DescribeLeft(exited) + " before or while joining it";
      };
      Status s = nccl->SetupAcrossProcesses(comm_ids_[k], local_, watch);
      if (s.code() == StatusCode::kUnavailable)
        return Status::Internal(call + ": the " + used_names_[i] + " link's NCCL communicator could not be made: " +
                                s.message() + "; its join was aborted (the group is broken, later calls on it fail at once)");
      if (s.code() == StatusCode::kDeadlineExceeded) {
        const std::vector<int> late = NotJoining(k);
        std::vector<int> others;
        for (int r = 0; r < group_.size(); ++r)
          if (!seg.is_local(r)) others.push_back(r);
        return Status::DeadlineExceeded(
            call + ": timed out after " + FormatSeconds(timeout) + " s making the " + used_names_[i] +
            " link's NCCL communicator across processes: " +
            (late.empty() ? "every rank started joining but NCCL did not complete; unconfirmed: " + names(others)
                          : "missing: " + names(late) + ", which never started joining") +
            " (the deadline is jax_flexlink's FLEXLINK_TIMEOUT_S / set_timeout; its join was aborted)");
      }
      FLEXLINK_RETURN_IF_ERROR(s);
    } else if (auto* pcie = dynamic_cast<PcieXprocChannel*>(channels_[i].get())) {
      FLEXLINK_RETURN_IF_ERROR(pcie->SetupLocal(local_));
    } else {
      return Status::Internal(where + "link " + used_names_[i] + " cannot span processes");
    }
  }
  for (int r : local_) {
    const int dev = group_.devices[r];
    Rank& k = ranks_[r];
    k.side.assign(channels_.size(), nullptr);
    if (channels_.size() > 1) {
      for (Stream& s : k.side) FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateStream(dev, &s)));
      FLEXLINK_RETURN_IF_ERROR(check(profiler_->SetupRank(r, dev, ledger_)));  // stage 1 needs two links
    }
    // Timing events (stage 2, stats): one call in flight per ring entry; they also fork and join
    // the side streams.
    void* flag = nullptr;
    FLEXLINK_RETURN_IF_ERROR(check(ledger_.AllocPinnedHost(sizeof(uint32_t), &flag)));
    k.hang_flag = static_cast<uint32_t*>(flag);
    *k.hang_flag = 0;  // nothing waits on it yet
    k.timed.assign(kTimed, Timed{});
    for (Timed& t : k.timed) {
      FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateEvent(dev, true, &t.start)));
      FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateEvent(dev, false, &t.before)));
      t.stop.assign(channels_.size(), nullptr);
      t.used.assign(channels_.size(), 0);
      t.budget.assign(channels_.size(), 0.0);
      for (Event& e : t.stop) FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateEvent(dev, true, &e)));
    }
  }
  return Status::Ok();
}

GpuXprocGroup::Timed& GpuXprocGroup::Claim(int rank, uint64_t call) {
  // One still unread (its call not complete on the device after kTimed later calls were enqueued)
  // is given up: its events are recorded again for this call. Claimed (call 0: the watchdog's
  // PollHangs skips it) under the lock and published by Enqueue under it; filled without it, so
  // that a rank waiting inside a link's enqueue (NCCL settling, the deadline) never holds up the
  // watchdog and with it every group's hang detection (as GpuExecutor::Enqueue).
  Rank& k = ranks_[rank];
  std::lock_guard<std::mutex> lock(k.timed_mu);
  Timed& t = k.timed[call % kTimed];
  t.call = 0;
  return t;
}

Status GpuXprocGroup::Enqueue(int rank, Timed& t, const CallDesc& desc, Stream stream,
                              const std::vector<plan::UnitRange>& ranges,
                              const Assignment& work, const Effects& effects, std::span<const plan::AlphaBeta> fits,
                              std::string_view label, uint64_t call, int64_t run_id) {
  Rank& k = ranks_[rank];
  std::vector<size_t> used;
  for (size_t i = 0; i < work.size(); ++i)
    if (!work[i].empty()) used.push_back(i);
  const std::string where =
      ErrorPrefix(label) + std::string(Name(desc.kind)) + " on group " + FormatIds(group_.ids) + " (" +
      std::string(kGpuXprocLink) + "): ";
  auto check = [&](const Status& s) { return Located(s, where); };
  const bool alone = used.size() == 1;  // one link: on XLA's stream itself, no fork or join
  t.kind = desc.kind;
  t.clock = CallClock{};
  for (size_t i = 0; i < t.used.size(); ++i) t.used[i] = 0, t.budget[i] = 0;
  FLEXLINK_RETURN_IF_ERROR(check(api_.Record(t.start, stream)));
  thread_local std::vector<Piece> pieces;
  const uint64_t message = MessageBytes(desc, group_.size());
  Status failed;
  for (size_t i : used) {
    const Stream on = alone ? stream : k.side[i];
    if (!alone) {
      failed = check(api_.Wait(on, t.start));
      if (!failed.ok()) break;
    }
    // From here the link's stream has started: whatever happens, its stop is recorded and XLA's
    // stream waits for it, so that XLA never frees or reuses this call's buffers while the link's
    // work still reads or writes them. A wait that could last for good (a peer gone: NCCL's kernel,
    // the pcie link's flags) ends when the group breaks (the enqueue's error breaks it in every
    // process) and Watch aborts the links.
    const double predicted = [&] {
      uint64_t units = 0;
      for (const plan::UnitRange& r : work[i]) units += r.size();
      return plan::PredictOrUnfitted(
          fits, i, desc.virtual_bytes() ? double(message) * double(units) / double(desc.virtual_bytes()) : 0);
    }();
    // An injected slow fault: a device-side delay after the range, K - 1 times its predicted time.
    const double delay = effects[i].slow > 1 ? (effects[i].slow - 1) * predicted : 0;
    t.budget[i] = LinkBudgetSeconds(predicted) + delay + (t.profiled ? ProfileAllowanceSeconds() : 0);
    // An injected hang: the stream waits on this rank's flag, which only the hang detector sets;
    // the device-side bound is the global timeout, far past the link's deadline.
    if (effects[i].hang) failed = check(api_.WaitFlag(k.hang_flag, TimeoutSeconds(), on));
    if (failed.ok()) {
      // Its own range, then any it carries for a refused link, in link order: the same on every rank.
      pieces.clear();
      thread_local std::vector<Piece> more;
      for (const plan::UnitRange& r : work[i]) {
        desc.PiecesOf(UnitRange{r.begin, r.end}, &more);
        pieces.insert(pieces.end(), more.begin(), more.end());
      }
      failed = check(channels_[i]->Enqueue(GpuWork{&desc, rank, pieces, on, label}));
    }
    if (failed.ok() && delay > 0) failed = check(api_.Delay(delay, on));
    Status joined = check(api_.Record(t.stop[i], on));
    t.used[i] = joined.ok();  // a recorded stop is watched (as GpuExecutor::Enqueue's)
    if (joined.ok() && !alone) joined = check(api_.Wait(stream, t.stop[i]));
    if (failed.ok()) failed = joined;
    if (!failed.ok()) break;
  }
  {
    std::lock_guard<std::mutex> lock(k.timed_mu);
    t.call = call;  // published: the hang detector watches its ranges, a failed call's too
  }
  if (!failed.ok()) return failed;
  if (splits_ && splits_->enabled()) {
    SplitRecord rec{FormatIds(group_.ids), run_id, call, rank, {}};
    for (const auto& r : ranges) rec.ranges.emplace_back(r.begin, r.end);
    splits_->Add(std::move(rec));
  }
  return Status::Ok();
}

Status GpuXprocGroup::AgreeProfile(int rank, const CallDesc& desc, const xproc::PlanSlot& slot, Stream stream,
                                   std::string_view label, uint64_t call, int64_t run_id, bool* run) {
  xproc::ProcessGroup& seg = *segment_;
  const Status made = profiler_->Prepare(rank, desc.kind, slot, stream, label);
  if (!made.ok())
    LogWarning(made.message() + " (" + seg.DescribeRank(rank) + ", its scratch for stage 1's phase " +
               std::to_string(slot.profile_phase) + "; every rank of the group skips the phase)");
  // failed[1], as round -1 of the fault agreement (Agree) that may follow in this call: that one
  // writes failed[0] first, and failed[1] only after its first barrier, which every reader of
  // this word has passed (layout.h, TimesSlot).
  __atomic_store_n(&seg.times_slot(rank, call).failed[1], made.ok() ? 0u : 1u, __ATOMIC_RELEASE);
  const Status met = seg.SyncWithoutData(rank, desc, label, run_id, kGpuXprocLink, "agree on stage 1's scratch");
  std::string unprepared;
  int count = 0;
  if (met.ok())
    for (int r = 0; r < group_.size(); ++r)
      if (__atomic_load_n(&seg.times_slot(r, call).failed[1], __ATOMIC_ACQUIRE))
        unprepared += (count++ ? ", " : "") + seg.DescribeRank(r);
  *run = met.ok() && unprepared.empty();
  if (*run) return Status::Ok();
  if (made.ok()) profiler_->Release(rank, stream);
  // The leader's rank 0: every process skipped the same phase.
  if (met.ok() && rank == 0)
    profiler_->Abandon(desc.kind, unprepared + (count > 1 ? " could not make their" : " could not make its") +
                                      " scratch (every rank skipped the phase)");
  return met;
}

Status GpuXprocGroup::Agree(int rank, const CallDesc& desc, const std::vector<plan::UnitRange>& ranges,
                            uint32_t unhealthy, std::string_view label, uint64_t call, int64_t run_id,
                            Assignment* work, bool* moved, uint32_t* refused_links, Effects* effects) {
  xproc::ProcessGroup& seg = *segment_;
  const size_t links = used_names_.size();
  const std::shared_ptr<const FaultSet> none = std::make_shared<FaultSet>();
  std::shared_ptr<const FaultSet> faults = CurrentFaults();
  if (!faults) faults = none;  // this process has none: it refuses nothing, but joins the rounds
  std::vector<std::string> errors(links);
  // Whether `link` refuses this rank's next range (the FaultyGpuChannel::Admit rule: an error
  // fault of the link firing at its range count). A slow or hang fault firing there goes with the
  // range onto the device if it is admitted (*effects); one that fires on a refused range does not.
  auto refused = [&](size_t link) {
    const uint64_t n = fault_calls_[link].Next(rank, *faults);
    FaultyGpuChannel::Effect e;
    for (const Fault& f : faults->faults) {
      if (f.link != used_names_[link] || !f.FiresAt(n)) continue;
      if (f.kind == Fault::Kind::kError) {
        if (errors[link].empty())
          errors[link] = ErrorPrefix(label) + "link " + used_names_[link] + ": injected error at its call " +
                         std::to_string(n) + " (FLEXLINK_FAULTS \"" + faults->text + "\")";
        return true;
      }
      if (f.kind == Fault::Kind::kSlow) e.slow = std::max(e.slow, f.factor), e.call = n;
      if (f.kind == Fault::Kind::kHang) e.hang = true, e.call = n;
    }
    FaultyGpuChannel::Effect& into = (*effects)[link];
    into.slow = std::max(into.slow, e.slow);
    into.hang = into.hang || e.hang;
    if (e.call) into.call = e.call;
    return false;
  };
  // Every rank's mask of round `round`, ORed (written before the round's barrier, read after it;
  // rewritten two rounds later, after the next barrier, which every reader has passed).
  auto exchange = [&](size_t round, uint32_t mine, uint32_t* all) -> Status {
    __atomic_store_n(&seg.times_slot(rank, call).failed[round & 1], mine, __ATOMIC_RELEASE);
    FLEXLINK_RETURN_IF_ERROR(seg.SyncWithoutData(rank, desc, label, run_id, kGpuXprocLink, "agree on refused links"));
    *all = 0;
    for (int r = 0; r < group_.size(); ++r) *all |= __atomic_load_n(&seg.times_slot(r, call).failed[round & 1], __ATOMIC_ACQUIRE);
    return Status::Ok();
  };
  uint32_t mine = 0, all = 0;
  for (size_t i = 0; i < links; ++i)
    if (!ranges[i].empty() && refused(i)) mine |= 1u << i;
  FLEXLINK_RETURN_IF_ERROR(exchange(0, mine, &all));
  std::vector<size_t> pending;
  std::vector<char> bad(links, 0);
  for (size_t i = 0; i < links; ++i)
    if (all & (1u << i)) pending.push_back(i), bad[i] = 1, (*work)[i].clear();
  *refused_links = all;
  if (pending.empty()) return Status::Ok();
  const xproc::PlanSlot& slot = seg.plan_slot(call);
  const std::vector<double> shares(slot.shares, slot.shares + links);
  auto is_unhealthy = [&](size_t j) { return ((unhealthy >> j) & 1) != 0; };
  std::vector<std::pair<size_t, size_t>> moves;
  for (size_t round = 1; round < links && !pending.empty(); ++round) {
    std::vector<size_t> carrier(links, links);
    for (size_t i : pending) carrier[i] = FailoverCarrier(bad, shares, is_unhealthy);
    if (carrier[pending[0]] == links) break;  // every pending range gets the same carrier
    mine = 0;
    for (size_t i : pending)
      if (refused(carrier[i])) mine |= 1u << i;
    FLEXLINK_RETURN_IF_ERROR(exchange(round, mine, &all));
    std::vector<size_t> still;
    for (size_t i : pending) {
      if (all & (1u << i)) {
        still.push_back(i);
        bad[carrier[i]] = 1;
        *refused_links |= 1u << carrier[i];
      } else {
        (*work)[carrier[i]].push_back(ranges[i]);
        moves.emplace_back(i, carrier[i]);
      }
    }
    pending = std::move(still);
  }
  *moved = !moves.empty();
  // Links refused only in other processes: named so (their reasons stay there).
  for (size_t i = 0; i < links; ++i)
    if (bad[i] && errors[i].empty()) errors[i] = "refused by another rank of the group";
  // Every process records the same decisions (its own stats): the refused links (a probe's refusal
  // sends its next probe twice as far), one failover per moved range.
  if (rank == local_.front()) {
    const std::string group = FormatIds(group_.ids);
    for (size_t j = 0; health_ && j < links; ++j)
      if (bad[j]) {
        if (is_unhealthy(j)) health_->Probed(j, call, false, errors[j]);
        else health_->Failed(j, call, errors[j]);
      }
    for (const auto& [from, to] : moves) {
      if (health_) health_->FailedOver(from);
      const auto& r = ranges[from];
      RecordFailover(FailoverRecord{group, std::string(Name(desc.kind)), used_names_[from], used_names_[to],
                                    errors[from], call, desc.InputBytes(UnitRange{r.begin, r.end}, group_.size()), 0,
                                    UnixNow()});
    }
  }
  if (pending.empty()) return Status::Ok();
  return Status::Unavailable(NoCarrierMessage(label, desc.kind, FormatIds(group_.ids) + " (" + std::string(kGpuXprocLink) + ")",
                                              call, used_names_, errors, is_unhealthy));
}

void GpuXprocGroup::WriteTimes(int rank, uint64_t call) {
  Rank& k = ranks_[rank];
  std::lock_guard<std::mutex> lock(k.timed_mu);
  const size_t links = used_names_.size();
  xproc::TimesSlot& out = segment_->times_slot(rank, call);
  out.call = 0;  // none, unless a completed call is found below
  out.links = static_cast<uint32_t>(links);
  // The newest call whose every range has completed on the device (calls complete in order on
  // XLA's stream, so older ones have too and are released unread). Never waits.
  Timed* best = nullptr;
  for (Timed& t : k.timed) {
    if (t.call == 0 || (best && t.call < best->call)) continue;
    std::string error;
    bool done = api_.Query(t.start, &error) == Poll::kDone;
    for (size_t i = 0; done && i < links; ++i)
      if (t.used[i]) done = api_.Query(t.stop[i], &error) == Poll::kDone;
    if (done) best = &t;
  }
  if (!best) return;
  double slowest = 0;
  for (size_t i = 0; i < links && i < xproc::kMaxXprocLinks; ++i) {
    double sec = 0;
    if (best->used[i] && !api_.ElapsedSeconds(best->start, best->stop[i], &sec).ok()) sec = 0;
    out.seconds[i] = sec;
    slowest = std::max(slowest, sec);
  }
  out.call_seconds = slowest;
  out.ok = 1;
  out.call = best->call;
  const uint64_t reported = best->call;
  board_->Reach(rank, reported);  // done on this device: released below, before a poll may see it
  for (Timed& t : k.timed)
    if (t.call != 0 && t.call <= reported) t.call = 0;
}

void GpuXprocGroup::GatherTimes(uint64_t call) {
  if (planned_.empty()) return;
  const size_t links = used_names_.size();
  for (int r = 0; r < group_.size(); ++r) {
    const xproc::TimesSlot& in = segment_->times_slot(r, call);
    // Another process wrote it: checked against what the leader planned, not trusted.
    if (in.call == 0 || in.links != links || in.call >= call) continue;
    Planned& p = planned_[in.call % planned_.size()];
    if (p.call != in.call || (!p.plan && !p.evidence)) continue;
    for (size_t i = 0; i < links; ++i)
      if (std::isfinite(in.seconds[i])) p.seconds[i] = std::max(p.seconds[i], in.seconds[i]);
    if (std::isfinite(in.call_seconds)) p.call_seconds = std::max(p.call_seconds, in.call_seconds);
    if (++p.heard < group_.size()) continue;
    // Every rank has reported this call: the slowest rank's time per link, as the in-process
    // executor reports (a collective is as fast as its slowest rank). Stage 2 and the link
    // statistics in the leader's process only (one count per call).
    if (p.plan) {
      const plan::Balancer::Outcome outcome = balancer_.Report(*p.plan, p.message_bytes, p.seconds, p.call_seconds);
      for (size_t i = 0; i < links; ++i)
        if (p.seconds[i] > 0) RecordLinkCall(used_names_[i], p.link_bytes[i], p.seconds[i]);
      if (outcome.changed) LogInfo("group " + FormatIds(group_.ids) + " across processes: " + outcome.reason);
    }
    // Degraded, in every process alike: each link's rate (its range's nccl-tests bytes over the
    // slowest rank's event time) against the leader's fit at that size, as the slot carried it.
    if (health_ && p.evidence)
      for (size_t i = 0; i < links; ++i) {
        const uint64_t b = p.link_message[i];
        if (b == 0 || !(p.seconds[i] > 0)) continue;
        const double expected = p.fits.size() == links ? b / p.fits[i].Predict(static_cast<double>(b)) : -1;
        health_->Observed(i, p.call, b, expected, b / p.seconds[i]);
      }
    p.call = 0;
    p.plan = nullptr;
  }
}

// --- the hang detector ---------------------------------------------------------------------------

void GpuXprocGroup::PollHangs(int rank) {
  // Broken already (here or in another process): nothing left to detect, and a late verdict would
  // only push Watch's release of the communicators further out.
  if (segment_->aborted()) return;
  Rank& k = ranks_[rank];
  std::lock_guard<std::mutex> lock(k.timed_mu);
  // The oldest call still pending on the device (calls complete in order on XLA's stream): its
  // ranges' clocks start once every rank's device, in every process, has reached it.
  Timed* oldest = nullptr;
  for (Timed& t : k.timed)
    if (t.call != 0 && (!oldest || t.call < oldest->call)) oldest = &t;
  while (oldest) {
    std::string error;
    bool pending = false;
    bool any = false;
    for (size_t i = 0; i < oldest->used.size(); ++i)
      if (oldest->used[i]) any = true, pending |= api_.Query(oldest->stop[i], &error) == Poll::kPending;
    // An entry with no range (its call failed before the first) is done once its start is.
    if (!any) pending = api_.Query(oldest->start, &error) == Poll::kPending;
    if (!pending) {  // done: the next one, if any, is the oldest pending
      board_->Reach(rank, oldest->call);
      Timed* next = nullptr;
      for (Timed& t : k.timed)
        if (t.call > oldest->call && (!next || t.call < next->call)) next = &t;
      oldest = next;
      continue;
    }
    // A rank that gave a call up before its stream reached it failed the group in every process
    // (Run's Abort), and one whose process died never comes: no peer's clock waits for either (the
    // link's deadline then finds the range that waits on a dead peer, as before its start counted).
    const ClockReading clock = TickClock(
        oldest->clock,
        [&] { return api_.Query(oldest->profiled ? oldest->before : oldest->start, &error) == Poll::kDone; }, *board_,
        rank, oldest->call,
        // Exited only: a rank closed by its engine's shutdown still runs on its device what its host
        // enqueued, and its device_reached word says how far (its Release marks the rest reached).
        [&] { return segment_->ExitedRanks(); });
    if (clock.state == ClockReading::kPeersLate) {
      PeersLate(*oldest, rank, clock);
    } else if (clock.state == ClockReading::kRunning) {
      for (size_t i = 0; i < oldest->used.size(); ++i)
        if (oldest->used[i] && oldest->budget[i] > 0 && clock.waited > oldest->budget[i] &&
            api_.Query(oldest->stop[i], &error) == Poll::kPending) {
          Hung(*oldest, rank, i, clock.waited);
          break;
        }
    }
    return;
  }
}

void GpuXprocGroup::Hung(const Timed& t, int rank, size_t link, double waited) {
  char budget[64];
  std::snprintf(budget, sizeof budget, "%.3g s (waited %.3g s)", t.budget[link], waited);
  Break(t.call, rank,
        "call " + std::to_string(t.call) + "'s " + used_names_[link] + " range on group " + FormatIds(group_.ids) +
            " (" + std::string(Name(t.kind)) + ", " + std::string(kGpuXprocLink) +
            ") did not complete on the device of " + segment_->DescribeRank(rank) + " within its deadline of " + budget,
        link);
}

void GpuXprocGroup::PeersLate(const Timed& t, int rank, const ClockReading& reading) {
  Break(t.call, rank,
        PeersLateReason(t.call, FormatIds(group_.ids), std::string(Name(t.kind)) + ", " + std::string(kGpuXprocLink),
                        reading.waited, reading.behind, [&](int r) { return segment_->DescribeRank(r); }) +
            " (seen by " + segment_->DescribeRank(rank) + ")",
        std::nullopt);
}

void GpuXprocGroup::Break(uint64_t call, int rank, const std::string& what, std::optional<size_t> link) {
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (hung_) return;
    hung_ = true;
    if (broken_at_ == std::chrono::steady_clock::time_point{}) broken_at_ = std::chrono::steady_clock::now();
  }
  const std::string reason = what + " (the hang detector); the results of call " + std::to_string(call) +
                             " and of every call enqueued after it cannot be trusted, and the group runs nothing "
                             "more (its streams released, its communicators aborted in every process)";
  // This process's view: the link missed its deadline (other processes see the group broken).
  if (health_ && link) health_->Failed(*link, call, reason, "missed its deadline");
  // Every process's later calls fail with this reason (the segment's abort word), and their
  // watchdogs release their own streams.
  segment_->Abort(rank, reason);
  LogInfo("group " + FormatIds(group_.ids) + " across processes: " + reason);
  ReleaseHangFlags();
}

void GpuXprocGroup::ReleaseHangFlags() {
  // A host write; WaitFlag's device-side poll sees it. Set for good: the group is broken.
  for (int r : local_)
    if (ranks_[r].hang_flag) std::atomic_ref<uint32_t>(*ranks_[r].hang_flag).store(1, std::memory_order_release);
}

void GpuXprocGroup::Watch() {
  std::unique_lock<std::mutex> held(release_mu_, std::try_to_lock);  // as GpuExecutor::Watch
  if (!held.owns_lock() || !setup_.ready() || released()) return;
  for (int r : local_) PollHangs(r);
  // Broken here or in another process (a hang there, or a dead peer): this process's streams may
  // wait on peers that will never come, and only aborting the communicators releases them.
  if (!segment_->aborted()) return;
  std::unique_lock<std::mutex> lock(broken_mu_);
  if (released_) {
    lock.unlock();
    for (auto& channel : channels_) channel->Unblock();
    return;
  }
  if (!hung_ && broken_at_ == std::chrono::steady_clock::time_point{}) broken_at_ = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(std::chrono::steady_clock::now() - broken_at_).count();
  // Not while a local rank may be enqueuing on the communicators (as in one process); a rank that
  // never comes back is waited for as long as the rendezvous would.
  if (inside_.load(std::memory_order_acquire) > 0 && since < 1.5 * TimeoutSeconds()) return;
  released_ = true;
  lock.unlock();
  ReleaseHangFlags();
  for (auto& channel : channels_) {
    Status s = channel->Abort();
    if (!s.ok())
      LogInfo("group " + FormatIds(group_.ids) + " across processes: releasing link " +
              std::string(channel->link_name()) + " after the break: " + s.message());
  }
}

// --- registry ---------------------------------------------------------------------------------

namespace {

// A group is set up at lowering for the links current then (its NCCL identities are per nccl link of
// that set); links configured later get a group of their own when a program is lowered after the
// change (processes.py sets the group up again), and programs lowered before keep theirs.
struct Key {
  uint64_t serial;           // the engine's
  std::vector<int64_t> ids;  // the group's devices, rank order
  uint64_t version;          // the engine's link set the group was set up for
  bool operator<(const Key& o) const { return std::tie(serial, ids, version) < std::tie(o.serial, o.ids, o.version); }
};

struct Registry {
  std::mutex mu;
  // Never erased (device threads keep raw pointers).
  std::map<Key, std::unique_ptr<GpuXprocGroup>> groups;
  std::set<std::pair<const GpuXprocGroup*, uint64_t>> told;  // older links' groups reported in use
  std::atomic<uint64_t> generation{1};
};

Registry& TheRegistry() {
  static Registry* r = new Registry;  // outlives device threads at exit
  return *r;
}

std::optional<plan::CostModel> SeedForGroup(const GpuXprocGroup& group, const plan::CostModel& seed);

Status Register(GpuEngine& engine, std::unique_ptr<xproc::ProcessGroup> segment, std::vector<CommId> ids,
                std::span<const int64_t> devices) {
  // A group set up after the shutdown would never be released (nor could it run a call).
  if (engine.shut_down())
    return Status::FailedPrecondition("flexlink: GPU group " + FormatIds(devices) +
                                      " across processes: FlexLink's GPU engine was shut down in this process");
  GroupInfo info;
  info.ids.assign(devices.begin(), devices.end());
  for (int r = 0; r < static_cast<int>(devices.size()); ++r)
    info.devices.push_back(segment->is_local(r) ? engine.DeviceOf(devices[r]) : -1);
  std::string why;
  const int count = engine.api().DeviceCount(&why);
  for (int r = 0; r < static_cast<int>(devices.size()); ++r)
    if (segment->is_local(r) && (info.devices[r] < 0 || info.devices[r] >= count))
      return Status::InvalidArgument("flexlink: GPU group " + FormatIds(devices) + " across processes: device " +
                                     std::to_string(devices[r]) + " is not a CUDA device of this process (" +
                                     std::to_string(count) + " visible" + (why.empty() ? "" : ": " + why) + ")");
  segment->SetSpin(XprocSpin(segment->size(), static_cast<int>(segment->local_devices().size()),
                             UsableHardwareThreads(), std::thread::hardware_concurrency()));
  plan::BalancerOptions options;
  // Stage 1 from the same size as in one process (gpu_xproc_profile.h).
  options.profile_from_bytes = AutotuneMinBytes();
  options.profile_max_bytes = TuneMaxBytes();
  std::shared_ptr<const GpuLinkSet> links = engine.CurrentLinks();
  auto group = std::make_unique<GpuXprocGroup>(std::move(segment), std::move(info), links, std::move(ids), options,
                                               &engine.api(), &engine.splits());
  // seed_model and set_shares given before the group was set up (at lowering) apply to it as to
  // in-process groups.
  if (std::optional<plan::CostModel> seed = engine.SeedFor(static_cast<int>(devices.size())))
    if (std::optional<plan::CostModel> mine = SeedForGroup(*group, *seed)) (void)group->balancer().SetSeed(*mine);
  for (const auto& [key, value] : engine.ShareOverrides()) {
    std::vector<double> mine;
    if (SharesForGroup(*group, links->names(), value.first, &mine).ok())
      (void)group->balancer().SetShares(key.first, key.second, std::move(mine), value.second);
  }
  Registry& reg = TheRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  Key key{engine.serial(), std::vector<int64_t>(devices.begin(), devices.end()), links->version};
  if (reg.groups.count(key))
    return Status::InvalidArgument("flexlink: GPU group " + FormatIds(devices) +
                                   " across processes is already registered in this process for the current links");
  reg.groups.emplace(std::move(key), std::move(group));
  reg.generation.fetch_add(1);
  engine.StartWatchdog();  // the hang detector's thread (Watch)
  return Status::Ok();
}

}  // namespace

Status SharesForGroup(const GpuXprocGroup& group, const std::vector<std::string>& names,
                      const std::vector<double>& shares, std::vector<double>* out) {
  out->clear();
  double sum = 0;
  for (const std::string& used : group.links()) {
    const auto it = std::find(names.begin(), names.end(), used);
    if (it == names.end() || static_cast<size_t>(it - names.begin()) >= shares.size())
      return Status::FailedPrecondition("link " + used + " of group " + FormatIds(group.group().ids) +
                                        " across processes is not among the current links");
    out->push_back(shares[it - names.begin()]);
    sum += out->back();
  }
  if (!(sum > 0))
    return Status::InvalidArgument("set_shares: the links group " + FormatIds(group.group().ids) +
                                   " across processes can use get no share");
  for (double& x : *out) x /= sum;
  return Status::Ok();
}

Status SetGpuXprocShares(const GpuEngine& engine, const std::vector<std::string>& names, Kind kind,
                         uint64_t bucket_bytes, const std::vector<double>& shares, bool pinned) {
  Registry& reg = TheRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  Status first;
  for (auto& [key, group] : reg.groups) {
    if (key.serial != engine.serial()) continue;
    std::vector<double> mine;
    Status s = SharesForGroup(*group, names, shares, &mine);
    // A group over links no longer current (configured again since) keeps its plans, as the
    // in-process engine's old groups do; a share-less link set is the caller's error.
    if (s.code() == StatusCode::kFailedPrecondition) continue;
    if (s.ok()) s = group->balancer().SetShares(kind, bucket_bytes, std::move(mine), pinned);
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

namespace {
// `seed` (over the engine's links) restricted to the links `group` uses; nullopt when one is missing.
std::optional<plan::CostModel> SeedForGroup(const GpuXprocGroup& group, const plan::CostModel& seed) {
  plan::CostModel mine(group.links());
  std::vector<size_t> at;
  for (const std::string& used : group.links()) {
    const auto it = std::find(seed.links().begin(), seed.links().end(), used);
    if (it == seed.links().end()) return std::nullopt;
    at.push_back(static_cast<size_t>(it - seed.links().begin()));
  }
  for (const Kind kind : kAllKinds) {
    if (!seed.Has(kind)) continue;
    for (size_t i = 0; i < at.size(); ++i) mine.Set(kind, i, seed.Fits(kind)[at[i]]);
  }
  return mine;
}
}  // namespace

void SetGpuXprocSeed(const GpuEngine& engine, int ranks, const plan::CostModel& seed) {
  Registry& reg = TheRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, group] : reg.groups) {
    if (key.serial != engine.serial() || group->group().size() != ranks) continue;
    if (std::optional<plan::CostModel> mine = SeedForGroup(*group, seed)) (void)group->balancer().SetSeed(*mine);
  }
}

void SetGpuXprocProfileBytes(const GpuEngine& engine, uint64_t from_bytes, uint64_t max_bytes) {
  Registry& reg = TheRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, group] : reg.groups)
    if (key.serial == engine.serial()) {
      group->balancer().SetProfileFromBytes(from_bytes);
      group->balancer().SetProfileMaxBytes(max_bytes);
    }
}

void ForgetGpuXprocModel(const GpuEngine& engine, Kind kind) {
  Registry& reg = TheRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, group] : reg.groups)
    if (key.serial == engine.serial()) group->ForgetKind(kind);
}

void AppendGpuXprocPlans(const GpuEngine& engine, std::vector<PlanSnapshot>* out) {
  Registry& reg = TheRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, group] : reg.groups) {
    if (key.serial != engine.serial() || !group->leader()) continue;
    for (const auto& p : group->balancer().Plans())
      out->push_back(PlanSnapshot{key.ids, *p, group->balancer().links()});
  }
}

Status CreateGpuXprocGroup(GpuEngine& engine, std::span<const int64_t> devices, std::span<const int64_t> local_devices,
                           int processes, std::string* segment_name, std::vector<CommId>* comm_ids) {
  if (devices.empty() || local_devices.empty() || local_devices.end() == std::find(local_devices.begin(), local_devices.end(), devices[0]))
    return Status::InvalidArgument("flexlink: GPU group " + FormatIds(devices) +
                                   " across processes: the leader process (the one that creates the group) "
                                   "runs its rank 0");
  const GpuXprocLinks which = GpuXprocLinksOf(*engine.CurrentLinks());
  std::vector<CommId> ids(which.nccl.size());
  for (CommId& id : ids) {
    Status s = engine.comm().NewId(&id);
    if (!s.ok()) return Status(s.code(), "flexlink: GPU group " + FormatIds(devices) + " across processes: " + s.message());
  }
  std::unique_ptr<xproc::ProcessGroup> segment;
  // With a pcie link the slots are its staging (FLEXLINK_XPROC_SLOT_BYTES, else kPcieStagingSlotBytes);
  // else of the minimum size: only fingerprints go through them.
  const bool staging = which.nccl.size() < which.used.size();
  FLEXLINK_RETURN_IF_ERROR(xproc::ProcessGroup::Create(
      devices, local_devices, staging ? XprocSlotBytesOr(kPcieStagingSlotBytes) : size_t{64} << 10, processes,
      &segment));
  const std::string name = segment->name();
  Status s = Register(engine, std::move(segment), ids, devices);
  if (!s.ok()) {
    (void)xproc::Segment::Unlink(name);
    return s;
  }
  *segment_name = name;
  *comm_ids = std::move(ids);
  return Status::Ok();
}

Status AttachGpuXprocGroup(GpuEngine& engine, const std::string& segment_name, std::span<const CommId> comm_ids,
                           std::span<const int64_t> devices, std::span<const int64_t> local_devices) {
  std::unique_ptr<xproc::ProcessGroup> segment;
  FLEXLINK_RETURN_IF_ERROR(xproc::ProcessGroup::Attach(segment_name, devices, local_devices, &segment));
  return Register(engine, std::move(segment), std::vector<CommId>(comm_ids.begin(), comm_ids.end()), devices);
}

GpuXprocGroup* FindGpuXprocGroup(const GpuEngine& engine, std::span<const int64_t> devices, uint64_t lowered,
                                 const GpuLinkSet* current) {
  const uint64_t now = current ? current->version : 0;
  Registry& reg = TheRegistry();
  // Device threads remember their lookups, misses included, until the next registration.
  struct Entry {
    uint64_t serial;
    std::vector<int64_t> ids;
    uint64_t lowered, now;
    GpuXprocGroup* group;
  };
  thread_local uint64_t seen_generation = 0;
  thread_local std::vector<Entry> cache;
  const uint64_t gen = reg.generation.load(std::memory_order_acquire);
  if (gen != seen_generation) {
    cache.clear();
    seen_generation = gen;
  }
  for (const Entry& e : cache)
    if (e.serial == engine.serial() && e.lowered == lowered && e.now == now &&
        std::equal(e.ids.begin(), e.ids.end(), devices.begin(), devices.end()))
      return e.group;
  GpuXprocGroup* found = nullptr;
  std::string note;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    const std::vector<int64_t> ids(devices.begin(), devices.end());
    // The map orders a device list's groups by the version they were set up for.
    GpuXprocGroup* newest = nullptr;
    for (auto it = reg.groups.lower_bound(Key{engine.serial(), ids, 0});
         it != reg.groups.end() && it->first.serial == engine.serial() && it->first.ids == ids; ++it) {
      newest = it->second.get();
      if (lowered == 0 || it->first.version <= lowered) found = newest;
    }
    if (!found) found = newest;
    if (found && current && found->links_spec() != current->spec && reg.told.emplace(found, now).second)
      note = "GPU group " + FormatIds(devices) + " across processes runs this program on the links it was set up "
             "with (" + found->links_spec() + "), not the current ones (" + current->spec + "): a program runs on "
             "the group set up when it was lowered (its NCCL identities travel through jax.distributed's store "
             "then), so links configured since take effect in programs lowered after the change "
             "(docs/multiprocess.md)";
  }
  if (!note.empty()) LogWarning(note);
  cache.push_back(Entry{engine.serial(), std::vector<int64_t>(devices.begin(), devices.end()), lowered, now, found});
  return found;
}

std::vector<GpuXprocInfo> GpuXprocGroups(const GpuEngine& engine) {
  Registry& reg = TheRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::vector<GpuXprocInfo> out;
  for (auto& [key, group] : reg.groups) {
    if (key.serial != engine.serial()) continue;
    GpuXprocInfo info;
    info.name = group->segment().name();
    info.devices = group->segment().devices();
    info.local_devices = group->segment().local_devices();
    info.links = group->links();
    info.left_out = group->left_out();
    info.calls = group->segment().calls();
    info.broken = group->broken();
    out.push_back(std::move(info));
  }
  return out;
}

std::vector<GpuXprocGroup*> GpuXprocGroupsOf(const GpuEngine& engine) {
  std::vector<GpuXprocGroup*> groups;
  Registry& reg = TheRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, group] : reg.groups)  // never erased while the process lives
    if (key.serial == engine.serial()) groups.push_back(group.get());
  return groups;
}

void WatchGpuXprocGroups(const GpuEngine& engine) {
  for (GpuXprocGroup* g : GpuXprocGroupsOf(engine)) g->Watch();
}

}  // namespace flexlink::gpu
