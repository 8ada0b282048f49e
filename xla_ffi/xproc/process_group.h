// A FlexLink group whose ranks live in several processes of one host: a shared segment (layout.h)
// and the step protocol over it (docs/xproc.md). One object per process and group; every local rank's
// device thread calls Run for its own rank.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/status.h"
#include "xla_ffi/core/stragglers.h"
#include "xla_ffi/xproc/layout.h"
#include "xla_ffi/xproc/segment.h"
#include "xla_ffi/xproc/steps.h"

namespace flexlink::xproc {

// Whether `pid` is gone: no such process, or a zombie (dead, not reaped yet by its parent). The
// liveness rule of every cross-process wait (and of the simulated NCCL across processes).
bool ProcessGone(int32_t pid);

// A CPU group's slot when nothing asks for another size (FLEXLINK_XPROC_SLOT_BYTES). A rank's two
// slots (double-buffered) then fit its core's L2 (2 MiB here), so what a rank stages is still cached
// when it and its peers copy it out: issue 13's command with 1 MiB against 4 MiB slots, six launches
// each, medians (docs/xproc.md, "Slot size"): 2 processes all_gather 64 MiB 17.2 against 18.4 ms,
// all_reduce 16 MiB 3.05 against 3.63 ms and 64 MiB 22.7 against 25.7 ms; 4 processes all_reduce
// 16 MiB 8.12 against 9.24 ms. 512 KiB and 2 MiB slots were slower than 1 MiB at 64 MiB.
inline constexpr size_t kCpuSlotBytes = size_t{1} << 20;

// The slot size a group of n ranks gets for a request (0: FLEXLINK_XPROC_SLOT_BYTES, else
// kCpuSlotBytes): at least 64 KiB, at most 256 MiB for the whole data area, a multiple of 4 KiB.
Status ChooseSlotBytes(size_t n, size_t requested, size_t* slot_bytes);

// How long a rank of a non-spinning group polls for a peer running on another CPU before it sleeps
// (ProcessGroup::SetAwayPoll): FLEXLINK_SPIN_US when set (0: never), else kAwayPoll. On this 2-vCPU
// VM a futex sleep and wake-up per barrier costs tens of µs, more than a 64 KiB call's own work;
// measured in docs/multiprocess.md, "Session 40".
inline constexpr std::chrono::microseconds kAwayPoll{100};
std::chrono::nanoseconds AwayPoll();

class ProcessGroup {
 public:
  // Creates the segment for `devices` (global ids in rank order) and claims `local_devices`.
  // `processes`: how many processes own `devices` (2..n; 0: not known, and the group then neither
  // reads nor writes the tuning cache).
  static Status Create(std::span<const int64_t> devices, std::span<const int64_t> local_devices,
                       size_t slot_bytes, int processes, std::unique_ptr<ProcessGroup>* out);
  // Maps segment `name`, checks its header against `devices` and claims `local_devices`.
  static Status Attach(const std::string& name, std::span<const int64_t> devices,
                       std::span<const int64_t> local_devices, std::unique_ptr<ProcessGroup>* out);
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // Rank `rank`'s part of one call (a local rank; zero-size calls never get here). Errors name the
  // collective by `label`; `run_id` only appears in messages.
  Status Run(int rank, const CallDesc& desc, std::string_view label, int64_t run_id);

  // Several links (xproc_executor.h). Arrive: the call's arrival as one step of the protocol with no
  // data: the fingerprint check, the outputs faulted in, and a barrier that makes what every rank
  // wrote before it (the leader's plan slot, every rank's times slot) visible after it. It counts the
  // call. RunPieces: only `pieces` of the call (a link's range, PiecesOf order) through the step
  // protocol, without a fingerprint (Arrive checked it); every rank runs the same pieces. Errors of
  // either fail the group (abort word) as Run's do.
  Status Arrive(int rank, const CallDesc& desc, std::string_view label, int64_t run_id);
  Status RunPieces(int rank, const CallDesc& desc, std::span<const Piece> pieces, std::string_view label,
                   int64_t run_id);
  // A barrier step with no data within the current call (the executor's failover agreement): what
  // every rank wrote before it is visible after it. Its failure fails the group as a step's does.
  Status Sync(int rank, const CallDesc& desc, std::string_view label, int64_t run_id);
  // For groups whose data moves elsewhere (the GPU engine's groups across processes, cuda/gpu_xproc.h):
  // the call's arrival (fingerprint + barrier + check, counting the call) and a barrier within the
  // call, as Arrive and Sync, but touching no output (they are device memory) and checking no slot
  // size (no data goes through the slots); messages name the group's link as `link`.
  Status ArriveWithoutData(int rank, const CallDesc& desc, std::string_view label, int64_t run_id,
                           std::string_view link);
  Status SyncWithoutData(int rank, const CallDesc& desc, std::string_view label, int64_t run_id,
                         std::string_view link, std::string_view what);
  // The GPU engine's pcie link across processes (cuda/pcie_xproc.h) stages through the data slots
  // (after the fingerprint area, which the arrival keeps using) and orders the devices with 32-bit
  // flags in the results area, which GPU groups do not use otherwise; the whole mapping is what it
  // registers as pinned memory.
  char* staging(int buffer, int rank) const { return Slot(buffer, rank) + kFingerprintBytes; }
  uint32_t* flag_words() const { return reinterpret_cast<uint32_t*>(results_); }
  size_t flag_bytes() const { return 2 * header_->slot_bytes; }
  char* mapping() const { return segment_->data(); }
  size_t mapping_bytes() const { return segment_->size(); }
  // Records `message` as the group's failure (first one wins) and wakes every waiter: another link's
  // error of this rank's call, so that the other processes fail fast with the reason.
  void Abort(int rank, const std::string& message) { Fail(rank, message); }
  bool aborted() const { return header_->abort.load(std::memory_order_acquire) != kAbortNone; }
  PlanSlot& plan_slot(uint64_t call) { return header_->plans[call & 1]; }
  TimesSlot& times_slot(int rank, uint64_t call) { return times_[static_cast<size_t>(rank) * 2 + (call & 1)]; }
  ProfileTimes& profile_times(int rank) { return profile_[rank]; }
  uint64_t rank_calls(int rank) const { return calls_[rank].load(std::memory_order_relaxed); }
  // GPU groups' start board (cuda/start_board.h): rank `rank`'s word in its control block.
  std::atomic<uint64_t>* device_reached(int rank) const { return &ranks_[rank].device_reached; }

  const std::string& name() const { return segment_->name(); }
  const std::vector<int64_t>& devices() const { return devices_; }
  const std::vector<int64_t>& local_devices() const { return local_; }
  bool is_local(int rank) const { return local_rank_[rank] != 0; }
  size_t slot_bytes() const { return header_->slot_bytes; }
  int size() const { return static_cast<int>(devices_.size()); }
  // How many processes the group spans, as its creator was told (0: not known).
  int processes() const { return static_cast<int>(header_->processes); }
  uint64_t calls() const;  // calls started by this process's ranks (the most of any local rank)
  // For waits outside the step protocol (the GPU engine's communicator set-up across processes,
  // cuda/gpu_xproc.cc): the ranks that will arrive at nothing more, their attached process exited or
  // closed (the barrier's liveness test), each as messages name it ("rank 2 (device 2048, pid
  // 12345) exited"), and a rank as messages name it ("rank 2 (device 2048, pid 12345)").
  // ExitedRanks: only those whose process is gone, for the hang detector, whose clocks wait for
  // what a rank's device reached: a closed rank's device still runs what its host enqueued.
  std::vector<int> LeftRanks() const { return Gone(true); }
  std::vector<int> ExitedRanks() const { return Gone(false); }
  std::string DescribeLeft(const std::vector<int>& ranks) const;
  std::string DescribeRank(int rank) const { return RankName(rank); }
  // This process's ranks (or local rank `rank`) arrive at nothing more (its GPU engine's shutdown,
  // once no call is inside it, or a call it refused): a peer waiting for one of them fails at once,
  // naming the shutdown, as for an exited process.
  void Close();
  void Close(int rank);
  std::optional<std::string> broken() const;
  // How long a rank waiting at a barrier polls its peers' counters before it sleeps on the futex: 0
  // (a few yields, then sleep) unless the owner sets it before the group's first call (the GPU
  // engine: gpu::XprocSpin, where each rank has a core).
  void SetSpin(std::chrono::nanoseconds spin) { spin_ = spin; }
  std::chrono::nanoseconds spin() const { return spin_; }
  // A group that does not spin (spin() 0): after its few yields, how long a waiting rank goes on
  // polling, yielding its CPU at each poll, while the rank it waits for last arrived from another
  // CPU, before it sleeps (docs/xproc.md, "Waits, liveness, abort"). AwayPoll() unless set before
  // the group's first call (tests and benches; 0: sleep after the yields, as before session 40).
  void SetAwayPoll(std::chrono::nanoseconds poll) { away_poll_ = poll; }
  std::chrono::nanoseconds away_poll() const { return away_poll_; }
  // The CPU rank `rank`'s thread ran on at its latest arrival (-1 before its first).
  int arrival_cpu(int rank) const { return ranks_[rank].cpu.load(std::memory_order_relaxed); }
  // Direct all_gather and all_reduce (docs/xproc.md): whether the group's ranks agreed that every
  // one of them can read every peer's memory, and from how many input bytes per rank Run reads the
  // peers' memory for `kind` (kAllGather or kAllReduce; UINT64_MAX: never) instead of staging;
  // nullopt until the group's first successful call through Run agreed. `direct_refusal`: why the
  // kind is never direct (empty otherwise).
  std::optional<uint64_t> direct_from(int rank, Kind kind) const;
  std::string direct_refusal(int rank, Kind kind) const;

 private:
  using Where = std::function<std::string()>;  // the call as messages name it
  ProcessGroup(std::unique_ptr<Segment> segment, std::span<const int64_t> devices,
               std::span<const int64_t> local_devices);
  Status Claim();
  std::string WhereText(std::string_view label, int64_t run_id, uint64_t call, const std::string& described) const;
  // The fingerprints of step buffer `buffer`, every rank's against rank 0's.
  Status CheckFingerprints(int buffer, std::string_view label, int64_t run_id, uint64_t call) const;
  // The steps of `cursor` (a whole call, or some pieces); `first` writes and checks the fingerprint
  // at its first step and faults in the outputs there.
  Status Steps(int rank, const CallDesc& desc, StepCursor& cursor, const Where& where, bool first,
               std::string_view label, int64_t run_id, uint64_t call);
  Status CheckSlotFits(const CallDesc& desc, const Where& where) const;
  // Direct all_gather (direct_gather.cc). AgreeDirect: once, after the group's first successful call
  // through Run, two barriers: every rank publishes its canary's address, tries to read every other
  // process's, and publishes its verdict and threshold; all then take the same decision.
  // UseDirect: the decision for one call, the same on every rank. RunDirectGather: the call with one
  // copy per byte (each peer's input read straight into the output) and two barriers (the arrival,
  // then "done reading", before which no rank returns and lets XLA reuse its input).
  Status AgreeDirect(int rank, const CallDesc& desc, const Where& where);
  enum class Direct { kNo, kGather, kReduce };
  Direct UseDirect(int rank, const CallDesc& desc) const;
  // A direct call's arrival: the fingerprint and every part's input and output addresses into this
  // rank's slot, the barrier, the fingerprints compared. *step: this rank's barrier count after it;
  // *buffer: the slot parity the addresses are in (PeerAddress reads them).
  Status ArriveDirect(int rank, const CallDesc& desc, const Where& where, std::string_view label, int64_t run_id,
                      uint64_t call, uint32_t* step, int* buffer);
  // Rank `rank`'s input (`output` false) or output address of part `part`, as ArriveDirect wrote it.
  uint64_t PeerAddress(int buffer, int rank, size_t part, bool output) const;
  Status RunDirectGather(int rank, const CallDesc& desc, const Where& where, std::string_view label, int64_t run_id,
                         uint64_t call);
  // Direct all_reduce (direct_reduce.cc): three barriers. After the arrival (every rank's input and
  // output addresses published) rank r reduces its slice of every part over every rank's input in
  // rank order, reading the peers' chunk by chunk into a scratch, into its own output;
  // after the second ("reduced") every rank reads every other slice from its owner's output; the
  // third ("done reading") keeps every input and output in place until nobody reads them.
  Status RunDirectReduce(int rank, const CallDesc& desc, const Where& where, std::string_view label, int64_t run_id,
                         uint64_t call);
  // The message and the group's failure for a read of rank `peer`'s memory the kernel refused.
  Status PeerReadFailed(int rank, const Where& where, int peer, const std::string& what, const std::string& why);
  char* Slot(int buffer, int rank) const {
    return data_ + (static_cast<size_t>(buffer) * devices_.size() + rank) * header_->slot_stride;
  }
  char* Result(int buffer) const { return results_ + static_cast<size_t>(buffer) * header_->slot_bytes; }
  // Publishes this rank's arrival at its next barrier (`*step` + 1) and waits for every rank there;
  // on failure records it for the whole group (Fail) unless it is another rank's report.
  Status Barrier(int rank, uint32_t* step, const Where& where, int step_of_call, bool fault_outputs,
                 const CallDesc& desc);
  std::string RankName(int rank) const;  // "rank 2 (device 2048, pid 12345)"
  std::vector<int> Gone(bool closed_too) const;
  bool Closed(int rank) const { return ranks_[rank].closed.load(std::memory_order_acquire) != 0; }
  Status WaitArrived(int rank, uint32_t target, const Where& where, int step_of_call);
  // The leader, after a call's arrival: who of the ranks came last, and how late (arrived_ns).
  void RecordArrivalOrder(int parity);
  Status AbortError(const Where& where);
  std::string AbortReason() const;  // "rank R (device D) reported: <message>" from the header
  // Records `message` as the group's failure (first failure wins) and wakes every waiter.
  void Fail(int rank, const std::string& message);
  void SetBroken(const std::string& reason);

  std::unique_ptr<Segment> segment_;
  Header* header_;
  RankBlock* ranks_;
  TimesSlot* times_;
  ProfileTimes* profile_;
  char* data_;
  char* results_;
  std::vector<int64_t> devices_, local_;
  std::vector<char> local_rank_;
  std::unique_ptr<std::atomic<uint64_t>[]> calls_;  // per rank
  // Who arrives last, recorded by the leader's process (rank 0 local) from the arrival times in
  // the rank blocks; the other processes' trackers stay empty (snapshots skip them).
  StragglerTracker stragglers_;
  std::atomic<bool> is_broken_{false};
  mutable std::mutex mu_;
  std::string broken_;
  std::chrono::nanoseconds spin_{0};
  std::chrono::nanoseconds away_poll_{AwayPoll()};
  // Per rank (only local ranks' entries are used, each by its own thread until agreed): kDirect*,
  // and the agreed threshold in bytes; the reason this rank could not read a peer.
  std::unique_ptr<std::atomic<uint32_t>[]> direct_state_;
  std::unique_ptr<std::atomic<uint64_t>[]> direct_from_, direct_reduce_from_;
  std::vector<std::string> direct_refusal_, direct_reduce_refusal_;
};

}  // namespace flexlink::xproc
