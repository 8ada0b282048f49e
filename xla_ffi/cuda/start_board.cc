#include "xla_ffi/cuda/start_board.h"

#include <algorithm>
#include <cstdio>

#include "xla_ffi/core/config.h"

namespace flexlink::gpu {

StartBoard::StartBoard(int ranks) : owned_(new std::atomic<uint64_t>[ranks]) {
  for (int r = 0; r < ranks; ++r) {
    owned_[r].store(0, std::memory_order_relaxed);
    words_.push_back(&owned_[r]);
  }
}

StartBoard::StartBoard(std::vector<std::atomic<uint64_t>*> words) : words_(std::move(words)) {}

void StartBoard::Reach(int rank, uint64_t call) {
  std::atomic<uint64_t>& w = *words_[rank];
  uint64_t seen = w.load(std::memory_order_relaxed);
  // A max, not a store: the host's give-up of a call and the watchdog's poll of an earlier one may
  // race, and a word that went back would stop peers' clocks that already run.
  while (seen < call && !w.compare_exchange_weak(seen, call, std::memory_order_release, std::memory_order_relaxed)) {
  }
}

std::vector<int> StartBoard::Behind(uint64_t call, const std::function<std::vector<int>()>& gone) const {
  std::vector<int> behind;
  for (int r = 0; r < size(); ++r)
    if (Reached(r) < call) behind.push_back(r);
  if (behind.empty() || !gone) return behind;
  const std::vector<int> dead = gone();
  std::erase_if(behind, [&](int r) { return std::find(dead.begin(), dead.end(), r) != dead.end(); });
  return behind;
}

double ProfileAllowanceSeconds() { return TimeoutSeconds() / 2; }

ClockReading TickClock(CallClock& clock, const std::function<bool()>& own_started, StartBoard& board, int rank,
                       uint64_t call, const std::function<std::vector<int>()>& gone) {
  using Clock = std::chrono::steady_clock;
  ClockReading reading;
  if (!clock.own) {
    if (!own_started()) return reading;
    clock.own = true;
    clock.own_at = Clock::now();
    board.Reach(rank, call);
  }
  if (!clock.all) {
    std::vector<int> behind = board.Behind(call, gone);
    if (!behind.empty()) {
      const double waited = std::chrono::duration<double>(Clock::now() - clock.own_at).count();
      if (waited <= TimeoutSeconds()) {
        reading.state = ClockReading::kWaitingPeers;
        return reading;
      }
      reading.state = ClockReading::kPeersLate;
      reading.waited = waited;
      reading.behind = std::move(behind);
      return reading;
    }
    clock.all = true;
    clock.all_at = Clock::now();
  }
  reading.state = ClockReading::kRunning;
  reading.waited = std::chrono::duration<double>(Clock::now() - clock.all_at).count();
  return reading;
}

std::string PeersLateReason(uint64_t call, const std::string& group, std::string_view kind, double waited,
                            const std::vector<int>& behind, const std::function<std::string(int)>& rank_name) {
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.3g s", waited);
  std::string who;
  for (size_t i = 0; i < behind.size(); ++i) who += (i ? ", " : "") + rank_name(behind[i]);
  return "call " + std::to_string(call) + "'s ranges on group " + group + " (" + std::string(kind) + ") waited " +
         secs + " (past the global timeout, FLEXLINK_TIMEOUT_S) after this rank's device reached the call for " +
         who + " to reach it on " + (behind.size() > 1 ? "their devices" : "its device");
}

}  // namespace flexlink::gpu
