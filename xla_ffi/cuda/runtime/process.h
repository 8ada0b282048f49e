// The CUDA module's one engine per process, over the CUDA runtime and NCCL; made at first use (the
// first handler call or control function), so importing the module touches neither.
#pragma once

#include "xla_ffi/cuda/device_ids.h"
#include "xla_ffi/cuda/gpu_engine.h"
#include "xla_ffi/cuda/runtime/cuda_device.h"
#include "xla_ffi/cuda/runtime/nccl_comm.h"

namespace flexlink::gpu {

CudaDevice& ProcessDevice();
NcclComm& ProcessNccl();
GpuEngine& ProcessEngine();

// XLA's CUDA ordinal of a handler's device <-> jax's global device id (device_ids.h); Python sets
// it at the first lowering for GPUs (`set_device_ids`).
DeviceIds& ProcessDeviceIds();

}  // namespace flexlink::gpu
