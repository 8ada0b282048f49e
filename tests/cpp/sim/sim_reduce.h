// What both simulated NCCLs (sim_comm: one process; sim_xproc_comm: across processes) share: the
// NCCL types and ops as the engine's, and the reduction of rank rows: with the engine's element code,
// so a simulated collective's result is the reference's bit for bit, except floating max/min, which
// is NCCL's own (below) written apart from the engine's, so that the tests' comparison of the nccl
// link with the pcie link (whose kernels run elementwise.h's FMax/FMin) checks something.
#pragma once

#include <cmath>
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

// NCCL's FuncMinMax for floats (src/device/reduce_kernel.h): fmaxf/fminf for float, fmax/fmin for
// double, __hmax/__hmin for half and bfloat16 (sm_80+; before, fmaxf of the float values, rounded
// back, which is the same for every non-NaN pair). A NaN operand is dropped; NaN only if both are:
// the half types' __hmax then returns the canonical NaN 0x7FFF. Here with the C library's fmax/fmin.
// The sign of max(+0, -0) is the C library's, as on a GPU it is the hardware's: in neither is it
// specified, and it is not part of FlexLink's contract. NaNs are dropped before the C library's fmax
// sees them: CUDA's fmaxf drops a signalling NaN like a quiet one (a GPU raises no exceptions), where
// glibc's fmax, IEEE 754-2008's maxNum, returns NaN for a signalling operand.
template <class F>
F NcclMinMax(bool is_max, F a, F b) {
  if (std::isnan(a)) return b;
  if (std::isnan(b)) return a;
  return is_max ? std::fmax(a, b) : std::fmin(a, b);
}

inline uint16_t NcclMinMax16(bool bf16, bool is_max, uint16_t a, uint16_t b) {
  const float x = bf16 ? gpu::Bf16ToF32(a) : gpu::HalfToF32(a);
  const float y = bf16 ? gpu::Bf16ToF32(b) : gpu::HalfToF32(b);
  if (std::isnan(x) && std::isnan(y)) return 0x7FFF;
  const float r = NcclMinMax(is_max, x, y);
  // The operand fmax picked (the conversions to float are exact): its own bits.
  uint32_t rb, xb;
  std::memcpy(&rb, &r, 4);
  std::memcpy(&xb, &x, 4);
  return rb == xb ? a : b;
}

inline bool NcclFloatMinMax(gpu::CommType t, gpu::CommOp op) {
  const bool floating = t == gpu::CommType::kFloat16 || t == gpu::CommType::kBfloat16 ||
                        t == gpu::CommType::kFloat32 || t == gpu::CommType::kFloat64;
  return floating && (op == gpu::CommOp::kMax || op == gpu::CommOp::kMin);
}

// dst[i] = NCCL's max/min over k of srcs[k][i] (rank order; the op makes it no matter but for the
// sign of a zero). Element i of every source is read before dst[i] is written, so dst may alias one.
inline void NcclReduceMinMax(gpu::CommType t, gpu::CommOp op, const std::vector<const void*>& srcs, void* dst,
                             size_t count) {
  const bool is_max = op == gpu::CommOp::kMax;
  auto each = [&]<class E>(auto&& apply) {
    for (size_t i = 0; i < count; ++i) {
      E acc;
      std::memcpy(&acc, static_cast<const E*>(srcs[0]) + i, sizeof acc);
      for (size_t k = 1; k < srcs.size(); ++k) {
        E x;
        std::memcpy(&x, static_cast<const E*>(srcs[k]) + i, sizeof x);
        acc = apply(acc, x);
      }
      std::memcpy(static_cast<E*>(dst) + i, &acc, sizeof acc);
    }
  };
  switch (t) {
    case gpu::CommType::kFloat32: each.template operator()<float>([&](float a, float b) { return NcclMinMax(is_max, a, b); }); return;
    case gpu::CommType::kFloat64: each.template operator()<double>([&](double a, double b) { return NcclMinMax(is_max, a, b); }); return;
    case gpu::CommType::kFloat16:
    case gpu::CommType::kBfloat16: {
      const bool bf16 = t == gpu::CommType::kBfloat16;
      each.template operator()<uint16_t>([&](uint16_t a, uint16_t b) { return NcclMinMax16(bf16, is_max, a, b); });
      return;
    }
    default: return;
  }
}

// dst[i] = reduce over k of srcs[k][i], in rank order. The rows are gathered into one buffer first,
// so that ReduceAt's strided rows apply and dst may alias a source.
inline void ReduceRows(gpu::CommType t, gpu::CommOp op, const std::vector<const void*>& srcs, void* dst,
                       size_t count) {
  if (NcclFloatMinMax(t, op)) return NcclReduceMinMax(t, op, srcs, dst, count);
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
