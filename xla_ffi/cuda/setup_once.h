// A group's one-time set-up on the GPU (in process: gpu_setup.cc; across processes: gpu_xproc.cc):
// the first of its ranks' device threads to call runs it, the others wait for its status, at most
// a given time. Not std::call_once: the waiters need a deadline, and the status is every rank's.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <string_view>

#include "xla_ffi/core/deadline.h"
#include "xla_ffi/core/status.h"

namespace flexlink::gpu {

class SetupOnce {
 public:
  struct Outcome {
    Status status;           // the set-up's (a waiter that timed out: Ok, see timed_out)
    bool ran = false;        // this caller ran it
    bool timed_out = false;  // this caller gave up waiting for it
  };

  // Whether the set-up ran and succeeded (lock-free: every call of a set-up group asks).
  bool ready() const { return ready_.load(std::memory_order_acquire); }

  // Runs `setup` (returning Status) if nobody has started it, else waits up to `wait_s` for it. An
  // exception from `setup` becomes Internal(`where` + its message), never this thread's unwinding.
  template <class F>
  Outcome Run(F&& setup, double wait_s, std::string_view where) {
    Outcome out;
    std::unique_lock<std::mutex> lock(mu_);
    if (!started_) {
      started_ = true;
      lock.unlock();
      Status s;
      try {
        s = setup();
      } catch (const std::exception& e) {
        s = Status::Internal(std::string(where) + e.what());
      }
      lock.lock();
      status_ = s;
      done_ = true;
      if (s.ok()) ready_.store(true, std::memory_order_release);
      cv_.notify_all();
      out.status = s;
      out.ran = true;
      return out;
    }
    const auto deadline = DeadlineAfter(wait_s);
    if (!cv_.wait_until(lock, deadline, [&] { return done_; })) {
      out.timed_out = true;
      return out;
    }
    out.status = status_;
    return out;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool started_ = false, done_ = false;
  std::atomic<bool> ready_{false};
  Status status_;
};

}  // namespace flexlink::gpu
