// The CUDA module's one engine per process, over the CUDA runtime and NCCL; made at first use (the
// first handler call or control function), so importing the module touches neither.
#pragma once

#include <cstdint>
#include <vector>

#include "xla_ffi/cuda/gpu_engine.h"
#include "xla_ffi/cuda/runtime/cuda_device.h"
#include "xla_ffi/cuda/runtime/nccl_comm.h"

namespace flexlink::gpu {

CudaDevice& ProcessDevice();
NcclComm& ProcessNccl();
GpuEngine& ProcessEngine();

// Multi-process jobs: XLA hands the handlers the CUDA ordinal (DeviceOrdinal), while groups hold
// jax's global device ids, which equal the ordinals only in a single-process job. Python sets the
// global id of each local ordinal once at lowering (`set_device_ids`); until then both are the same.
// Returns false (nothing changed) when ids were already set to different values: calls may run.
bool SetDeviceIds(std::vector<int64_t> global_of_ordinal);
int64_t GlobalIdOf(int32_t ordinal);
int OrdinalOf(int64_t global_id);

}  // namespace flexlink::gpu
