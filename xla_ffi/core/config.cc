#include "xla_ffi/core/config.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

std::mutex g_warnings_mu;
std::vector<std::string>& Warnings() {
  static auto* warnings = new std::vector<std::string>();
  return *warnings;
}

size_t SlotBytesFromEnv() {
  const char* v = std::getenv("FLEXLINK_XPROC_SLOT_BYTES");
  if (!v || std::string_view(v).find_first_not_of(" \t") == std::string_view::npos) return 0;
  uint64_t bytes = 0;
  if (!ParseByteCount(v, &bytes) || bytes == 0) {
    std::lock_guard<std::mutex> lock(g_warnings_mu);
    Warnings().push_back(std::string("FLEXLINK_XPROC_SLOT_BYTES='") + v +
                         "': expected a positive byte count such as 1048576, 256K or 4M; using the defaults (1M for "
                         "CPU groups, 4M for GPU groups' pcie staging)");
    return 0;
  }
  return static_cast<size_t>(bytes);
}
std::atomic<size_t> g_xproc_slot_bytes{SlotBytesFromEnv()};

// A byte count from `name` (0 or "off": never, UINT64_MAX), else `fallback` (`fallback_text` in the
// warning a bad value gets).
uint64_t DirectBytesFromEnv(const char* name, uint64_t fallback, const char* fallback_text) {
  const char* v = std::getenv(name);
  if (!v || std::string_view(v).find_first_not_of(" \t") == std::string_view::npos) return fallback;
  if (std::string_view(v) == "off") return UINT64_MAX;
  uint64_t bytes = 0;
  if (!ParseByteCount(v, &bytes)) {
    std::lock_guard<std::mutex> lock(g_warnings_mu);
    Warnings().push_back(std::string(name) + "='" + v +
                         "': expected a byte count such as 262144, 256K or 1M, or 0/off (never); using the default " +
                         fallback_text);
    return fallback;
  }
  return bytes == 0 ? UINT64_MAX : bytes;
}
std::atomic<uint64_t> g_xproc_direct_bytes{DirectBytesFromEnv("FLEXLINK_XPROC_DIRECT_BYTES", uint64_t{64} << 10, "64K")};
std::atomic<uint64_t> g_xproc_direct_reduce_bytes{
    DirectBytesFromEnv("FLEXLINK_XPROC_DIRECT_REDUCE_BYTES", UINT64_MAX, "off")};

int64_t SpinFromEnv() {
  const char* v = std::getenv("FLEXLINK_SPIN_US");
  if (!v || std::string_view(v).find_first_not_of(" \t") == std::string_view::npos) return kAutoSpin;
  char* end = nullptr;
  const long long us = std::strtoll(v, &end, 10);
  if (end != v && std::string_view(end).find_first_not_of(" \t") == std::string_view::npos && us >= 0 &&
      us <= kMaxSpinMicros)
    return static_cast<int64_t>(us);
  std::lock_guard<std::mutex> lock(g_warnings_mu);
  Warnings().push_back(std::string("FLEXLINK_SPIN_US='") + v + "': expected microseconds from 0 to " +
                       std::to_string(kMaxSpinMicros) + " such as 50 (0: never spin); using the engine's choice");
  return kAutoSpin;
}
std::atomic<int64_t> g_spin_micros{SpinFromEnv()};
// From 1 MiB: through JAX (fresh outputs, XLA's threads beside the ranks) the traffic it saves
// outweighs its second barrier per step from there on, with 4 processes and with 2 x 4 ranks on 2
// cores (docs/xproc.md, "Two-phase all_reduce"). Not read from the environment: every rank of a
// group must take the same decision, and every process of a job runs the same build.
std::atomic<uint64_t> g_xproc_two_phase_bytes{uint64_t{1} << 20};
std::string& CachePath() {
  static auto* path = new std::string();
  return *path;
}

}  // namespace

int64_t SpinMicros() { return g_spin_micros.load(); }
void SetSpinMicros(int64_t micros) { g_spin_micros.store(micros < 0 ? kAutoSpin : std::min(micros, kMaxSpinMicros)); }

bool ParseByteCount(std::string_view text, uint64_t* out) {
  const size_t b = text.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return false;
  text = text.substr(b, text.find_last_not_of(" \t\r\n") - b + 1);
  size_t digits = 0;
  uint64_t value = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') {
    if (value > (uint64_t{1} << 63) / 10) return false;
    value = value * 10 + static_cast<uint64_t>(text[digits] - '0');
    ++digits;
  }
  if (digits == 0) return false;
  std::string suffix;
  size_t at = digits;
  while (at < text.size() && (text[at] == ' ' || text[at] == '\t')) ++at;  // "4 M", as Python reads it
  for (char c : text.substr(at)) suffix += static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
  int shift = 0;
  if (suffix.empty()) shift = 0;
  else if (suffix == "K" || suffix == "KB" || suffix == "KIB") shift = 10;
  else if (suffix == "M" || suffix == "MB" || suffix == "MIB") shift = 20;
  else if (suffix == "G" || suffix == "GB" || suffix == "GIB") shift = 30;
  else return false;
  if (value > ((uint64_t{1} << 63) >> shift)) return false;
  *out = value << shift;
  return *out <= (uint64_t{1} << 63);
}

std::vector<std::string> ConfigWarnings() {
  XprocSlotBytes();  // its environment value is read at static initialisation, before this
  XprocDirectBytes();
  XprocDirectReduceBytes();
  std::lock_guard<std::mutex> lock(g_warnings_mu);
  return Warnings();
}

bool ValidTimeoutSeconds(double seconds) { return seconds > 0 && seconds <= kMaxTimeoutSeconds; }
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
size_t XprocSlotBytesOr(size_t fallback) {
  const size_t set = XprocSlotBytes();
  return set ? set : fallback;
}
void SetXprocSlotBytes(size_t bytes) { g_xproc_slot_bytes.store(bytes, std::memory_order_relaxed); }
uint64_t XprocTwoPhaseBytes() { return g_xproc_two_phase_bytes.load(std::memory_order_relaxed); }
void SetXprocTwoPhaseBytes(uint64_t bytes) { g_xproc_two_phase_bytes.store(bytes, std::memory_order_relaxed); }
uint64_t XprocDirectBytes() { return g_xproc_direct_bytes.load(std::memory_order_relaxed); }
void SetXprocDirectBytes(uint64_t bytes) { g_xproc_direct_bytes.store(bytes, std::memory_order_relaxed); }
uint64_t XprocDirectReduceBytes() { return g_xproc_direct_reduce_bytes.load(std::memory_order_relaxed); }
void SetXprocDirectReduceBytes(uint64_t bytes) {
  g_xproc_direct_reduce_bytes.store(bytes, std::memory_order_relaxed);
}

int DebugLevel() { return g_debug_level.load(std::memory_order_relaxed); }
void SetDebugLevel(int level) { g_debug_level.store(level, std::memory_order_relaxed); }
void LogInfo(const std::string& msg) {
  if (DebugLevel() >= kDebugInfo) std::fprintf(stderr, "flexlink: %s\n", msg.c_str());
}

void LogWarning(const std::string& msg) {
  // A Status message carries its own "flexlink: " (Located): said once.
  const char* text = msg.rfind("flexlink: ", 0) == 0 ? msg.c_str() + 10 : msg.c_str();
  std::fprintf(stderr, "flexlink: warning: %s\n", text);
}

}  // namespace flexlink
