// The GPU engine's kernels: a reduction of n rows in rank order and the [outer, n, inner] layout
// copies, one grid-stride loop each over kernel_args.h's per-element code.
#include "xla_ffi/cuda/runtime/kernels.h"

#include <algorithm>

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

unsigned Blocks(size_t n) { return static_cast<unsigned>(std::max<size_t>(1, std::min(kMaxBlocks, (n + kThreads - 1) / kThreads))); }

const DType kDTypes[] = {DType::kPred, DType::kS8, DType::kS16, DType::kS32, DType::kS64, DType::kU8, DType::kU16,
                         DType::kU32, DType::kU64, DType::kF16, DType::kBF16, DType::kF32, DType::kF64, DType::kC64,
                         DType::kC128};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMax, ReduceOp::kMin};

}  // namespace

cudaError_t LaunchReduce(const ReduceArgs& a, cudaStream_t stream) {
  if (a.count == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DispatchReduce(a.dtype, a.op, [&]<class Op>() {
    ReduceKernel<Op><<<Blocks(a.count), kThreads, 0, stream>>>(a);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t LaunchLayout(const LayoutArgs& a, cudaStream_t stream) {
  if (a.total() == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  DispatchWidth(a.width, [&]<class E>() {
    LayoutKernel<E><<<Blocks(a.total()), kThreads, 0, stream>>>(a);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t PreloadAllKernels() {
  cudaError_t err = cudaSuccess;
  cudaFuncAttributes attr;
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
