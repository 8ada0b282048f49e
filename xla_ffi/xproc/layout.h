// The layout of a cross-process group's segment (docs/xproc.md). Every process maps the same bytes;
// the words that ranks wait on are 32-bit atomics used as shared futexes.
//
//   Header (one page)            magic, version, n, slot sizes, offsets, abort word and message
//   devices   int64[n]           the group's global device ids in rank order
//   RankBlock[n]                 one cache line each: arrival counter, pid, device, arrival times
//   TimesSlot[n][2]              several links: each rank's per-link seconds of a call, by parity
//   ProfileTimes[n]              GPU groups: each rank's times of stage 1's latest phase
//   data      [2][n] slots       slot = Fingerprint area + slot_bytes of staged data
//   results   [2] slot_bytes     two-phase all_reduce: rank r's reduced slice of each step
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace flexlink::xproc {

inline constexpr uint64_t kMagic = 0x4b4e494c58454c46ull;  // "FLEXLINK" little-endian
// 2: plan slots in the header, times slots per rank; 3: failover masks in the times slots;
// 4: arrival times in the rank blocks (straggler detection); 5: the leader's unhealthy links and
// stage-1 fits in the plan slot, failover masks per round parity (several failover rounds);
// 6: GPU groups' stage 1 (the profile fields of the plan slot, ProfileTimes); 7: the plan slot's
// measured and profiled bytes; 8: the rank blocks' device_reached (GPU groups' hang detector);
// 9: GPU groups' stage-1 agreement (TimesSlot::failed[1] and a barrier in every profiling call);
// 10: the rank blocks' `closed` (a GPU engine's shutdown, seen by the other processes' waits);
// 11: the rank blocks' `sleepers` (a barrier wakes only when someone sleeps); 12: the rank blocks'
// `direct` and `direct_kib` (all_gather reading the peers' inputs, process_group.h); 13: the rank
// blocks' `direct_reduce_kib` (all_reduce reading them); 14: the rank blocks' `cpu` (a waiter polls
// for a peer on another CPU), which makes a rank block two cache lines
inline constexpr uint32_t kLayoutVersion = 14;
inline constexpr size_t kAbortMessageBytes = 3072;
// A call's description (kind, op, every part's dtype and shape, ppermute's sources) travels in the
// slot of the call's first step, so it is double-buffered with the data for free: the same
// one-barrier argument that protects the data protects it (docs/xproc.md, "Steps").
inline constexpr size_t kFingerprintBytes = 4096;

// Several links across processes (xproc_executor.h): the most links one group splits a call across.
inline constexpr size_t kMaxXprocLinks = 8;

// The leader's (rank 0's) plan for call `call`, in slot call & 1: written by the leader before it
// arrives at the call, read by every rank right after the call's arrival (the acquire on the
// leader's counter makes it visible). Rewritten for call + 2 only after the leader passed call + 1's
// arrival, by which every rank has read it.
struct PlanSlot {
  uint64_t call;   // the group's call number (1, 2, ...) the plan is for
  uint64_t epoch;  // the leader's Plan epoch (messages, tests)
  uint32_t mode;   // plan::PlanMode
  uint32_t links;  // how many links the leader's group has (processes must agree)
  double shares[kMaxXprocLinks];
  // Health and fits as the leader sees them, so that every process decides the same from the same
  // bytes (docs/faults.md, "Across processes"): bit i of `unhealthy`: link i is unhealthy (never a
  // failover carrier, even while probed; GPU groups also use bits 30 and 31 as flags, gpu_xproc.h); `has_fits`: alpha/beta are the leader's stage-1 fits for
  // the call's kind (per-link deadlines and degraded detection predict from them), else none.
  uint32_t unhealthy;
  uint32_t has_fits;
  double alpha[kMaxXprocLinks], beta[kMaxXprocLinks];
  // With has_fits, the rest of the leader's model of the kind (slot_model.h), so that every process
  // reports the model the leader plans with, wherever it came from (stage 1, the tuning cache,
  // tune()): `has_measured`: `measured_bytes` is stage 1's measured split threshold; `profiled_bytes`:
  // the largest size it profiled (layout version 7).
  uint32_t has_measured;
  uint64_t measured_bytes;
  uint64_t profiled_bytes;
  // GPU groups' stage 1 (cuda/gpu_xproc_profile.h): every rank enqueues phase `profile_phase` (0:
  // none, 1: every link alone, 2: the split check from the fits in alpha/beta, has_fits set) of
  // profile `profile_id` for the call's kind up to `profile_top` bytes, dropping shares below
  // `profile_min_share`: the leader's numbers, so that every process enqueues the same NCCL
  // operations in the same order.
  uint32_t profile_phase;
  uint32_t profile_id;
  uint64_t profile_top;
  double profile_min_share;
};

// One rank's times of call `call` (slot call & 1), written at the end of the call, before the rank
// arrives at the next; read by the leader after call + 1's arrival (every rank finished `call`).
// Rewritten for call + 2 only after call + 2's arrival, which the leader enters after reading.
struct alignas(64) TimesSlot {
  uint64_t call;
  uint32_t links;
  uint32_t ok;  // 1: the call succeeded on this rank
  // Failover (docs/faults.md): bit i set when link i's range (in round r: its re-run) failed on this
  // rank in `call`, in [r & 1] (written before round r's agreement barrier, read by every rank
  // between it and the next, rewritten for round r + 2 only after the next, which every reader has
  // reached); `touched`: it may have written buffers first. GPU groups' stage 1 uses failed[1] as
  // round -1 before those (non-zero: the rank could not make its scratch for the call's phase).
  uint32_t failed[2];
  uint32_t touched[2];
  double call_seconds;
  double seconds[kMaxXprocLinks];
};

// One rank's times of a GPU group's stage-1 phase (cuda/gpu_xproc_profile.h): the rank writes
// `ok`, `steps` and `seconds` once the phase's events completed on its device, then `tag` (release);
// the leader reads them after an acquire of `tag`. A rank rewrites them only for a later phase,
// which the leader starts only after it has read every rank's times of this one.
inline constexpr size_t kMaxProfileSteps = 256;
struct alignas(64) ProfileTimes {
  uint64_t tag;    // (profile id << 2) | phase of the times below; 0: none yet
  uint32_t ok;     // 0: the device failed the phase on this rank
  uint32_t steps;  // the phase's steps (their count must match the leader's)
  double seconds[kMaxProfileSteps];
};

inline constexpr uint32_t kAbortNone = 0, kAbortWriting = 1, kAbortSet = 2;

struct Header {
  uint64_t magic;  // written last by the creator (release): an attacher never sees a half-made header
  uint32_t version;
  uint32_t n;
  uint64_t slot_bytes;   // data bytes of one slot
  uint64_t slot_stride;  // kFingerprintBytes + slot_bytes
  uint64_t total_bytes;
  uint64_t devices_offset, ranks_offset, times_offset, profile_offset, data_offset, results_offset;
  uint32_t creator_pid;
  // How many processes the group spans, as the creator was told at set-up (Python's processes.py
  // counts the processes owning its devices); 0: not said. Part of the tuning cache's key (layout 7).
  uint32_t processes;
  alignas(64) std::atomic<uint32_t> abort;  // kAbort*; a futex word nobody waits on, read between slices
  int32_t abort_rank;
  char abort_message[kAbortMessageBytes];
  alignas(64) PlanSlot plans[2];
};
static_assert(sizeof(Header) <= 4096);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

// One rank's control block, on its own cache line: peers poll `arrived` while its owner writes it.
struct alignas(64) RankBlock {
  std::atomic<uint32_t> arrived;  // steps this rank has staged, over all calls (wraps)
  std::atomic<int32_t> pid;       // 0 until the rank's process attached
  int64_t device;
  int32_t process_index;
  // Nonzero once the rank's process shut its GPU engine down (GpuEngine::Shutdown, after the calls
  // inside it returned): the rank arrives at nothing more, so a peer waiting for it fails at once,
  // as for an exited process, instead of at its deadline. Written by the rank's process only.
  std::atomic<uint32_t> closed;
  // steady_clock nanoseconds (CLOCK_MONOTONIC: one clock for every process of the host) of this
  // rank's arrival at a call, by the parity of the call's first step: written before the release of
  // `arrived`, read by the leader after its acquire (straggler detection, core/stragglers.h). The
  // slot is rewritten two arrivals later, which needs the leader past the barrier in between, so
  // the leader always reads the call it waited at.
  std::atomic<int64_t> arrived_ns[2];
  // GPU groups (cuda/start_board.h): the latest of the group's calls this rank's device has
  // reached, which starts its peers' hang-detector clocks; written by the rank's process only.
  std::atomic<uint64_t> device_reached;
  // Ranks (of any process) asleep on this block's `arrived` futex: a rank that arrives issues the
  // futex wake, a system call, only when someone sleeps (a seq_cst fence on both sides, as in
  // ProcessGroup::Barrier and WaitArrived).
  std::atomic<uint32_t> sleepers;
  // Whether this rank can read every peer's memory (process_vm_readv; kDirect*), and its
  // XprocDirectBytes in KiB (UINT32_MAX: never), written once at the group's first call, before a
  // barrier after which every rank reads every rank's (ProcessGroup::AgreeDirect).
  std::atomic<uint32_t> direct;
  uint32_t direct_kib;
  uint32_t direct_reduce_kib;  // XprocDirectReduceBytes in KiB, published with `direct_kib`
  // The CPU this rank's thread ran on at its latest arrival (sched_getcpu, -1 unknown; layout
  // version 14), written before the release of `arrived`: a peer waiting for this rank polls only
  // while they run on different CPUs (ProcessGroup::WaitArrived).
  std::atomic<int32_t> cpu;
};
static_assert(sizeof(RankBlock) == 128);
inline constexpr uint32_t kDirectUnknown = 0, kDirectYes = 1, kDirectNo = 2;
static_assert(std::atomic<uint64_t>::is_always_lock_free);

inline constexpr size_t RoundUp(size_t x, size_t m) { return (x + m - 1) / m * m; }

struct Layout {
  size_t devices_offset, ranks_offset, times_offset, profile_offset, data_offset, results_offset, slot_stride,
      total_bytes;
};

inline Layout ComputeLayout(uint32_t n, size_t slot_bytes) {
  Layout l;
  l.devices_offset = 4096;
  l.ranks_offset = RoundUp(l.devices_offset + n * sizeof(int64_t), 64);
  l.times_offset = RoundUp(l.ranks_offset + n * sizeof(RankBlock), 64);
  l.profile_offset = RoundUp(l.times_offset + 2 * size_t{n} * sizeof(TimesSlot), 64);
  l.data_offset = RoundUp(l.profile_offset + size_t{n} * sizeof(ProfileTimes), 4096);
  l.slot_stride = kFingerprintBytes + slot_bytes;
  l.results_offset = l.data_offset + 2 * size_t{n} * l.slot_stride;
  l.total_bytes = l.results_offset + 2 * slot_bytes;
  return l;
}

}  // namespace flexlink::xproc
