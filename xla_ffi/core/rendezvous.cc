#include "xla_ffi/core/rendezvous.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "xla_ffi/core/communicator.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/deadline.h"
#include "xla_ffi/core/spin.h"

namespace flexlink {

CallContext::CallContext(Communicator* comm, int64_t run_id, uint64_t seq, std::string label, int lanes)
    : comm_(comm),
      run_id_(run_id),
      seq_(seq),
      label_(std::move(label)),
      n_(comm->size()),
      spin_(comm->spin()),
      present_(n_, 0),
      descs_(n_),
      lanes_(lanes),
      dispatch_(n_),
      faults_(n_) {
  for (Lane& lane : lanes_) {
    lane.entered.assign(n_, 0);
    lane.progress.assign(n_, 0);
    lane.waiting.resize(n_);
    lane.cv = std::vector<std::condition_variable>(n_);
  }
}

void CallContext::WakeAll() {
  Bump();
  cv_.notify_all();
  for (Lane& lane : lanes_)
    for (auto& cv : lane.cv) cv.notify_all();
}

std::string CallContext::Where(std::string_view link) const {
  std::string s = ErrorPrefix(label_);
  // descs_ of any arrived rank tell what the call is; the first present one will do.
  for (int r = 0; r < n_; ++r)
    if (present_[r]) {
      s += descs_[r].Describe() + " ";
      break;
    }
  s += "on group " + FormatIds(comm_->devices()) + " (" + (link.empty() ? "" : "link " + std::string(link) + ", ") +
       "run " + std::to_string(run_id_) + ", call " + std::to_string(seq_) + " on this group)";
  return s;
}

std::string CallContext::RankList(const std::vector<int>& ranks) const {
  std::string s = "rank";
  if (ranks.size() > 1) s += "s";
  for (size_t i = 0; i < ranks.size(); ++i)
    s += (i ? ", " : " ") + std::to_string(ranks[i]) + " (device " +
         std::to_string(comm_->devices()[ranks[i]]) + ")";
  return s;
}

CallContext::TimePoint CallContext::Deadline() {
  return DeadlineAfter(TimeoutSeconds());
}

template <class Ready>
void CallContext::Spin(std::unique_lock<std::mutex>& lock, Ready ready) {
  SpinBudget budget(spin_);
  while (!ready()) {
    // Read under mu_: a change not visible to ready() yet is made under mu_ later, then bumped.
    const uint64_t seen = wakes_.load(std::memory_order_acquire);
    lock.unlock();
    const bool in_time = budget.Until([&] { return wakes_.load(std::memory_order_acquire) != seen; });
    // Every spinning rank sees the same bump at once: re-locking after a spin too keeps the others
    // from sleeping on mu_ while the first re-checks.
    RelockSpinning(lock, spin_);
    if (!in_time) return;
  }
}

// Waits for `done` up to `deadline`. On timeout the call is abandoned for everyone: waiting ranks
// wake up with the same error, and ranks that come later fail at once. With a `lane` whose deadline
// comes first, that deadline (or an abort of the lane) fails the lane alone.
template <class Done, class Missing>
Status CallContext::WaitAll(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, Done done,
                            Missing missing, std::string_view what, std::string_view link, TimePoint deadline,
                            Lane* lane) {
  const double timeout = TimeoutSeconds();
  const TimePoint lane_deadline = lane ? LaneDeadline(*lane) : TimePoint::max();
  const bool lane_first = lane_deadline < deadline;
  if (spin_.count() > 0) Spin(lock, [&] { return done() || abandoned_ || (lane && lane->aborted); });
  const bool ok = cv.wait_until(lock, lane_first ? lane_deadline : deadline,
                                [&] { return done() || abandoned_ || (lane && lane->aborted); });
  if (abandoned_) return Abandoned();
  if (lane && lane->aborted) return Status::DeadlineExceeded(lane->error);
  if (ok) return Status::Ok();
  if (lane_first) {
    lane->aborted = true;
    lane->error = Where(link) + ": link " + std::string(link) + " missed its deadline of " + FormatSeconds(lane->budget_s) +
                  " s waiting for " + RankList(missing()) + " to " + std::string(what) +
                  " (the link's own deadline: docs/faults.md, FLEXLINK_LINK_TIMEOUT_S)";
    WakeAll();
    return Status::DeadlineExceeded(lane->error);
  }
  abandoned_ = true;
  error_ = Where(link) + ": timed out after " + FormatSeconds(timeout) + " s waiting for " + RankList(missing()) + " to " +
           std::string(what) +
           " (a device that never issues the matching collective, or issues collectives in a "
           "different order; the deadline is jax_flexlink's FLEXLINK_TIMEOUT_S / set_timeout)";
  WakeAll();
  return Status::DeadlineExceeded(error_);
}

CallContext::TimePoint CallContext::LaneDeadline(const Lane& lane) const {
  if (!(lane.budget_s > 0)) return TimePoint::max();
  TimePoint start = lane.started;
  if (start == TimePoint{}) {
    if (arrived_ < n_) return TimePoint::max();  // before the arrival only the global deadline counts
    start = arrived_at_;
  }
  return start + ClampedSeconds(lane.budget_s);
}

void CallContext::SetLaneBudget(int lane, double budget_s) {
  const std::unique_lock<std::mutex> lock = Hold();
  if (!(lanes_[lane].budget_s > 0)) lanes_[lane].budget_s = budget_s;
}

void CallContext::StartLaneClock(int lane) {
  const std::unique_lock<std::mutex> lock = Hold();
  if (lanes_[lane].started == TimePoint{}) lanes_[lane].started = std::chrono::steady_clock::now();
}

void CallContext::AbortLane(int lane, std::string why) {
  const std::unique_lock<std::mutex> lock = Hold();
  if (lanes_[lane].aborted) return;
  lanes_[lane].aborted = true;
  lanes_[lane].error = std::move(why);
  WakeAll();
}

CallContext::TimePoint CallContext::LaneDeadlineFor(int lane, double* budget_s) {
  const std::unique_lock<std::mutex> lock = Hold();
  if (budget_s) *budget_s = lanes_[lane].budget_s;
  return LaneDeadline(lanes_[lane]);
}

bool CallContext::LaneAborted(int lane) {
  const std::unique_lock<std::mutex> lock = Hold();
  return lanes_[lane].aborted;
}

Status CallContext::WaitLane(int rank, int lane_index, std::string_view link) {
  std::unique_lock<std::mutex> lock = Hold();
  Lane& lane = lanes_[lane_index];
  const TimePoint lane_deadline = LaneDeadline(lane);
  const TimePoint global = Deadline();
  cv_.wait_until(lock, std::min(lane_deadline, global), [&] { return abandoned_ || lane.aborted; });
  if (abandoned_) return Abandoned();
  if (!lane.aborted) {
    lane.aborted = true;
    lane.error = Where(link) + ": link " + std::string(link) + " did not complete within its deadline of " +
                 FormatSeconds(lane_deadline < global ? lane.budget_s : TimeoutSeconds()) + " s (rank " + std::to_string(rank) + ")";
    WakeAll();
  }
  return Status::DeadlineExceeded(lane.error);
}

bool CallContext::HasArrived(int rank) {
  const std::unique_lock<std::mutex> lock = Hold();
  return present_[rank] != 0;
}

void CallContext::Refuse(int rank, std::string_view reason, StatusCode code) {
  const std::unique_lock<std::mutex> lock = Hold();
  if (abandoned_) return;
  abandoned_ = true;
  abandon_code_ = code;
  error_ = Where("") + ": " + RankList({rank}) + " " + std::string(reason);
  WakeAll();
}

Status CallContext::WaitAbandoned(int rank) {
  std::unique_lock<std::mutex> lock = Hold();
  const auto deadline = DeadlineAfter(1.5 * TimeoutSeconds());
  cv_.wait_until(lock, deadline, [&] { return abandoned_; });
  if (abandoned_) return Abandoned();
  return Status::DeadlineExceeded(Where("") + ": rank " + std::to_string(rank) +
                                  " stayed away (injected rank:absent) and no peer timed out");
}

Status CallContext::Arrive(int rank, const CallDesc& desc, std::string_view link) {
  bool last = false;
  {
    std::unique_lock<std::mutex> lock = Hold();
    if (abandoned_)
      return Status(abandon_code_, ErrorPrefix(label_) + "rank " + std::to_string(rank) + " (device " +
                                       std::to_string(comm_->devices()[rank]) +
                                       ") arrived after the call was abandoned: " + error_);
    descs_[rank] = desc;
    present_[rank] = 1;
    const int arrived = ++arrived_;
    last = arrived == n_;
    // Straggler detection: the last rank's lateness is measured from the arrival before it, so
    // only those two arrivals read the clock (the last one did anyway, for arrived_at_).
    if (arrived == n_ - 1) previous_arrival_at_ = std::chrono::steady_clock::now();
    if (last) {
      arrived_at_ = std::chrono::steady_clock::now();
      lock.unlock();  // waiters wake straight into a free mutex
      Bump();
      cv_.notify_all();
    } else {
      // While waiting, help fault in outputs that later ranks publish: otherwise the last rank to
      // start faults its whole output alone while the others sleep here.
      const TimePoint deadline = Deadline();
      for (;;) {
        Status s = WaitAll(
            lock, cv_, [&] { return arrived_ == n_ || faults_.Unclaimed(); },
            [&] {
              std::vector<int> m;
              for (int r = 0; r < n_; ++r)
                if (!present_[r]) m.push_back(r);
              return m;
            },
            "arrive", link, deadline);
        if (!s.ok()) {
          // Counted once per call, by whichever rank wakes first, with the ranks still missing; a
          // call refused by a closed engine (Refuse) counts nobody as a straggler.
          if (!absence_counted_ && arrived_ < n_ && abandon_code_ == StatusCode::kDeadlineExceeded) {
            absence_counted_ = true;
            for (int r = 0; r < n_; ++r)
              if (!present_[r]) comm_->stragglers().RecordAbsent(r);
          }
          return s;
        }
        if (arrived_ == n_) break;
        lock.unlock();
        faults_.Help(rank);
        lock.lock();
      }
    }
  }
  if (last) {
    comm_->Retire(run_id_, seq_);  // outside mu_: Communicator locks its mutex first
    if (n_ > 1) {
      const auto late = std::chrono::duration_cast<std::chrono::nanoseconds>(arrived_at_ - previous_arrival_at_);
      comm_->stragglers().RecordLast(rank, static_cast<uint64_t>(std::max<int64_t>(0, late.count())));
    }
  }
  // Every rank sees the same descs_, so every rank returns the same verdict.
  for (int r = 1; r < n_; ++r) {
    if (descs_[r].SameCall(descs_[0])) continue;
    return Status::InvalidArgument(
        Where(link) + ": ranks disagree on the call: rank 0 (device " +
        std::to_string(comm_->devices()[0]) + ") has " + descs_[0].Describe() + ", rank " +
        std::to_string(r) + " (device " + std::to_string(comm_->devices()[r]) + ") has " +
        descs_[r].Describe() + " (every device must call the collective with the same operands: "
        "number, shapes and dtypes, and the same reduction or pairs)");
  }
  faults_.Help(rank);
  return Status::Ok();
}

void CallContext::PublishOutputs(int rank, const CallDesc& desc) {
  thread_local std::vector<OutputRegion> regions;
  regions.clear();
  for (const Part& p : desc.parts)
    regions.push_back({p.out, desc.out_count(p, n_) * p.width(), p.out == p.in});
  PublishOutputs(rank, regions);
}

void CallContext::PublishOutputs(int rank, std::span<const OutputRegion> outputs) {
  if (faults_.Publish(rank, outputs)) {
    { const std::unique_lock<std::mutex> lock = Hold(); }  // a rank between its check and its wait sees it
    Bump();
    cv_.notify_all();
  }
  faults_.Help(rank);
}

void CallContext::WithdrawOutputs(int rank) { faults_.Withdraw(rank); }

uint64_t CallContext::barriers_passed(int lane) {
  const std::unique_lock<std::mutex> lock = Hold();
  return lanes_[lane].generation;
}

Status CallContext::Barrier(int rank, int lane_index, std::string_view phase, std::string_view link) {
  std::unique_lock<std::mutex> lock = Hold();
  if (abandoned_) return Abandoned();
  Lane& lane = lanes_[lane_index];
  if (lane.aborted) return Status::DeadlineExceeded(lane.error);
  const uint64_t generation = lane.generation;
  lane.entered[rank] = generation + 1;
  if (++lane.count == n_) {
    lane.count = 0;
    ++lane.generation;
    lock.unlock();
    Bump();
    cv_.notify_all();
    return Status::Ok();
  }
  return WaitAll(
      lock, cv_, [&] { return lane.generation != generation; },
      [&] {
        std::vector<int> m;
        for (int r = 0; r < n_; ++r)
          if (lane.entered[r] != generation + 1) m.push_back(r);
        return m;
      },
      "finish the " + std::string(phase) + " phase", link, Deadline(), &lane);
}

}  // namespace flexlink

namespace flexlink {

uint64_t CallContext::progress(int rank, int lane) {
  const std::unique_lock<std::mutex> lock = Hold();
  return lanes_[lane].progress[rank];
}

void CallContext::Advance(int rank, int lane_index) {
  const std::unique_lock<std::mutex> lock = Hold();
  Lane& lane = lanes_[lane_index];
  ++lane.progress[rank];
  Bump();
  for (int w = 0; w < n_; ++w) {
    const Lane::Waiter& want = lane.waiting[w];
    bool waits_for_us = false, satisfied = true;
    for (int p : want.peers) {
      waits_for_us |= p == rank;
      satisfied &= lane.progress[p] >= want.value;
    }
    if (waits_for_us && satisfied) lane.cv[w].notify_one();
  }
}

Status CallContext::WaitProgress(int rank, int lane_index, std::span<const int> peers, uint64_t value,
                                 std::string_view what, std::string_view link) {
  std::unique_lock<std::mutex> lock = Hold();
  if (abandoned_) return Abandoned();
  Lane& lane = lanes_[lane_index];
  if (lane.aborted) return Status::DeadlineExceeded(lane.error);
  auto there = [&] {
    for (int p : peers)
      if (lane.progress[p] < value) return false;
    return true;
  };
  if (there()) return Status::Ok();
  lane.waiting[rank] = {value, peers};
  Status s = WaitAll(
      lock, lane.cv[rank], there,
      [&] {
        std::vector<int> m;
        for (int p : peers)
          if (lane.progress[p] < value) m.push_back(p);
        return m;
      },
      what, link, Deadline(), &lane);
  lane.waiting[rank] = {};
  return s;
}

}  // namespace flexlink
