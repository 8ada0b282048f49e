#include "xla_ffi/cuda/runtime/process.h"

namespace flexlink::gpu {

DeviceIds& ProcessDeviceIds() {
  static DeviceIds* ids = new DeviceIds();  // never destroyed, as the engine below
  return *ids;
}

CudaDevice& ProcessDevice() {
  static CudaDevice* device = new CudaDevice();  // never destroyed: device threads may outlive exit handlers
  return *device;
}

NcclComm& ProcessNccl() {
  static NcclComm* comm = new NcclComm();
  return *comm;
}

GpuEngine& ProcessEngine() {
  // Group members are jax's global device ids; the handlers translate XLA's DeviceOrdinal (the CUDA
  // ordinal) into them and the engine maps them back (device_ids.h).
  static GpuEngine* engine = [] {
    GpuEngineOptions options;
    options.stop_watchdog_at_exit = true;
    options.device_of = [](int64_t id) { return ProcessDeviceIds().OrdinalOf(id); };
    return new GpuEngine(&ProcessDevice(), &ProcessNccl(), options);
  }();
  return *engine;
}

}  // namespace flexlink::gpu
