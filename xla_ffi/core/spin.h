// Spinning before sleeping, for host threads that each have a core (the GPU engine's device threads:
// gpu::ArrivalSpin). A group's ranks reach the same locks within a microsecond of each other at
// every call (the call's shared state, the plan, the rendezvous): a contended std::mutex puts the
// second one to sleep in the kernel and the first one's unlock wakes it, several microseconds each
// way, more than the work done under the lock (docs/cuda.md, "The host path of a call").
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

namespace flexlink {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Locks `lock`'s mutex (not held), trying without blocking for up to `spin` first; with spin 0 (the
// CPU engine, whose device threads outnumber the cores) it is a plain lock. Never fails: after the
// spin it blocks.
inline void RelockSpinning(std::unique_lock<std::mutex>& lock, std::chrono::nanoseconds spin) {
  if (spin.count() > 0) {
    std::chrono::steady_clock::time_point until{};  // read only if the first tries fail
    for (uint32_t i = 0;; ++i) {
      if (lock.try_lock()) return;
      CpuRelax();
      if (i % 64 != 63) continue;
      const auto now = std::chrono::steady_clock::now();
      if (until == std::chrono::steady_clock::time_point{}) until = now + spin;
      else if (now >= until) break;
    }
  }
  lock.lock();
}

// The same for a mutex not yet in a lock.
inline std::unique_lock<std::mutex> LockSpinning(std::mutex& mu, std::chrono::nanoseconds spin) {
  std::unique_lock<std::mutex> lock(mu, std::defer_lock);
  RelockSpinning(lock, spin);
  return lock;
}

}  // namespace flexlink
