// What the ranks of one executor call share (internal to executor.cc and executor_profile.cc).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/plan/balancer.h"

namespace flexlink {

using Clock = std::chrono::steady_clock;

inline double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// nccl-tests' "size" of a call: AllReduce and SendRecv (ppermute) the buffer, AllGather the gathered
// output, ReduceScatter the input, AlltoAll the whole per-rank buffer; summed over the call's parts.
// Plans are bucketed by it.
inline uint64_t MessageBytes(const CallDesc& d, int n) {
  uint64_t bytes = 0;
  for (const Part& p : d.parts) bytes += p.bytes();
  return bytes * (d.kind == Kind::kAllReduce || d.kind == Kind::kPpermute ? 1 : n);
}

// Stage 1 run by the ranks of one call (executor_profile.cc). Every rank runs the same steps in the
// same order; a step's time is the slowest rank's, a size's time the best of its timed repetitions.
struct Executor::Profile {
  Kind kind = Kind::kAllReduce;
  std::vector<uint64_t> sizes;  // profiled message sizes (nccl-tests bytes), ascending
  int warmup = 1, iters = 2;    // untimed and timed repetitions of every step
  int64_t run_id = 0;           // of the nested calls: the same on every rank, never an XLA run's
  std::string label;
  Clock::time_point started;
  std::vector<double> alone;    // [link][size][repetition]: max over ranks
  std::vector<double> split;    // [size][repetition]
  std::vector<double> paired;   // [size][repetition]: the fastest link alone, timed just before each split
  bool installed = false;
};

// The largest size stage 1 profiles for a call of `message_bytes`: powers of two from 64 KiB up to
// the call's bucket, at most TuneMaxBytes (at least two sizes).
uint64_t ProfileTopBytes(uint64_t message_bytes);

struct Executor::CallState {
  std::mutex mu;
  std::shared_ptr<const plan::Plan> plan;  // replaced (under mu) once stage 1 ran in this call
  bool profile = false;                    // this call runs stage 1 first
  // Health (core/health.h): the group's call number, the plan's shares with unhealthy links removed
  // (and a probe's share), whether they differ from the plan's, the probed link (-1: none).
  uint64_t call = 0;
  std::vector<double> shares;
  bool shares_ready = false, masked = false;
  int probe = -1;
  std::vector<plan::AlphaBeta> fits;  // stage 1's for this kind (empty: none)
  // Failover (executor.cc Recover), per round (0: the plan's ranges, r: the r-th re-run) and per
  // source link (whose range it is): failed on some rank; failed having maybe touched buffers.
  std::vector<std::vector<char>> round_failed, touched;
  std::vector<std::string> errors;     // per link: the first error it reported in this call
  std::vector<std::pair<size_t, size_t>> moves;  // (failed link, link that carried its range)
  std::vector<char> bad;               // links that failed in this call
  bool recovered = false;              // some range was re-run: stage 2 does not learn from the call
  std::unique_ptr<Profile> profiling;      // made by the first rank to profile
  std::vector<double> link_seconds;        // slowest rank's time per link
  std::vector<double> health_seconds;      // the same from the arrival on (health's evidence)
  double call_seconds = 0;
  int finished = 0;
  bool failed = false;
};

}  // namespace flexlink
