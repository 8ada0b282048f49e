// Where each rank of a GPU group is on its device, and the hang detector's clock built on it.
//
// A collective cannot finish before the slowest rank's stream reaches it, so a range's deadline
// counts from the moment every rank's device has reached the call, not from this rank's: a GPU
// that is busy with a long program of its own (or a long transfer) before the call would otherwise
// make its peers' ranges look hung and break the group for good. Each rank publishes on the board
// the latest of the group's calls its stream has reached (a poll saw the call's start event
// complete, or its whole call done) or that its host gave up before anything watched reached its
// stream (once no earlier call is pending on its device); the board is process memory for a group
// in one process, and a word in each rank's block of the shared segment for a group across
// processes. A rank whose peers never reach the call is
// still bounded: past the global timeout (FLEXLINK_TIMEOUT_S) from its own start, the detector
// breaks the group naming the ranks that never arrived on the device.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace flexlink::gpu {

class StartBoard {
 public:
  // A board in process memory for `ranks` ranks.
  explicit StartBoard(int ranks);
  // A board over words kept elsewhere (the segment's rank blocks): words[r] is rank r's.
  explicit StartBoard(std::vector<std::atomic<uint64_t>*> words);
  StartBoard(const StartBoard&) = delete;
  StartBoard& operator=(const StartBoard&) = delete;

  int size() const { return static_cast<int>(words_.size()); }
  // Rank `rank` has reached call `call` (its word only grows: calls reach a stream in order).
  void Reach(int rank, uint64_t call);
  uint64_t Reached(int rank) const { return words_[rank]->load(std::memory_order_acquire); }
  // The ranks that have not reached `call`, ascending, less those `gone` says will never come (a
  // dead peer process: its peers' clocks run, and the link's deadline finds what waits for it).
  std::vector<int> Behind(uint64_t call, const std::function<std::vector<int>()>& gone = nullptr) const;

 private:
  std::unique_ptr<std::atomic<uint64_t>[]> owned_;
  std::vector<std::atomic<uint64_t>*> words_;
};

// What a call that runs stage 1's profile first adds to each of its ranges' deadlines: its clock
// starts before the profile, whose length nothing predicts; half the global timeout, as much as
// any range's own deadline may be (LinkBudgetSeconds).
double ProfileAllowanceSeconds();

// One call's clock on one rank, kept in its timing slot.
struct CallClock {
  using TimePoint = std::chrono::steady_clock::time_point;
  bool own = false;  // this rank's start event was seen complete, at own_at
  TimePoint own_at;
  bool all = false;  // every rank had reached the call, seen at all_at: the ranges' clocks run
  TimePoint all_at;
};

struct ClockReading {
  enum State {
    kNotStarted,    // this rank's stream has not reached the call
    kWaitingPeers,  // it has; some peers' have not (yet within the global timeout)
    kRunning,       // every rank's has: `waited` seconds since
    kPeersLate,     // some peers' have not, past the global timeout since this rank's start
  };
  State state = kNotStarted;
  double waited = 0;        // kRunning: since every rank reached it; kPeersLate: since this rank did
  std::vector<int> behind;  // kPeersLate: the ranks that have not reached the call
};

// One poll of `clock` for call `call` of rank `rank`: `own_started` says whether this rank's start
// event of the call has completed (queried only until it has); publishes the rank's arrival on the
// board the first time it is seen. `gone`: as Behind's.
ClockReading TickClock(CallClock& clock, const std::function<bool()>& own_started, StartBoard& board, int rank,
                       uint64_t call, const std::function<std::vector<int>()>& gone = nullptr);

// The hang detector's reason for a call whose peers never reached it on their devices: "call 7's
// ranges on group [0, 1] (all_reduce) waited 300 s (past the global timeout, FLEXLINK_TIMEOUT_S) after
// this rank's device reached the call for rank 1 (device 1) to reach it on its device". `rank_name`
// names a rank as the group's messages do.
std::string PeersLateReason(uint64_t call, const std::string& group, std::string_view kind, double waited,
                            const std::vector<int>& behind, const std::function<std::string(int)>& rank_name);

}  // namespace flexlink::gpu
