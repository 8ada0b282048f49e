#include "xla_ffi/cuda/runtime/process.h"

#include <atomic>
#include <algorithm>
#include <mutex>

namespace flexlink::gpu {
namespace {

// Set once, before any call of a group spanning processes (lowering), then only read: device
// threads read `g_ids` after the acquire on `g_count`.
constexpr int kMaxOrdinals = 64;
int64_t g_ids[kMaxOrdinals];
std::atomic<int> g_count{0};
std::mutex g_ids_mu;

}  // namespace

bool SetDeviceIds(std::vector<int64_t> global_of_ordinal) {
  std::lock_guard<std::mutex> lock(g_ids_mu);
  const int n = static_cast<int>(std::min<size_t>(global_of_ordinal.size(), kMaxOrdinals));
  const int have = g_count.load(std::memory_order_acquire);
  if (have) {
    if (have != n) return false;
    for (int i = 0; i < n; ++i)
      if (g_ids[i] != global_of_ordinal[i]) return false;
    return true;
  }
  for (int i = 0; i < n; ++i) g_ids[i] = global_of_ordinal[i];
  g_count.store(n, std::memory_order_release);
  return true;
}

int64_t GlobalIdOf(int32_t ordinal) {
  const int n = g_count.load(std::memory_order_acquire);
  return ordinal >= 0 && ordinal < n ? g_ids[ordinal] : ordinal;
}

int OrdinalOf(int64_t global_id) {
  const int n = g_count.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (g_ids[i] == global_id) return i;
  return n ? -1 : static_cast<int>(global_id);
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
  // ordinal) into them and the engine maps them back (identity in a single-process job).
  static GpuEngine* engine = [] {
    GpuEngineOptions options;
    options.stop_watchdog_at_exit = true;
    options.device_of = [](int64_t id) { return OrdinalOf(id); };
    return new GpuEngine(&ProcessDevice(), &ProcessNccl(), options);
  }();
  return *engine;
}

}  // namespace flexlink::gpu
