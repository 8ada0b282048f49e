// Cutting one call's units (elements, see core/call.h) into one contiguous range per link.
//
// Every rank of a call must cut identically (one split per call), so this is a pure function of
// (units, element size, shares): the same inputs give the same ranges in every process. Boundaries
// fall on multiples of lcm(element size, 64 bytes) where possible so that no two links write the same
// cache line (false sharing between link workers) and vector loops start aligned; only the end of
// the last used range may fall mid-cache-line, when the total itself is not aligned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace flexlink::plan {

inline constexpr size_t kCacheLineBytes = 64;

struct UnitRange {
  uint64_t begin = 0;  // first unit
  uint64_t end = 0;    // one past the last unit
  uint64_t size() const { return end - begin; }
  bool empty() const { return end == begin; }
};

// Ranges, in link order, covering [0, units) exactly and in order (range i ends where range i+1
// begins). A link with share <= 0 gets an empty range; a link with a tiny share may also get an empty
// range when its share rounds to less than one aligned block. The last link with a positive share
// ends at `units` (takes the remainder). Shares need not sum to 1 exactly (they are normalised); if
// none is positive, everything goes to link 0.
std::vector<UnitRange> CutRanges(uint64_t units, size_t element_bytes, std::span<const double> shares,
                                 size_t align_bytes = kCacheLineBytes);

// nccl-tests bytes of range `r` of a call's `virtual_bytes` units: its share of the call's
// `message_bytes` (what stage 2, health and the link statistics count a range by).
inline uint64_t RangeMessageBytes(uint64_t message_bytes, UnitRange r, uint64_t virtual_bytes) {
  return virtual_bytes ? static_cast<uint64_t>(static_cast<double>(message_bytes) * r.size() / virtual_bytes) : 0;
}

}  // namespace flexlink::plan
