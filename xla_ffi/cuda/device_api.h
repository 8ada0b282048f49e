// The device operations the GPU engine uses, behind one interface. The engine, its links and its
// executor are plain C++ written against it: cuda_device.cc implements it with the CUDA runtime (the
// CUDA module), tests/cpp/sim with host threads standing in for streams, so every line of the
// GPU engine's scheduling (which stream waits for which event, which byte goes where) runs in the
// CPU-only tests too.
//
// Rules the engine keeps (docs/cuda.md): resources (streams, events, memory) are made only at a
// group's setup, never on a call's path; a call's path only enqueues (Record, Wait, copies, kernels)
// and polls (Query) — nothing here blocks the calling thread on the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "xla_ffi/core/status.h"
#include "xla_ffi/cuda/kernel_args.h"

namespace flexlink::gpu {

using Stream = void*;  // cudaStream_t / the simulation's stream
using Event = void*;   // cudaEvent_t / the simulation's event

enum class Poll { kDone, kPending, kError };

class DeviceApi {
 public:
  virtual ~DeviceApi() = default;

  // Devices this process can use; 0 with `why` filled when there is none (no driver, no GPU).
  virtual int DeviceCount(std::string* why) = 0;
  virtual Status GetDevice(int* device) = 0;
  virtual Status SetDevice(int device) = 0;

  // Setup only (a group's first call, all its ranks waiting at the host).
  virtual Status CreateStream(int device, Stream* stream) = 0;
  // timing: the event can be an end of ElapsedSeconds (costs a little more to record).
  virtual Status CreateEvent(int device, bool timing, Event* event) = 0;
  virtual Status AllocDevice(int device, size_t bytes, void** ptr) = 0;
  // Pinned (page-locked) host memory every device can copy to and from.
  virtual Status AllocPinnedHost(size_t bytes, void** ptr) = 0;
  // The engine's shutdown only (GpuEngine::Shutdown, device_ledger.h), once nothing enqueued on or
  // with these is left to run: each undoes one Create/Alloc/RegisterHost above.
  virtual Status DestroyStream(Stream stream) = 0;
  virtual Status DestroyEvent(Event event) = 0;
  virtual Status FreeDevice(void* ptr) = 0;
  virtual Status FreePinnedHost(void* ptr) = 0;
  // What the device keeps for every group (CUDA: stage 1's scratch pools), once every group was
  // released. Default: nothing.
  virtual Status ReleaseShared() { return Status::Ok(); }
  // Loads the engine's kernels on `device` now: loading one lazily at its first launch, while
  // another kernel waits on a peer, can deadlock (CUDA's lazy loading).
  virtual Status PreloadKernels(int device) = 0;

  // A call's path: enqueue on `stream` (whose device is current) and return.
  // Record captures the stream's work so far in `event`; a Wait made later waits for that capture
  // (the most recent Record at the time of the Wait, as CUDA events do), across devices too.
  virtual Status Record(Event event, Stream stream) = 0;
  virtual Status Wait(Stream stream, Event event) = 0;
  virtual Status Copy(void* dst, const void* src, size_t bytes, Stream stream) = 0;
  // `height` rows of `width` bytes, rows `dpitch` / `spitch` bytes apart.
  virtual Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                        Stream stream) = 0;
  virtual Status Zero(void* dst, size_t bytes, Stream stream) = 0;
  virtual Status Reduce(const ReduceArgs& args, Stream stream) = 0;
  virtual Status Layout(const LayoutArgs& args, Stream stream) = 0;
  // Stream-ordered scratch (stage 1's buffers): usable by work ordered after the allocation on
  // `stream`, freed once the work before the FreeAsync on `stream` is done. No host synchronisation.
  virtual Status MallocAsync(size_t bytes, Stream stream, void** ptr) = 0;
  virtual Status FreeAsync(void* ptr, Stream stream) = 0;

  // Injected faults (gpu_faults.h), enqueued like any work; neither blocks the calling thread.
  // Delay: the stream does nothing for `seconds` (a slow link's extra time, so that its completion
  // event shows it). A device-side spin, not cudaLaunchHostFunc: a host callback would hold a
  // CUDA-internal thread and may not call CUDA, and XLA's streams share that thread.
  virtual Status Delay(double seconds, Stream stream) = 0;
  // WaitFlag: the stream waits until the 32-bit word at `flag` (pinned host memory from
  // AllocPinnedHost, written by the host) is non-zero, or `max_seconds` have passed on the device: a
  // fail-safe, so a stream is never held forever even if the host never writes (the hang detector
  // releases it long before).
  virtual Status WaitFlag(const uint32_t* flag, double max_seconds, Stream stream) = 0;

  // Never blocks: whether the work captured by the event's last Record has completed.
  virtual Poll Query(Event event, std::string* error) = 0;
  // Never blocks: whether everything enqueued on the stream so far has completed.
  virtual Poll QueryStream(Stream stream, std::string* error) = 0;
  // Seconds between two completed timing events of one device.
  virtual Status ElapsedSeconds(Event start, Event stop, double* seconds) = 0;

  // Groups across processes (pcie_xproc.h): host memory another process maps too (the group's
  // shared segment) made pinned and device-visible in this process (cudaHostRegister, portable
  // and mapped), and stream memory operations on 32-bit flags in it: WriteValue32 stores `value`
  // once the stream's earlier work is done; WaitValue32 holds the stream until
  // (int32_t)(*flag - value) >= 0 (cuStreamWaitValue32 GEQ, wrap-aware). Defaults: unsupported.
  virtual Status RegisterHost(void* ptr, size_t bytes);
  virtual Status UnregisterHost(void* ptr);  // shutdown only, as DestroyStream
  virtual Status WriteValue32(uint32_t* flag, uint32_t value, Stream stream);
  virtual Status WaitValue32(const uint32_t* flag, uint32_t value, Stream stream);
};

inline Status DeviceApi::RegisterHost(void*, size_t) {
  return Status::FailedPrecondition("this device cannot register shared host memory");
}
inline Status DeviceApi::UnregisterHost(void*) {
  return Status::FailedPrecondition("this device cannot register shared host memory");
}
inline Status DeviceApi::WriteValue32(uint32_t*, uint32_t, Stream) {
  return Status::FailedPrecondition("this device has no stream memory operations");
}
inline Status DeviceApi::WaitValue32(const uint32_t*, uint32_t, Stream) {
  return Status::FailedPrecondition("this device has no stream memory operations");
}

// Restores the calling thread's current device on every way out (XLA's device threads keep their
// own device current; setup switches between devices).
class DeviceGuard {
 public:
  explicit DeviceGuard(DeviceApi& api) : api_(api) { ok_ = api_.GetDevice(&saved_).ok(); }
  ~DeviceGuard() {
    if (ok_) (void)api_.SetDevice(saved_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  DeviceApi& api_;
  int saved_ = 0;
  bool ok_ = false;
};

}  // namespace flexlink::gpu
