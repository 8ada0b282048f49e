#include "xla_ffi/cuda/runtime/cuda_device.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <mutex>
#include <string>

#include "xla_ffi/cuda/runtime/kernels.h"

namespace flexlink::gpu {
namespace {

cudaStream_t S(Stream s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t E(Event e) { return static_cast<cudaEvent_t>(e); }

// Every failed runtime call turned into a Status here also clears the thread's last error: the
// runtime keeps the last failure of any call (per host thread, per instance of the runtime: this
// module links its own, statically) until cudaGetLastError reads it, so a non-sticky error
// (cudaErrorNotReady, an out-of-memory, an invalid value) reported once here would otherwise come
// back from the next cudaGetLastError on this thread as someone else's failure. A sticky error (the
// context is lost) is not cleared by this and keeps failing every later call, as it must.
void ClearLastError() { (void)cudaGetLastError(); }

Status Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  ClearLastError();
  return Status::Internal(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

std::string Describe(cudaError_t err) { return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")"; }

// The device whose work `stream` holds: its own device (cudaStreamGetDevice), else the current one,
// which device_api.h's contract makes the same.
int DeviceOf(cudaStream_t stream) {
  int device = -1;
  if (cudaStreamGetDevice(stream, &device) == cudaSuccess && device >= 0) return device;
  ClearLastError();
  if (cudaGetDevice(&device) != cudaSuccess) {
    ClearLastError();
    return -1;
  }
  return device;
}

}  // namespace

int CudaDevice::DeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    ClearLastError();  // not sticky: leave no error behind for this thread's next check
    return 0;
  }
  return count;
}

Status CudaDevice::GetDevice(int* device) { return Check(cudaGetDevice(device), "cudaGetDevice"); }
Status CudaDevice::SetDevice(int device) { return Check(cudaSetDevice(device), "cudaSetDevice"); }

Status CudaDevice::CreateStream(int device, Stream* stream) {
  FLEXLINK_RETURN_IF_ERROR(SetDevice(device));
  cudaStream_t s = nullptr;
  FLEXLINK_RETURN_IF_ERROR(Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
  *stream = s;
  return Status::Ok();
}

Status CudaDevice::CreateEvent(int device, bool timing, Event* event) {
  FLEXLINK_RETURN_IF_ERROR(SetDevice(device));
  cudaEvent_t e = nullptr;
  FLEXLINK_RETURN_IF_ERROR(
      Check(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreateWithFlags"));
  *event = e;
  return Status::Ok();
}

Status CudaDevice::AllocDevice(int device, size_t bytes, void** ptr) {
  FLEXLINK_RETURN_IF_ERROR(SetDevice(device));
  return Check(cudaMalloc(ptr, bytes), "cudaMalloc");
}

Status CudaDevice::AllocPinnedHost(size_t bytes, void** ptr) {
  // Portable: every device's copy engines may read and write it as pinned memory. Mapped: kernels
  // may read it too (WaitFlag's host flags; implied under unified addressing, said anyway).
  return Check(cudaHostAlloc(ptr, bytes, cudaHostAllocPortable | cudaHostAllocMapped), "cudaHostAlloc");
}

// Shutdown only (device_ledger.h), after the group drained. None of these needs its device
// current: streams and events know theirs, and memory is freed by address (unified addressing).
Status CudaDevice::DestroyStream(Stream stream) {
  return Check(cudaStreamDestroy(static_cast<cudaStream_t>(stream)), "cudaStreamDestroy");
}

Status CudaDevice::DestroyEvent(Event event) { return Check(cudaEventDestroy(E(event)), "cudaEventDestroy"); }

Status CudaDevice::FreeDevice(void* ptr) { return Check(cudaFree(ptr), "cudaFree"); }

Status CudaDevice::FreePinnedHost(void* ptr) { return Check(cudaFreeHost(ptr), "cudaFreeHost"); }

Status CudaDevice::PreloadKernels(int device) {
  FLEXLINK_RETURN_IF_ERROR(SetDevice(device));
  FLEXLINK_RETURN_IF_ERROR(Check(PreloadAllKernels(), "loading the engine's kernels"));
  // Every group's setup preloads each of its devices: the place to prepare what later calls of
  // the device need (its scratch pool and peers' access to it, its copies' pitch limit), so that
  // none of it is made on a call's path.
  NoteDevice(device);
  return Status::Ok();
}

Status CudaDevice::Record(Event event, Stream stream) { return Check(cudaEventRecord(E(event), S(stream)), "cudaEventRecord"); }

Status CudaDevice::Wait(Stream stream, Event event) {
  return Check(cudaStreamWaitEvent(S(stream), E(event), 0), "cudaStreamWaitEvent");
}

Status CudaDevice::Copy(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return Status::Ok();
  return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, S(stream)), "cudaMemcpyAsync");
}

size_t CudaDevice::MaxPitch() {
  size_t v = max_pitch_.load(std::memory_order_relaxed);
  if (v) return v;
  int device = 0, pitch = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, device) != cudaSuccess ||
      pitch <= 0) {
    ClearLastError();
    pitch = INT_MAX;  // what every current GPU reports (2^31 - 1)
  }
  v = static_cast<size_t>(pitch);
  size_t expected = 0;
  if (!max_pitch_.compare_exchange_strong(expected, v, std::memory_order_relaxed)) return expected;
  return v;
}

Status CudaDevice::Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                          Stream stream) {
  if (width == 0 || height == 0) return Status::Ok();
  // cudaMemcpy2DAsync refuses a pitch past cudaDevAttrMaxPitch (cudaErrorInvalidPitchValue; 2^31 - 1
  // on current GPUs), and the pcie link's rows are whole per-rank blocks: all_gather, reduce_scatter
  // and all_to_all with blocks of 2 GiB or more. Their rows are few (at most the group's size), so
  // one plain copy per row costs nothing that matters.
  const size_t max_pitch = MaxPitch();
  if (dpitch > max_pitch || spitch > max_pitch || width > max_pitch) {
    for (size_t row = 0; row < height; ++row)
      FLEXLINK_RETURN_IF_ERROR(Check(cudaMemcpyAsync(static_cast<char*>(dst) + row * dpitch,
                                                     static_cast<const char*>(src) + row * spitch, width,
                                                     cudaMemcpyDefault, S(stream)),
                                     "cudaMemcpyAsync (a row of a copy past the device's maximum pitch)"));
    return Status::Ok();
  }
  return Check(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault, S(stream)),
               "cudaMemcpy2DAsync");
}

Status CudaDevice::Zero(void* dst, size_t bytes, Stream stream) {
  if (bytes == 0) return Status::Ok();
  return Check(cudaMemsetAsync(dst, 0, bytes, S(stream)), "cudaMemsetAsync");
}

Status CudaDevice::Reduce(const ReduceArgs& args, Stream stream) {
  return Check(LaunchReduce(args, S(stream)), "the reduction kernel");
}

Status CudaDevice::Layout(const LayoutArgs& args, Stream stream) {
  return Check(LaunchLayout(args, S(stream)), "the layout kernel");
}

// Stage 1's scratch (gpu_profile.cc) becomes the buffers of NCCL operations, and with every rank of
// a group in this process NCCL's P2P transport reads and writes a peer GPU's buffers directly. Memory
// of a memory pool is reachable from another device only once cudaMemPoolSetAccess grants it:
// cudaDeviceEnablePeerAccess (which NCCL calls) covers cudaMalloc's memory, not a pool's. Taken from
// the device's default pool (plain cudaMallocAsync), a peer's kernel would fault on it (an illegal
// address: sticky, the context is lost). So the scratch comes from a pool of FlexLink's own per
// device (cudaMemPoolCreate), made at the group's setup, with read-write access granted to the
// other devices the engine set up that can reach it (cudaDeviceCanAccessPeer). Not chosen:
//   - granting peers access to the default pool: XLA may allocate from it (jax's platform and
//     cuda_async allocators), so its access flags are XLA's, and changing them is a process-wide
//     side effect on every allocation of that pool;
//   - cudaMalloc/cudaFree: they may synchronise the device, which the call path never does
//     (openxla/xla#6825), and the scratch's size is only known at the first profile, on that path;
//   - access for every device the process can see: GPUs the engine never uses need none, and mapping
//     memory for them may initialise their contexts (several processes sharing a host each see all
//     of them).
// Only stage 1 allocates here; cudaFreeAsync returns the memory to this pool.
void CudaDevice::GrantLocked(int owner, Scratch& scratch) {
  if (!scratch.pool) return;  // its creation failed: `error` says why
  scratch.error.clear();      // this pass's verdict; a peer refused earlier is tried again
  for (const auto& entry : scratch_) {
    const int peer = entry.first;
    if (peer == owner || std::find(scratch.granted.begin(), scratch.granted.end(), peer) != scratch.granted.end())
      continue;
    int can = 0;
    const cudaError_t q = cudaDeviceCanAccessPeer(&can, peer, owner);  // can `peer` reach `owner`'s memory
    if (q != cudaSuccess) {
      ClearLastError();
      scratch.error = "cudaDeviceCanAccessPeer(" + std::to_string(peer) + ", " + std::to_string(owner) + "): " + Describe(q);
      continue;
    }
    if (!can) continue;  // no P2P between them: NCCL does not use the peer's buffers directly either
    cudaMemAccessDesc desc = {};
    desc.location.type = cudaMemLocationTypeDevice;
    desc.location.id = peer;
    desc.flags = cudaMemAccessFlagsProtReadWrite;
    const cudaError_t e = cudaMemPoolSetAccess(static_cast<cudaMemPool_t>(scratch.pool), &desc, 1);
    if (e != cudaSuccess) {
      ClearLastError();
      scratch.error = "cudaMemPoolSetAccess (device " + std::to_string(peer) + " on device " + std::to_string(owner) +
                      "'s scratch pool): " + Describe(e);
      continue;
    }
    scratch.granted.push_back(peer);
  }
}

void CudaDevice::NoteDevice(int device) {
  if (device < 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  int pitch = 0;
  if (cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, device) == cudaSuccess && pitch > 0) {
    size_t seen = max_pitch_.load(std::memory_order_relaxed);
    while ((seen == 0 || static_cast<size_t>(pitch) < seen) &&
           !max_pitch_.compare_exchange_weak(seen, static_cast<size_t>(pitch), std::memory_order_relaxed)) {
    }
  } else {
    ClearLastError();
  }
  if (scratch_.find(device) == scratch_.end()) {
    Scratch& mine = scratch_[device];
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;  // no IPC: the pool is this process's
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    const cudaError_t e = cudaMemPoolCreate(&pool, &props);
    if (e == cudaSuccess) {
      mine.pool = pool;
    } else {
      ClearLastError();
      mine.error = "cudaMemPoolCreate on device " + std::to_string(device) + ": " + Describe(e);
    }
  }
  // The new device reaches the earlier devices' pools, and they reach its pool.
  for (auto& [owner, scratch] : scratch_) GrantLocked(owner, scratch);
}

// cudaMemPoolDestroy returns at once even with allocations outstanding and frees the pool once
// they are: nothing here waits. A device set up again later (an engine after the shutdown: the
// tests') gets a new pool, as at first.
Status CudaDevice::ReleaseShared() {
  std::lock_guard<std::mutex> lock(mu_);
  Status first;
  for (auto& [device, scratch] : scratch_)
    if (scratch.pool) {
      Status s = Check(cudaMemPoolDestroy(static_cast<cudaMemPool_t>(scratch.pool)), "cudaMemPoolDestroy");
      if (!s.ok() && first.ok()) first = Status::Internal("device " + std::to_string(device) + ": " + s.message());
    }
  scratch_.clear();
  return first;
}

Status CudaDevice::MallocAsync(size_t bytes, Stream stream, void** ptr) {
  const int device = DeviceOf(S(stream));
  if (device < 0) return Status::Internal("stage 1's scratch: the stream's device is unknown");
  void* pool = nullptr;
  for (int attempt = 0; attempt < 2 && !pool; ++attempt) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = scratch_.find(device);
      if (it != scratch_.end()) {
        if (!it->second.pool || !it->second.error.empty())
          return Status::Internal("stage 1's scratch pool: " + it->second.error);
        pool = it->second.pool;
        break;
      }
    }
    // A device no setup went through (the engine always sets up first): its pool is made now, once.
    NoteDevice(device);
  }
  if (!pool) return Status::Internal("stage 1's scratch pool: none for device " + std::to_string(device));
  return Check(cudaMallocFromPoolAsync(ptr, bytes, static_cast<cudaMemPool_t>(pool), S(stream)),
               "cudaMallocFromPoolAsync (stage 1's scratch)");
}

Status CudaDevice::FreeAsync(void* ptr, Stream stream) { return Check(cudaFreeAsync(ptr, S(stream)), "cudaFreeAsync"); }

Status CudaDevice::Delay(double seconds, Stream stream) {
  return Check(LaunchDelay(seconds, S(stream)), "the delay kernel (injected slow link)");
}

Status CudaDevice::WaitFlag(const uint32_t* flag, double max_seconds, Stream stream) {
  return Check(LaunchWaitFlag(flag, max_seconds, S(stream)), "the flag-wait kernel (injected hang)");
}

Poll CudaDevice::Query(Event event, std::string* error) {
  const cudaError_t err = cudaEventQuery(E(event));
  if (err == cudaSuccess) return Poll::kDone;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // cudaErrorNotReady is not an error; clear it
    return Poll::kPending;
  }
  ClearLastError();  // reported here, not left for the thread's next cudaGetLastError
  if (error) *error = std::string("cudaEventQuery: ") + cudaGetErrorString(err);
  return Poll::kError;
}

Poll CudaDevice::QueryStream(Stream stream, std::string* error) {
  const cudaError_t err = cudaStreamQuery(static_cast<cudaStream_t>(stream));
  if (err == cudaSuccess) return Poll::kDone;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return Poll::kPending;
  }
  ClearLastError();
  if (error) *error = std::string("cudaStreamQuery: ") + cudaGetErrorString(err);
  return Poll::kError;
}

Status CudaDevice::ElapsedSeconds(Event start, Event stop, double* seconds) {
  float ms = 0;
  FLEXLINK_RETURN_IF_ERROR(Check(cudaEventElapsedTime(&ms, E(start), E(stop)), "cudaEventElapsedTime"));
  *seconds = ms * 1e-3;
  return Status::Ok();
}

// Groups across processes (pcie_xproc.h). The stream memory operations are driver API entry
// points, resolved through the runtime (the module links no libcuda: it loads the driver at its
// first call, so it still imports without one).
namespace {

using WaitValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

template <class F>
Status DriverEntry(const char* name, F* out) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (*out) return Status::Ok();
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
  if (e != cudaSuccess) ClearLastError();
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || !fn)
    return Status::FailedPrecondition(std::string("the CUDA driver has no ") + name +
                                      " (stream memory operations, needed by the pcie link across processes)");
  *out = reinterpret_cast<F>(fn);
  return Status::Ok();
}

WaitValue32Fn g_wait = nullptr;
WriteValue32Fn g_write = nullptr;

Status DevicePointer(const void* host, CUdeviceptr* out) {
  void* d = nullptr;
  FLEXLINK_RETURN_IF_ERROR(Check(cudaHostGetDevicePointer(&d, const_cast<void*>(host), 0), "cudaHostGetDevicePointer"));
  *out = reinterpret_cast<CUdeviceptr>(d);
  return Status::Ok();
}

}  // namespace

Status CudaDevice::RegisterHost(void* ptr, size_t bytes) {
  // Portable: every local GPU's copy engines use it as pinned memory; mapped: the flags in it have
  // a device address for the stream memory operations.
  return Check(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped), "cudaHostRegister");
}

Status CudaDevice::UnregisterHost(void* ptr) { return Check(cudaHostUnregister(ptr), "cudaHostUnregister"); }

Status CudaDevice::WriteValue32(uint32_t* flag, uint32_t value, Stream stream) {
  FLEXLINK_RETURN_IF_ERROR(DriverEntry("cuStreamWriteValue32", &g_write));
  CUdeviceptr d = 0;
  FLEXLINK_RETURN_IF_ERROR(DevicePointer(flag, &d));
  const CUresult r = g_write(static_cast<CUstream>(stream), d, value, CU_STREAM_WRITE_VALUE_DEFAULT);
  return r == CUDA_SUCCESS ? Status::Ok() : Status::Internal("cuStreamWriteValue32 failed (" + std::to_string(r) + ")");
}

Status CudaDevice::WaitValue32(const uint32_t* flag, uint32_t value, Stream stream) {
  FLEXLINK_RETURN_IF_ERROR(DriverEntry("cuStreamWaitValue32", &g_wait));
  CUdeviceptr d = 0;
  FLEXLINK_RETURN_IF_ERROR(DevicePointer(flag, &d));
  const CUresult r = g_wait(static_cast<CUstream>(stream), d, value, CU_STREAM_WAIT_VALUE_GEQ);
  return r == CUDA_SUCCESS ? Status::Ok() : Status::Internal("cuStreamWaitValue32 failed (" + std::to_string(r) + ")");
}

}  // namespace flexlink::gpu
