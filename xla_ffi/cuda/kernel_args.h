// What the two GPU kernels take, and the per-element work both sides run (the CUDA kernels in
// kernels.cu over a grid, the simulated device in a loop). Plain structs passed by value.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla_ffi/core/types.h"
#include "xla_ffi/cuda/elementwise.h"

namespace flexlink::gpu {

// dst[i] = src_0[i] op src_1[i] op ... op src_{nrows-1}[i] for i < count, in rank order, where
// src_k = rows + k * row_stride (elements), except src_own = own_src: a rank's own contribution is
// read where it already is (its input, or its packed send buffer) instead of a staged copy. dst may
// be own_src (in-place all_reduce): element i is read before it is written, by the same thread.
struct ReduceArgs {
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  void* dst = nullptr;
  const void* rows = nullptr;
  size_t row_stride = 0;
  int nrows = 0;
  int own = -1;
  const void* own_src = nullptr;
  size_t count = 0;
};

// Copies units between a packed buffer (one row per block, `units` elements each, rows
// packed_stride elements apart) and a part's [outer, n, inner] layout, where unit u = (o, i) of
// block j is element (o*n + j)*inner + i. Covers units [unit_begin, unit_begin + units) of blocks
// [block_begin, block_begin + blocks); packed row r holds block block_begin + r. kPack reads the
// layout and writes the packed rows, kUnpack the other way round. `width`: bytes per element.
struct LayoutArgs {
  enum Direction : uint8_t { kPack, kUnpack };
  Direction direction = kPack;
  size_t width = 4;
  size_t n = 1, inner = 1;
  size_t unit_begin = 0, units = 0;
  size_t block_begin = 0, blocks = 0;
  size_t packed_stride = 0;
  void* packed = nullptr;  // written by kPack
  void* layout = nullptr;  // written by kUnpack
  FLEXLINK_HD size_t total() const { return units * blocks; }
};

template <class Op>
FLEXLINK_HD void ReduceAt(const ReduceArgs& a, size_t i) {
  using T = typename Op::T;
  auto src = [&](int k) {
    return k == a.own ? static_cast<const T*>(a.own_src) : static_cast<const T*>(a.rows) + k * a.row_stride;
  };
  typename Op::Acc acc = Op::Load(src(0)[i]);
  for (int k = 1; k < a.nrows; ++k) acc = Op::Apply(acc, Op::Load(src(k)[i]));
  static_cast<T*>(a.dst)[i] = Op::Store(acc);
}

// Element t < a.total() of a layout copy, with E an element type of a.width bytes.
template <class E>
FLEXLINK_HD void LayoutAt(const LayoutArgs& a, size_t t) {
  const size_t row = t / a.units, k = t % a.units;
  const size_t u = a.unit_begin + k;
  const size_t o = u / a.inner, i = u % a.inner;
  E* packed = static_cast<E*>(a.packed) + row * a.packed_stride + k;
  E* layout = static_cast<E*>(a.layout) + (o * a.n + a.block_begin + row) * a.inner + i;
  if (a.direction == LayoutArgs::kPack) *packed = *layout;
  else *layout = *packed;
}

}  // namespace flexlink::gpu
