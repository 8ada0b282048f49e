#include "xla_ffi/cuda/runtime/process.h"

namespace flexlink::gpu {

CudaDevice& ProcessDevice() {
  static CudaDevice* device = new CudaDevice();  // never destroyed: device threads may outlive exit handlers
  return *device;
}

NcclComm& ProcessNccl() {
  static NcclComm* comm = new NcclComm();
  return *comm;
}

GpuEngine& ProcessEngine() {
  // Group members are XLA's DeviceOrdinal, the CUDA ordinal: GpuEngineOptions' identity default.
  static GpuEngine* engine = [] {
    GpuEngineOptions options;
    options.stop_watchdog_at_exit = true;
    return new GpuEngine(&ProcessDevice(), &ProcessNccl(), options);
  }();
  return *engine;
}

}  // namespace flexlink::gpu
