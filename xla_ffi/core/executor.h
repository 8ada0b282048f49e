// The multi-path executor: one call split across the links of a communicator.
//
// The balancer's plan for the call (fetched once, by the first rank that joins, and shared by all
// ranks through the call's context, so every rank cuts identical ranges) gives each link a share;
// the call's virtual byte space (all its parts, core/call.h) is cut into one contiguous range per
// link at 64-byte multiples (plan/ranges.h), and each link runs the pieces (part, unit range) its range
// covers, part by part. After one arrival, each link runs its range concurrently: the device thread runs the first, long-lived per-(link, rank)
// workers run the others (no thread is created per call). Each link's time for its range is
// measured on every rank; the last rank to finish reports the slowest rank's time per link to the
// balancer (stage 2) and to the link statistics. A plan with one link runs that link alone, which
// keeps the shm link's single-rendezvous path for small calls.
//
// Stage 1 runs inside a group's first large call of a kind without fits (the balancer answers with a
// kProfile plan): the tuning cache is tried first; else, after the call's arrival, all ranks together
// time every link alone and then the fitted split at power-of-two sizes on scratch buffers (nested
// calls of the same communicator, under a run id of their own), fit α–β per link, find the size from
// which the split measurably beats the best link alone, install that in the balancer, store it in the
// cache, and run the call itself with the resulting plan (executor_profile.cc).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/status.h"
#include "xla_ffi/plan/balancer.h"
#include "xla_ffi/plan/ranges.h"

namespace flexlink {

class CallContext;
class Communicator;

// A thread that runs one task at a time for its owner and reports the task's status.
class LinkWorker {
 public:
  LinkWorker();
  ~LinkWorker();
  LinkWorker(const LinkWorker&) = delete;
  LinkWorker& operator=(const LinkWorker&) = delete;

  void Post(std::function<Status()> task);
  // Waits for the posted task; an error if it is not done within `timeout_s`.
  Status Wait(double timeout_s);
  // No task posted or running (a range a call gave up on may still run until its link's deadline).
  bool Idle();

 private:
  void Loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<Status()> task_;
  bool has_task_ = false, running_ = false, done_ = false, stop_ = false;
  Status result_;
  std::thread thread_;
};

class Executor {
 public:
  // `comm` has one channel per link of `link_names`, in the same order.
  // `spec`: the link set's canonical spec (the tuning cache's key).
  Executor(Communicator* comm, std::vector<std::string> link_names, std::string spec,
           plan::Balancer* balancer);
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  Status Run(CallContext& ctx, int rank, const CallDesc& desc);
  // Every worker idle (LinkWorker::Idle): destroying the executor would not wait for a range.
  bool Idle();

  const std::shared_ptr<GroupHealth>& health() const { return health_; }

 private:
  struct CallState;
  struct Profile;
  // After `ctx`'s arrival: runs every non-empty range, the first on this thread, the others on their
  // link's worker; (*seconds)[i] is link i's time from the start, (*status)[i] its status on this rank
  // (a failed link's lane is aborted, so its peers there stop waiting at once).
  void RunRanges(CallContext& ctx, int rank, const std::vector<plan::UnitRange>& ranges,
                 const std::shared_ptr<std::vector<double>>& seconds, std::vector<Status>* status);
  // The call's shares once its plan is final (unhealthy links out, a probe in) and the lanes'
  // deadlines from them; every rank, any order.
  void PrepareShares(CallContext& ctx, CallState& state, const CallDesc& desc, uint64_t bytes, int only_lane);
  // Failover (docs/faults.md): every rank publishes which of its links failed, then after a barrier
  // all re-run the union's ranges on healthy links, round after round, until none fails or no link
  // is left. OK when every range was carried; else the call's error, naming every link's report.
  Status Recover(CallContext& ctx, int rank, const CallDesc& desc, const std::vector<plan::UnitRange>& ranges,
                 const std::vector<Status>& status, CallState& state);
  // Rank 0, after the call: health and the failover log from what Recover decided.
  void RecordHealth(CallState& state, const CallDesc& desc, const std::vector<plan::UnitRange>& ranges,
                    double seconds);
  // Stage 1 (executor_profile.cc). LoadCachedFits: installs the cached fits for `kind` and this
  // group's size, if any (one thread). RunProfile: every rank, after the arrival; on return
  // state.plan is the call's plan from the new fits.
  // `needed_bytes`: the size the entry must have been profiled up to.
  bool LoadCachedFits(Kind kind, int n, uint64_t needed_bytes);
  Status RunProfile(CallContext& ctx, int rank, const CallDesc& desc, CallState& state);
  void Finish(CallState& state, int n, const CallDesc& desc, const std::vector<plan::UnitRange>& ranges,
              const std::vector<double>& seconds, double call_seconds, bool ok, int rank,
              int64_t run_id, uint64_t call_number);

  Communicator* const comm_;
  const std::vector<std::string> link_names_;
  const std::string spec_;
  plan::Balancer* const balancer_;
  std::shared_ptr<GroupHealth> health_;
  // workers_[link][rank]. A call's first link with a range runs on the device thread; the others
  // are posted to their workers. That first link is never a later one than the others, so link 0
  // needs no workers.
  std::vector<std::vector<std::unique_ptr<LinkWorker>>> workers_;
};

// Per-rank byte ranges of recent calls (for the rank-consistency test); off unless enabled.
struct SplitRecord {
  std::string group;
  int64_t run_id = 0;
  uint64_t call = 0;
  int rank = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // per link: [begin, end) of the virtual bytes
};
void SetRecordSplits(bool on);
std::vector<SplitRecord> TakeSplitRecords();
// For other executors (xproc/xproc_executor.cc: cross-process calls): whether recording is on, and
// one record (dropped beyond the cap, as the executor's).
bool RecordingSplits();
void RecordSplit(SplitRecord record);

}  // namespace flexlink
