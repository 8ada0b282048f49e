#include "xla_ffi/core/executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>

#include "xla_ffi/core/communicator.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/executor_state.h"
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
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(std::min(timeout_s, 1e9)));
  if (!cv_.wait_until(lock, deadline, [&] { return done_; }))
    return Status::DeadlineExceeded("flexlink: a link worker did not finish its range within " +
                                    std::to_string(timeout_s) + " s");
  return result_;
}

void LinkWorker::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return has_task_ || stop_; });
    if (stop_) return;
    std::function<Status()> task = std::move(task_);
    has_task_ = false;
    lock.unlock();
    Status s;
    try {  // a worker thread must not take the process down with an exception
      s = task();
    } catch (const std::exception& e) {
      s = Status::Internal(std::string("flexlink: a link worker failed: ") + e.what());
    }
    lock.lock();
    result_ = std::move(s);
    done_ = true;
    cv_.notify_all();
  }
}

Executor::Executor(Communicator* comm, std::vector<std::string> link_names, std::string spec,
                   plan::Balancer* balancer)
    : comm_(comm), link_names_(std::move(link_names)), spec_(std::move(spec)), balancer_(balancer) {
  workers_.resize(link_names_.size());
  for (size_t i = 1; i < link_names_.size(); ++i)
    for (int r = 0; r < comm_->size(); ++r) workers_[i].push_back(std::make_unique<LinkWorker>());
}

Status Executor::Run(CallContext& ctx, int rank, const CallDesc& desc) {
  const int n = ctx.size();
  const uint64_t bytes = MessageBytes(desc, n);
  CallState* state = ctx.ExecutorState<CallState>([&] {
    auto s = std::make_shared<CallState>();
    s->plan = balancer_->PlanFor(desc.kind, bytes);
    if (s->plan->mode == plan::PlanMode::kProfile && TuneUseCache() &&
        LoadCachedFits(desc.kind, n, ProfileTopBytes(bytes)))
      s->plan = balancer_->PlanFor(desc.kind, bytes);
    s->profile = s->plan->mode == plan::PlanMode::kProfile;
    s->link_seconds.assign(link_names_.size(), 0.0);
    return s;
  });

  // Heap-held: a worker may still write its time if this rank gives up waiting for it.
  auto seconds = std::make_shared<std::vector<double>>(link_names_.size(), 0.0);
  auto start = Clock::now();
  Status status;
  std::vector<plan::UnitRange> ranges;
  if (state->profile) {
    status = ctx.Arrive(rank, desc, link_names_[0]);
    if (status.ok()) status = RunProfile(ctx, rank, desc, *state);
    std::shared_ptr<const plan::Plan> plan;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      plan = state->plan;
    }
    ranges = plan::CutRanges(desc.virtual_bytes(), 1, plan->shares);
    start = Clock::now();  // the call's own time, not the profiling's, goes to stage 2
    if (status.ok()) status = RunRanges(ctx, rank, ranges, seconds);
  } else {
    ranges = plan::CutRanges(desc.virtual_bytes(), 1, state->plan->shares);
    size_t used = 0, only = 0;
    for (size_t i = 0; i < ranges.size(); ++i)
      if (!ranges[i].empty()) ++used, only = i;
    if (used <= 1) {
      // One link: its own path (shm stages small calls: a single rendezvous), and the output pages
      // prepared as a group with one link prepares them.
      {
        const OutputPublication published(ctx, rank, desc);
        status = comm_->channel(only).RunAlone(ctx, rank, desc);
      }
      (*seconds)[only] = Since(start);
    } else {
      status = ctx.Arrive(rank, desc, link_names_[0]);
      if (status.ok()) status = RunRanges(ctx, rank, ranges, seconds);
    }
  }
  Finish(*state, n, desc, ranges, *seconds, Since(start), status.ok(), rank, ctx.run_id(),
         ctx.call_number());
  return status;
}

Status Executor::RunRanges(CallContext& ctx, int rank, const std::vector<plan::UnitRange>& ranges,
                           const std::shared_ptr<std::vector<double>>& seconds) {
  std::vector<size_t> used;
  for (size_t i = 0; i < ranges.size(); ++i)
    if (!ranges[i].empty()) used.push_back(i);
  if (used.empty()) return Status::Ok();
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
      return s;
    });
  }
  const std::vector<Piece> first = pieces_of(used[0]);
  Status status = comm_->channel(used[0]).Run(ctx, rank, static_cast<int>(used[0]), first);
  (*seconds)[used[0]] = Since(t0);
  // A link's own waits are bounded by the timeout; this one only guards against a stuck worker.
  const double worker_timeout = 2 * TimeoutSeconds() + 5;
  for (size_t k = 1; k < used.size(); ++k) {
    Status s = workers_[used[k]][rank]->Wait(worker_timeout);
    if (status.ok() && !s.ok()) status = std::move(s);
  }
  return status;
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
  const plan::Balancer::Outcome outcome =
      balancer_->Report(*state.plan, MessageBytes(desc, n), state.link_seconds, state.call_seconds);
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
