#include "xla_ffi/cuda/pcie_gate.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/deadline.h"
#include "xla_ffi/core/spin.h"

namespace flexlink::gpu {

PcieGate::PcieGate(int ranks, std::chrono::nanoseconds spin)
    : n_(ranks), spin_(spin), recorded_(ranks * kNumKinds), waited_(ranks * kNumKinds) {
  for (auto& v : recorded_) v.store(0);
  for (auto& v : waited_) v.store(0);
}

void PcieGate::Publish(Table* t, int rank, Kind kind, uint64_t seq) {
  (*t)[rank * kNumKinds + kind].store(seq + 1, std::memory_order_release);
  // Store-buffering against Await (store progress, read sleepers_ | count a sleeper, read
  // progress): without a full fence on both sides each can miss the other's store (x86's store
  // buffer allows it), and the sleeper waits out the whole deadline for a record already issued.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_relaxed) > 0) {
    { std::lock_guard<std::mutex> lock(mu_); }  // a sleeper between its check and its wait sees it
    cv_.notify_all();
  }
}

void PcieGate::Abort(const std::string& who) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (who_.empty()) who_ = who;
    aborted_.store(true);
  }
  cv_.notify_all();
}

template <class Ready, class What>
Status PcieGate::Await(Ready ready, What what) {
  // The peers run the same loop a few microseconds apart: a spin catches nearly every case without
  // a sleep (up to spin_ where each rank has a core, else a few polls); then sleep on the condition
  // variable until the deadline.
  auto settled = [&] { return ready() || aborted_.load(); };
  bool done = false;
  for (int i = 0; i < 64 && !done; ++i) done = settled();  // with spin 0, these polls are all
  if ((done || SpinBudget(spin_).Until(settled)) && ready()) return Status::Ok();
  const double timeout = TimeoutSeconds();
  const auto deadline = DeadlineAfter(timeout);
  std::unique_lock<std::mutex> lock(mu_);
  sleepers_.fetch_add(1);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // Publish's fence pairs with this one
  const bool ok = cv_.wait_until(lock, deadline, settled);
  sleepers_.fetch_sub(1);
  if (ok && ready()) return Status::Ok();
  if (aborted_.load())
    return Status::Internal("a peer rank failed while the ranks were enqueuing their copies (" + who_ + ")");
  return Status::DeadlineExceeded("timed out after " + std::to_string(timeout) + " s waiting for " + what() +
                                  " (a rank that stopped issuing this call; the deadline is FLEXLINK_TIMEOUT_S)");
}

Status PcieGate::AwaitRecorded(int peer, Kind kind, uint64_t seq) {
  const auto& v = recorded_[peer * kNumKinds + kind];
  return Await([&] { return v.load(std::memory_order_acquire) > seq; },
               [&] { return "rank " + std::to_string(peer) + " to issue its copies"; });
}

Status PcieGate::AwaitWaitedByAll(Kind kind, uint64_t seq) {
  return Await(
      [&] {
        for (int r = 0; r < n_; ++r)
          if (waited_[r * kNumKinds + kind].load(std::memory_order_acquire) <= seq) return false;
        return true;
      },
      [] { return std::string("every rank to issue its waits"); });
}

}  // namespace flexlink::gpu
