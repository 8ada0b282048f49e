#include "xla_ffi/core/executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>

#include "xla_ffi/core/communicator.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/deadline.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/failover.h"
#include "xla_ffi/core/pages.h"
#include "xla_ffi/core/rendezvous.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/links/link.h"
#include "xla_ffi/plan/ranges.h"

namespace flexlink {
namespace {

std::atomic<bool> g_record_splits{false};
std::mutex g_splits_mu;
std::vector<SplitRecord>& Splits() {
  static auto* v = new std::vector<SplitRecord>();
  return *v;
}
constexpr size_t kMaxSplitRecords = 4096;

}  // namespace

LinkWorker::LinkWorker() : thread_([this] { Loop(); }) {}

LinkWorker::~LinkWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void LinkWorker::Post(std::function<Status()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    task_ = std::move(task);
    has_task_ = true;
    done_ = false;
  }
  cv_.notify_all();
}

Status LinkWorker::Wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = DeadlineAfter(timeout_s);
  if (!cv_.wait_until(lock, deadline, [&] { return done_; }))
    return Status::DeadlineExceeded("flexlink: a link worker did not finish its range within " +
                                    std::to_string(timeout_s) + " s");
  return result_;
}

bool LinkWorker::Idle() {
  std::lock_guard<std::mutex> lock(mu_);
  return !has_task_ && !running_;
}

bool Executor::Idle() {
  for (auto& per_rank : workers_)
    for (auto& worker : per_rank)
      if (worker && !worker->Idle()) return false;
  return true;
}

void LinkWorker::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return has_task_ || stop_; });
    if (stop_) return;
    std::function<Status()> task = std::move(task_);
    has_task_ = false;
    running_ = true;
    lock.unlock();
    Status s;
    try {  // a worker thread must not take the process down with an exception
      s = task();
    } catch (const std::exception& e) {
      s = Status::Internal(std::string("flexlink: a link worker failed: ") + e.what());
    }
    lock.lock();
    result_ = std::move(s);
    running_ = false;
    done_ = true;
    cv_.notify_all();
  }
}

Executor::Executor(Communicator* comm, std::vector<std::string> link_names, std::string spec,
                   plan::Balancer* balancer)
    : comm_(comm), link_names_(std::move(link_names)), spec_(std::move(spec)), balancer_(balancer),
      health_(std::make_shared<GroupHealth>(FormatIds(comm->devices()), link_names_)) {
  workers_.resize(link_names_.size());
  for (size_t i = 1; i < link_names_.size(); ++i)
    for (int r = 0; r < comm_->size(); ++r) workers_[i].push_back(std::make_unique<LinkWorker>());
}

namespace {

// Lanes of a call (communicator.cc LanesFor): link i's range on lane i; the re-run of link i's range
// in failover round r (from 0) on lane L + r L + i; the agreement barrier on lane L².
int FailoverLane(size_t links, size_t round, size_t source) {
  return static_cast<int>(links + round * links + source);
}
int AgreeLane(size_t links) { return static_cast<int>(links * links); }

// Whether any rank's part overlapping `range` is computed in place (its input may be half overwritten
// by a link that failed after writing).
bool AnyAliased(CallContext& ctx, plan::UnitRange range) {
  for (int r = 0; r < ctx.size(); ++r)
    for (const Part& p : ctx.desc(r).parts)
      if (p.in == p.out && p.offset < range.end && range.begin < p.offset + p.bytes()) return true;
  return false;
}

// A link's predicted time for `bytes` (nccl-tests bytes): its stage-1 fit's, else the unfitted one.
double Predicted(const std::vector<plan::AlphaBeta>& fits, size_t link, double bytes) {
  return plan::PredictOrUnfitted(fits, link, bytes);
}

using plan::RangeMessageBytes;

}  // namespace

void Executor::PrepareShares(CallContext& ctx, CallState& state, const CallDesc& desc, uint64_t bytes,
                             int only_lane) {
  std::vector<double> budget(link_names_.size(), 0.0);
  {
    std::lock_guard<std::mutex> lock(state.mu);
    if (!state.shares_ready) {
      state.shares = health_->Effective(state.plan->shares, state.call, desc.virtual_bytes(), &state.masked,
                                        &state.probe);
      state.shares_ready = true;
    }
    for (size_t i = 0; i < budget.size(); ++i)
      if (state.shares[i] > 0)
        budget[i] = LinkBudgetSeconds(Predicted(state.fits, i, bytes * state.shares[i]));
  }
  if (only_lane >= 0) {
    for (size_t i = 0; i < budget.size(); ++i)
      if (budget[i] > 0) ctx.SetLaneBudget(only_lane, budget[i]);
    return;
  }
  for (size_t i = 0; i < budget.size(); ++i)
    if (budget[i] > 0) ctx.SetLaneBudget(static_cast<int>(i), budget[i]);
}

Status Executor::Run(CallContext& ctx, int rank, const CallDesc& desc) {
  const int n = ctx.size();
  const size_t links = link_names_.size();
  const uint64_t bytes = MessageBytes(desc, n);
  CallState* state = ctx.ExecutorState<CallState>([&] {
    auto s = std::make_shared<CallState>();
    s->plan = balancer_->PlanFor(desc.kind, bytes);
    if (s->plan->mode == plan::PlanMode::kProfile && TuneUseCache() &&
        LoadCachedFits(desc.kind, n, ProfileTopBytes(bytes)))
      s->plan = balancer_->PlanFor(desc.kind, bytes);
    s->profile = s->plan->mode == plan::PlanMode::kProfile;
    s->link_seconds.assign(links, 0.0);
    s->health_seconds.assign(links, 0.0);
    s->call = health_->NextCall();
    (void)balancer_->FitsFor(desc.kind, &s->fits);
    s->round_failed.assign(links, std::vector<char>(links, 0));
    s->touched = s->round_failed;
    s->errors.assign(links, "");
    s->bad.assign(links, 0);
    if (!s->profile) {
      s->shares = health_->Effective(s->plan->shares, s->call, desc.virtual_bytes(), &s->masked, &s->probe);
      s->shares_ready = true;
    }
    return s;
  });

  // Heap-held: a worker may still write its time if this rank gives up waiting for it.
  auto seconds = std::make_shared<std::vector<double>>(links, 0.0);
  auto start = Clock::now();
  Status status;
  std::vector<Status> link_status(links);
  std::vector<plan::UnitRange> ranges;
  if (state->profile) {
    status = ctx.Arrive(rank, desc, link_names_[0]);
    if (status.ok()) status = RunProfile(ctx, rank, desc, *state);
    {
      std::lock_guard<std::mutex> lock(state->mu);
      if (state->fits.empty()) (void)balancer_->FitsFor(desc.kind, &state->fits);
    }
    PrepareShares(ctx, *state, desc, bytes, -1);
    ranges = plan::CutRanges(desc.virtual_bytes(), 1, state->shares);
    start = Clock::now();  // the call's own time, not the profiling's, goes to stage 2
    if (status.ok()) {
      RunRanges(ctx, rank, ranges, seconds, &link_status);
      status = Recover(ctx, rank, desc, ranges, link_status, *state);
    }
  } else {
    ranges = plan::CutRanges(desc.virtual_bytes(), 1, state->shares);
    size_t used = 0, only = 0;
    for (size_t i = 0; i < ranges.size(); ++i)
      if (!ranges[i].empty()) ++used, only = i;
    if (used <= 1) {
      // One link: its own path (shm stages small calls: a single rendezvous), and the output pages
      // prepared as a group with one link prepares them. It runs on lane 0 with its own deadline.
      PrepareShares(ctx, *state, desc, bytes, 0);
      {
        const OutputPublication published(ctx, rank, desc);
        link_status[only] = comm_->channel(only).RunAlone(ctx, rank, desc);
      }
      (*seconds)[only] = Since(start);
      if (link_status[only].ok()) {
        // Health's evidence is the link's time from the arrival: the wait for the last rank to
        // arrive (device threads scheduled over few cores) is not the link's.
        std::lock_guard<std::mutex> lock(state->mu);
        state->health_seconds[only] = std::max(state->health_seconds[only], Since(ctx.ArrivedTime()));
      }
      // Only a failed call pays for the agreement: a rank whose link succeeded has returned, and a
      // rank whose link failed alone then fails at the agreement's deadline naming it.
      status = link_status[only].ok() ? Status::Ok() : Recover(ctx, rank, desc, ranges, link_status, *state);
    } else {
      PrepareShares(ctx, *state, desc, bytes, -1);
      status = ctx.Arrive(rank, desc, link_names_[0]);
      if (status.ok()) {
        RunRanges(ctx, rank, ranges, seconds, &link_status);
        status = Recover(ctx, rank, desc, ranges, link_status, *state);
      }
    }
  }
  if (rank == 0) RecordHealth(*state, desc, ranges, Since(start));
  Finish(*state, n, desc, ranges, *seconds, Since(start), status.ok(), rank, ctx.run_id(),
         ctx.call_number());
  return status;
}

void Executor::RunRanges(CallContext& ctx, int rank, const std::vector<plan::UnitRange>& ranges,
                         const std::shared_ptr<std::vector<double>>& seconds, std::vector<Status>* status) {
  std::vector<size_t> used;
  for (size_t i = 0; i < ranges.size(); ++i)
    if (!ranges[i].empty()) used.push_back(i);
  if (used.empty()) return;
  const auto t0 = Clock::now();
  ctx.SetDispatchTime(rank, ctx.ArrivedTime());
  // Every rank cuts the same pieces: the parts' shapes agree (checked at the arrival).
  const CallDesc& desc = ctx.desc(rank);
  auto pieces_of = [&](size_t i) {
    std::vector<Piece> pieces;
    desc.PiecesOf(UnitRange{ranges[i].begin, ranges[i].end}, &pieces);
    return pieces;
  };
  for (size_t k = 1; k < used.size(); ++k) {
    const size_t i = used[k];
    Channel* channel = &comm_->channel(i);
    // Owned by the task: a worker this rank gave up waiting for may still be running it.
    workers_[i][rank]->Post([&ctx, channel, rank, i, pieces = pieces_of(i), t0, seconds] {
      Status s = channel->Run(ctx, rank, static_cast<int>(i), pieces);
      (*seconds)[i] = Since(t0);
      if (!s.ok()) ctx.AbortLane(static_cast<int>(i), s.message());
      return s;
    });
  }
  const std::vector<Piece> first = pieces_of(used[0]);
  (*status)[used[0]] = comm_->channel(used[0]).Run(ctx, rank, static_cast<int>(used[0]), first);
  (*seconds)[used[0]] = Since(t0);
  if (!(*status)[used[0]].ok()) ctx.AbortLane(static_cast<int>(used[0]), (*status)[used[0]].message());
  // A link's own waits are bounded by its deadline; this one only guards against a stuck worker.
  const double worker_timeout = 2 * TimeoutSeconds() + 5;
  for (size_t k = 1; k < used.size(); ++k) (*status)[used[k]] = workers_[used[k]][rank]->Wait(worker_timeout);
}

Status Executor::Recover(CallContext& ctx, int rank, const CallDesc& desc,
                         const std::vector<plan::UnitRange>& ranges, const std::vector<Status>& status,
                         CallState& state) {
  const size_t links = link_names_.size();
  Status first_error;
  auto publish = [&](size_t round, size_t source, size_t link, const Status& s) {
    std::lock_guard<std::mutex> lock(state.mu);
    state.round_failed[round][source] = 1;
    state.touched[round][source] |= s.code() != StatusCode::kUnavailable;
    if (state.errors[link].empty()) state.errors[link] = s.message();
  };
  for (size_t i = 0; i < links; ++i)
    if (!status[i].ok()) {
      publish(0, i, i, status[i]);
      if (first_error.ok()) first_error = status[i];
    }
  // A single-link call that failed before its arrival (the arrival is the channel's there).
  if (!ctx.HasArrived(rank)) FLEXLINK_RETURN_IF_ERROR(ctx.Arrive(rank, desc, link_names_[0]));
  const int agree = AgreeLane(links);
  Status b = ctx.Barrier(rank, agree, "agree on failed links", "executor");
  if (!b.ok()) return first_error.ok() ? b : first_error;
  std::vector<char> bad(links, 0), touched(links, 0);
  std::vector<size_t> pending;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    for (size_t i = 0; i < links; ++i)
      if (state.round_failed[0][i]) pending.push_back(i), bad[i] = 1, touched[i] = state.touched[0][i];
  }
  if (pending.empty()) return Status::Ok();
  std::vector<size_t> carrier(links, links);
  for (size_t round = 1; round < links && !pending.empty(); ++round) {
    // Every rank decides from the same shared state, so all choose the same carriers.
    for (size_t i : pending) {
      if (touched[i] && AnyAliased(ctx, ranges[i])) {
        std::lock_guard<std::mutex> lock(state.mu);
        state.bad = bad;
        return Status::Internal(
            ErrorPrefix(ctx.label()) + std::string(Name(desc.kind)) + " on group " + FormatIds(comm_->devices()) +
            ": link " + link_names_[i] + " failed after it may have written part of its range of an in-place "
            "(aliased) call, so its input bytes cannot be recovered and the range cannot be re-run elsewhere: " +
            state.errors[i]);
      }
      carrier[i] = FailoverCarrier(bad, state.shares, [&](size_t j) { return health_->Unhealthy(j); });
    }
    if (std::any_of(pending.begin(), pending.end(), [&](size_t i) { return carrier[i] == links; })) break;
    for (size_t i : pending) {
      const int lane = FailoverLane(links, round - 1, i);
      const uint64_t range_bytes = RangeMessageBytes(MessageBytes(desc, ctx.size()), ranges[i], desc.virtual_bytes());
      ctx.SetLaneBudget(lane, LinkBudgetSeconds(Predicted(state.fits, carrier[i], range_bytes)));
      ctx.StartLaneClock(lane);
      std::vector<Piece> pieces;
      ctx.desc(rank).PiecesOf(UnitRange{ranges[i].begin, ranges[i].end}, &pieces);
      Status s = comm_->channel(carrier[i]).Run(ctx, rank, lane, pieces);
      if (!s.ok()) {
        ctx.AbortLane(lane, s.message());
        publish(round, i, carrier[i], s);
      }
    }
    b = ctx.Barrier(rank, agree, "agree on failed links", "executor");
    if (!b.ok()) return b;
    std::vector<size_t> still;
    {
      std::lock_guard<std::mutex> lock(state.mu);
      for (size_t i : pending) {
        if (state.round_failed[round][i]) {
          still.push_back(i);
          bad[carrier[i]] = 1;
          touched[i] |= state.touched[round][i];
        } else if (rank == 0) {
          state.moves.emplace_back(i, carrier[i]);
        }
      }
    }
    pending = std::move(still);
  }
  {
    std::lock_guard<std::mutex> lock(state.mu);
    state.bad = bad;
    state.recovered = true;
  }
  if (pending.empty()) return Status::Ok();
  std::lock_guard<std::mutex> lock(state.mu);
  return Status::Internal(NoCarrierMessage(ctx.label(), desc.kind, FormatIds(comm_->devices()), state.call,
                                           link_names_, state.errors,
                                           [&](size_t j) { return health_->Unhealthy(j); }));
}

void Executor::RecordHealth(CallState& state, const CallDesc& desc, const std::vector<plan::UnitRange>& ranges,
                            double seconds) {
  std::lock_guard<std::mutex> lock(state.mu);
  if (state.bad.empty()) return;
  const uint64_t message = MessageBytes(desc, comm_->size());
  for (size_t j = 0; j < link_names_.size(); ++j) {
    if (!state.bad[j]) continue;
    if (static_cast<int>(j) == state.probe) health_->Probed(j, state.call, false, state.errors[j]);
    else health_->Failed(j, state.call, state.errors[j]);
  }
  const std::string group = FormatIds(comm_->devices());
  for (const auto& [from, to] : state.moves) {
    health_->FailedOver(from);
    RecordFailover(FailoverRecord{group, std::string(Name(desc.kind)), link_names_[from], link_names_[to],
                                  state.errors[from], state.call,
                                  RangeMessageBytes(message, ranges[from], desc.virtual_bytes()), seconds,
                                  UnixNow()});
  }
}

void Executor::Finish(CallState& state, int n, const CallDesc& desc,
                      const std::vector<plan::UnitRange>& ranges, const std::vector<double>& seconds,
                      double call_seconds, bool ok, int rank, int64_t run_id, uint64_t call_number) {
  if (RecordingSplits()) {
    SplitRecord rec{FormatIds(comm_->devices()), run_id, call_number, rank, {}};
    for (const auto& r : ranges) rec.ranges.emplace_back(r.begin, r.end);
    RecordSplit(std::move(rec));
  }
  {
    std::lock_guard<std::mutex> lock(state.mu);
    for (size_t i = 0; i < seconds.size(); ++i)
      state.link_seconds[i] = std::max(state.link_seconds[i], seconds[i]);
    state.call_seconds = std::max(state.call_seconds, call_seconds);
    state.failed |= !ok;
    if (++state.finished < n || state.failed) return;
  }
  // The last rank of a successful call: every rank's times are in; nobody else touches `state`.
  const uint64_t message = MessageBytes(desc, n);
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].empty() || (!state.bad.empty() && state.bad[i])) continue;
    const uint64_t b = RangeMessageBytes(message, ranges[i], desc.virtual_bytes());
    const double t = state.health_seconds[i] > 0 ? state.health_seconds[i] : state.link_seconds[i];
    const double expected = state.fits.empty() ? -1 : b / state.fits[i].Predict(static_cast<double>(b));
    health_->Observed(i, state.call, b, expected, t > 0 ? b / t : -1);
    // A probe, or the plan's only links all unhealthy and this one carried its range after all.
    if (static_cast<int>(i) == state.probe || health_->Unhealthy(i))
      health_->Probed(i, state.call, true, "");
  }
  // Shares changed by health (a link excluded or probed) or ranges re-run: not the plan's call.
  if (state.masked || state.recovered) {
    for (size_t i = 0; i < ranges.size(); ++i)
      if (!ranges[i].empty() && (state.bad.empty() || !state.bad[i]))
        RecordLinkCall(link_names_[i], desc.InputBytes(UnitRange{ranges[i].begin, ranges[i].end}, n),
                       state.link_seconds[i]);
    return;
  }
  const plan::Balancer::Outcome outcome =
      balancer_->Report(*state.plan, message, state.link_seconds, state.call_seconds);
  for (size_t i = 0; i < ranges.size(); ++i)
    if (!ranges[i].empty())
      RecordLinkCall(link_names_[i], desc.InputBytes(UnitRange{ranges[i].begin, ranges[i].end}, n),
                     state.link_seconds[i]);
  if (outcome.changed) LogInfo("group " + FormatIds(comm_->devices()) + ": " + outcome.reason);
}

void SetRecordSplits(bool on) { g_record_splits.store(on); }

bool RecordingSplits() { return g_record_splits.load(std::memory_order_relaxed); }

void RecordSplit(SplitRecord record) {
  std::lock_guard<std::mutex> lock(g_splits_mu);
  if (Splits().size() < kMaxSplitRecords) Splits().push_back(std::move(record));
}

std::vector<SplitRecord> TakeSplitRecords() {
  std::lock_guard<std::mutex> lock(g_splits_mu);
  std::vector<SplitRecord> out;
  out.swap(Splits());
  return out;
}

}  // namespace flexlink
