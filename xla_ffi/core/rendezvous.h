// One collective call as all its ranks see it: the rendezvous where ranks publish their buffers, the
// phase barriers links use inside the call, and the deadline/abandonment rules. Every wait blocks on
// a condition variable (device threads outnumber cores; spinning would starve the ranks we wait for),
// after a short spin only where the communicator says its ranks each have a core (Communicator::spin,
// the GPU engine's groups: docs/cuda.md, "The host path of a call").
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/pages.h"
#include "xla_ffi/core/spin.h"
#include "xla_ffi/core/status.h"

namespace flexlink {

class Communicator;

class CallContext {
 public:
  // `lanes`: independent barrier sequences, one per link that may run a range of this call.
  CallContext(Communicator* comm, int64_t run_id, uint64_t seq, std::string label, int lanes);
  CallContext(const CallContext&) = delete;
  CallContext& operator=(const CallContext&) = delete;

  int size() const { return n_; }
  const std::string& label() const { return label_; }
  int64_t run_id() const { return run_id_; }
  uint64_t call_number() const { return seq_; }
  // Valid once Arrive returned OK: what every rank published (buffers included).
  const CallDesc& desc(int rank) const { return descs_[rank]; }

  // Publishes `desc` for `rank` and waits until all ranks did; then checks they describe the same
  // call (all ranks reach the same verdict, so a mismatch fails every rank and no buffer is touched).
  // Then helps fault in the published outputs (PublishOutput) before the links write them.
  Status Arrive(int rank, const CallDesc& desc, std::string_view link);

  // The call's outputs, faulted in by all ranks together (core/pages.h). When one link runs the
  // whole call, each rank publishes its outputs (every part's) before Arrive and helps fault in
  // every published output, also while it waits there; it withdraws them before its call returns.
  void PublishOutputs(int rank, const CallDesc& desc);
  void PublishOutputs(int rank, std::span<const OutputRegion> outputs);
  void WithdrawOutputs(int rank);
  const OutputFaults& output_faults() const { return faults_; }

  // Waits until every rank reached this barrier on `lane`. `phase` names it in timeout messages.
  Status Barrier(int rank, int lane, std::string_view phase, std::string_view link);
  // Barriers all ranks have passed on `lane` so far (tests: a staged call has none, a direct one of
  // any number of parts has one per link).
  uint64_t barriers_passed(int lane);

  // Per-lane deadlines and aborts, for the executor's failover (docs/faults.md). A lane with a budget
  // times out `budget_s` after its clock started (StartLaneClock, else the call's arrival), or at the
  // global deadline if that comes first. A lane's timeout, or AbortLane, fails that lane's waits
  // (Barrier, WaitProgress, WaitLane) for every rank at once with the lane's error, without
  // abandoning the call: the other lanes and the executor's own lane go on, so the failed range can
  // be re-run elsewhere. The first budget or clock set wins (all ranks set the same values).
  void SetLaneBudget(int lane, double budget_s);
  void StartLaneClock(int lane);
  void AbortLane(int lane, std::string why);
  bool LaneAborted(int lane);
  // The lane's own deadline (TimePoint::max() without a budget, or before the call's arrival) and,
  // in *budget_s, its budget: for links whose waits are not this context's (tcp's sockets poll).
  std::chrono::steady_clock::time_point LaneDeadlineFor(int lane, double* budget_s);
  // Blocks until `lane` is aborted or past its deadline (a link that never completes: fault
  // injection's hang), or the call is abandoned; returns that error. Touches nothing else.
  Status WaitLane(int rank, int lane, std::string_view link);
  // Whether `rank` has published its arrival (a failed single-link call may or may not have).
  bool HasArrived(int rank);
  // For a rank that will never arrive (its engine refused the call: the GPU engine's shutdown):
  // abandons the call at once for every rank, waiting or still to come, with `reason` after the
  // call and the rank's name and with `code`, as its deadline would later.
  void Refuse(int rank, std::string_view reason, StatusCode code);
  // For a rank that does not arrive (fault injection's rank:absent): waits until the others abandon
  // the call at their deadline and returns their error (naming this rank), or its own after 1.5 x
  // the timeout.
  Status WaitAbandoned(int rank);

  // Progress counters, one per rank and lane, for links that overwrite an input in place while peers
  // still read it (shm's in-place ppermute / all_to_all, links/shm_inplace.cc): a rank counts the
  // steps it finished, and a rank about to overwrite what others read waits until they are that far.
  // Unlike a barrier, a wait names only the ranks it depends on and wakes only when they are all there.
  uint64_t progress(int rank, int lane);
  void Advance(int rank, int lane);  // this rank's counter on `lane` += 1; wakes whoever that satisfies
  // Waits until every rank in `peers` has reached `value` on `lane` (`what` completes "waiting for
  // rank 3 (device 3) to ..." in the timeout message). Bounded by the deadline like every wait.
  Status WaitProgress(int rank, int lane, std::span<const int> peers, uint64_t value, std::string_view what,
                      std::string_view link);

  // When the executor handed this rank's ranges to the links: the moment the last rank arrived, the
  // same for every rank. A paced (emulated) link starts its clock there, like copy engines that all
  // start once the transfer is posted, not when a CPU thread of the emulation gets scheduled (8
  // device threads and their link workers share 2 cores here). Unset (epoch) when a link runs the
  // call alone.
  using TimePoint = std::chrono::steady_clock::time_point;
  // Valid once Arrive returned OK.
  TimePoint ArrivedTime() const { return arrived_at_; }
  void SetDispatchTime(int rank, TimePoint t) { dispatch_[rank] = t; }
  TimePoint DispatchTime(int rank) const { return dispatch_[rank]; }

  // Per-call scratch of a link (e.g. shm staging): made by the first rank that asks, released when the
  // last rank drops the call — no extra synchronisation needed to know that all ranks are done.
  template <class T, class Make>
  T* Scratch(Make&& make) {
    const std::unique_lock<std::mutex> lock = Hold();
    if (!scratch_) scratch_ = make();
    return static_cast<T*>(scratch_.get());
  }

  // The same for the executor (its plan and per-link times for this call), apart from the links'.
  template <class T, class Make>
  T* ExecutorState(Make&& make) {
    const std::unique_lock<std::mutex> lock = Hold();
    if (!executor_state_) executor_state_ = make();
    return static_cast<T*>(executor_state_.get());
  }

 private:
  friend class Communicator;
  std::string Where(std::string_view link) const;  // label, kind, group, link, run and call number
  std::string RankList(const std::vector<int>& ranks) const;
  static TimePoint Deadline();  // now + the configured timeout
  struct Lane;
  // `lane` (may be null): the lane whose deadline and abort also end the wait.
  template <class Done, class Missing>
  Status WaitAll(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, Done done, Missing missing,
                 std::string_view what, std::string_view link, TimePoint deadline, Lane* lane = nullptr);
  TimePoint LaneDeadline(const Lane& lane) const;  // under mu_; TimePoint::max() without a budget
  void WakeAll();  // every waiter of any kind (under mu_)
  // Every change a waiter may wait for is followed by Bump; Spin (under mu_, which it drops while
  // spinning) returns once `ready()` holds or spin_ has passed, and the wait then blocks as usual.
  // Only where ranks spin: nothing reads the count otherwise, and the CPU engine's calls need not pay
  // an atomic per notification.
  void Bump() {
    if (spin_.count() > 0) wakes_.fetch_add(1, std::memory_order_release);
  }
  // mu_, locked after a spin where the ranks spin (spin.h): they all take it within a microsecond.
  std::unique_lock<std::mutex> Hold() { return LockSpinning(mu_, spin_); }
  template <class Ready>
  void Spin(std::unique_lock<std::mutex>& lock, Ready ready);

  Communicator* const comm_;
  const int64_t run_id_;
  const uint64_t seq_;
  const std::string label_;
  const int n_;
  const std::chrono::nanoseconds spin_;  // Communicator::spin()
  std::atomic<uint64_t> wakes_{0};       // Bump's count

  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::vector<char> present_;
  std::vector<CallDesc> descs_;
  struct Lane {
    uint64_t generation = 0;
    int count = 0;
    std::vector<uint64_t> entered;   // per rank: generation + 1 of the barrier it waits at
    std::vector<uint64_t> progress;  // per rank: Advance count
    // Per rank: what it waits for in WaitProgress (peers empty: not waiting), and its own condition
    // variable, so that an Advance wakes only the ranks it satisfies. Per lane, since one rank may
    // wait on several links at once (the executor runs them on different threads).
    struct Waiter {
      uint64_t value = 0;
      std::span<const int> peers;
    };
    std::vector<Waiter> waiting;
    std::vector<std::condition_variable> cv;
    double budget_s = 0;   // 0: no deadline of its own
    TimePoint started{};   // epoch: the call's arrival
    bool aborted = false;
    std::string error;
  };
  std::vector<Lane> lanes_;
  bool abandoned_ = false;  // a wait timed out: later arrivals fail at once instead of hanging
  std::string error_;
  StatusCode abandon_code_ = StatusCode::kDeadlineExceeded;  // a timeout's, or Refuse's
  Status Abandoned() const { return Status(abandon_code_, error_); }
  std::shared_ptr<void> scratch_;
  std::shared_ptr<void> executor_state_;
  std::vector<TimePoint> dispatch_;
  TimePoint arrived_at_{};
  TimePoint previous_arrival_at_{};  // the second-to-last arrival: the last one's lateness is from here
  bool absence_counted_ = false;     // the arrival's timeout was counted in the group's stragglers
  OutputFaults faults_;  // per rank, written by that rank's own thread before it posts
};

// A rank's outputs published to its call's shared faulting for as long as it lives: withdrawn on
// every way out (errors and exceptions included), so no helper touches a buffer after its owner's
// call returned.
class OutputPublication {
 public:
  OutputPublication(CallContext& ctx, int rank, const CallDesc& desc) : ctx_(ctx), rank_(rank) {
    ctx.PublishOutputs(rank, desc);
  }
  ~OutputPublication() { ctx_.WithdrawOutputs(rank_); }
  OutputPublication(const OutputPublication&) = delete;
  OutputPublication& operator=(const OutputPublication&) = delete;

 private:
  CallContext& ctx_;
  const int rank_;
};

}  // namespace flexlink
