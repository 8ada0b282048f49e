// Fault injection at the GPU link boundary (docs/faults.md, "GPU links"): the GPU executor asks a
// link's FaultyGpuChannel whether its next range may be enqueued before any rank enqueues anything
// of the call, so an injected error never puts work on a stream and every rank agrees on it at the
// host (gpu_executor.cc, Agree). The three link faults act where a GPU link can fail:
//   error: the range is refused at the host, before any rank enqueues anything (failover in the call);
//   slow:  the range is enqueued, then a device-side delay of (K - 1) x its predicted time on the
//          same stream (DeviceApi::Delay), so its completion event, stage 2 and health see it;
//   hang:  the link's stream first waits on a host flag that nobody sets (DeviceApi::WaitFlag): the
//          range never completes until the executor's hang detector (GpuExecutor::Watch, on the engine's watchdog thread) declares it
//          hung past its deadline, breaks the group and releases the stream.
// rank:absent is the engine's, not a link's: the rank's device thread never arrives at the host
// rendezvous (GpuExecutor::Run; across processes GpuXprocGroup::Run), so nothing of the call is
// enqueued anywhere and the others' deadline names it.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/faults.h"
#include "xla_ffi/cuda/gpu_link.h"

namespace flexlink::gpu {

class FaultyGpuChannel : public GpuChannel {
 public:
  FaultyGpuChannel(std::unique_ptr<GpuChannel> inner, int ranks) : inner_(std::move(inner)), counter_(ranks) {}
  std::string_view link_name() const override { return inner_->link_name(); }
  Status Setup() override { return inner_->Setup(); }
  Status Enqueue(const GpuWork& work) override { return inner_->Enqueue(work); }
  Status Abort() override { return inner_->Abort(); }
  void Unblock() override { inner_->Unblock(); }
  void Forsake(const std::string& why) override { inner_->Forsake(why); }
  bool Drained(std::string* busy) override { return inner_->Drained(busy); }
  Status Release(double timeout_s) override { return inner_->Release(timeout_s); }
  // What an admitted range carries with it on the device (every rank decides the same).
  struct Effect {
    double slow = 1;    // > 1: delay (slow - 1) x the range's predicted time after it
    bool hang = false;  // the stream waits on the rank's hang flag before the range
    uint64_t call = 0;  // the link's call count that fired (messages)
  };
  // Counts this rank's next range on the link under `faults` and returns the injected error
  // (kUnavailable: nothing was enqueued) if one fires there; a slow or hang fault firing there is
  // added to *effect. Every rank calls it for the same ranges in the same order, so their counts agree.
  Status Admit(int rank, const FaultSet& faults, std::string_view label, Effect* effect);

 private:
  std::unique_ptr<GpuChannel> inner_;
  FaultCounter counter_;
};

// inject_faults for the CUDA module: the shared grammar (core/faults.h) against the GPU links' names.
Status SetGpuFaults(std::string_view text, const std::vector<std::string>& links);

}  // namespace flexlink::gpu
