#include "xla_ffi/cuda/runtime/cuda_device.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>

#include <string>

#include "xla_ffi/cuda/runtime/kernels.h"

namespace flexlink::gpu {
namespace {

cudaStream_t S(Stream s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t E(Event e) { return static_cast<cudaEvent_t>(e); }

Status Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

}  // namespace

int CudaDevice::DeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    (void)cudaGetLastError();  // not sticky: leave no error behind for XLA's next check
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

Status CudaDevice::PreloadKernels(int device) {
  FLEXLINK_RETURN_IF_ERROR(SetDevice(device));
  return Check(PreloadAllKernels(), "loading the engine's kernels");
}

Status CudaDevice::Record(Event event, Stream stream) { return Check(cudaEventRecord(E(event), S(stream)), "cudaEventRecord"); }

Status CudaDevice::Wait(Stream stream, Event event) {
  return Check(cudaStreamWaitEvent(S(stream), E(event), 0), "cudaStreamWaitEvent");
}

Status CudaDevice::Copy(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return Status::Ok();
  return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, S(stream)), "cudaMemcpyAsync");
}

Status CudaDevice::Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                          Stream stream) {
  if (width == 0 || height == 0) return Status::Ok();
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

Status CudaDevice::MallocAsync(size_t bytes, Stream stream, void** ptr) {
  return Check(cudaMallocAsync(ptr, bytes, S(stream)), "cudaMallocAsync");
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
  if (error) *error = std::string("cudaEventQuery: ") + cudaGetErrorString(err);
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
