// Host-side ordering between the ranks' threads for the pcie link's cross-device events.
//
// Ranks order each other's copies with CUDA events: a consumer's stream waits for the event a
// producer recorded after its device-to-host copy, and the other way round for slot reuse. A CUDA
// wait binds to the event's most recent record *at the time of the wait call*, so the wait must be
// issued after the producer issued that record and before it re-records the same event. Each rank
// keeps a ring of events per kind and publishes, per kind, up to which sequence number it has
// issued its records and its waits; a thread about to wait (or to reuse a ring slot) checks its
// peers' published progress first. This is host threads waiting for each other's *enqueue*
// progress (microseconds, the ranks run the same loop), never for the device.
//
// It also makes every wait refer to work already submitted, which is what keeps the device side
// deadlock-free when streams share hardware queues (several ranks on one GPU): the earliest
// submitted unfinished operation can always run. Stream memory operations on host flags
// (cuStreamWaitValue32) would avoid the host ordering but create dependencies CUDA cannot see,
// which its documentation warns may deadlock (docs/cuda.md).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/status.h"

namespace flexlink::gpu {

class PcieGate {
 public:
  // Event kinds: what was posted to / consumed from the host slots of round 0 and round 1.
  enum Kind { kPosted0, kConsumed0, kPosted1, kConsumed1, kNumKinds };
  static Kind Posted(int round) { return round ? kPosted1 : kPosted0; }
  static Kind Consumed(int round) { return round ? kConsumed1 : kConsumed0; }

  // `spin`: how long a waiting rank polls before it sleeps (the group's ArrivalSpin); with 0 (ranks
  // that share cores) a few polls only.
  explicit PcieGate(int ranks, std::chrono::nanoseconds spin = {});

  void PublishRecorded(int rank, Kind kind, uint64_t seq) { Publish(&recorded_, rank, kind, seq); }
  void PublishWaited(int rank, Kind kind, uint64_t seq) { Publish(&waited_, rank, kind, seq); }
  // Until `peer` has issued its record of (kind, seq). Errors say what was awaited, not where: the
  // caller puts its link's prefix in front (it is made for an error only).
  Status AwaitRecorded(int peer, Kind kind, uint64_t seq);
  // Until every rank has issued its waits of (kind, seq) (or passed seq without waiting).
  Status AwaitWaitedByAll(Kind kind, uint64_t seq);
  // Wakes every waiter with an error (a rank failed; its peers must not wait for it). `who`: the
  // rank that failed, or why the link was given up, for the waiters' errors (the first one kept).
  void Abort(const std::string& who);

 private:
  using Table = std::vector<std::atomic<uint64_t>>;  // [rank * kNumKinds + kind] = seq + 1, 0: none
  void Publish(Table* t, int rank, Kind kind, uint64_t seq);
  template <class Ready, class What>
  Status Await(Ready ready, What what);

  const int n_;
  const std::chrono::nanoseconds spin_;
  Table recorded_, waited_;
  std::atomic<bool> aborted_{false};
  std::string who_;  // under mu_
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace flexlink::gpu
