// The GPU engine's kernels: a reduction of n rows in rank order and the [outer, n, inner] layout
// copies, one grid-stride loop each over kernel_args.h's per-element code.
#include "xla_ffi/cuda/runtime/kernels.h"

#include <algorithm>
#include <utility>

namespace flexlink::gpu {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU; the grid-stride loop covers the rest.
constexpr size_t kMaxBlocks = 4096;

template <class Op>
__global__ void ReduceKernel(ReduceArgs a) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < a.count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    ReduceAt<Op>(a, i);
}

template <class E>
__global__ void LayoutKernel(LayoutArgs a) {
  const size_t total = a.total();
  for (size_t t = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<size_t>(gridDim.x) * blockDim.x)
    LayoutAt<E>(a, t);
}

// The device's nanosecond clock (%globaltimer), the same on every SM, unlike clock64's cycles whose
// rate follows the SM's clock.
__device__ __forceinline__ unsigned long long GlobalNanos() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread that sleeps in short naps until `nanos` have passed: an injected slow link's extra
// time. __nanosleep yields the SM's issue slots to other warps, so it costs one resident thread.
__global__ void DelayKernel(unsigned long long nanos) {
  const unsigned long long t0 = GlobalNanos();
  while (GlobalNanos() - t0 < nanos) __nanosleep(10000);
}

// A system-scope acquire load (sm_70+): sees the host's latest write to mapped pinned memory, with
// no stale copy in the GPU's caches.
__device__ __forceinline__ unsigned int LoadAcquireSystem(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One thread that polls a host-written word in pinned (mapped) memory until it is non-zero or
// `max_nanos` passed: an injected hang, released by the host's hang detector.
__global__ void WaitFlagKernel(const unsigned int* flag, unsigned long long max_nanos) {
  const unsigned long long t0 = GlobalNanos();
  while (LoadAcquireSystem(flag) == 0 && GlobalNanos() - t0 < max_nanos) __nanosleep(20000);
}

unsigned Blocks(size_t n) { return static_cast<unsigned>(std::max<size_t>(1, std::min(kMaxBlocks, (n + kThreads - 1) / kThreads))); }

// Launches `kernel` on `stream` and returns this launch's own error. Not <<<>>> followed by
// cudaGetLastError(): that returns the last error of any earlier runtime call on this thread (a
// cudaErrorNotReady from an event query, an out-of-memory already reported), which would then be
// reported as this launch's failure. cudaLaunchKernelEx (cuda_runtime.h, type-checked against the
// kernel's parameters) returns the launch's status itself. A failed launch also leaves its error as
// the thread's last error; the caller's Check (cuda_device.cc) clears it.
template <class... Params, class... Args>
cudaError_t Launch(void (*kernel)(Params...), unsigned blocks, unsigned threads, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = nullptr;
  config.numAttrs = 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

const DType kDTypes[] = {DType::kPred, DType::kS8, DType::kS16, DType::kS32, DType::kS64, DType::kU8, DType::kU16,
                         DType::kU32, DType::kU64, DType::kF16, DType::kBF16, DType::kF32, DType::kF64, DType::kC64,
                         DType::kC128};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMax, ReduceOp::kMin};

}  // namespace

cudaError_t LaunchReduce(const ReduceArgs& a, cudaStream_t stream) {
  if (a.count == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DispatchReduce(a.dtype, a.op, [&]<class Op>() {
    err = Launch(ReduceKernel<Op>, Blocks(a.count), kThreads, stream, a);
  });
  return err;
}

cudaError_t LaunchLayout(const LayoutArgs& a, cudaStream_t stream) {
  if (a.total() == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DispatchWidth(a.width, [&]<class E>() {
    err = Launch(LayoutKernel<E>, Blocks(a.total()), kThreads, stream, a);
  });
  return err;
}

cudaError_t LaunchDelay(double seconds, cudaStream_t stream) {
  if (!(seconds > 0)) return cudaSuccess;
  return Launch(DelayKernel, 1, 1, stream, static_cast<unsigned long long>(seconds * 1e9));
}

cudaError_t LaunchWaitFlag(const unsigned int* flag, double max_seconds, cudaStream_t stream) {
  void* device_flag = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&device_flag, const_cast<unsigned int*>(flag), 0);
  if (err != cudaSuccess) return err;
  return Launch(WaitFlagKernel, 1, 1, stream, static_cast<const unsigned int*>(device_flag),
                static_cast<unsigned long long>(std::max(0.0, max_seconds) * 1e9));
}

cudaError_t PreloadAllKernels() {
  cudaError_t err = cudaSuccess;
  cudaFuncAttributes attr;
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, DelayKernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, WaitFlagKernel);
  for (DType t : kDTypes)
    for (ReduceOp op : kOps)
      DispatchReduce(t, op, [&]<class Op>() {
        if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, ReduceKernel<Op>);
      });
  for (size_t width : {1, 2, 4, 8, 16})
    DispatchWidth(width, [&]<class E>() {
      if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, LayoutKernel<E>);
    });
  return err;
}

}  // namespace flexlink::gpu
