// What the GPU programs (cuda_ranks_test, cuda_pcie_bench) share: the process's CUDA device and NCCL
// behind the engine's interfaces, and the test harness of gpu_cases.h over real device memory. The
// harness's own copies and synchronisations are the test's, outside the engine's call path.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/cpp/gpu_cases.h"
#include "xla_ffi/cuda/runtime/process.h"

namespace flexlink::testing {

// NCCL for the programs: FLEXLINK_NCCL_LIBRARY, else the wheel the build found (CMake passes it).
inline void UseNcclLibrary() {
  const char* env = std::getenv("FLEXLINK_NCCL_LIBRARY");
#ifdef FLEXLINK_NCCL_LIBRARY_DEFAULT
  const char* fallback = FLEXLINK_NCCL_LIBRARY_DEFAULT;
#else
  const char* fallback = "";
#endif
  gpu::ProcessNccl().SetLibrary(env && *env ? env : fallback);
}

inline void CudaOrDie(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::printf("FAIL: %s: %s\n", what, cudaGetErrorString(err));
  std::exit(1);
}

// `ranks` ranks, rank r on device device_of(r).
inline Harness CudaHarness(int ranks, std::function<int(int64_t)> device_of) {
  Harness h;
  h.api = &gpu::ProcessDevice();
  h.ranks = ranks;
  h.device_of = std::move(device_of);
  h.alloc = [](int dev, size_t bytes) {
    void* p = nullptr;
    CudaOrDie(cudaSetDevice(dev), "cudaSetDevice");
    CudaOrDie(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc (test buffers)");
    return p;
  };
  h.upload = [](void* d, const void* s, size_t b) { CudaOrDie(cudaMemcpy(d, s, b, cudaMemcpyDefault), "upload"); };
  h.download = [](void* d, const void* s, size_t b) { CudaOrDie(cudaMemcpy(d, s, b, cudaMemcpyDefault), "download"); };
  h.sync = [](gpu::Stream s) { CudaOrDie(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), "cudaStreamSynchronize"); };
  h.free = [](void* p) { CudaOrDie(cudaFree(p), "cudaFree (test buffers)"); };  // after the streams ran
  MakeStreams(h);
  return h;
}

}  // namespace flexlink::testing
