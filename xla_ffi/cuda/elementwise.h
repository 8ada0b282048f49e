// The arithmetic of the GPU kernels, written once for both sides: nvcc compiles it into the CUDA
// kernels (kernels.cu) and the host compiler into the simulated device of the tests
// (tests/cpp/sim), so the sum, rounding and index math that runs on a GPU is the code the CPU tests
// check bitwise against the CPU engine and the independent reference.
//
// Semantics are the CPU engine's (core/reduce.h) except floating max/min: rank order 0..n-1,
// float16/bfloat16 accumulated in float32 and rounded once (nearest-even, the bit-exact conversions
// of core/half.h), integers wrap, bool max = or and min = and, complex sum and textbook product.
//
// Floating max/min (float16, bfloat16, float32, float64) follow NCCL, not the CPU engine: the GPU
// engine's nccl link runs ncclMax/ncclMin (NCCL's fmaxf/fmax/__hmax: a NaN operand is dropped), which
// is what XLA:GPU's own all-reduce does, so lax.pmax on a GPU drops NaN; the pcie link's kernels must
// give the same, or one call's result would depend on its split. So FMax/FMin are IEEE 754
// maxNum/minNum, made total so that host and device give the same bits in any order:
//   - a NaN operand yields the other operand: the result is NaN only if every contribution is NaN;
//   - two NaN operands yield the positive quiet NaN with every mantissa bit set (float32 0x7FFFFFFF,
//     PTX's canonical NaN; float64 0x7FFFFFFFFFFFFFFF), which the conversions store as float16 0x7E00
//     and bfloat16 0x7FFF; NaN payloads and signs of the inputs never reach the result;
//   - +0 and -0: max gives +0, min gives -0 (IEEE 754-2019 maximumNumber/minimumNumber's order).
//     NCCL's fmaxf(+0, -0) may give either sign (CUDA leaves it unspecified), so the sign of a zero
//     max/min may differ from native lax; it is not part of FlexLink's contract.
// The rule is commutative and associative, so neither the rank order nor the split matters.
// float16/bfloat16 decide on their exact float32 values, so for non-NaN inputs the result is the
// input __hmax/__hmin would pick. A group's single contribution is returned as it is.
//
// No fused multiply-add: nvcc contracts a*b+c into an FMA by default (--fmad=true), which the host
// (x86-64 without -march) never does, so every floating operation here goes through Mul/Add/Sub,
// which on the device are __fmul_rn/__fadd_rn/__fsub_rn (__dmul_rn/... for double): the CUDA
// documentation guarantees these are never merged into an FMA, whatever --fmad says. (The CUDA build
// also passes --fmad=false: cmake/flexlink_cuda.cmake, xla_ffi/BUILD.bazel.) On the host, fusing is
// the host flags' business (here and in the CPU engine): the builds target plain x86-64 (no -march),
// which has no FMA to fuse into; gcc fuses by default (-ffp-contract=fast) on aarch64 or with
// -march=x86-64-v3, and gcc 12's vectorised complex product fuses (vfmaddsub) even with
// -ffp-contract=off.
// Do not build with --use_fast_math (or -ftz=true): the float16 rounding relies on IEEE float
// arithmetic with subnormals, and max/min on NaN comparisons.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "xla_ffi/core/types.h"

#if defined(__CUDACC__)
#define FLEXLINK_HD __host__ __device__ __forceinline__
#else
#define FLEXLINK_HD inline
#endif

namespace flexlink::gpu {

FLEXLINK_HD float BitsToF32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

FLEXLINK_HD uint32_t F32ToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

FLEXLINK_HD double BitsToF64(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
#endif
}

FLEXLINK_HD uint64_t F64ToBits(double d) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
#endif
}

// Floating operations that are never contracted into an FMA on the device (the _rn intrinsics: CUDA
// merges no multiply and add written with them, whatever --fmad says), rounded to nearest-even, as
// the host computes them.
FLEXLINK_HD float Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FLEXLINK_HD float Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FLEXLINK_HD float Sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
FLEXLINK_HD double Mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
FLEXLINK_HD double Add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
FLEXLINK_HD double Sub(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}

FLEXLINK_HD bool SignBit(float f) { return (F32ToBits(f) >> 31) != 0; }
FLEXLINK_HD bool SignBit(double d) { return (F64ToBits(d) >> 63) != 0; }
// The NaN of max/min when both operands are NaN (see the top of this file).
FLEXLINK_HD float CanonicalNaN(float) { return BitsToF32(0x7FFFFFFFu); }
FLEXLINK_HD double CanonicalNaN(double) { return BitsToF64(0x7FFFFFFFFFFFFFFFull); }

// core/half.h's conversions (Maratyszcza's FP16 algorithm), with bit casts that work on the device.
FLEXLINK_HD float HalfToF32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = Mul(BitsToF32((two_w >> 4) + (0xE0u << 23)), 0x1.0p-112f);
  const float denormalized = Sub(BitsToF32((two_w >> 17) | (126u << 23)), 0.5f);
  const uint32_t bits = two_w < (1u << 27) ? F32ToBits(denormalized) : F32ToBits(normalized);
  return BitsToF32(sign | bits);
}

FLEXLINK_HD uint16_t F32ToHalf(float f) {
  const uint32_t w = F32ToBits(f);
  float base = Mul(Mul(BitsToF32(w & 0x7FFFFFFFu), 0x1.0p+112f), 0x1.0p-110f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = Add(BitsToF32((bias >> 1) + 0x07800000u), base);
  const uint32_t bits = F32ToBits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

FLEXLINK_HD float Bf16ToF32(uint16_t b) { return BitsToF32(static_cast<uint32_t>(b) << 16); }

FLEXLINK_HD uint16_t F32ToBf16(float f) {
  const uint32_t u = F32ToBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

template <class F>
struct Cx {
  F re, im;
};

// Each op: the stored type T, the accumulator Acc, Load/Store between them, Apply.
template <class T>
using WrapAcc = std::conditional_t<(sizeof(T) < 4), uint32_t, std::make_unsigned_t<T>>;

template <class T_>
struct IntSum {
  using T = T_;
  using Acc = WrapAcc<T>;
  static FLEXLINK_HD Acc Load(T x) { return static_cast<Acc>(x); }
  static FLEXLINK_HD T Store(Acc a) { return static_cast<T>(a); }
  static FLEXLINK_HD Acc Apply(Acc a, Acc b) { return a + b; }
};
template <class T_>
struct IntProd : IntSum<T_> {
  using Acc = typename IntSum<T_>::Acc;
  static FLEXLINK_HD Acc Apply(Acc a, Acc b) { return static_cast<Acc>(a * b); }
};
template <class T_>
struct IntMax {
  using T = T_;
  using Acc = T;
  static FLEXLINK_HD Acc Load(T x) { return x; }
  static FLEXLINK_HD T Store(Acc a) { return a; }
  static FLEXLINK_HD Acc Apply(Acc a, Acc b) { return a > b ? a : b; }
};
template <class T_>
struct IntMin : IntMax<T_> {
  static FLEXLINK_HD T_ Apply(T_ a, T_ b) { return a < b ? a : b; }
};
struct PredOr {
  using T = uint8_t;
  using Acc = uint8_t;
  static FLEXLINK_HD Acc Load(T x) { return x; }
  static FLEXLINK_HD T Store(Acc a) { return a; }
  static FLEXLINK_HD Acc Apply(Acc a, Acc b) { return a | b; }
};
struct PredAnd : PredOr {
  static FLEXLINK_HD uint8_t Apply(uint8_t a, uint8_t b) { return a & b; }
};

// Floating point: Conv maps the stored type to the accumulator.
template <class F>
struct Same {
  using T = F;
  using Acc = F;
  static FLEXLINK_HD Acc Load(T x) { return x; }
  static FLEXLINK_HD T Store(Acc a) { return a; }
};
struct Half {
  using T = uint16_t;
  using Acc = float;
  static FLEXLINK_HD Acc Load(T x) { return HalfToF32(x); }
  static FLEXLINK_HD T Store(Acc a) { return F32ToHalf(a); }
};
struct BFloat16 {
  using T = uint16_t;
  using Acc = float;
  static FLEXLINK_HD Acc Load(T x) { return Bf16ToF32(x); }
  static FLEXLINK_HD T Store(Acc a) { return F32ToBf16(a); }
};
template <class Conv>
struct FSum : Conv {
  using Acc = typename Conv::Acc;
  static FLEXLINK_HD Acc Apply(Acc a, Acc b) { return Add(a, b); }
};
template <class Conv>
struct FProd : Conv {
  using Acc = typename Conv::Acc;
  static FLEXLINK_HD Acc Apply(Acc a, Acc b) { return Mul(a, b); }
};
// NCCL's max (maxNum): a NaN operand is dropped; two NaNs give CanonicalNaN; max(+0, -0) = +0.
template <class Conv>
struct FMax : Conv {
  using Acc = typename Conv::Acc;
  static FLEXLINK_HD Acc Apply(Acc a, Acc b) {
    if (a != a) return b != b ? CanonicalNaN(a) : b;
    if (b != b) return a;
    if (a != b) return a > b ? a : b;
    return SignBit(a) ? b : a;  // equal: the same bits, or +0 and -0
  }
};
// NCCL's min (minNum): a NaN operand is dropped; two NaNs give CanonicalNaN; min(+0, -0) = -0.
template <class Conv>
struct FMin : Conv {
  using Acc = typename Conv::Acc;
  static FLEXLINK_HD Acc Apply(Acc a, Acc b) {
    if (a != a) return b != b ? CanonicalNaN(a) : b;
    if (b != b) return a;
    if (a != b) return a < b ? a : b;
    return SignBit(a) ? a : b;
  }
};
template <class F>
struct CSum : Same<Cx<F>> {
  static FLEXLINK_HD Cx<F> Apply(Cx<F> a, Cx<F> b) { return {Add(a.re, b.re), Add(a.im, b.im)}; }
};
template <class F>
struct CProd : Same<Cx<F>> {  // textbook product, as XLA's emitters compute it, each product rounded
  static FLEXLINK_HD Cx<F> Apply(Cx<F> a, Cx<F> b) {
    return {Sub(Mul(a.re, b.re), Mul(a.im, b.im)), Add(Mul(a.re, b.im), Mul(a.im, b.re))};
  }
};

template <template <class> class Sum, template <class> class Prod, template <class> class Max,
          template <class> class Min, class Arg, class F>
bool DispatchOp(ReduceOp op, F&& f) {
  switch (op) {
    case ReduceOp::kSum: f.template operator()<Sum<Arg>>(); return true;
    case ReduceOp::kProd: f.template operator()<Prod<Arg>>(); return true;
    case ReduceOp::kMax: f.template operator()<Max<Arg>>(); return true;
    case ReduceOp::kMin: f.template operator()<Min<Arg>>(); return true;
  }
  return false;
}

// Calls f.template operator()<Op>() with the op struct of (dtype, op); false where the pair is not
// a reduction (complex max/min, which DescribeCall rejects before any link runs).
template <class F>
bool DispatchReduce(DType t, ReduceOp op, F&& f) {
  switch (t) {
    case DType::kPred:
      if (op == ReduceOp::kSum || op == ReduceOp::kMax) f.template operator()<PredOr>();
      else f.template operator()<PredAnd>();
      return true;
    case DType::kS8: return DispatchOp<IntSum, IntProd, IntMax, IntMin, int8_t>(op, f);
    case DType::kS16: return DispatchOp<IntSum, IntProd, IntMax, IntMin, int16_t>(op, f);
    case DType::kS32: return DispatchOp<IntSum, IntProd, IntMax, IntMin, int32_t>(op, f);
    case DType::kS64: return DispatchOp<IntSum, IntProd, IntMax, IntMin, int64_t>(op, f);
    case DType::kU8: return DispatchOp<IntSum, IntProd, IntMax, IntMin, uint8_t>(op, f);
    case DType::kU16: return DispatchOp<IntSum, IntProd, IntMax, IntMin, uint16_t>(op, f);
    case DType::kU32: return DispatchOp<IntSum, IntProd, IntMax, IntMin, uint32_t>(op, f);
    case DType::kU64: return DispatchOp<IntSum, IntProd, IntMax, IntMin, uint64_t>(op, f);
    case DType::kF16: return DispatchOp<FSum, FProd, FMax, FMin, Half>(op, f);
    case DType::kBF16: return DispatchOp<FSum, FProd, FMax, FMin, BFloat16>(op, f);
    case DType::kF32: return DispatchOp<FSum, FProd, FMax, FMin, Same<float>>(op, f);
    case DType::kF64: return DispatchOp<FSum, FProd, FMax, FMin, Same<double>>(op, f);
    case DType::kC64:
    case DType::kC128: {
      const bool wide = t == DType::kC128;
      if (op == ReduceOp::kSum) {
        if (wide) f.template operator()<CSum<double>>();
        else f.template operator()<CSum<float>>();
        return true;
      }
      if (op == ReduceOp::kProd) {
        if (wide) f.template operator()<CProd<double>>();
        else f.template operator()<CProd<float>>();
        return true;
      }
      return false;
    }
  }
  return false;
}

struct alignas(16) Bytes16 {
  uint64_t lo, hi;
};

// Calls f.template operator()<E>() with an element type of `width` bytes (layout copies move bytes).
template <class F>
bool DispatchWidth(size_t width, F&& f) {
  switch (width) {
    case 1: f.template operator()<uint8_t>(); return true;
    case 2: f.template operator()<uint16_t>(); return true;
    case 4: f.template operator()<uint32_t>(); return true;
    case 8: f.template operator()<uint64_t>(); return true;
    case 16: f.template operator()<Bytes16>(); return true;
  }
  return false;
}

}  // namespace flexlink::gpu
