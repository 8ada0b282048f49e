#include "xla_ffi/cuda/pcie_gate.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/deadline.h"

namespace flexlink::gpu {

PcieGate::PcieGate(int ranks) : n_(ranks), recorded_(ranks * kNumKinds), waited_(ranks * kNumKinds) {
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

template <class Ready>
Status PcieGate::Await(Ready ready, std::string_view where, std::string_view what) {
  // The peers run the same loop a few microseconds apart: a short spin catches nearly every case
  // without a sleep; then sleep on the condition variable until the deadline.
  for (int i = 0; i < 64; ++i) {
    if (ready()) return Status::Ok();
    if (aborted_.load()) break;
  }
  const double timeout = TimeoutSeconds();
  const auto deadline = DeadlineAfter(timeout);
  std::unique_lock<std::mutex> lock(mu_);
  sleepers_.fetch_add(1);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // Publish's fence pairs with this one
  const bool ok = cv_.wait_until(lock, deadline, [&] { return ready() || aborted_.load(); });
  sleepers_.fetch_sub(1);
  if (ok && ready()) return Status::Ok();
  if (aborted_.load())
    return Status::Internal(std::string(where) + "a peer rank failed while the ranks were enqueuing their copies (" +
                            who_ + ")");
  return Status::DeadlineExceeded(std::string(where) + "timed out after " + std::to_string(timeout) +
                                  " s waiting for " + std::string(what) +
                                  " (a rank that stopped issuing this call; the deadline is FLEXLINK_TIMEOUT_S)");
}

Status PcieGate::AwaitRecorded(int peer, Kind kind, uint64_t seq, std::string_view where) {
  const auto& v = recorded_[peer * kNumKinds + kind];
  return Await([&] { return v.load(std::memory_order_acquire) > seq; }, where,
               "rank " + std::to_string(peer) + " to issue its copies");
}

Status PcieGate::AwaitWaitedByAll(Kind kind, uint64_t seq, std::string_view where) {
  return Await(
      [&] {
        for (int r = 0; r < n_; ++r)
          if (waited_[r * kNumKinds + kind].load(std::memory_order_acquire) <= seq) return false;
        return true;
      },
      where, "every rank to issue its waits");
}

}  // namespace flexlink::gpu
