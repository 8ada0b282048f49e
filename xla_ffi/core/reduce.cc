#include "xla_ffi/core/reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "xla_ffi/core/half.h"

namespace flexlink {
namespace {

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

// Elements per tile: one 64-byte cache line of storage (every dtype's width divides 64).
template <class T>
constexpr size_t kTile = 64 / sizeof(T);

// res[0, m) = the reduction of srcs[*][i, i + m), m <= kTile. The accumulator is a few registers (a line
// of storage widened to Acc), so each source line is read exactly once and nothing is stored before
// every source of the tile was read: a destination may alias any source. Always inlined, so the full
// tiles get a constant m (unrolled and vectorized) and only the tail loops.
template <class T, class Op>
[[gnu::always_inline]] inline void ReduceTile(const void* const* srcs, int nsrc, size_t i, size_t m, T* res) {
  using Acc = typename Op::Acc;
  Acc acc[kTile<T>];
  const T* s0 = static_cast<const T*>(srcs[0]) + i;
  for (size_t j = 0; j < m; ++j) acc[j] = Op::Load(s0[j]);
  for (int k = 1; k < nsrc; ++k) {
    const T* s = static_cast<const T*>(srcs[k]) + i;
    for (size_t j = 0; j < m; ++j) acc[j] = Op::Apply(acc[j], Op::Load(s[j]));
  }
  for (size_t j = 0; j < m; ++j) res[j] = Op::Store(acc[j]);
}

// Stores one 64-byte tile; non-temporal when asked and the tile is exactly one cache line of the
// destination. A tile that straddles two lines would leave both half-written in the write-combining
// buffers while the other destinations are written, and partial-line streaming writes cost a
// read-modify-write each (engine, 16-byte-offset buffers: 64 MiB in place 178 ms vs 53 ms).
inline void StoreTile(char* dst, const void* tile, bool stream) {
#if defined(__SSE2__)
  if (stream && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    const __m128i* s = static_cast<const __m128i*>(tile);
    __m128i* d = reinterpret_cast<__m128i*>(dst);
    _mm_stream_si128(d, _mm_load_si128(s));
    _mm_stream_si128(d + 1, _mm_load_si128(s + 1));
    _mm_stream_si128(d + 2, _mm_load_si128(s + 2));
    _mm_stream_si128(d + 3, _mm_load_si128(s + 3));
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, tile, 64);
}

template <class T, class Op>
void ReducePartial(const void* const* srcs, int nsrc, void* const* dsts, int ndst, size_t i, size_t m) {
  alignas(64) T res[kTile<T>];
  ReduceTile<T, Op>(srcs, nsrc, i, m, res);
  for (int d = 0; d < ndst; ++d) std::memcpy(static_cast<char*>(dsts[d]) + i * sizeof(T), res, m * sizeof(T));
}

// One pass: each tile of the sources is read once and its result stored to every destination.
// (The earlier kernel accumulated 16 KiB blocks in a stack buffer, one source at a time, and the
// shm link copied the block to the other outputs afterwards: 8 devices, 16 MiB out of place, 15.6 ms
// per call against 8.4 ms for this, the machine's streaming-copy speed being ~7 ms; docs/engine.md.)
// Tiles start where the first destination's cache lines do, so that when the destinations share
// their alignment (XLA's buffers, the engine's own) every streamed tile is a whole line.
template <class T, class Op>
void ReduceToImpl(const void* const* srcs, int nsrc, void* const* dsts, int ndst, size_t count,
                  const uint8_t* stream) {
  constexpr size_t kT = kTile<T>;
  if (nsrc == 1) {
    for (int d = 0; d < ndst; ++d)
      if (dsts[d] != srcs[0]) std::memmove(dsts[d], srcs[0], count * sizeof(T));
    return;
  }
  const uintptr_t misalign = reinterpret_cast<uintptr_t>(dsts[0]) % 64;
  size_t i = misalign % sizeof(T) != 0 ? 0 : std::min(count, (64 - misalign) % 64 / sizeof(T));
  if (i > 0) ReducePartial<T, Op>(srcs, nsrc, dsts, ndst, 0, i);
  alignas(64) T res[kT];
  for (; i + kT <= count; i += kT) {
    ReduceTile<T, Op>(srcs, nsrc, i, kT, res);
    for (int d = 0; d < ndst; ++d)
      StoreTile(static_cast<char*>(dsts[d]) + i * sizeof(T), res, stream != nullptr && stream[d]);
  }
  if (i < count) ReducePartial<T, Op>(srcs, nsrc, dsts, ndst, i, count - i);
#if defined(__SSE2__)
  if (stream != nullptr) _mm_sfence();  // streaming stores are weakly ordered: complete them before any later signal
#endif
}

template <class T, class Op>
void ReduceImpl(const void* const* srcs, int nsrc, void* dst, size_t count) {
  ReduceToImpl<T, Op>(srcs, nsrc, &dst, 1, count, /*stream=*/nullptr);
}

// Both entry points of one (dtype, op); nullptr (both) when the combination is not supported.
struct ReduceKernels {
  ReduceKernel one = nullptr;
  ReduceToKernel to_many = nullptr;
};

template <class T, class Op>
constexpr ReduceKernels Kernels() {
  return {&ReduceImpl<T, Op>, &ReduceToImpl<T, Op>};
}

template <class T>
ReduceKernels IntKernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return Kernels<T, IntSum<T>>();
    case ReduceOp::kProd: return Kernels<T, IntProd<T>>();
    case ReduceOp::kMax: return Kernels<T, IntMax<T>>();
    case ReduceOp::kMin: return Kernels<T, IntMin<T>>();
  }
  return {};
}

template <class T, class Conv>
ReduceKernels FloatKernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return Kernels<T, FSum<Conv>>();
    case ReduceOp::kProd: return Kernels<T, FProd<Conv>>();
    case ReduceOp::kMax: return Kernels<T, FMax<Conv>>();
    case ReduceOp::kMin: return Kernels<T, FMin<Conv>>();
  }
  return {};
}

template <class F>
ReduceKernels ComplexKernel(ReduceOp op) {
  using C = Complex<F>;
  static_assert(sizeof(C) == 2 * sizeof(F));
  switch (op) {
    case ReduceOp::kSum: return Kernels<C, CSum<F>>();
    case ReduceOp::kProd: return Kernels<C, CProd<F>>();
    default: return {};  // complex numbers have no order
  }
}

ReduceKernels GetReduceKernels(DType dtype, ReduceOp op) {
  switch (dtype) {
    // XLA's add on PRED is or and multiply is and; lax converts bool psum to int32 before us anyway.
    case DType::kPred:
      return (op == ReduceOp::kSum || op == ReduceOp::kMax) ? Kernels<uint8_t, PredOr>()
                                                             : Kernels<uint8_t, PredAnd>();
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
  return {};
}

}  // namespace

ReduceKernel GetReduceKernel(DType dtype, ReduceOp op) { return GetReduceKernels(dtype, op).one; }
ReduceToKernel GetReduceToKernel(DType dtype, ReduceOp op) { return GetReduceKernels(dtype, op).to_many; }

Status CheckReduction(DType dtype, ReduceOp op) {
  if (GetReduceKernels(dtype, op).one != nullptr) return Status::Ok();
  return Status::InvalidArgument("reduction '" + std::string(Name(op)) + "' is not defined for " +
                                 std::string(Name(dtype)) + " (complex numbers support sum and prod only)");
}

}  // namespace flexlink
