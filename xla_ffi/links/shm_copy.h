// Copies the shm link's kernels share: streaming stores for outputs nobody reads soon, and row-wise
// copies between the [outer, n, inner] layouts of docs/interfaces.md.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>

#include "xla_ffi/core/call.h"

namespace flexlink::shm {

inline constexpr size_t kCacheLine = 64;

// memcpy, but with streaming (non-temporal) stores when `stream` (x86-64; plain memcpy elsewhere).
void CopyOut(char* dst, const char* src, size_t bytes, bool stream);
// memset(dst, 0, bytes), streamed the same way.
void ZeroOut(char* dst, size_t bytes, bool stream);

// Copies `rows` rows of `len` bytes between row-strided buffers. Short rows (gathering or
// scattering along a late axis) would spend more time calling memcpy than copying; common lengths get
// a fixed-size copy the compiler inlines.
void CopyRows(char* dst, size_t dst_stride, const char* src, size_t src_stride, size_t rows, size_t len);

// Calls f(row, first, last) for the pieces of `range` that fall in each row of `inner` units.
template <class F>
void ForEachRow(UnitRange range, size_t inner, F f) {
  for (size_t u = range.begin; u < range.end;) {
    const size_t row = u / inner, row_end = std::min(range.end, (row + 1) * inner);
    f(row, u - row * inner, row_end - row * inner);
    u = row_end;
  }
}

// The whole rows inside `range` (rows of `inner` units): [first, last); first >= last when none.
inline std::pair<size_t, size_t> FullRows(UnitRange range, size_t inner) {
  return {(range.begin + inner - 1) / inner, range.end / inner};
}

// One rank block of a row-strided buffer: unit (o, i) of the block is the element at
// base + (o * row + i - first) * width (for block k of an [outer, n, inner] buffer: base = buffer +
// k * inner elements, row = n * inner; for a packed [outer, inner] buffer: row = inner; for a packed
// buffer holding only the units from `first` on: row = inner and that `first`).
struct Rows {
  char* base;
  size_t row;        // elements from one row of the block to the next
  size_t first = 0;  // the unit at base (packed buffers of a range only; never above a unit copied)
};
struct ConstRows {
  const char* base;
  size_t row;
  size_t first = 0;
};

// Copies units `range` (of a block of rows of `inner` units, `width` bytes each) from `src` to
// `dst`: partial rows at the ends one by one, whole rows in between as one strided copy (or, when
// streaming and rows are long, row by row with streaming stores).
void CopyUnits(Rows dst, ConstRows src, size_t inner, size_t width, UnitRange range, bool stream);

}  // namespace flexlink::shm
