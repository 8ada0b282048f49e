// DeviceApi over the CUDA runtime (cudart, linked statically: it loads the driver at its first call,
// so the module imports on a machine without one). Streams are non-blocking (no implicit ordering
// with the legacy default stream); events without timing unless asked, which makes them cheaper to
// record and wait on.
#pragma once

#include <atomic>
#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "xla_ffi/cuda/device_api.h"

namespace flexlink::gpu {

class CudaDevice : public DeviceApi {
 public:
  int DeviceCount(std::string* why) override;
  Status GetDevice(int* device) override;
  Status SetDevice(int device) override;
  Status CreateStream(int device, Stream* stream) override;
  Status CreateEvent(int device, bool timing, Event* event) override;
  Status AllocDevice(int device, size_t bytes, void** ptr) override;
  Status AllocPinnedHost(size_t bytes, void** ptr) override;
  Status DestroyStream(Stream stream) override;
  Status DestroyEvent(Event event) override;
  Status FreeDevice(void* ptr) override;
  Status FreePinnedHost(void* ptr) override;
  Status ReleaseShared() override;
  Status PreloadKernels(int device) override;
  Status Record(Event event, Stream stream) override;
  Status Wait(Stream stream, Event event) override;
  Status Copy(void* dst, const void* src, size_t bytes, Stream stream) override;
  Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                Stream stream) override;
  Status Zero(void* dst, size_t bytes, Stream stream) override;
  Status Reduce(const ReduceArgs& args, Stream stream) override;
  Status Layout(const LayoutArgs& args, Stream stream) override;
  Status MallocAsync(size_t bytes, Stream stream, void** ptr) override;
  Status FreeAsync(void* ptr, Stream stream) override;
  Status Delay(double seconds, Stream stream) override;
  Status WaitFlag(const uint32_t* flag, double max_seconds, Stream stream) override;
  Poll Query(Event event, std::string* error) override;
  Poll QueryStream(Stream stream, std::string* error) override;
  Status ElapsedSeconds(Event start, Event stop, double* seconds) override;
  Status RegisterHost(void* ptr, size_t bytes) override;
  Status UnregisterHost(void* ptr) override;
  Status WriteValue32(uint32_t* flag, uint32_t value, Stream stream) override;
  Status WaitValue32(const uint32_t* flag, uint32_t value, Stream stream) override;

 private:
  // A device the engine set up (PreloadKernels at a group's setup): its stage-1 scratch pool,
  // made then, with access granted to the other such devices that can reach it (MallocAsync).
  struct Scratch {
    void* pool = nullptr;      // cudaMemPool_t
    std::string error;         // why the pool is missing or a peer that can reach it lacks access
    std::vector<int> granted;  // devices with read-write access to the pool
  };
  // Records `device` as one of the engine's and brings every noted device's scratch pool up to date
  // (setup only; MallocAsync too, should a device reach it without setup).
  void NoteDevice(int device);
  void GrantLocked(int owner, Scratch& scratch);
  // cudaDevAttrMaxPitch, the least over the devices seen; read once per device (Copy2D).
  size_t MaxPitch();

  std::mutex mu_;
  std::map<int, Scratch> scratch_;  // by CUDA ordinal, under mu_
  std::atomic<size_t> max_pitch_{0};  // 0: not read yet
};

}  // namespace flexlink::gpu
