// The GPU link interface, the counterpart of links/link.h for devices: a GpuLink is a configured
// transport ("nccl", "pcie"); opening it on a group gives a GpuChannel, which owns what the transport
// needs per group (communicators, pinned staging, streams, scratch). A channel *enqueues* one rank's
// part of a sub-collective on a list of pieces (core/call.h) and returns; it never waits for the
// device and never decides routing (the executor does, gpu_executor.h).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/status.h"
#include "xla_ffi/cuda/device_api.h"

namespace flexlink::gpu {

// A group as the links see it: global device ids (rank order, what `groups` holds) and the CUDA
// device each rank runs on (the same numbers under XLA; tests put several ranks on one device).
struct GroupInfo {
  std::vector<int64_t> ids;
  std::vector<int> devices;
  // How long its ranks' host threads spin before they sleep when they wait for each other (at the
  // rendezvous, the locks they all take, the pcie link's gate): gpu::ArrivalSpin for a group in one
  // process; 0 across processes (they wait in their shared segment).
  std::chrono::nanoseconds spin{0};
  int size() const { return static_cast<int>(ids.size()); }
};

// One rank's part of one call on one link.
struct GpuWork {
  const CallDesc* desc = nullptr;  // this rank's parts (device pointers)
  int rank = 0;
  std::span<const Piece> pieces;
  // The link's work starts after what is on `stream` now and is all on `stream` when Enqueue
  // returns (a channel forks its own streams from it and joins them back, with events).
  Stream stream = nullptr;
  std::string_view label;  // the collective, for error messages
};

class GpuChannel {
 public:
  virtual ~GpuChannel() = default;
  virtual std::string_view link_name() const = 0;
  // Once per group, from one thread, while every rank of the group waits at the host inside its
  // first call's rendezvous: nothing of the group is in flight on any device.
  virtual Status Setup() = 0;
  // Called by every rank with the same pieces, each rank on its own thread.
  virtual Status Enqueue(const GpuWork& work) = 0;
  // After a hang (gpu_executor.h): ends what may keep the link's work in flight on the device
  // forever (nccl: ncclCommAbort of every rank's communicator; pcie across processes: every rank's
  // step flag raised past any step, since cuStreamWaitValue32 has no timeout). Called once, from
  // one thread, when no rank is enqueuing (or one has not come back from its enqueue for 1.5 times
  // the deadline: GpuXprocGroup::Watch); the channel is never used again. Links whose waits are
  // all CUDA events on work already submitted (pcie in one process) have nothing of their own to
  // release.
  virtual Status Abort() { return Status::Ok(); }
  // After Abort, on every later poll of the hang detector while the process lives: re-opens any
  // device-side wait on host memory that a peer's late write may have closed again (pcie across
  // processes: a stream still draining stores its own, smaller step into a flag Abort raised).
  // Idempotent and cheap; never blocks.
  virtual void Unblock() {}
  // A rank of the group failed before it reached this link in the call its peers are enqueuing
  // (stage 1's profile could not be enqueued on it): wakes, with an error, every host-side wait of
  // theirs for that rank's enqueue progress (pcie in one process: its gate), so that they leave the
  // call and the group's communicators can be aborted. The group is broken; the channel refuses
  // every later call, saying `why`. Never blocks.
  virtual void Forsake(const std::string& why) { (void)why; }
  // The engine's shutdown (GpuEngine::Shutdown). Drained: whether nothing the channel enqueued is
  // still running on a device (never blocks; *busy says what is). Release: once, from one thread,
  // with no rank inside a call and the channel drained: ends its communicators (each finalize
  // within `timeout_s`) and releases everything its set-up made; the channel is never used again.
  virtual bool Drained(std::string* busy) {
    (void)busy;
    return true;
  }
  virtual Status Release(double timeout_s) {
    (void)timeout_s;
    return Status::Ok();
  }
};

class GpuLink {
 public:
  virtual ~GpuLink() = default;
  virtual std::string_view name() const = 0;
  virtual std::unique_ptr<GpuChannel> Open(const GroupInfo& group) = 0;
};

// A channel that failed half way through enqueuing a call has ranks out of step (NCCL's operation
// order, pcie's sequence numbers), so it refuses every later call with the first error.
class Breaker {
 public:
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  std::string message() const {
    std::lock_guard<std::mutex> lock(mu_);
    return message_;
  }
  Status Break(Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.load()) {
      message_ = s.message();
      broken_.store(true, std::memory_order_release);
    }
    return s;
  }
  Status Check(std::string_view link) const {
    if (!broken()) return Status::Ok();
    return Status::Internal("flexlink: the " + std::string(link) +
                            " link of this group failed (in this call or an earlier one) and stays off: " + message());
  }

 private:
  std::atomic<bool> broken_{false};
  mutable std::mutex mu_;
  std::string message_;
};

// "flexlink: <label>: all_reduce on group [0, 1] (link pcie): "
std::string LinkWhere(std::string_view label, Kind kind, std::span<const int64_t> ids, std::string_view link);

}  // namespace flexlink::gpu
