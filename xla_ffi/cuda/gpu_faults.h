// Fault injection at the GPU link boundary (docs/faults.md, "GPU links"): the GPU executor asks a
// link's FaultyGpuChannel whether its next range may be enqueued before any rank enqueues anything
// of the call, so an injected error never puts work on a stream and every rank agrees on it at the
// host (gpu_executor.cc, Agree). Only `error` is supported on GPU links: the host never waits for the
// device on the call path, so a device-side hang or slowdown cannot be observed in the call it
// happens in, and SetGpuFaults refuses them with a message saying so.
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
  // Counts this rank's next range on the link under `faults` and returns the injected error
  // (kUnavailable: nothing was enqueued) if one fires there. Every rank calls it for the same ranges
  // in the same order, so their counts agree.
  Status Admit(int rank, const FaultSet& faults, std::string_view label);

 private:
  std::unique_ptr<GpuChannel> inner_;
  FaultCounter counter_;
};

// inject_faults for the CUDA module: the shared grammar (core/faults.h) against the GPU links'
// names, with the kinds a stream-ordered engine cannot honour refused.
Status SetGpuFaults(std::string_view text, const std::vector<std::string>& links);

}  // namespace flexlink::gpu
