#include "xla_ffi/core/config.h"

#include <atomic>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <utility>

namespace flexlink {
namespace {

std::atomic<double> g_timeout_s{300.0};
// Measured crossover on the 2-core test machine with 8 device threads (docs/engine.md).
std::atomic<size_t> g_shm_staging_bytes{16 * 1024};
std::atomic<bool> g_huge_page_outputs{true};
std::atomic<size_t> g_shm_streaming_separate_bytes{256 << 10};
std::atomic<int> g_debug_level{0};
std::atomic<bool> g_populate_outputs{false};
std::atomic<uint64_t> g_autotune_min_bytes{1 << 20};
std::atomic<uint64_t> g_tune_max_bytes{16 << 20};
std::atomic<bool> g_tune_use_cache{true};
std::mutex g_cache_mu;

size_t SlotBytesFromEnv() {
  constexpr size_t kDefault = size_t{4} << 20;
  const char* v = std::getenv("FLEXLINK_XPROC_SLOT_BYTES");
  if (!v || !*v) return kDefault;
  char* end = nullptr;
  const unsigned long long bytes = std::strtoull(v, &end, 10);
  if (*end != 0 || bytes == 0) {
    std::fprintf(stderr, "flexlink: ignoring FLEXLINK_XPROC_SLOT_BYTES=%s (not a positive integer)\n", v);
    return kDefault;
  }
  return static_cast<size_t>(bytes);
}
std::atomic<size_t> g_xproc_slot_bytes{SlotBytesFromEnv()};
// Off: on the 2-core test machine (4 processes on 2 cores) the second barrier per step cost more
// than the traffic it saves (docs/xproc.md, "Two-phase all_reduce").
std::atomic<uint64_t> g_xproc_two_phase_bytes{UINT64_MAX};
std::string& CachePath() {
  static auto* path = new std::string();
  return *path;
}

}  // namespace

double TimeoutSeconds() { return g_timeout_s.load(std::memory_order_relaxed); }
void SetTimeoutSeconds(double seconds) { g_timeout_s.store(seconds, std::memory_order_relaxed); }
size_t ShmStagingBytes() { return g_shm_staging_bytes.load(std::memory_order_relaxed); }
void SetShmStagingBytes(size_t bytes) { g_shm_staging_bytes.store(bytes, std::memory_order_relaxed); }
size_t ShmStreamingSeparateBytes() { return g_shm_streaming_separate_bytes.load(std::memory_order_relaxed); }
void SetShmStreamingSeparateBytes(size_t bytes) {
  g_shm_streaming_separate_bytes.store(bytes, std::memory_order_relaxed);
}
bool HugePageOutputs() { return g_huge_page_outputs.load(std::memory_order_relaxed); }
void SetHugePageOutputs(bool on) { g_huge_page_outputs.store(on, std::memory_order_relaxed); }

uint64_t AutotuneMinBytes() { return g_autotune_min_bytes.load(std::memory_order_relaxed); }
void SetAutotuneMinBytes(uint64_t bytes) { g_autotune_min_bytes.store(bytes, std::memory_order_relaxed); }
uint64_t TuneMaxBytes() { return g_tune_max_bytes.load(std::memory_order_relaxed); }
void SetTuneMaxBytes(uint64_t bytes) { g_tune_max_bytes.store(bytes, std::memory_order_relaxed); }
bool TuneUseCache() { return g_tune_use_cache.load(std::memory_order_relaxed); }
void SetTuneUseCache(bool on) { g_tune_use_cache.store(on, std::memory_order_relaxed); }
std::string TuneCachePath() {
  std::lock_guard<std::mutex> lock(g_cache_mu);
  return CachePath();
}
void SetTuneCachePath(std::string path) {
  std::lock_guard<std::mutex> lock(g_cache_mu);
  CachePath() = std::move(path);
}

bool PopulateOutputs() { return g_populate_outputs.load(std::memory_order_relaxed); }
void SetPopulateOutputs(bool on) { g_populate_outputs.store(on, std::memory_order_relaxed); }

size_t XprocSlotBytes() { return g_xproc_slot_bytes.load(std::memory_order_relaxed); }
void SetXprocSlotBytes(size_t bytes) { g_xproc_slot_bytes.store(bytes, std::memory_order_relaxed); }
uint64_t XprocTwoPhaseBytes() { return g_xproc_two_phase_bytes.load(std::memory_order_relaxed); }
void SetXprocTwoPhaseBytes(uint64_t bytes) { g_xproc_two_phase_bytes.store(bytes, std::memory_order_relaxed); }

int DebugLevel() { return g_debug_level.load(std::memory_order_relaxed); }
void SetDebugLevel(int level) { g_debug_level.store(level, std::memory_order_relaxed); }
void LogInfo(const std::string& msg) {
  if (DebugLevel() >= kDebugInfo) std::fprintf(stderr, "flexlink: %s\n", msg.c_str());
}

}  // namespace flexlink
