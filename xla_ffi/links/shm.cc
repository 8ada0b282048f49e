#include "xla_ffi/links/shm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/reduce.h"

namespace flexlink {
namespace {

constexpr size_t kCacheLine = 64;

size_t RoundUp(size_t x, size_t m) { return (x + m - 1) / m * m; }

// Whether a separate output (never read by this call) is written with non-temporal stores: a cached
// store first reads the line for ownership, wasted traffic from a few hundred KiB per rank on (A/B
// through XLA, out of place, 2-4 MiB: 0.88x -> 0.93-0.98x of native's time ratio with the earlier
// kernel; 1-4 MiB 1.29-1.53x -> 1.48-1.65x of native's speed with the one-pass one). An output that
// is its own input is never streamed: the call just read its lines, and streaming into cached lines
// costs more than writing them back (engine, all_reduce in place, one-pass kernel: 16 MiB 11-12 ms
// streamed vs 6.4-6.6 ms cached, 64 MiB 48-49 vs 29 ms).
bool StreamSeparate(const CallDesc& d, size_t out_bytes) {
  return d.out != d.in && out_bytes >= ShmStreamingSeparateBytes();
}

// memcpy, but with streaming stores when `stream` (x86-64; plain memcpy elsewhere).
void CopyOut(char* dst, const char* src, size_t bytes, bool stream) {
#if defined(__SSE2__)
  if (stream && bytes >= 4096) {
    const size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
    std::memcpy(dst, src, head);
    dst += head, src += head, bytes -= head;
    const size_t body = bytes / 64 * 64;
    for (size_t i = 0; i < body; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + body, src + body, bytes - body);
    _mm_sfence();  // streaming stores are weakly ordered: complete them before any later signal
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, bytes);
}

// Rank r's slice of `range` for the reduce-scatter phase. Slices start on cache-line multiples of
// elements so that vector loops run aligned whenever the buffers are.
UnitRange Slice(UnitRange range, int n, int r, size_t width) {
  const size_t align = std::max<size_t>(1, kCacheLine / width);
  const size_t chunk = RoundUp((range.size() + n - 1) / n, align);
  const size_t begin = std::min(range.end, range.begin + chunk * r);
  return {begin, std::min(range.end, begin + chunk)};
}

// Per-rank source pointers (inputs of every rank, or their staging regions). thread_local: no
// allocation per call once a device thread has seen its largest group.
std::vector<const void*>& SourcePointers(size_t n) {
  thread_local std::vector<const void*> v;
  v.resize(n);
  return v;
}

// Every rank's base pointer (input or staging region); separate from SourcePointers, which the helpers
// below fill with offset pointers.
std::vector<const char*>& BasePointers(size_t n) {
  thread_local std::vector<const char*> v;
  v.resize(n);
  return v;
}

std::vector<void*>& DestinationPointers(size_t n) {
  thread_local std::vector<void*> v;
  v.resize(n);
  return v;
}

std::vector<char*>& OutputPointers(size_t n) {
  thread_local std::vector<char*> v;
  v.resize(n);
  return v;
}

// all_reduce: out[u] = reduce_k inputs[k][u] for u in range.
void ReduceUnits(ReduceKernel kernel, std::span<const char* const> inputs, char* out, size_t w,
                 UnitRange range) {
  if (range.size() == 0) return;
  auto& srcs = SourcePointers(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) srcs[k] = inputs[k] + range.begin * w;
  kernel(srcs.data(), static_cast<int>(inputs.size()), out + range.begin * w, range.size());
}

// all_reduce, direct: reduce `slice` across every rank's input and store the result into every rank's
// output, in one pass (each input line read once, each output line written once).
void ReduceBroadcast(ReduceToKernel kernel, const CallContext& ctx, std::span<const char* const> inputs,
                     int rank, size_t w, UnitRange slice) {
  if (slice.size() == 0) return;
  const size_t n = inputs.size();
  auto& srcs = SourcePointers(n);
  for (size_t k = 0; k < n; ++k) srcs[k] = inputs[k] + slice.begin * w;
  auto& dsts = DestinationPointers(n);
  thread_local std::vector<uint8_t> stream;
  stream.resize(n);
  for (size_t j = 0; j < n; ++j) {
    const CallDesc& peer = ctx.desc(static_cast<int>((rank + j) % n));
    dsts[j] = static_cast<char*>(peer.out) + slice.begin * w;
    stream[j] = StreamSeparate(peer, peer.units * w);
  }
  kernel(srcs.data(), static_cast<int>(n), dsts.data(), static_cast<int>(n), slice.size(), stream.data());
}

// Calls f(row, first, last) for the pieces of `range` that fall in each row of `inner` units.
template <class F>
void ForEachRow(UnitRange range, size_t inner, F f) {
  for (size_t u = range.begin; u < range.end;) {
    const size_t row = u / inner, row_end = std::min(range.end, (row + 1) * inner);
    f(row, u - row * inner, row_end - row * inner);
    u = row_end;
  }
}

// Copies `rows` rows of `len` bytes between row-strided buffers. Short rows (gathering or
// scattering along a late axis) would spend more time calling memcpy than copying; common lengths get
// a fixed-size copy the compiler inlines.
template <size_t kLen>
void CopyRowsFixed(char* dst, size_t dst_stride, const char* src, size_t src_stride, size_t rows) {
  for (size_t o = 0; o < rows; ++o) std::memcpy(dst + o * dst_stride, src + o * src_stride, kLen);
}

void CopyRows(char* dst, size_t dst_stride, const char* src, size_t src_stride, size_t rows, size_t len) {
  switch (len) {
    case 1: return CopyRowsFixed<1>(dst, dst_stride, src, src_stride, rows);
    case 2: return CopyRowsFixed<2>(dst, dst_stride, src, src_stride, rows);
    case 4: return CopyRowsFixed<4>(dst, dst_stride, src, src_stride, rows);
    case 8: return CopyRowsFixed<8>(dst, dst_stride, src, src_stride, rows);
    case 16: return CopyRowsFixed<16>(dst, dst_stride, src, src_stride, rows);
    default:
      for (size_t o = 0; o < rows; ++o) std::memcpy(dst + o * dst_stride, src + o * src_stride, len);
  }
}

// The whole rows inside `range` (rows of `inner` units): [first, last); first >= last when none.
std::pair<size_t, size_t> FullRows(UnitRange range, size_t inner) {
  return {(range.begin + inner - 1) / inner, range.end / inner};
}

// all_gather: unit (o, i) of rank k's input goes to out[o, k, i]. Copies units `range` of one rank's
// input `src` (packed [outer, inner]) into block `k` of `dst` ([outer, n, inner]).
void PlaceBlock(const CallDesc& d, size_t n, const char* src, size_t k, char* dst, UnitRange range,
                bool stream) {
  const size_t w = d.width(), inner = d.inner;
  auto piece = [&](size_t o, size_t i0, size_t i1) {
    CopyOut(dst + ((o * n + k) * inner + i0) * w, src + (o * inner + i0) * w, (i1 - i0) * w, stream);
  };
  // Whole rows in the middle of the range go through CopyRows; partial rows at the ends one by one.
  const auto [first_full, last_full] = FullRows(range, inner);
  if (first_full >= last_full) {  // the range lies within one row (or two partial rows)
    ForEachRow(range, inner, piece);
    return;
  }
  if (range.begin < first_full * inner) piece(first_full - 1, range.begin - (first_full - 1) * inner, inner);
  if (stream && inner * w >= 4096) {  // long rows: stream each
    for (size_t o = first_full; o < last_full; ++o) piece(o, 0, inner);
  } else {
    CopyRows(dst + ((first_full * n + k) * inner) * w, n * inner * w, src + first_full * inner * w,
             inner * w, last_full - first_full, inner * w);
  }
  if (range.end > last_full * inner) piece(last_full, 0, range.end - last_full * inner);
}

bool StreamGather(const CallDesc& d, size_t n) { return StreamSeparate(d, d.units * n * d.width()); }

// Pull: this rank copies every rank's block into its own output (from staging, or from the peers'
// inputs). Starting at our own rank spreads the ranks' reads over different sources.
void GatherUnits(const CallDesc& d, std::span<const char* const> inputs, int rank, char* out,
                 UnitRange range, bool stream) {
  const size_t n = inputs.size();
  for (size_t j = 0; j < n; ++j) {
    const size_t k = (rank + j) % n;
    PlaceBlock(d, n, inputs[k], k, out, range, stream);
  }
}

// Below this output size per rank all_gather pulls with cached stores: all outputs together fit in the
// last-level cache, each thread writes one buffer only, and the inputs (1/n of it) are read n times
// from cache. Above it, pushing with streaming stores reads each input once and moves n outputs' worth
// past the cache. (8 threads, reused buffers: 1 MiB output pull 0.14 ms vs push 0.37 ms, 2 MiB 0.42 vs
// 0.68 ms, 4 MiB 1.66 vs 1.45 ms, 8 MiB 3.5 vs 2.8 ms.)
constexpr size_t kPullGatherBytes = size_t{4} << 20;

// Push: this rank copies its own block into every rank's output, a cache-sized chunk at a time so its
// input is read from memory once (n + 1 bytes moved per output byte / n instead of 2).
constexpr size_t kPushChunkBytes = 64 * 1024;

void PushUnits(const CallDesc& d, const char* in, std::span<char* const> outputs, int rank,
               UnitRange range) {
  const size_t n = outputs.size();
  const size_t chunk = std::max<size_t>(1, kPushChunkBytes / d.width());
  for (size_t b = range.begin; b < range.end; b += chunk) {
    const UnitRange piece{b, std::min(range.end, b + chunk)};
    for (size_t j = 0; j < n; ++j)
      PlaceBlock(d, n, in, rank, outputs[(rank + j) % n], piece, StreamGather(d, n));
  }
}

// reduce_scatter: out[o, i] = reduce_k inputs[k][o, rank, i]. The output units of a range are
// contiguous; the sources are rows n*inner apart. Long rows are reduced in place row by row; short
// rows (< kPackRowBytes) are first packed per source into a small contiguous scratch so that one
// kernel call covers many rows instead of one call per row.
constexpr size_t kPackRowBytes = 256;
constexpr size_t kPackChunkBytes = 8 * 1024;  // per source, so n chunks stay in L1/L2

void ScatterReduceUnits(const CallDesc& d, ReduceKernel kernel, std::span<const char* const> inputs,
                        int rank, char* out, UnitRange range) {
  const size_t n = inputs.size(), w = d.width(), inner = d.inner, row_bytes = inner * w;
  auto& srcs = SourcePointers(n);
  auto row_piece = [&](size_t o, size_t i0, size_t i1) {
    for (size_t k = 0; k < n; ++k) srcs[k] = inputs[k] + ((o * n + rank) * inner + i0) * w;
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
      CopyRows(dst, row_bytes, inputs[k] + (o * n + rank) * row_bytes, n * row_bytes, rows, row_bytes);
      srcs[k] = dst;
    }
    kernel(srcs.data(), static_cast<int>(n), out + o * row_bytes, rows * inner);
  }
  if (range.end > last_full * inner) row_piece(last_full, 0, range.end - last_full * inner);
}

}  // namespace

StagingBuffer::StagingBuffer(int n, size_t region_bytes)
    : region_bytes_(region_bytes), stride_(RoundUp(std::max<size_t>(region_bytes, 1), kCacheLine)) {
  const size_t total = stride_ * static_cast<size_t>(n);
  data_ = static_cast<char*>(std::aligned_alloc(kCacheLine, total));
  if (data_ == nullptr) throw std::bad_alloc();
  std::memset(data_, 0, total);  // touch every page now, not on the latency-critical path
}

StagingBuffer::~StagingBuffer() { std::free(data_); }

// Enough for the calls in flight on one communicator (usually one or two).
constexpr size_t kPoolKeep = 4;

std::shared_ptr<StagingBuffer> StagingPool::Acquire(size_t region_bytes) {
  std::unique_ptr<StagingBuffer> buffer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if ((*it)->region_bytes() == region_bytes) {
        buffer = std::move(*it);
        free_.erase(it);
        break;
      }
  }
  if (!buffer) buffer = std::make_unique<StagingBuffer>(n_, region_bytes);
  return std::shared_ptr<StagingBuffer>(buffer.release(), [this](StagingBuffer* b) { Release(b); });
}

void StagingPool::Release(StagingBuffer* buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.emplace_back(buffer);
  if (free_.size() > kPoolKeep) free_.erase(free_.begin());  // the oldest (likely an unused size)
}

Status ShmChannel::RunAlone(CallContext& ctx, int rank, const CallDesc& desc) {
  const int n = ctx.size();
  const size_t w = desc.width();
  const size_t in_bytes = desc.in_count(n) * w;
  // The first rank fixes the staging size for the call, so all ranks take the same path even if the
  // setting changes meanwhile (and if their sizes differ, Arrive fails them all before any reads).
  StagingBuffer* staging =
      ctx.Scratch<StagingBuffer>([&] { return staging_pool_.Acquire(ShmStagingBytes()); });
  if (in_bytes > staging->region_bytes()) {
    FLEXLINK_RETURN_IF_ERROR(ctx.Arrive(rank, desc, link_name()));
    return Run(ctx, rank, /*lane=*/0, UnitRange{0, desc.units});
  }
  std::memcpy(staging->region(rank), desc.in, in_bytes);
  FLEXLINK_RETURN_IF_ERROR(ctx.Arrive(rank, desc, link_name()));
  auto& regions = BasePointers(n);
  for (int k = 0; k < n; ++k) regions[k] = staging->region(k);
  char* out = static_cast<char*>(desc.out);
  const UnitRange all{0, desc.units};
  switch (desc.kind) {
    case Kind::kAllReduce:
      ReduceUnits(GetReduceKernel(desc.dtype, desc.op), regions, out, w, all);
      break;
    case Kind::kAllGather:
      GatherUnits(desc, regions, rank, out, all, StreamGather(desc, n));
      break;
    case Kind::kReduceScatter:
      ScatterReduceUnits(desc, GetReduceKernel(desc.dtype, desc.op), regions, rank, out, all);
      break;
  }
  return Status::Ok();
}

Status ShmChannel::Run(CallContext& ctx, int rank, int lane, UnitRange range) {
  const int n = ctx.size();
  const CallDesc& me = ctx.desc(rank);
  const size_t w = me.width();
  auto& inputs = BasePointers(n);
  for (int k = 0; k < n; ++k) inputs[k] = static_cast<const char*>(ctx.desc(k).in);
  char* out = static_cast<char*>(me.out);
  switch (me.kind) {
    case Kind::kAllReduce:
      ReduceBroadcast(GetReduceToKernel(me.dtype, me.op), ctx, inputs, rank, w, Slice(range, n, rank, w));
      return ctx.Barrier(rank, lane, "reduce-broadcast", link_name());
    case Kind::kAllGather: {
      if (me.units * n * w < kPullGatherBytes) {
        GatherUnits(me, inputs, rank, out, range, /*stream=*/false);
      } else {
        auto& outputs = OutputPointers(n);
        for (int k = 0; k < n; ++k) outputs[k] = static_cast<char*>(ctx.desc(k).out);
        PushUnits(me, inputs[rank], outputs, rank, range);
      }
      return ctx.Barrier(rank, lane, "all-gather", link_name());
    }
    case Kind::kReduceScatter:
      ScatterReduceUnits(me, GetReduceKernel(me.dtype, me.op), inputs, rank, out, range);
      return ctx.Barrier(rank, lane, "reduce-scatter", link_name());
  }
  return Status::Internal("shm: unknown collective kind");
}

}  // namespace flexlink
