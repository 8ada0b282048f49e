// Reference arithmetic for the engine tests, written independently of core/half.h and
// core/reduce.cc: GCC's _Float16 for float16, a separate nearest-even rounding for bfloat16, 64-bit
// wrap for integers, and the same left-to-right rank order the engine promises.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "xla_ffi/core/types.h"

namespace flexlink::testing {


inline float RefHalfToFloat(uint16_t h) {
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
}
inline uint16_t RefFloatToHalf(float x) {
  _Float16 f = static_cast<_Float16>(x);  // GCC: IEEE round-to-nearest-even
  uint16_t h;
  std::memcpy(&h, &f, 2);
  return h;
}
inline float RefBf16ToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest, ties to even, by comparing the two neighbours in double precision.
inline uint16_t RefFloatToBf16(float x) {
  if (std::isnan(x)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t lo = u & 0xFFFF0000u, hi = lo + 0x10000u;
  if (lo == u) return static_cast<uint16_t>(u >> 16);
  float flo, fhi;
  std::memcpy(&flo, &lo, 4);
  std::memcpy(&fhi, &hi, 4);
  const double dl = std::fabs(static_cast<double>(x) - flo), dh = std::fabs(static_cast<double>(fhi) - x);
  if (dl < dh || (dl == dh && ((lo >> 16) & 1) == 0)) return static_cast<uint16_t>(lo >> 16);
  return static_cast<uint16_t>(hi >> 16);
}

template <class F>
F FOp(ReduceOp op, F a, F b) {
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kProd: return a * b;
    case ReduceOp::kMax: return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b);
    case ReduceOp::kMin: return (std::isnan(a) || std::isnan(b)) ? NAN : std::min(a, b);
  }
  return a;
}

template <class T>
void RefInt(ReduceOp op, const std::vector<const uint8_t*>& s, size_t i, uint8_t* dst) {
  T v[1];
  std::memcpy(v, s[0] + i * sizeof(T), sizeof(T));
  uint64_t acc = static_cast<uint64_t>(v[0]);
  T m = v[0];
  for (size_t k = 1; k < s.size(); ++k) {
    T x;
    std::memcpy(&x, s[k] + i * sizeof(T), sizeof(T));
    if (op == ReduceOp::kSum) acc += static_cast<uint64_t>(x);
    if (op == ReduceOp::kProd) acc *= static_cast<uint64_t>(x);
    if (op == ReduceOp::kMax) m = std::max(m, x);
    if (op == ReduceOp::kMin) m = std::min(m, x);
  }
  T r = (op == ReduceOp::kSum || op == ReduceOp::kProd) ? static_cast<T>(acc) : m;
  std::memcpy(dst, &r, sizeof(T));
}

template <class F>
void RefFloat(ReduceOp op, const std::vector<const uint8_t*>& s, size_t i, uint8_t* dst) {
  F acc;
  std::memcpy(&acc, s[0] + i * sizeof(F), sizeof(F));
  for (size_t k = 1; k < s.size(); ++k) {
    F x;
    std::memcpy(&x, s[k] + i * sizeof(F), sizeof(F));
    acc = FOp(op, acc, x);
  }
  std::memcpy(dst, &acc, sizeof(F));
}

inline void RefHalf(bool bf16, ReduceOp op, const std::vector<const uint8_t*>& s, size_t i, uint8_t* dst) {
  auto load = [&](size_t k) {
    uint16_t h;
    std::memcpy(&h, s[k] + 2 * i, 2);
    return bf16 ? RefBf16ToFloat(h) : RefHalfToFloat(h);
  };
  float acc = load(0);
  for (size_t k = 1; k < s.size(); ++k) acc = FOp(op, acc, load(k));
  uint16_t r = bf16 ? RefFloatToBf16(acc) : RefFloatToHalf(acc);
  std::memcpy(dst, &r, 2);
}

template <class F>
void RefComplex(ReduceOp op, const std::vector<const uint8_t*>& s, size_t i, uint8_t* dst) {
  F a[2];
  std::memcpy(a, s[0] + i * 2 * sizeof(F), 2 * sizeof(F));
  for (size_t k = 1; k < s.size(); ++k) {
    F b[2];
    std::memcpy(b, s[k] + i * 2 * sizeof(F), 2 * sizeof(F));
    if (op == ReduceOp::kSum) {
      a[0] += b[0];
      a[1] += b[1];
    } else {
      const F re = a[0] * b[0] - a[1] * b[1], im = a[0] * b[1] + a[1] * b[0];
      a[0] = re;
      a[1] = im;
    }
  }
  std::memcpy(dst, a, 2 * sizeof(F));
}

inline void RefReduce(DType t, ReduceOp op, const std::vector<const uint8_t*>& s, size_t i, uint8_t* dst) {
  switch (t) {
    case DType::kPred: {
      uint8_t r = s[0][i];
      for (size_t k = 1; k < s.size(); ++k)
        r = (op == ReduceOp::kSum || op == ReduceOp::kMax) ? (r | s[k][i]) : (r & s[k][i]);
      *dst = r;
      return;
    }
    case DType::kS8: return RefInt<int8_t>(op, s, i, dst);
    case DType::kS16: return RefInt<int16_t>(op, s, i, dst);
    case DType::kS32: return RefInt<int32_t>(op, s, i, dst);
    case DType::kS64: return RefInt<int64_t>(op, s, i, dst);
    case DType::kU8: return RefInt<uint8_t>(op, s, i, dst);
    case DType::kU16: return RefInt<uint16_t>(op, s, i, dst);
    case DType::kU32: return RefInt<uint32_t>(op, s, i, dst);
    case DType::kU64: return RefInt<uint64_t>(op, s, i, dst);
    case DType::kF16: return RefHalf(false, op, s, i, dst);
    case DType::kBF16: return RefHalf(true, op, s, i, dst);
    case DType::kF32: return RefFloat<float>(op, s, i, dst);
    case DType::kF64: return RefFloat<double>(op, s, i, dst);
    case DType::kC64: return RefComplex<float>(op, s, i, dst);
    case DType::kC128: return RefComplex<double>(op, s, i, dst);
  }
}

inline bool IsNaN(DType t, const uint8_t* p) {
  switch (t) {
    case DType::kF16: { uint16_t h; std::memcpy(&h, p, 2); return std::isnan(RefHalfToFloat(h)); }
    case DType::kBF16: { uint16_t h; std::memcpy(&h, p, 2); return std::isnan(RefBf16ToFloat(h)); }
    case DType::kF32: { float f; std::memcpy(&f, p, 4); return std::isnan(f); }
    case DType::kF64: { double f; std::memcpy(&f, p, 8); return std::isnan(f); }
    default: return false;
  }
}

// Bitwise equality, except that any NaN equals any NaN (payloads are not part of the contract).
inline size_t CountWrong(DType t, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  const size_t w = ByteWidth(t);
  if (got.size() != want.size()) return SIZE_MAX;
  size_t wrong = 0;
  for (size_t i = 0; i < got.size(); i += w) {
    if (std::memcmp(&got[i], &want[i], w) == 0) continue;
    if (IsNaN(t, &got[i]) && IsNaN(t, &want[i])) continue;
    ++wrong;
  }
  return wrong;
}

// Random values that keep products finite and exercise wrapping for integers.
inline std::vector<uint8_t> RandomData(DType t, size_t count, uint32_t seed, bool with_nan) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> real(0.5f, 1.5f);
  std::uniform_int_distribution<int> sign(0, 1);
  const size_t w = ByteWidth(t);
  std::vector<uint8_t> v(count * w);
  for (size_t i = 0; i < count; ++i) {
    uint8_t* p = &v[i * w];
    float f = real(rng) * (sign(rng) ? 1.f : -1.f);
    if (with_nan && rng() % 97 == 0) f = NAN;
    switch (t) {
      case DType::kPred: *p = rng() & 1; break;
      case DType::kF16: { uint16_t h = RefFloatToHalf(f); std::memcpy(p, &h, 2); break; }
      case DType::kBF16: { uint16_t h = RefFloatToBf16(f); std::memcpy(p, &h, 2); break; }
      case DType::kF32: std::memcpy(p, &f, 4); break;
      case DType::kF64: { double d = static_cast<double>(f) + 1e-9 * (rng() % 1000); std::memcpy(p, &d, 8); break; }
      case DType::kC64: { float c[2] = {f, real(rng)}; std::memcpy(p, c, 8); break; }
      case DType::kC128: { double c[2] = {f, real(rng)}; std::memcpy(p, c, 16); break; }
      default: for (size_t b = 0; b < w; ++b) p[b] = static_cast<uint8_t>(rng()); break;
    }
  }
  return v;
}

// ppermute: rank d's result is the input of the rank s with a pair (s, d), zeros if there is none.
// `pairs` are (source, destination) rank pairs; `inputs[r]` is rank r's input.
inline std::vector<uint8_t> RefPpermute(const std::vector<std::pair<int64_t, int64_t>>& pairs,
                                        const std::vector<const uint8_t*>& inputs, size_t bytes, int rank) {
  std::vector<uint8_t> out(bytes, 0);
  for (const auto& [s, d] : pairs)
    if (d == rank && bytes) std::memcpy(out.data(), inputs[s], bytes);  // no memcpy from null (UBSan)
  return out;
}

// all_to_all about `axis` of `dims` for n ranks: viewed as [outer, n, inner], rank r's result block j
// is block r of rank j's input: out_r[o, j, i] = in_j[o, r, i]. Element by element, on purpose.
inline std::vector<uint8_t> RefAllToAll(const std::vector<int64_t>& dims, int64_t axis,
                                        const std::vector<const uint8_t*>& inputs, size_t width, int rank) {
  const size_t n = inputs.size();
  size_t outer = 1, count = 1;
  for (size_t a = 0; a < dims.size(); ++a) {
    count *= static_cast<size_t>(dims[a]);
    if (static_cast<int64_t>(a) < axis) outer *= static_cast<size_t>(dims[a]);
  }
  const size_t inner = outer ? count / outer / n : 0;
  std::vector<uint8_t> out(count * width);
  for (size_t o = 0; o < outer; ++o)
    for (size_t j = 0; j < n; ++j)
      for (size_t i = 0; i < inner; ++i)
        std::memcpy(&out[((o * n + j) * inner + i) * width], inputs[j] + ((o * n + rank) * inner + i) * width,
                    width);
  return out;
}

// One operand of any kind on `rank` of a group whose inputs are `inputs` (rank order), per-rank input
// dims `dims`: all_reduce / reduce_scatter reduce in rank order, all_gather stacks the ranks' blocks
// along `axis` ([outer, n, inner]), ppermute and all_to_all as above. Element by element.
inline std::vector<uint8_t> RefCollective(Kind kind, ReduceOp op, DType t, const std::vector<int64_t>& dims,
                                          int64_t axis, const std::vector<std::pair<int64_t, int64_t>>& pairs,
                                          const std::vector<const uint8_t*>& inputs, int rank) {
  const size_t n = inputs.size(), w = ByteWidth(t);
  size_t count = 1, outer = 1;
  for (size_t a = 0; a < dims.size(); ++a) {
    count *= static_cast<size_t>(dims[a]);
    if (static_cast<int64_t>(a) < axis) outer *= static_cast<size_t>(dims[a]);
  }
  std::vector<uint8_t> out;
  switch (kind) {
    case Kind::kPpermute: return RefPpermute(pairs, inputs, count * w, rank);
    case Kind::kAllToAll: return RefAllToAll(dims, axis, inputs, w, rank);
    case Kind::kAllReduce:
      out.resize(count * w);
      for (size_t i = 0; i < count; ++i) RefReduce(t, op, inputs, i, &out[i * w]);
      return out;
    case Kind::kAllGather: {
      const size_t inner = outer ? count / outer : 0;
      out.resize(count * n * w);
      for (size_t o = 0; o < outer; ++o)
        for (size_t k = 0; k < n; ++k)
          if (inner) std::memcpy(&out[(o * n + k) * inner * w], inputs[k] + o * inner * w, inner * w);
      return out;
    }
    case Kind::kReduceScatter: {
      const size_t out_count = count / n, inner = outer ? out_count / outer : 0;
      out.resize(out_count * w);
      for (size_t o = 0; o < outer; ++o)
        for (size_t i = 0; i < inner; ++i)
          RefReduce(t, op, inputs, (o * n + rank) * inner + i, &out[(o * inner + i) * w]);
      return out;
    }
  }
  return out;
}

}  // namespace flexlink::testing
