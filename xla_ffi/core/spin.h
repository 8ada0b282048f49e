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

// A time-bounded poll, the one spin loop every waiter here runs: Until(ready) polls ready() with a
// pause between polls until it holds (true) or `spin` has passed (false). The clock is read only
// every 64 polls and started at its first read, so a wait that ends within a few polls reads no
// clock. The budget is shared by every Until on the same object (a wait over several ranks spins
// `spin` in all, not per rank); a zero budget checks ready() once.
class SpinBudget {
 public:
  explicit SpinBudget(std::chrono::nanoseconds spin) : spin_(spin) {}

  template <class Ready>
  bool Until(Ready ready) {
    for (uint32_t i = 1;; ++i) {
      if (ready()) return true;
      if (spin_.count() <= 0) return false;
      CpuRelax();
      if (i % 64 != 0) continue;
      const auto now = std::chrono::steady_clock::now();
      if (until_ == std::chrono::steady_clock::time_point{}) until_ = now + spin_;
      else if (now >= until_) {
        spin_ = std::chrono::nanoseconds(0);  // spent: later Untils check once
        return ready();
      }
    }
  }

 private:
  std::chrono::nanoseconds spin_;
  std::chrono::steady_clock::time_point until_{};
};

// Locks `lock`'s mutex (not held), trying without blocking for up to `spin` first; with spin 0 (the
// CPU engine, whose device threads outnumber the cores) it is a plain lock. Never fails: after the
// spin it blocks.
inline void RelockSpinning(std::unique_lock<std::mutex>& lock, std::chrono::nanoseconds spin) {
  if (spin.count() > 0 && SpinBudget(spin).Until([&] { return lock.try_lock(); })) return;
  lock.lock();
}

// The same for a mutex not yet in a lock.
inline std::unique_lock<std::mutex> LockSpinning(std::mutex& mu, std::chrono::nanoseconds spin) {
  std::unique_lock<std::mutex> lock(mu, std::defer_lock);
  RelockSpinning(lock, spin);
  return lock;
}

}  // namespace flexlink
