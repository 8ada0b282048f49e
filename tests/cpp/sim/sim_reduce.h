// What both simulated NCCLs (sim_comm: one process; sim_xproc_comm: across processes) share: the
// NCCL types and ops as the engine's, and the reduction of rank rows with the engine's element code,
// so a simulated collective's result is the reference's bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "xla_ffi/core/types.h"
#include "xla_ffi/cuda/comm_api.h"
#include "xla_ffi/cuda/elementwise.h"
#include "xla_ffi/cuda/kernel_args.h"

namespace flexlink::sim {

inline DType DTypeOf(gpu::CommType t) {
  switch (t) {
    case gpu::CommType::kInt8: return DType::kS8;
    case gpu::CommType::kUint8: return DType::kU8;
    case gpu::CommType::kInt32: return DType::kS32;
    case gpu::CommType::kUint32: return DType::kU32;
    case gpu::CommType::kInt64: return DType::kS64;
    case gpu::CommType::kUint64: return DType::kU64;
    case gpu::CommType::kFloat16: return DType::kF16;
    case gpu::CommType::kFloat32: return DType::kF32;
    case gpu::CommType::kFloat64: return DType::kF64;
    case gpu::CommType::kBfloat16: return DType::kBF16;
  }
  return DType::kU8;
}

inline ReduceOp OpOf(gpu::CommOp op) {
  switch (op) {
    case gpu::CommOp::kSum: return ReduceOp::kSum;
    case gpu::CommOp::kProd: return ReduceOp::kProd;
    case gpu::CommOp::kMax: return ReduceOp::kMax;
    case gpu::CommOp::kMin: return ReduceOp::kMin;
  }
  return ReduceOp::kSum;
}

inline size_t Width(gpu::CommType t) { return ByteWidth(DTypeOf(t)); }

// dst[i] = reduce over k of srcs[k][i], in rank order. The rows are gathered into one buffer first,
// so that ReduceAt's strided rows apply and dst may alias a source.
inline void ReduceRows(gpu::CommType t, gpu::CommOp op, const std::vector<const void*>& srcs, void* dst,
                       size_t count) {
  const DType dtype = DTypeOf(t);
  const size_t w = ByteWidth(dtype);
  std::vector<uint8_t> rows(srcs.size() * count * w);
  for (size_t k = 0; k < srcs.size(); ++k) std::memcpy(rows.data() + k * count * w, srcs[k], count * w);
  gpu::ReduceArgs a;
  a.dtype = dtype;
  a.op = OpOf(op);
  a.dst = dst;
  a.rows = rows.data();
  a.row_stride = count;
  a.nrows = static_cast<int>(srcs.size());
  a.count = count;
  gpu::DispatchReduce(dtype, a.op, [&]<class R>() {
    for (size_t i = 0; i < count; ++i) gpu::ReduceAt<R>(a, i);
  });
}

}  // namespace flexlink::sim
