#include "xla_ffi/cuda/spin_rule.h"

#include <cstdint>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

#include "xla_ffi/core/config.h"

namespace flexlink::gpu {
namespace {

// The one place FLEXLINK_SPIN_US overrides the rule (core/config.h reads it once, at load).
std::chrono::nanoseconds Spin(bool every_rank_has_a_core) {
  const int64_t configured = SpinMicros();
  if (configured != kAutoSpin) return std::chrono::microseconds(configured);
  return every_rank_has_a_core ? std::chrono::nanoseconds(kArrivalSpin) : std::chrono::nanoseconds(0);
}

}  // namespace

unsigned UsableHardwareThreads() {
#if defined(__linux__)
  // The process's affinity, not the machine's count: a job bound to a few cores (Slurm, taskset)
  // has only those to spin on.
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<unsigned>(CPU_COUNT(&set));
#endif
  return std::thread::hardware_concurrency();
}

std::chrono::nanoseconds ArrivalSpin(int ranks, unsigned hardware_threads) {
  return Spin(hardware_threads > static_cast<unsigned>(ranks));
}

std::chrono::nanoseconds XprocSpin(int ranks, int local_ranks, unsigned usable_threads, unsigned machine_threads) {
  return Spin(usable_threads > static_cast<unsigned>(local_ranks) && machine_threads > static_cast<unsigned>(ranks));
}

}  // namespace flexlink::gpu
