// Per-link times of GPU calls, read when the device has done them. A call records a timing event
// on XLA's stream before its links start and one per link when that link's range is done; nobody
// waits for them. At each later call every rank polls its own pending events (Query never blocks),
// and once every rank of a call has read its times, the last one reports the slowest rank's time
// per link to the group's balancer (stage 2) and to the link statistics — one call late, or a few
// when the host runs far ahead of the device.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "xla_ffi/plan/balancer.h"

namespace flexlink::gpu {

struct TimingRecord {
  std::shared_ptr<const plan::Plan> plan;
  uint64_t message_bytes = 0;              // nccl-tests bytes (the balancer's size)
  std::vector<uint64_t> link_bytes;        // per link: the input bytes of its range (statistics)
  std::vector<double> link_seconds;        // per link: the slowest rank's time so far
  double call_seconds = 0;
  uint64_t call = 0;                       // the group's call number (health)
  std::vector<uint64_t> link_message_bytes;  // per link: nccl-tests bytes of its range (health)
  std::vector<char> slowed;                // per link: an injected delay ran after its range
  int pending = 0;                         // ranks that have not read (or given up on) their times
  bool lost = false;                       // some rank gave up: nothing is reported
};

class TimingBook {
 public:
  // `spin`: how long a rank tries the lock before it sleeps (core/spin.h): a group's ranks read
  // their times at the same moment of every call.
  explicit TimingBook(int ranks, std::chrono::nanoseconds spin = {}) : n_(ranks), spin_(spin) {}
  // A new call's record (its first rank, while making the call's state).
  uint64_t Open(std::shared_ptr<const plan::Plan> plan, uint64_t message_bytes, std::vector<uint64_t> link_bytes,
                uint64_t call = 0, std::vector<uint64_t> link_message_bytes = {});
  // Link `link` of the call ran an injected delay (its time says nothing of the link's rate).
  void MarkSlowed(uint64_t id, size_t link);
  // This rank's times; returns the record once every rank has given its times (report it).
  std::optional<TimingRecord> Add(uint64_t id, const std::vector<double>& link_seconds, double call_seconds);
  // This rank cannot time the call (its events were reused, or an error): no report for it.
  void Lose(uint64_t id);
  size_t open_records() const;

 private:
  std::optional<TimingRecord> Retire(std::map<uint64_t, TimingRecord>::iterator it);
  const int n_;
  const std::chrono::nanoseconds spin_;
  mutable std::mutex mu_;
  uint64_t next_ = 1;
  std::map<uint64_t, TimingRecord> records_;
};

}  // namespace flexlink::gpu
