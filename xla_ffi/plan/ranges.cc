#include "xla_ffi/plan/ranges.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace flexlink::plan {

std::vector<UnitRange> CutRanges(uint64_t units, size_t element_bytes, std::span<const double> shares,
                                 size_t align_bytes) {
  size_t n = shares.size();
  std::vector<UnitRange> ranges(n);
  if (n == 0) return ranges;
  element_bytes = std::max<size_t>(element_bytes, 1);
  align_bytes = std::max<size_t>(align_bytes, 1);
  // Boundaries move in blocks of `block` units: the smallest unit count whose byte size is a
  // multiple of both the element size and the alignment.
  uint64_t block = std::lcm(element_bytes, align_bytes) / element_bytes;

  double total = 0;
  size_t last_used = n;
  for (size_t i = 0; i < n; ++i) {
    if (shares[i] > 0) {
      total += shares[i];
      last_used = i;
    }
  }
  if (last_used == n) {  // no positive share: link 0 carries the call
    ranges[0] = {0, units};
    for (size_t i = 1; i < n; ++i) ranges[i] = {units, units};
    return ranges;
  }
  // Round the *cumulative* share to a block boundary (not each share on its own): rounding errors
  // then never accumulate, and every boundary is within half a block of its exact position.
  uint64_t aligned_units = units / block * block;
  uint64_t blocks = units / block;
  double cumulative = 0;
  uint64_t begin = 0;
  for (size_t i = 0; i < n; ++i) {
    uint64_t end = begin;
    if (i == last_used) {
      end = units;
    } else if (shares[i] > 0 && i < last_used) {
      cumulative += shares[i];
      double exact_blocks = cumulative / total * static_cast<double>(blocks);
      uint64_t b = static_cast<uint64_t>(std::llround(exact_blocks));
      end = std::clamp<uint64_t>(std::min(b, blocks) * block, begin, aligned_units);
    }
    ranges[i] = {begin, end};
    begin = end;
  }
  return ranges;
}

}  // namespace flexlink::plan
