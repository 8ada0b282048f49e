#include "xla_ffi/core/reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "xla_ffi/core/half.h"

namespace flexlink {
namespace {

// Accumulator block: small enough to stay in L1 together with the streamed sources, large enough that
// loop overhead is negligible. Changing it never changes results (each element is reduced alone).
constexpr size_t kBlockBytes = 16 * 1024;

template <class F>
struct Complex {
  F re, im;
};

// Each Op names its accumulator type and how a stored value enters and leaves it.
// Integers: sum/prod in an unsigned type at least 32 bits wide, so overflow wraps (defined behaviour)
// and uint16*uint16 cannot promote to a signed int that overflows; truncation on store gives the
// same bits as XLA's two's-complement wrap.
template <class T>
using WrapAcc = std::conditional_t<(sizeof(T) < 4), uint32_t, std::make_unsigned_t<T>>;

template <class T>
struct IntSum {
  using Acc = WrapAcc<T>;
  static Acc Load(T x) { return static_cast<Acc>(x); }
  static T Store(Acc a) { return static_cast<T>(a); }
  static Acc Apply(Acc a, Acc b) { return a + b; }
};
template <class T>
struct IntProd {
  using Acc = WrapAcc<T>;
  static Acc Load(T x) { return static_cast<Acc>(x); }
  static T Store(Acc a) { return static_cast<T>(a); }
  static Acc Apply(Acc a, Acc b) { return static_cast<Acc>(a * b); }
};
template <class T>
struct IntMax {
  using Acc = T;
  static Acc Load(T x) { return x; }
  static T Store(Acc a) { return a; }
  static Acc Apply(Acc a, Acc b) { return a > b ? a : b; }
};
template <class T>
struct IntMin {
  using Acc = T;
  static Acc Load(T x) { return x; }
  static T Store(Acc a) { return a; }
  static Acc Apply(Acc a, Acc b) { return a < b ? a : b; }
};

struct PredOr {
  using Acc = uint8_t;
  static Acc Load(uint8_t x) { return x; }
  static uint8_t Store(Acc a) { return a; }
  static Acc Apply(Acc a, Acc b) { return a | b; }
};
struct PredAnd {
  using Acc = uint8_t;
  static Acc Load(uint8_t x) { return x; }
  static uint8_t Store(Acc a) { return a; }
  static Acc Apply(Acc a, Acc b) { return a & b; }
};

// Floating point: Conv maps storage to the accumulator (identity for f32/f64, widening for f16/bf16).
template <class T>
struct Identity {
  using Acc = T;
  static Acc Load(T x) { return x; }
  static T Store(Acc a) { return a; }
};
struct HalfConv {
  using Acc = float;
  static Acc Load(uint16_t x) { return HalfToFloat(x); }
  static uint16_t Store(Acc a) { return FloatToHalf(a); }
};
struct BF16Conv {
  using Acc = float;
  static Acc Load(uint16_t x) { return BFloat16ToFloat(x); }
  static uint16_t Store(Acc a) { return FloatToBFloat16(a); }
};

template <class Conv>
struct FSum : Conv {
  static typename Conv::Acc Apply(typename Conv::Acc a, typename Conv::Acc b) { return a + b; }
};
template <class Conv>
struct FProd : Conv {
  static typename Conv::Acc Apply(typename Conv::Acc a, typename Conv::Acc b) { return a * b; }
};
// XLA's max/min: NaN if either operand is NaN.
template <class Conv>
struct FMax : Conv {
  static typename Conv::Acc Apply(typename Conv::Acc a, typename Conv::Acc b) {
    return a != a ? a : (b != b ? b : (a > b ? a : b));
  }
};
template <class Conv>
struct FMin : Conv {
  static typename Conv::Acc Apply(typename Conv::Acc a, typename Conv::Acc b) {
    return a != a ? a : (b != b ? b : (a < b ? a : b));
  }
};

template <class F>
struct CSum : Identity<Complex<F>> {
  static Complex<F> Apply(Complex<F> a, Complex<F> b) { return {a.re + b.re, a.im + b.im}; }
};
// Textbook product (no C99 Annex G inf/nan recovery), as XLA's CPU emitter computes it.
template <class F>
struct CProd : Identity<Complex<F>> {
  static Complex<F> Apply(Complex<F> a, Complex<F> b) {
    return {a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re};
  }
};

template <class T, class Op>
void ReduceImpl(const void* const* srcs, int nsrc, void* dst, size_t count) {
  using Acc = typename Op::Acc;
  constexpr size_t kBlock = std::max<size_t>(1, kBlockBytes / sizeof(Acc));
  T* out = static_cast<T*>(dst);
  if (nsrc == 1) {
    if (dst != srcs[0]) std::memmove(dst, srcs[0], count * sizeof(T));
    return;
  }
  alignas(64) Acc acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    const T* s0 = static_cast<const T*>(srcs[0]) + base;
    for (size_t i = 0; i < m; ++i) acc[i] = Op::Load(s0[i]);
    for (int k = 1; k < nsrc; ++k) {
      const T* s = static_cast<const T*>(srcs[k]) + base;
      for (size_t i = 0; i < m; ++i) acc[i] = Op::Apply(acc[i], Op::Load(s[i]));
    }
    T* o = out + base;
    for (size_t i = 0; i < m; ++i) o[i] = Op::Store(acc[i]);
  }
}

template <class T>
ReduceKernel IntKernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return &ReduceImpl<T, IntSum<T>>;
    case ReduceOp::kProd: return &ReduceImpl<T, IntProd<T>>;
    case ReduceOp::kMax: return &ReduceImpl<T, IntMax<T>>;
    case ReduceOp::kMin: return &ReduceImpl<T, IntMin<T>>;
  }
  return nullptr;
}

template <class T, class Conv>
ReduceKernel FloatKernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return &ReduceImpl<T, FSum<Conv>>;
    case ReduceOp::kProd: return &ReduceImpl<T, FProd<Conv>>;
    case ReduceOp::kMax: return &ReduceImpl<T, FMax<Conv>>;
    case ReduceOp::kMin: return &ReduceImpl<T, FMin<Conv>>;
  }
  return nullptr;
}

template <class F>
ReduceKernel ComplexKernel(ReduceOp op) {
  using C = Complex<F>;
  static_assert(sizeof(C) == 2 * sizeof(F));
  switch (op) {
    case ReduceOp::kSum: return &ReduceImpl<C, CSum<F>>;
    case ReduceOp::kProd: return &ReduceImpl<C, CProd<F>>;
    default: return nullptr;  // complex numbers have no order
  }
}

}  // namespace

ReduceKernel GetReduceKernel(DType dtype, ReduceOp op) {
  switch (dtype) {
    // XLA's add on PRED is or and multiply is and; lax converts bool psum to int32 before us anyway.
    case DType::kPred:
      return (op == ReduceOp::kSum || op == ReduceOp::kMax) ? &ReduceImpl<uint8_t, PredOr>
                                                             : &ReduceImpl<uint8_t, PredAnd>;
    case DType::kS8: return IntKernel<int8_t>(op);
    case DType::kS16: return IntKernel<int16_t>(op);
    case DType::kS32: return IntKernel<int32_t>(op);
    case DType::kS64: return IntKernel<int64_t>(op);
    case DType::kU8: return IntKernel<uint8_t>(op);
    case DType::kU16: return IntKernel<uint16_t>(op);
    case DType::kU32: return IntKernel<uint32_t>(op);
    case DType::kU64: return IntKernel<uint64_t>(op);
    case DType::kF16: return FloatKernel<uint16_t, HalfConv>(op);
    case DType::kBF16: return FloatKernel<uint16_t, BF16Conv>(op);
    case DType::kF32: return FloatKernel<float, Identity<float>>(op);
    case DType::kF64: return FloatKernel<double, Identity<double>>(op);
    case DType::kC64: return ComplexKernel<float>(op);
    case DType::kC128: return ComplexKernel<double>(op);
  }
  return nullptr;
}

Status CheckReduction(DType dtype, ReduceOp op) {
  if (GetReduceKernel(dtype, op) != nullptr) return Status::Ok();
  return Status::InvalidArgument("reduction '" + std::string(Name(op)) + "' is not defined for " +
                                 std::string(Name(dtype)) + " (complex numbers support sum and prod only)");
}

}  // namespace flexlink
