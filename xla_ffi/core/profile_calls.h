// What stage 1 runs and how it reports it, the same on every executor (the CPU one,
// core/executor_profile.cc, and the GPU one, cuda/gpu_profile.cc): its sizes, the call it times, the
// tuning cache it reads and writes, and the fits' one-line description in the log.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/plan/cost_model.h"
#include "xla_ffi/plan/tuning_cache.h"

namespace flexlink {

// The smallest profiled size (nccl-tests bytes).
inline constexpr uint64_t kMinProfileBytes = 64 << 10;
// Above this, sizes step by 4x instead of 2x and skip the untimed repetition: the time there is
// bandwidth (a line needs few points) and slow links make these steps the whole cost of stage 1; the
// smaller sizes before them have warmed every buffer already (the best of the timed runs is kept).
inline constexpr uint64_t kCoarseProfileBytes = 1 << 20;

// Stage 1's message sizes up to `top` (ProfileTopBytes): from kMinProfileBytes doubling, then by 4x
// above kCoarseProfileBytes, and `top` itself last; every executor profiles exactly these.
std::vector<uint64_t> StageOneSizes(uint64_t top);

// The tuning cache file: the configured one, else plan::DefaultCachePath().
std::string ProfileCachePath();

// The cached model of `key` (ProfileCachePath()) when its links are `names` and it holds `kind`
// profiled up to at least `needed_bytes`; a problem with the cache is reported on stderr (never
// silent, whatever FLEXLINK_DEBUG says) and answers false, as does no entry.
bool LoadCachedModel(const plan::CacheKey& key, const std::vector<std::string>& names, Kind kind,
                     uint64_t needed_bytes, plan::CostModel* out);

// Stores `model`'s fits for `kind` (profiled up to `max_bytes`) under `key`, keeping what the entry
// holds for the other kinds; a problem is reported on stderr, never an error (the fits are in use).
void StoreProfiledModel(const plan::CacheKey& key, const std::vector<std::string>& names, Kind kind,
                        const plan::CostModel& model, uint64_t max_bytes);

// A float32 sum (for the kinds that do not reduce: their data movement) of `message` nccl-tests bytes
// for a group of n; ppermute as a ring shift by one, the common case (pipelines, halos).
CallDesc ProfileDesc(Kind kind, uint64_t message, int n, void* in, void* out);

// A profile's scratch: zeroed (sums and gathers of zeros are exact whatever the split) and
// cache-line aligned; ptr is null when out of memory.
struct ProfileBuffer {
  explicit ProfileBuffer(size_t bytes) {
    const size_t rounded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
    ptr = std::aligned_alloc(64, rounded);
    if (ptr) std::memset(ptr, 0, rounded);
  }
  ~ProfileBuffer() { std::free(ptr); }
  ProfileBuffer(const ProfileBuffer&) = delete;
  ProfileBuffer& operator=(const ProfileBuffer&) = delete;
  void* ptr = nullptr;
};

// "split from N B per call" or "never split (...)", for the log.
std::string SplitThresholdText(uint64_t threshold);

// "name a=..us bw=..GB/s, ..." for the log.
std::string DescribeFits(const std::vector<std::string>& names, std::span<const plan::AlphaBeta> fits);

}  // namespace flexlink
