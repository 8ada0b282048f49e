// all_reduce and reduce_scatter on the shm link (see shm.h for the algorithms and their traffic).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/reduce.h"
#include "xla_ffi/links/shm_copy.h"
#include "xla_ffi/links/shm_ops.h"

namespace flexlink::shm {
namespace {

size_t RoundUp(size_t x, size_t m) { return (x + m - 1) / m * m; }

// Per-rank pointer arrays for the kernels. thread_local: no allocation per call once a device thread
// has seen its largest group.
std::vector<const void*>& SourcePointers(size_t n) {
  thread_local std::vector<const void*> v;
  v.resize(n);
  return v;
}

std::vector<void*>& DestinationPointers(size_t n) {
  thread_local std::vector<void*> v;
  v.resize(n);
  return v;
}

// Rank r's slice of `range` for the reduce-scatter phase. Slices start on cache-line multiples of
// elements so that vector loops run aligned whenever the buffers are.
UnitRange Slice(UnitRange range, int n, int r, size_t width) {
  const size_t align = std::max<size_t>(1, kCacheLine / width);
  const size_t chunk = RoundUp((range.size() + n - 1) / n, align);
  const size_t begin = std::min(range.end, range.begin + chunk * r);
  return {begin, std::min(range.end, begin + chunk)};
}

// reduce_scatter: short rows (< kPackRowBytes) are first packed per source into a small contiguous
// scratch so that one kernel call covers many rows instead of one call per row.
constexpr size_t kPackRowBytes = 256;
constexpr size_t kPackChunkBytes = 8 * 1024;  // per source, so n chunks stay in L1/L2

}  // namespace

// Whether a separate output (never read by this call) is written with non-temporal stores: a cached
// store first reads the line for ownership, wasted traffic from a few hundred KiB per rank on (A/B
// through XLA, out of place, 2-4 MiB: 0.88x -> 0.93-0.98x of native's time ratio with the earlier
// kernel; 1-4 MiB 1.29-1.53x -> 1.48-1.65x of native's speed with the one-pass one). An output that
// is its own input is never streamed: the call just read its lines, and streaming into cached lines
// costs more than writing them back (engine, all_reduce in place, one-pass kernel: 16 MiB 11-12 ms
// streamed vs 6.4-6.6 ms cached, 64 MiB 48-49 vs 29 ms).
bool StreamSeparate(const void* in, const void* out, size_t out_bytes) {
  return out != in && out_bytes >= ShmStreamingSeparateBytes();
}

void AllReduceStaged(const PartView& v, ReduceOp op, UnitRange range) {
  if (range.empty()) return;
  const size_t n = v.sources.size(), w = v.width();
  auto& srcs = SourcePointers(n);
  for (size_t k = 0; k < n; ++k) srcs[k] = v.sources[k] + range.begin * w;
  GetReduceKernel(v.part.dtype, op)(srcs.data(), static_cast<int>(n), v.out() + range.begin * w, range.size());
}

// Reduces this rank's slice across every rank's input and stores the result into every rank's
// output, in one pass (each input line read once, each output line written once).
void AllReduceDirect(const PartView& v, ReduceOp op, UnitRange range) {
  const size_t w = v.width();
  const UnitRange slice = Slice(range, v.n, v.rank, w);
  if (slice.empty()) return;
  const size_t n = v.sources.size();
  auto& srcs = SourcePointers(n);
  for (size_t k = 0; k < n; ++k) srcs[k] = v.sources[k] + slice.begin * w;
  auto& dsts = DestinationPointers(n);
  thread_local std::vector<uint8_t> stream;
  stream.resize(n);
  for (size_t j = 0; j < n; ++j) {
    const size_t peer = (v.rank + j) % n;  // own output first
    dsts[j] = v.outputs[peer] + slice.begin * w;
    stream[j] = StreamSeparate(v.sources[peer], v.outputs[peer], v.part.units * w);
  }
  GetReduceToKernel(v.part.dtype, op)(srcs.data(), static_cast<int>(n), dsts.data(), static_cast<int>(n),
                                      slice.size(), stream.data());
}

void ReduceScatter(const PartView& v, ReduceOp op, UnitRange range) {
  if (range.empty()) return;
  const ReduceKernel kernel = GetReduceKernel(v.part.dtype, op);
  const size_t n = v.sources.size(), w = v.width(), inner = v.part.inner, row_bytes = inner * w;
  const size_t rank = static_cast<size_t>(v.rank);
  char* const out = v.out();
  auto& srcs = SourcePointers(n);
  auto row_piece = [&](size_t o, size_t i0, size_t i1) {
    for (size_t k = 0; k < n; ++k) srcs[k] = v.sources[k] + ((o * n + rank) * inner + i0) * w;
    kernel(srcs.data(), static_cast<int>(n), out + (o * inner + i0) * w, i1 - i0);
  };
  const auto [first_full, last_full] = FullRows(range, inner);
  if (row_bytes >= kPackRowBytes || first_full >= last_full) {
    ForEachRow(range, inner, row_piece);
    return;
  }
  if (range.begin < first_full * inner)
    row_piece(first_full - 1, range.begin - (first_full - 1) * inner, inner);
  const size_t chunk_rows = std::max<size_t>(1, kPackChunkBytes / row_bytes);
  const size_t chunk_bytes = chunk_rows * row_bytes;
  thread_local std::vector<char> pack;
  pack.resize(n * chunk_bytes);
  for (size_t o = first_full; o < last_full; o += chunk_rows) {
    const size_t rows = std::min(chunk_rows, last_full - o);
    for (size_t k = 0; k < n; ++k) {
      char* dst = pack.data() + k * chunk_bytes;
      CopyRows(dst, row_bytes, v.sources[k] + (o * n + rank) * row_bytes, n * row_bytes, rows, row_bytes);
      srcs[k] = dst;
    }
    kernel(srcs.data(), static_cast<int>(n), out + o * row_bytes, rows * inner);
  }
  if (range.end > last_full * inner) row_piece(last_full, 0, range.end - last_full * inner);
}

}  // namespace flexlink::shm
