// Launchers of the GPU engine's two kernels (kernels.cu, compiled by nvcc), for cuda_device.cc.
// The element code they run is kernel_args.h's, the same the simulated device runs in the tests.
#pragma once

#include <cuda_runtime.h>

#include "xla_ffi/cuda/kernel_args.h"

namespace flexlink::gpu {

// Each launcher returns its own launch's status (cudaLaunchKernelEx's), never an earlier call's
// error left as the thread's last error; a failed launch leaves its error there too, for the caller
// to clear (cuda_device.cc's Check). cudaErrorInvalidValue when (dtype, op) has no kernel (the
// engine never asks for one).
cudaError_t LaunchReduce(const ReduceArgs& args, cudaStream_t stream);
cudaError_t LaunchLayout(const LayoutArgs& args, cudaStream_t stream);
// Injected faults (device_api.h Delay, WaitFlag): one-thread kernels that nap on the device's
// nanosecond clock, so nothing on the host blocks and the stream's events show the time.
cudaError_t LaunchDelay(double seconds, cudaStream_t stream);
// `flag`: pinned host memory (cudaHostAlloc); the kernel polls its device mapping.
cudaError_t LaunchWaitFlag(const unsigned int* flag, double max_seconds, cudaStream_t stream);
// Loads every kernel instance on the current device now (cudaFuncGetAttributes loads a function
// under CUDA's lazy loading): loading one at its first launch while a peer's kernel waits on this
// device can deadlock.
cudaError_t PreloadAllKernels();

}  // namespace flexlink::gpu
