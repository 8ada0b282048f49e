// The CUDA module's configured links: FLEXLINK_LINKS syntax (plan/link_spec.h) with the kinds
// "nccl" (NVLink, through NCCL), "pcie" (pinned host staging) and "rdma" (NIC loopback), which is
// designed (docs/cuda.md) but not built: a spec naming it is refused with a message saying so.
// Immutable once made; configuring again makes a new version, and groups are per (version, devices).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/cuda/comm_api.h"
#include "xla_ffi/cuda/device_api.h"
#include "xla_ffi/cuda/gpu_link.h"

namespace flexlink::gpu {

inline constexpr std::string_view kDefaultGpuLinks = "nccl";

struct GpuLinkSet {
  uint64_t version = 0;
  std::string spec;  // canonical (plan::FormatLinkSpecs): the tuning cache's key
  std::vector<std::unique_ptr<GpuLink>> links;  // links[0] is the primary
  std::vector<std::string> names() const;
};

Status MakeGpuLinkSet(std::string_view spec, uint64_t version, DeviceApi* api, CommApi* comm,
                      std::shared_ptr<const GpuLinkSet>* out);

}  // namespace flexlink::gpu
