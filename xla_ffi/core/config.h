// Process-wide engine settings. Python sets them from FLEXLINK_* variables at import (one place reads
// the environment: jax_flexlink's config module); the engine only reads them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace flexlink {

// Deadline of every wait in the engine (arrival, phase barriers). Default 300 s. A deadline must be
// one: finite, positive, at most kMaxTimeoutSeconds (Python's configure() and FLEXLINK_TIMEOUT_S
// apply the same bound, jax_flexlink/_src/config.py).
inline constexpr double kMaxTimeoutSeconds = 1e6;
bool ValidTimeoutSeconds(double seconds);
double TimeoutSeconds();
void SetTimeoutSeconds(double seconds);

// A byte count as FLEXLINK_* variables spell it, the grammar of Python's config.parse_bytes: ASCII
// digits, then optionally K, KB, KiB, M, MB, MiB, G, GB or GiB (any case, binary multiples), with
// surrounding whitespace; false on anything else or past 2^63.
bool ParseByteCount(std::string_view text, uint64_t* out);
// Environment values the C++ side read and ignored (default used), one sentence each; Python turns
// them into warnings at import.
std::vector<std::string> ConfigWarnings();

// Per-rank input size up to which the shm link stages inputs and lets every rank reduce the whole
// call itself (one rendezvous per call instead of two). Default: see config.cc.
size_t ShmStagingBytes();
void SetShmStagingBytes(size_t bytes);

// Output size from which the shm link writes a separate (not in-place) output with non-temporal
// stores. Default: see config.cc.
size_t ShmStreamingSeparateBytes();
void SetShmStreamingSeparateBytes(size_t bytes);

// Whether large fresh outputs get transparent huge pages advised before they are written
// (core/pages.h). Default on.
bool HugePageOutputs();
void SetHugePageOutputs(bool on);

// Whether fresh outputs are faulted in with one madvise(MADV_POPULATE_WRITE) instead of a store per
// page (core/pages.h). Default off: the madvise holds the process's mmap lock for the whole range, and
// through XLA (which maps and unmaps large outputs on other threads every call) that made stalls of
// 100-700 ms; a store per page faults under the per-VMA lock. Falls back to stores where unsupported.
bool PopulateOutputs();
void SetPopulateOutputs(bool on);

// Stage 1 inside the engine (core/executor.h): a group's first call of a kind with at least this many
// bytes (nccl-tests size) and no fits for that kind profiles every link alone, at power-of-two sizes
// from 64 KiB up to that call's bucket but at most TuneMaxBytes, verifies the split, and caches the
// result. 0: never (stage 1 only from jax_flexlink.tune() or the cache). Default 1 MiB.
uint64_t AutotuneMinBytes();
void SetAutotuneMinBytes(uint64_t bytes);
uint64_t TuneMaxBytes();  // default 16 MiB
// Whether stage 1 in the engine may take fits from the tuning cache (default true; tune(use_cache=
// False) turns it off while it runs).
bool TuneUseCache();
void SetTuneUseCache(bool on);
void SetTuneMaxBytes(uint64_t bytes);
// The tuning cache file (plan/tuning_cache.h); empty: plan::DefaultCachePath().
std::string TuneCachePath();
void SetTuneCachePath(std::string path);

// Data bytes of one slot of a cross-process group's segment (xla_ffi/xproc/, docs/xproc.md) when
// the group's creator asks for the default: FLEXLINK_XPROC_SLOT_BYTES if set (read once, here: the
// one place the C++ side reads the environment, since processes create groups before Python could
// configure them), else 0: each kind of group has its own default (XprocSlotBytesOr; CPU groups
// xproc::kCpuSlotBytes, GPU groups' pcie staging gpu::kPcieStagingSlotBytes). The group clamps it
// to [64 KiB, 256 MiB / (2 n)]. SetXprocSlotBytes(0): the defaults again.
size_t XprocSlotBytes();
size_t XprocSlotBytesOr(size_t fallback);
void SetXprocSlotBytes(size_t bytes);
// Cross-process all_reduce of at least this many bytes per rank on 3+ ranks reduces in two phases
// (each rank its slice, then all copy; docs/xproc.md). Default: 1 MiB, see config.cc.
uint64_t XprocTwoPhaseBytes();
void SetXprocTwoPhaseBytes(uint64_t bytes);
// Cross-process all_gather of at least this many input bytes per rank (and at most 8 MiB, above
// which staging wins) reads the peers' inputs directly (process_vm_readv) instead of staging them
// through the segment, where every rank of the group can (xproc/peer_read.h, docs/xproc.md); the
// group's ranks agree on the largest of their values. FLEXLINK_XPROC_DIRECT_BYTES if set (read once,
// as the slot size; 0 or "off": never), else 64 KiB (below it, and below 512 KiB before the
// waits' away-poll made barriers cheaper, the second barrier costs what the copy saves: docs/xproc.md).
uint64_t XprocDirectBytes();
void SetXprocDirectBytes(uint64_t bytes);
// Cross-process all_reduce of at least this many bytes per rank reduces directly from the peers'
// inputs (each rank its slice, read chunk by chunk with process_vm_readv, then every rank reads the
// other slices from their owners' outputs) where the group agreed that every rank can read every
// peer (as for all_gather); the ranks agree on the largest value. FLEXLINK_XPROC_DIRECT_REDUCE_BYTES
// if set (read once; 0 or "off": never), else never: it lost at every size on the 2-core VM this was
// built on, whose kernel copies slower than user space (docs/xproc.md, "Direct all_reduce").
uint64_t XprocDirectReduceBytes();
void SetXprocDirectReduceBytes(uint64_t bytes);

// Logging on stderr (FLEXLINK_DEBUG): 0 off, kDebugInfo logs stage-1 results and plan changes.
inline constexpr int kDebugInfo = 1;
// FLEXLINK_SPIN_US: how many microseconds a rank of a GPU group waiting for its peers at the host
// rendezvous spins before it sleeps (0: never spins); kAutoSpin (unset) lets the GPU engine choose
// per group (gpu::ArrivalSpin). Groups across processes that do not spin take it as their
// away-poll's length (xproc::AwayPoll). Read once from the environment, a bad value warned about and
// ignored; SetSpinMicros for tests and benches (groups made later use it).
inline constexpr int64_t kAutoSpin = -1;
inline constexpr int64_t kMaxSpinMicros = 10000;
int64_t SpinMicros();
void SetSpinMicros(int64_t micros);

int DebugLevel();
void SetDebugLevel(int level);
// "flexlink: <msg>" on stderr at kDebugInfo and above.
void LogInfo(const std::string& msg);
// "flexlink: warning: <msg>" on stderr whatever the level: what the user must learn (something did
// not run as configured).
void LogWarning(const std::string& msg);

}  // namespace flexlink
