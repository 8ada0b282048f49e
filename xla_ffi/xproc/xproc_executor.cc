#include "xla_ffi/xproc/xproc_executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/deadline.h"
#include "xla_ffi/core/entry_word.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/failover.h"
#include "xla_ffi/core/faults.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/link_set.h"
#include "xla_ffi/core/profile_calls.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/links/tcp.h"
#include "xla_ffi/links/tcp_xproc.h"
#include "xla_ffi/plan/link_spec.h"
#include "xla_ffi/plan/ranges.h"
#include "xla_ffi/xproc/layout.h"
#include "xla_ffi/xproc/process_group.h"
#include "xla_ffi/xproc/registry.h"
#include "xla_ffi/xproc/slot_model.h"
#include "xla_ffi/xproc/xproc_profile.h"

namespace flexlink::xproc {
namespace {

struct Resolved {
  XprocLinks info;
  std::vector<TcpChannel*> tcp;  // per used link; nullptr: the segment
  size_t segment = 0;            // index of the segment among the used links
  std::string spec;              // the used links' spec (plan::FormatLinkSpecs): the tuning cache's key
};

Resolved Resolve(ProcessGroup* group, const LinkSet& set) {
  Resolved r;
  std::vector<plan::LinkSpec> specs;
  if (!plan::ParseLinkSpecs(set.spec, {}, &specs).ok()) specs.clear();
  bool have_segment = false;
  std::vector<plan::LinkSpec> used;
  for (const plan::LinkSpec& spec : specs) {
    auto leave = [&](const std::string& why) { r.info.left_out.emplace_back(spec.name, why); };
    if (r.info.links.size() >= kMaxXprocLinks) {
      leave("more than " + std::to_string(kMaxXprocLinks) + " links: a cross-process group splits across at most that many");
      continue;
    }
    if (spec.kind == "shm") {
      if (have_segment) {
        leave("a second link of kind shm: the group's one shared segment already plays the shm link");
        continue;
      }
      have_segment = true;
      r.segment = r.info.links.size();
      r.info.links.push_back(spec.name);
      r.tcp.push_back(nullptr);
      used.push_back(spec);
    } else if (spec.kind == "tcp") {
      TcpChannel* ch = CrossProcessTcp(group->devices(), spec.name);
      if (!ch) {
        leave("not connected across processes for this group (no cross-process ring was connected)");
        continue;
      }
      r.info.links.push_back(spec.name);
      r.tcp.push_back(ch);
      used.push_back(spec);
    } else {
      leave("a link of kind " + spec.kind + " models an in-process path and cannot span processes");
    }
  }
  if (!have_segment) {  // the segment carries the arrival in any case; it plays "shm"
    r.segment = 0;
    r.info.links.insert(r.info.links.begin(), "shm");
    r.tcp.insert(r.tcp.begin(), nullptr);
    used.insert(used.begin(), plan::LinkSpec{"shm", "shm", {}});
    if (r.info.links.size() > kMaxXprocLinks) {
      r.info.left_out.emplace_back(r.info.links.back(), "more than " + std::to_string(kMaxXprocLinks) + " links");
      r.info.links.pop_back();
      r.tcp.pop_back();
      used.pop_back();
    }
  }
  r.spec = plan::FormatLinkSpecs(used);
  return r;
}

std::string Join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "+" : "") + v[i];
  return s;
}

class XprocExecutor {
 public:
  XprocExecutor(ProcessGroup* group, Resolved r) : g_(group), r_(std::move(r)) {
    const size_t L = r_.info.links.size();
    const int n = g_->size();
    workers_.resize(L);
    for (size_t i = 0; i < L; ++i) {
      workers_[i].resize(n);
      if (!r_.tcp[i]) continue;
      for (int rank = 0; rank < n; ++rank)
        if (g_->is_local(rank)) workers_[i][rank] = std::make_unique<LinkWorker>();
    }
    for (size_t i = 0; i < L; ++i) counters_.push_back(std::make_unique<FaultCounter>(n));
    health_ = std::make_shared<GroupHealth>(FormatIds(g_->devices()), r_.info.links);
    if (g_->is_local(0)) {
      plan::BalancerOptions options;
      // Stage 1 across processes (xproc_profile.h) from the same size as in one process.
      options.profile_from_bytes = AutotuneMinBytes();
      options.profile_max_bytes = TuneMaxBytes();
      balancer_ = std::make_unique<plan::Balancer>(r_.info.links, options);
      if (auto model = CurrentModel(); model && model->links() == r_.info.links) (void)balancer_->SetModel(*model);
      for (const auto& [key, shares] : CurrentShareOverrides())
        (void)balancer_->SetShares(key.first, key.second, shares.shares, shares.pinned);
    }
  }

  plan::Balancer* balancer() { return balancer_.get(); }
  // No tcp range of an earlier call still on a worker (one a rank gave up on, until its deadline).
  bool Idle() {
    for (auto& per_link : workers_)
      for (auto& w : per_link)
        if (w && !w->Idle()) return false;
    return true;
  }
  // The group's model in this process: the leader's balancer's, else what stage 1 across processes
  // computed here (every rank computes the same fits; only the leader plans with them). Empty links:
  // nothing for any kind.
  plan::CostModel Model() const {
    if (balancer_) return balancer_->Model();
    std::lock_guard<std::mutex> lock(profiled_mu_);
    for (size_t k = 0; k < plan::kNumKinds; ++k)
      if (profiled_.Has(static_cast<Kind>(k))) return profiled_;
    return plan::CostModel{};
  }
  void ForgetKind(Kind kind) {
    if (balancer_) balancer_->ForgetKind(kind);
    std::lock_guard<std::mutex> lock(profiled_mu_);
    profiled_.ClearKind(kind);
  }
  const std::shared_ptr<GroupHealth>& health() const { return health_; }
  const std::vector<std::string>& links() const { return r_.info.links; }

  Status Run(int rank, const CallDesc& desc, std::string_view label, int64_t run_id) {
    const int n = g_->size();
    const size_t L = r_.info.links.size();
    // The group's call number (ProcessGroup counts every call, split or not, in every process), not
    // this executor's: after a reconfiguration the parity argument still holds across executors.
    const uint64_t c = g_->rank_calls(rank) + 1;
    const uint64_t bytes = MessageBytes(desc, n);
    auto where = [&] {
      return ErrorPrefix(label) + desc.Describe() + " on cross-process group " + FormatIds(g_->devices()) +
             " (links " + Join(r_.info.links) + ", run " + std::to_string(run_id) + ", call " + std::to_string(c) +
             " on this group)";
    };
    auto fail = [&](const std::string& message) {
      if (!g_->aborted()) g_->Abort(rank, message);
      return Status::Internal(message);
    };
    if (rank == 0) {
      std::shared_ptr<const plan::Plan> plan = balancer_->PlanFor(desc.kind, bytes);
      if (plan->mode == plan::PlanMode::kProfile && LoadCached(desc.kind, bytes)) plan = balancer_->PlanFor(desc.kind, bytes);
      PlanSlot& slot = g_->plan_slot(c);
      slot.call = c;
      slot.epoch = plan->epoch;
      slot.mode = static_cast<uint32_t>(plan->mode);
      slot.links = static_cast<uint32_t>(L);
      const bool usable = plan->mode != plan::PlanMode::kProfile && plan->shares.size() == L;
      std::vector<double> planned(L);
      for (size_t i = 0; i < L; ++i) planned[i] = usable ? plan->shares[i] : (i == r_.segment ? 1.0 : 0.0);
      // Unhealthy links out (core/health.h); every process learns the result from this slot.
      bool masked = false;
      int probe = -1;
      const std::vector<double> shares = health_->Effective(planned, c, desc.virtual_bytes(), &masked, &probe);
      for (size_t i = 0; i < kMaxXprocLinks; ++i) slot.shares[i] = i < L ? shares[i] : 0.0;
      // The leader's view of health and its fits: every process chooses carriers, sets deadlines and
      // judges bandwidth from these, so all decide alike (other processes have no fits of their own).
      slot.unhealthy = 0;
      for (size_t i = 0; i < L; ++i)
        if (health_->Unhealthy(i)) slot.unhealthy |= 1u << i;
      WriteSlotModel(*balancer_, desc.kind, L, &slot);
      // A masked call is not the plan's: stage 2 learns nothing from it.
      held_[c & 1] = Held{masked ? nullptr : plan, bytes, std::vector<uint64_t>(L, 0), c};
    }
    // Its errors failed the group already where they must (ProcessGroup::Barrier); a fingerprint
    // mismatch is every rank's same verdict and leaves the group usable.
    FLEXLINK_RETURN_IF_ERROR(g_->Arrive(rank, desc, label, run_id));

    // The leader's plan for this call (written before its arrival, visible after ours).
    const PlanSlot& slot = g_->plan_slot(c);
    if (slot.call != c || slot.links != L)
      return fail(where() + ": the leader's plan slot holds call " + std::to_string(slot.call) + " for " +
                  std::to_string(slot.links) + " links, expected call " + std::to_string(c) + " for " +
                  std::to_string(L) + " (processes disagree on the group's calls or on its links: every process "
                  "must configure the same links and connect the same cross-process rings)");
    std::vector<double> shares(L);
    for (size_t i = 0; i < L; ++i) {
      shares[i] = slot.shares[i];
      if (!std::isfinite(shares[i]) || shares[i] < 0)
        return fail(where() + ": the leader's plan has an invalid share for link " + r_.info.links[i]);
    }
    // Copied now: the slot is rewritten for call c + 2 once the leader passed c + 1's arrival.
    const uint32_t unhealthy = slot.unhealthy;
    const bool profile = slot.mode == static_cast<uint32_t>(plan::PlanMode::kProfile);
    std::vector<plan::AlphaBeta> fits(L);
    if (!SlotFits(slot, L, fits.data())) fits.clear();  // predict without
    if (!balancer_ && rank == FirstLocalRank()) {  // this process reports the leader's model
      std::lock_guard<std::mutex> lock(profiled_mu_);
      LearnSlotModel(slot, desc.kind, L, &profiled_);
    }
    if (rank == 0 && c > 1) ReportCall(c - 1);
    if (rank == FirstLocalRank() && c > 1) ObserveCall(c - 1);
    // After ReportCall and ObserveCall: the profile's rounds reuse the times slots they read.
    if (profile) FLEXLINK_RETURN_IF_ERROR(Profile(rank, desc, c, label, run_id));

    const std::vector<plan::UnitRange> ranges = plan::CutRanges(desc.virtual_bytes(), 1, shares);
    if (rank == 0)
      for (size_t i = 0; i < L; ++i)
        if (!ranges[i].empty()) held_[c & 1].link_bytes[i] = desc.InputBytes(UnitRange{ranges[i].begin, ranges[i].end}, n);
    if (RecordingSplits()) {
      SplitRecord rec{FormatIds(g_->devices()), run_id, c, rank, {}};
      for (const auto& range : ranges) rec.ranges.emplace_back(range.begin, range.end);
      RecordSplit(std::move(rec));
    }

    auto seconds = std::make_shared<std::vector<double>>(L, 0.0);
    const auto t0 = Clock::now();
    auto pieces_of = [&](size_t i) {
      std::vector<Piece> pieces;
      if (!ranges[i].empty()) desc.PiecesOf(UnitRange{ranges[i].begin, ranges[i].end}, &pieces);
      return pieces;
    };
    // Each link's own deadline for its range (docs/faults.md: min(T/2, max(8 x predicted, floor))),
    // from the call's arrival, predicted from the leader's fits.
    std::vector<double> budget(L, 0.0);
    for (size_t i = 0; i < L; ++i)
      if (!ranges[i].empty()) budget[i] = LinkBudgetSeconds(Predicted(fits, i, RangeBytes(desc, bytes, ranges[i])));
    // Injected faults (core/faults.h), decided per link before it runs: the same on every rank.
    std::shared_ptr<const FaultSet> faults = CurrentFaults();
    std::vector<const Fault*> fault(L, nullptr);
    std::vector<uint64_t> fault_call(L, 0);
    for (size_t i = 0; i < L && faults; ++i)
      if (!ranges[i].empty()) {
        fault_call[i] = counters_[i]->Next(rank, *faults);
        fault[i] = faults->ForLink(r_.info.links[i], fault_call[i]);
      }
    auto slow = [&](size_t i, Clock::time_point start) {
      if (fault[i] && fault[i]->kind == Fault::Kind::kSlow)
        std::this_thread::sleep_for((Clock::now() - start) * (fault[i]->factor - 1));
    };
    std::vector<Status> link_status(L);
    FLEXLINK_RETURN_IF_ERROR(RebuildProbedRings(rank, desc, label, run_id, c, ranges, unhealthy, budget, &link_status));
    std::vector<size_t> posted;
    for (size_t i = 0; i < L; ++i) {
      if (!r_.tcp[i] || ranges[i].empty() || !link_status[i].ok()) continue;
      if (fault[i] && fault[i]->kind == Fault::Kind::kError) {
        link_status[i] = Injected(label, i, *fault[i], fault_call[i], *faults, budget[i]);
        continue;
      }
      TcpChannel* ch = r_.tcp[i];
      const Fault* f = fault[i];
      TcpLimits limits{t0 + Seconds(budget[i]), budget[i], label};
      workers_[i][rank]->Post([&, ch, n, rank, i, f, limits, pieces = pieces_of(i), t0, seconds] {
        if (f && f->kind == Fault::Kind::kHang) return Injected(limits.label, i, *f, fault_call[i], *faults, budget[i]);
        const auto start = Clock::now();
        Status s = ch->RunPieces(desc, n, rank, pieces, limits);
        slow(i, start);
        (*seconds)[i] = Since(t0);
        return s;
      });
      posted.push_back(i);
    }
    {
      const size_t i = r_.segment;
      if (fault[i] && fault[i]->kind != Fault::Kind::kSlow) {
        link_status[i] = Injected(label, i, *fault[i], fault_call[i], *faults, budget[i]);
      } else {
        const auto start = Clock::now();
        link_status[i] = g_->RunPieces(rank, desc, pieces_of(i), label, run_id);
        slow(i, start);
      }
      (*seconds)[i] = Since(t0);
    }
    const double worker_timeout = 2 * TimeoutSeconds() + 5;
    for (size_t i : posted) link_status[i] = workers_[i][rank]->Wait(worker_timeout);
    // The segment failing for real failed the group (its steps' abort word): nothing can carry on.
    if (!link_status[r_.segment].ok() && link_status[r_.segment].code() != StatusCode::kUnavailable)
      return link_status[r_.segment];
    uint32_t bad = 0;
    FLEXLINK_RETURN_IF_ERROR(
        Recover(rank, desc, label, run_id, c, ranges, shares, unhealthy, fits, link_status, where, &bad));
    const double call_seconds = Since(t0);
    if (rank == FirstLocalRank()) {
      // A link that carried its range everywhere while unhealthy (a probe, or the plan's only links
      // all unhealthy) is re-admitted, from the same union every process read: the same decision.
      for (size_t i = 0; i < L; ++i)
        if (!ranges[i].empty() && !((bad >> i) & 1) && health_->Unhealthy(i)) health_->Probed(i, c, true, "");
      // What the next call's ObserveCall needs to judge this one's bandwidth (the same everywhere).
      Observation& o = observed_[c & 1];
      o.call = c;
      o.bad = bad;
      o.fits = fits;
      o.bytes.assign(L, 0);
      for (size_t i = 0; i < L; ++i)
        if (!ranges[i].empty()) o.bytes[i] = RangeBytes(desc, bytes, ranges[i]);
    }
    TimesSlot& t = g_->times_slot(rank, c);
    t.call = c;
    t.links = static_cast<uint32_t>(L);
    t.ok = 1;
    t.call_seconds = call_seconds;
    for (size_t i = 0; i < kMaxXprocLinks; ++i) t.seconds[i] = i < L ? (*seconds)[i] : 0.0;
    return Status::Ok();  // the next arrival's release publishes the times
  }

 private:
  // Stage 1 in this call, on every rank (xproc_profile.h); the call itself then runs on the kProfile
  // plan's shares (the segment alone). The leader installs the fits; a profile that a link failed
  // installs nothing and turns stage 1 off for the group (its calls are then planned from equal
  // shares by stage 2, as before stage 1 existed here), with a warning that says why.
  Status Profile(int rank, const CallDesc& desc, uint64_t c, std::string_view label, int64_t run_id) {
    ProfiledLinks links{g_, r_.info.links, r_.tcp, &workers_};
    plan::BalancerOptions options;  // the thresholds only: every rank must use the same
    ProfileOutcome outcome;
    FLEXLINK_RETURN_IF_ERROR(ProfileAcrossProcesses(links, rank, c, desc.kind, MessageBytes(desc, g_->size()),
                                                    options, label, run_id, &outcome));
    if (rank == FirstLocalRank() && outcome.ok) {  // every rank computed the same model
      std::lock_guard<std::mutex> lock(profiled_mu_);
      profiled_.CopyKind(outcome.model, desc.kind);
    }
    if (rank != 0) return Status::Ok();
    const std::string group = "stage 1 for " + std::string(Name(desc.kind)) + " on cross-process group " +
                              FormatIds(g_->devices()) + " (links " + Join(r_.info.links) + ")";
    if (!outcome.ok) {
      balancer_->StopProfiling();  // every kind's kProfile plans with it
      balancer_->ForgetKind(desc.kind);
      LogWarning(group + " did not complete, so none of its calls profiles again and stage 2 "
                 "plans them from equal shares: " + outcome.why_not);
      return Status::Ok();
    }
    Status merged = balancer_->MergeModel(outcome.model);
    LogInfo(group + ": " + outcome.summary);
    if (merged.ok() && g_->processes() > 0)
      StoreProfiledModel(CacheKey(), r_.info.links, desc.kind, outcome.model, outcome.model.ProfiledBytes(desc.kind));
    return merged;
  }

  // The tuning cache's key of this group: its used links, its ranks and the processes it spans
  // (an entry of the same links inside one process is another path: tuning_cache.h).
  plan::CacheKey CacheKey() const {
    plan::CacheKey key{plan::HostName(), r_.spec, g_->size()};
    key.processes = g_->processes();
    return key;
  }

  // The leader, for a kProfile plan: stage 1 from the tuning cache instead, when it holds this
  // group's fits for `kind` up to the size stage 1 would profile. Only the leader's process reads
  // the cache; the others learn the model from the plan slots (slot_model.h). A group whose creator
  // was not told how many processes it spans (0) neither reads nor writes it.
  bool LoadCached(Kind kind, uint64_t bytes) {
    if (!TuneUseCache() || g_->processes() == 0) return false;
    plan::CostModel cached, one(r_.info.links);
    if (!LoadCachedModel(CacheKey(), r_.info.links, kind, ProfileTopBytes(bytes), &cached)) return false;
    // This kind alone: the other processes learn a kind's model from its calls' slots, so each kind
    // is installed at its own first large call and every process reports the same kinds.
    one.CopyKind(cached, kind);
    if (!balancer_->MergeModel(one).ok()) return false;
    LogInfo("stage 1 for " + std::string(Name(kind)) + " on cross-process group " + FormatIds(g_->devices()) +
            " (links " + Join(r_.info.links) + ", " + std::to_string(g_->processes()) + " processes) from cache " +
            ProfileCachePath() + ": " + DescribeFits(r_.info.links, cached.Fits(kind)) + "; " +
            SplitThresholdText(balancer_->SplitThresholdBytes(kind)));
    return true;
  }

  // A probe of an unhealthy tcp ring (health_->Effective gave it a small range) rebuilds the ring
  // first (docs/faults.md, "Across processes"): a ring that failed for real has its streams out of
  // step, and only new connections can carry the probe. Every rank of every process reads the same
  // unhealthy bits and ranges from the leader's slot, so all take part: each local rank listens
  // anew (TcpChannel::ListenAgain) and publishes its port in its times slot of this call (free until
  // the call's end: the leader read it for call c - 2 before this call's arrival), a barrier of the
  // segment, then each connects to its successor and accepts its predecessor with the job's token
  // (ConnectAgain) by the link's deadline. A rank that cannot leaves its error in *link_status: the
  // range fails over like any failed range and the link stays unhealthy.
  Status RebuildProbedRings(int rank, const CallDesc& desc, std::string_view label, int64_t run_id, uint64_t c,
                            const std::vector<plan::UnitRange>& ranges, uint32_t unhealthy,
                            const std::vector<double>& budget, std::vector<Status>* link_status) {
    const size_t L = r_.info.links.size();
    std::vector<size_t> rebuild;
    for (size_t i = 0; i < L; ++i)
      if (r_.tcp[i] && !ranges[i].empty() && ((unhealthy >> i) & 1)) rebuild.push_back(i);
    if (rebuild.empty()) return Status::Ok();
    TimesSlot& mine = g_->times_slot(rank, c);
    for (size_t i : rebuild) {
      uint16_t port = 0;
      (*link_status)[i] = r_.tcp[i]->ListenAgain(rank, &port);
      mine.seconds[i] = (*link_status)[i].ok() ? port : 0;  // 0: this rank has no listener
    }
    FLEXLINK_RETURN_IF_ERROR(g_->Sync(rank, desc, label, run_id));
    const int n = g_->size();
    for (size_t i : rebuild) {
      if (!(*link_status)[i].ok()) continue;
      std::vector<uint16_t> ports(n, 0);
      for (int q = 0; q < n; ++q) ports[q] = static_cast<uint16_t>(g_->times_slot(q, c).seconds[i]);
      // A rank without a listener cannot be reached; its own error says why, and every rank that
      // connects to it fails at the deadline, so the range fails over everywhere.
      (*link_status)[i] = r_.tcp[i]->ConnectAgain(rank, ports, Deadline(budget[i]));
    }
    return Status::Ok();
  }

  static Clock::time_point Deadline(double seconds) { return Clock::now() + Seconds(seconds); }
  static Clock::duration Seconds(double s) {
    return ClampedSeconds(s);
  }
  // A link's predicted time for `bytes` (nccl-tests bytes): the leader's fit, else the unfitted one.
  static double Predicted(const std::vector<plan::AlphaBeta>& fits, size_t link, double bytes) {
    return plan::PredictOrUnfitted(fits, link, bytes);
  }
  static uint64_t RangeBytes(const CallDesc& desc, uint64_t bytes, plan::UnitRange r) {
    return plan::RangeMessageBytes(bytes, r, desc.virtual_bytes());
  }

  // An injected error, or a hang: that waits the link's deadline touching nothing (a cross-process
  // lane has no shared context to abort; the hang's peers hang alike, at the same call).
  Status Injected(std::string_view label, size_t i, const Fault& f, uint64_t call, const FaultSet& faults,
                  double budget_s) const {
    std::string m = ErrorPrefix(label) + "link " + r_.info.links[i] + " of cross-process group " +
                    FormatIds(g_->devices()) + ": injected ";
    if (f.kind == Fault::Kind::kHang) {
      std::this_thread::sleep_for(std::chrono::duration<double>(budget_s));
      m += "hang at its call " + std::to_string(call) + ": it did not complete within its deadline of " +
           FormatSeconds(budget_s) + " s";
    } else {
      m += "error at its call " + std::to_string(call);
    }
    return Status::Unavailable(m + " (FLEXLINK_FAULTS \"" + faults.text + "\")");
  }

  // Failover across processes (docs/faults.md, "Across processes"), the rules of the in-process
  // Executor::Recover: every rank writes which of its links failed into its times slot, one barrier
  // step of the segment (ProcessGroup::Sync) makes them visible, and every rank re-runs the union's
  // ranges on FailoverCarrier's choice from the leader's plan slot (shares, unhealthy links): the
  // same choice everywhere. A re-run that fails marks its carrier failed and the range goes to the
  // next link, for at most L - 1 rounds, one Sync each; when no link is left the call fails on every
  // rank alike with every link's report, and the group stays usable (all ranks consumed the same
  // steps). *bad: the links that failed in this call, on any rank.
  Status Recover(int rank, const CallDesc& desc, std::string_view label, int64_t run_id, uint64_t c,
                 const std::vector<plan::UnitRange>& ranges, const std::vector<double>& shares, uint32_t unhealthy,
                 const std::vector<plan::AlphaBeta>& fits, const std::vector<Status>& status,
                 const std::function<std::string()>& where, uint32_t* bad_out) {
    const size_t L = r_.info.links.size();
    const int n = g_->size();
    const uint64_t bytes = MessageBytes(desc, n);
    auto fail = [&](const std::string& message) {
      if (!g_->aborted()) g_->Abort(rank, message);
      return Status::Internal(message);
    };
    std::vector<std::string> errors(L);  // this rank's reports (another rank's are in its own message)
    uint32_t failed = 0, touched = 0;
    for (size_t i = 0; i < L; ++i)
      if (!status[i].ok()) {
        failed |= 1u << i;
        if (status[i].code() != StatusCode::kUnavailable) touched |= 1u << i;
        errors[i] = status[i].message();
      }
    // Round r's bits of every rank after its barrier (Sync); false if a rank did not publish them.
    auto agree = [&](size_t round, uint32_t mine_failed, uint32_t mine_touched, uint32_t* all_failed,
                     uint32_t* all_touched) -> Status {
      TimesSlot& mine = g_->times_slot(rank, c);
      mine.call = c;
      mine.ok = 0;
      mine.failed[round & 1] = mine_failed;
      mine.touched[round & 1] = mine_touched;
      FLEXLINK_RETURN_IF_ERROR(g_->Sync(rank, desc, label, run_id));
      *all_failed = *all_touched = 0;
      for (int r = 0; r < n; ++r) {
        const TimesSlot& t = g_->times_slot(r, c);
        if (t.call != c) return fail(where() + ": rank " + std::to_string(r) + " did not publish its links' status");
        *all_failed |= t.failed[round & 1];
        *all_touched |= t.touched[round & 1];
      }
      return Status::Ok();
    };
    uint32_t all_failed = 0, all_touched = 0;
    FLEXLINK_RETURN_IF_ERROR(agree(0, failed, touched, &all_failed, &all_touched));
    *bad_out = all_failed;
    if (all_failed == 0) return Status::Ok();
    std::vector<char> bad(L, 0), range_touched(L, 0);
    std::vector<size_t> pending;
    for (size_t i = 0; i < L; ++i)
      if ((all_failed >> i) & 1) {
        pending.push_back(i);
        bad[i] = 1;
        range_touched[i] = (all_touched >> i) & 1;
        if (errors[i].empty()) errors[i] = "failed on another rank";
      }
    auto is_unhealthy = [&](size_t j) { return ((unhealthy >> j) & 1) != 0; };
    std::shared_ptr<const FaultSet> faults = CurrentFaults();
    std::vector<size_t> carrier(L, L);
    std::vector<std::pair<size_t, size_t>> moves;  // (failed link, its carrier)
    for (size_t round = 1; round < L && !pending.empty(); ++round) {
      for (size_t i : pending) {
        bool aliased = false;  // this rank's own parts only: another rank may decide otherwise, so abort
        for (const Part& p : desc.parts)
          aliased |= p.in == p.out && p.offset < ranges[i].end && ranges[i].begin < p.offset + p.bytes();
        if (range_touched[i] && aliased)
          return fail(where() + ": link " + r_.info.links[i] + " failed after it may have written part of its range of "
                      "an in-place (aliased) call, so its input bytes cannot be recovered: " + errors[i]);
        carrier[i] = FailoverCarrier(bad, shares, is_unhealthy);
      }
      if (std::any_of(pending.begin(), pending.end(), [&](size_t i) { return carrier[i] == L; })) break;
      uint32_t round_failed = 0, round_touched = 0;
      for (size_t i : pending) {
        const size_t to = carrier[i];
        std::vector<Piece> pieces;
        desc.PiecesOf(UnitRange{ranges[i].begin, ranges[i].end}, &pieces);
        // The re-run has a deadline of its own, from its start, for the carrier's time for the bytes;
        // it counts as the carrier's call for injected faults (as in one process).
        const double budget = LinkBudgetSeconds(Predicted(fits, to, RangeBytes(desc, bytes, ranges[i])));
        const Fault* f = nullptr;
        uint64_t fault_call = 0;
        if (faults) {
          fault_call = counters_[to]->Next(rank, *faults);
          f = faults->ForLink(r_.info.links[to], fault_call);
        }
        Status s;
        if (f && f->kind != Fault::Kind::kSlow) {
          s = Injected(label, to, *f, fault_call, *faults, budget);
        } else if (to == r_.segment) {
          s = g_->RunPieces(rank, desc, pieces, label, run_id);
          // The segment failing for real failed the group already (its abort word).
          if (!s.ok()) return s;
        } else {
          s = r_.tcp[to]->RunPieces(desc, n, rank, pieces, TcpLimits{Deadline(budget), budget, label});
        }
        if (!s.ok()) {
          round_failed |= 1u << i;
          if (s.code() != StatusCode::kUnavailable) round_touched |= 1u << i;
          if (errors[to].empty()) errors[to] = s.message();
        }
      }
      FLEXLINK_RETURN_IF_ERROR(agree(round, round_failed, round_touched, &all_failed, &all_touched));
      std::vector<size_t> still;
      for (size_t i : pending) {
        if ((all_failed >> i) & 1) {
          still.push_back(i);
          bad[carrier[i]] = 1;
          *bad_out |= 1u << carrier[i];
          range_touched[i] |= (all_touched >> i) & 1;
          if (errors[carrier[i]].empty()) errors[carrier[i]] = "failed on another rank";
        } else {
          moves.emplace_back(i, carrier[i]);
        }
      }
      pending = std::move(still);
    }
    // Every process records the same decisions (its own stats); the leader's mask the next plans.
    if (rank == FirstLocalRank()) {
      for (size_t j = 0; j < L; ++j)
        if ((*bad_out >> j) & 1) {
          if (is_unhealthy(j)) health_->Probed(j, c, false, errors[j]);  // a probe that failed
          else health_->Failed(j, c, errors[j]);
        }
      for (const auto& [from, to] : moves) {
        health_->FailedOver(from);
        RecordFailover(FailoverRecord{FormatIds(g_->devices()), std::string(Name(desc.kind)), r_.info.links[from],
                                      r_.info.links[to], errors[from], c, RangeBytes(desc, bytes, ranges[from]), 0.0,
                                      UnixNow()});
      }
    }
    if (pending.empty()) return Status::Ok();
    return Status::Internal(NoCarrierMessage(label, desc.kind, FormatIds(g_->devices()) + " across processes", c,
                                             r_.info.links, errors, is_unhealthy));
  }

  // Degraded detection (core/health.h), in every process alike: after call p + 1's arrival every
  // rank's times of p are visible (the leader's stage-2 report reads the same), so each process's
  // first local rank takes the slowest rank's time per link and compares the link's rate with the
  // leader's fit that p's plan slot carried. Same bytes, same fits, same rule: the same verdict in
  // every process, one call later than in one process.
  void ObserveCall(uint64_t p) {
    const Observation& o = observed_[p & 1];
    const size_t L = r_.info.links.size();
    if (o.call != p || o.bytes.size() != L) return;
    std::vector<double> secs(L, 0.0);
    for (int r = 0; r < g_->size(); ++r) {
      const TimesSlot& t = g_->times_slot(r, p);
      if (t.call != p || t.links != L || t.ok != 1) return;  // failed somewhere: no evidence
      for (size_t i = 0; i < L; ++i) {
        const double v = t.seconds[i];
        if (!std::isfinite(v) || v < 0 || v > 1e6) return;
        secs[i] = std::max(secs[i], v);
      }
    }
    for (size_t i = 0; i < L; ++i) {
      if (!o.bytes[i] || ((o.bad >> i) & 1) || !(secs[i] > 0)) continue;
      const double b = static_cast<double>(o.bytes[i]);
      const double expected = o.fits.empty() ? -1 : b / o.fits[i].Predict(b);
      health_->Observed(i, p, o.bytes[i], expected, b / secs[i]);
    }
  }

  int FirstLocalRank() const {
    for (int r = 0; r < g_->size(); ++r)
      if (g_->is_local(r)) return r;
    return 0;
  }

  struct Held {
    std::shared_ptr<const plan::Plan> plan;
    uint64_t bytes = 0;
    std::vector<uint64_t> link_bytes;
    uint64_t call = 0;
  };

  // The leader, after call p + 1's arrival: every rank finished p and wrote its times.
  void ReportCall(uint64_t p) {
    Held& h = held_[p & 1];
    const size_t L = r_.info.links.size();
    if (!h.plan || h.call != p) return;
    std::vector<double> secs(L, 0.0);
    double call_s = 0;
    for (int r = 0; r < g_->size(); ++r) {
      const TimesSlot& t = g_->times_slot(r, p);
      if (t.call != p || t.links != L || t.ok != 1) return;  // a call that failed somewhere: nothing learnt
      for (size_t i = 0; i < L; ++i) {
        const double v = t.seconds[i];
        if (!std::isfinite(v) || v < 0 || v > 1e6) return;
        secs[i] = std::max(secs[i], v);
      }
      if (std::isfinite(t.call_seconds)) call_s = std::max(call_s, t.call_seconds);
    }
    for (size_t i = 0; i < L; ++i)
      if (!h.link_bytes[i]) secs[i] = 0;
    const plan::Balancer::Outcome outcome = balancer_->Report(*h.plan, h.bytes, secs, call_s);
    for (size_t i = 0; i < L; ++i)
      if (h.link_bytes[i]) RecordLinkCall(r_.info.links[i], h.link_bytes[i], secs[i]);
    if (outcome.changed) LogInfo("cross-process group " + FormatIds(g_->devices()) + ": " + outcome.reason);
    h.plan.reset();
  }

  ProcessGroup* const g_;
  const Resolved r_;
  std::unique_ptr<plan::Balancer> balancer_;  // the leader's process only
  mutable std::mutex profiled_mu_;
  plan::CostModel profiled_{r_.info.links};  // stage 1's results in this process (Model())
  std::vector<std::vector<std::unique_ptr<LinkWorker>>> workers_;  // [link][rank]: tcp links, local ranks
  Held held_[2];                 // leader (rank 0's thread) only: the plans of the last two calls
  struct Observation {           // a call's facts for ObserveCall (the first local rank's thread only)
    uint64_t call = 0;
    uint32_t bad = 0;                   // links that failed somewhere: no evidence
    std::vector<plan::AlphaBeta> fits;  // the leader's, from the call's plan slot (empty: none)
    std::vector<uint64_t> bytes;        // per link: nccl-tests bytes of its range
  };
  Observation observed_[2];
  std::vector<std::unique_ptr<FaultCounter>> counters_;  // per link: its calls per local rank
  std::shared_ptr<GroupHealth> health_;
};

struct Entry {
  std::shared_ptr<const LinkSet> set;  // keeps the names' link set current for the entry's life
  XprocLinks info;
  std::unique_ptr<XprocExecutor> executor;  // null: one usable link
  // Per local rank: the group's calls (rank:absent) and the segment's calls when it runs alone. A
  // released entry's successor takes them over, so that call numbers go on as in the processes
  // that kept theirs.
  std::shared_ptr<FaultCounter> calls;
  std::shared_ptr<FaultCounter> calls_alone;
  // Local ranks inside a call of it, retired once released (ReleaseEarlierXprocEntries).
  EntryWord entry;
};

struct Registry {
  std::mutex mu;
  // Device threads cache raw pointers (as the engine's groups), so an entry is never freed: a
  // released one leaves the map and keeps its shell in `released`.
  std::map<std::pair<ProcessGroup*, uint64_t>, std::unique_ptr<Entry>> entries;
  std::vector<std::unique_ptr<Entry>> released;
  // The counters of released entries, for their successors.
  std::map<std::pair<ProcessGroup*, uint64_t>, std::pair<std::shared_ptr<FaultCounter>, std::shared_ptr<FaultCounter>>>
      counters;
};

Registry& Reg() {
  static auto* r = new Registry;
  return *r;
}

// The group's entry for link set `version` (0: the current one), entered for one call (the caller
// leaves it with an Entered), cached per device thread.
Status EntryFor(ProcessGroup* group, uint64_t version, std::string_view label, Entry** out) {
  thread_local std::vector<std::tuple<ProcessGroup*, uint64_t, Entry*>> cache;
  std::shared_ptr<const LinkSet> set;
  if (version == 0) {
    set = CurrentLinkSet();
    version = set->version;
  }
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    const auto& [g, v, e] = *it;
    if (g != group || v != version) continue;
    if (e->entry.Enter()) {
      *out = e;
      return Status::Ok();
    }
    cache.erase(it);  // released: the registry makes its successor
    break;
  }
  if (!set)
    if (Status s = LinkSetAt(version, &set); !s.ok()) return Status::InvalidArgument(ErrorPrefix(label) + s.message());
  // Health is reported for the current set's entries only (an earlier set's is dropped when the
  // links change; a successor made for a late call of it is not reported).
  const bool current = set->version == CurrentLinkSet()->version;
  Registry& reg = Reg();
  Entry* e = nullptr;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto& slot = reg.entries[{group, set->version}];
    if (!slot) {
      slot = std::make_unique<Entry>();
      Resolved r = Resolve(group, *set);
      slot->info = r.info;
      if (r.info.links.size() > 1) {
        slot->executor = std::make_unique<XprocExecutor>(group, std::move(r));
        if (current) RegisterGroupHealth(slot->executor->health(), set->version);
      }
      if (auto kept = reg.counters.find({group, set->version}); kept != reg.counters.end()) {
        slot->calls = kept->second.first;
        slot->calls_alone = kept->second.second;
      } else {
        slot->calls = std::make_shared<FaultCounter>(group->size());
        slot->calls_alone = std::make_shared<FaultCounter>(group->size());
      }
      slot->set = set;
    }
    e = slot.get();
    // Under the registry's lock nothing is released, and an entry in the map is never retired.
    e->entry.EnterUnretired();
  }
  cache.emplace_back(group, set->version, e);
  *out = e;
  return Status::Ok();
}

}  // namespace

XprocLinks XprocLinksOf(ProcessGroup* group) {
  std::shared_ptr<const LinkSet> set = CurrentLinkSet();
  {
    Registry& reg = Reg();
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.entries.find({group, set->version});
    if (it != reg.entries.end()) return it->second->info;
  }
  return Resolve(group, *set).info;
}

Status StayAway(ProcessGroup* group, int rank, uint64_t call, std::string_view label) {
  const auto deadline = DeadlineAfter(1.5 * TimeoutSeconds());
  while (!group->aborted() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const std::optional<std::string> broken = group->broken();
  return Status::DeadlineExceeded(ErrorPrefix(label) + "rank " + std::to_string(rank) + " (device " +
                                  std::to_string(group->devices()[rank]) + ") stayed away from call " +
                                  std::to_string(call) + " of cross-process group " + FormatIds(group->devices()) +
                                  " (injected rank:absent)" + (broken ? ": " + *broken : std::string()));
}

Status RunXprocCall(ProcessGroup* group, int rank, const CallDesc& desc, std::string_view label, int64_t run_id,
                    uint64_t links_version) {
  Entry* e = nullptr;
  FLEXLINK_RETURN_IF_ERROR(EntryFor(group, links_version, label, &e));
  const Entered entered(e->entry);
  if (std::shared_ptr<const FaultSet> faults = CurrentFaults()) {
    const uint64_t c = e->calls->Next(rank, *faults);
    if (faults->AbsentAt(rank, c)) return StayAway(group, rank, c, label);
  }
  if (e->executor) return e->executor->Run(rank, desc, label, run_id);
  // One usable link: an injected error or hang of it fails the call on every rank alike, before the
  // segment is touched (nothing to fail over to; the group stays usable).
  if (std::shared_ptr<const FaultSet> faults = CurrentFaults()) {
    const uint64_t c = e->calls_alone->Next(rank, *faults);
    if (const Fault* f = faults->ForLink(e->info.links.empty() ? "shm" : e->info.links[0], c);
        f && f->kind != Fault::Kind::kSlow) {
      double budget = 0;
      if (f->kind == Fault::Kind::kHang) {
        budget = LinkBudgetSeconds(plan::UnfittedSeconds(static_cast<double>(MessageBytes(desc, group->size()))));
        std::this_thread::sleep_for(std::chrono::duration<double>(budget));
      }
      const std::string secs = FormatSeconds(budget);
      return Status::Unavailable(ErrorPrefix(label) + "link shm of cross-process group " + FormatIds(group->devices()) +
                                 ": injected " + (f->kind == Fault::Kind::kHang
                                                      ? std::string("hang at its call ") + std::to_string(c) +
                                                            ": it did not complete within its deadline of " + secs + " s"
                                                      : "error at its call " + std::to_string(c)) +
                                 " (FLEXLINK_FAULTS \"" + faults->text + "\"; no other link to fail over to)");
    }
  }
  // One usable link: the segment runs the call alone, recorded as the single-link path records it.
  const auto start = std::chrono::steady_clock::now();
  Status status = group->Run(rank, desc, label, run_id);
  if (rank == 0 && status.ok())
    RecordLinkCall("shm", desc.InputBytes(group->size()),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return status;
}

ReleasedGroups ReleaseEarlierXprocEntries() {
  const uint64_t current = CurrentLinkSet()->version;
  ReleasedGroups out;
  std::vector<std::unique_ptr<XprocExecutor>> gone;  // joined after the lock
  Registry& reg = Reg();
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    RetireEarlier(
        reg.entries, [&](const auto& key) { return key.second < current; },
        [](Entry& e) { return e.executor && !e.executor->Idle(); },
        [&](auto it) {
          Entry& e = *it->second;
          reg.counters[it->first] = {e.calls, e.calls_alone};
          gone.push_back(std::move(e.executor));
          reg.released.push_back(std::move(it->second));
        },
        &out.released, &out.kept);
  }
  gone.clear();  // joins the idle workers
  return out;
}

std::vector<PlanSnapshot> SnapshotXprocPlans() {
  const uint64_t version = CurrentLinkSet()->version;
  std::vector<PlanSnapshot> out;
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, e] : reg.entries) {
    if (key.second != version || !e->executor || !e->executor->balancer()) continue;
    for (const auto& p : e->executor->balancer()->Plans())
      out.push_back(PlanSnapshot{key.first->devices(), *p, e->executor->links()});
  }
  return out;
}

std::optional<plan::CostModel> XprocGroupModel(std::span<const int64_t> devices) {
  ProcessGroup* group = FindProcessGroup(devices);
  if (!group) return std::nullopt;
  const uint64_t version = CurrentLinkSet()->version;
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.entries.find({group, version});
  if (it == reg.entries.end() || !it->second->executor) return std::nullopt;
  plan::CostModel model = it->second->executor->Model();
  if (model.links().empty()) return std::nullopt;
  return model;
}

void ForgetXprocKind(Kind kind) {
  const uint64_t version = CurrentLinkSet()->version;
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, e] : reg.entries)
    if (key.second == version && e->executor) e->executor->ForgetKind(kind);
}

Status ForEachXprocBalancer(const std::function<Status(plan::Balancer&)>& f) {
  const uint64_t version = CurrentLinkSet()->version;
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, e] : reg.entries)
    if (key.second == version && e->executor && e->executor->balancer())
      FLEXLINK_RETURN_IF_ERROR(f(*e->executor->balancer()));
  return Status::Ok();
}

}  // namespace flexlink::xproc
