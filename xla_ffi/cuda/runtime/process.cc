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
  static GpuEngine* engine = new GpuEngine(&ProcessDevice(), &ProcessNccl());
  return *engine;
}

}  // namespace flexlink::gpu
