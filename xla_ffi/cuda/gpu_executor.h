// The GPU executor: one group's calls, split across its links, enqueued on XLA's stream.
//
// Per call (every rank on its own XLA device thread, concurrently):
//   1. poll: this rank reads its completed timing events of earlier calls (never blocks); a call
//      every rank has read is reported to the balancer (stage 2) and the statistics (gpu_timing.h);
//   2. the call's first rank takes the plan (one per call, shared through the CallContext, so all
//      ranks cut identical ranges) and stage 1's decision for this call (gpu_profile.cc);
//   3. arrival: the host rendezvous of the group's ranks (core/rendezvous.h: every rank's
//      descriptor, the same checks and messages as on CPU, the deadline);
//   4. the group's first call sets everything up here, once, for all ranks (streams, events,
//      NCCL communicators, pinned pools, scratch, kernels loaded), while the others wait;
//   5. enqueue: stage 1's profile when this call runs it (on its own stream, before the call's
//      work); a timing event on XLA's stream; each link with a range either directly on XLA's
//      stream (one link) or on its own side stream, forked from XLA's stream with that event and
//      joined back with the link's end event; then return. The host never waits for the device.
//      Every stream forked from XLA's stream is joined back also when the call fails half way
//      (here, and inside the links for their own streams), and a failed call's ranges are watched
//      by the hang detector like any others, which bounds what such a join can wait for.
// Faults and health (docs/faults.md, "GPU links"): the call's shares leave out unhealthy links (and
// give one due for a probe a small range); with faults injected, every rank asks each link whether
// its range may be enqueued and the ranks agree at a host barrier before anything is enqueued, so a
// refused range is enqueued on another link of the same call (Agree). Injected slow and hang faults
// go onto the link's stream as device work (a delay after the range, a wait on a host flag before it).
//
// Health from the device (docs/faults.md, "GPU links"): the event times read a call or more later
// feed GroupHealth against stage 1's fits, as the CPU executor's do (degraded), and a hang detector
// gives every link's range a deadline (LinkBudgetSeconds, from the moment every rank's device was
// seen to reach the call: start_board.h; a rank whose peers never reach it breaks the group past
// the global timeout, naming them). Polling (PollTimings) runs at every call and on the engine's
// watchdog thread (Watch); a range past its deadline marks the link unhealthy, breaks the group (every later call
// fails at once, naming the hung call) and releases the stream: the rank's hang flags are set, and
// the watchdog aborts the group's NCCL communicators once no rank is inside a call.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/communicator.h"
#include "xla_ffi/core/entry_word.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/faults.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/rendezvous.h"
#include "xla_ffi/cuda/device_api.h"
#include "xla_ffi/cuda/device_ledger.h"
#include "xla_ffi/cuda/gpu_faults.h"
#include "xla_ffi/cuda/gpu_link.h"
#include "xla_ffi/cuda/gpu_link_set.h"
#include "xla_ffi/cuda/gpu_profile.h"
#include "xla_ffi/cuda/gpu_timing.h"
#include "xla_ffi/cuda/setup_once.h"
#include "xla_ffi/cuda/start_board.h"
#include "xla_ffi/plan/balancer.h"
#include "xla_ffi/plan/ranges.h"

namespace flexlink::gpu {

class SplitLog;

class GpuExecutor {
 public:
  GpuExecutor(GroupInfo group, std::shared_ptr<const GpuLinkSet> links, plan::BalancerOptions options,
              DeviceApi* api, SplitLog* splits);
  GpuExecutor(const GpuExecutor&) = delete;
  GpuExecutor& operator=(const GpuExecutor&) = delete;

  const GroupInfo& group() const { return group_; }
  Communicator& comm() { return comm_; }
  plan::Balancer& balancer() { return balancer_; }
  const std::vector<std::string>& link_names() const { return names_; }
  const std::string& links_spec() const { return links_->spec; }
  uint64_t links_version() const { return links_->version; }
  GroupHealth& health() { return *health_; }

  // One rank's part of one call: returns once its work is enqueued on `stream`.
  Status Run(CallContext& ctx, int rank, const CallDesc& desc, Stream stream);
  // Reads every rank's completed timing events now (stats() from Python, so that the counters do
  // not wait for the group's next call); never blocks on the device.
  void PollAll();
  // The watchdog's tick (GpuEngine): PollAll, which also finds ranges past their deadline, and the
  // release of a broken group's communicators once no rank is inside one of its calls. Never blocks
  // on the device, nor on a host wait longer than a lock.
  void Watch();
  // The engine's shutdown (GpuEngine::Shutdown, ReleaseEarlierLinks; gpu_release.cc), from its thread, with no rank
  // inside a call (the watchdog may still run: Release holds release_mu_, which Watch and PollAll
  // try). Drained: nothing the group made is still in use on a device (never blocks; *busy says
  // what is). Release: once drained, every link's communicators ended and everything the set-up
  // and stage 1 made released; PollAll and Watch do nothing afterwards.
  bool Drained(std::string* busy);
  // Drained as far as the set-up's ledgers tell (every stream and event they made idle), which is
  // safe while calls of the group run (the ledgers lock; stage 1's events, made on the call path,
  // are left out, but their work runs on the profile stream, a ledger's): whether the group's
  // devices are busy with its work, for GpuEngine::ReleaseEarlierLinks' shared-device rule.
  bool Idle(std::string* busy);
  // `why` is what a call that still found the group would be told (none should: the engine refuses
  // calls after its shutdown, and calls of later link sets find their own groups).
  Status Release(double timeout_s, std::string_view why);
  bool released() const { return released_all_.load(std::memory_order_acquire); }

  // The ranks inside a call of the group (GpuEngine), retired once the engine took it out of use
  // (ReleaseEarlierLinks). A rank stays inside until its part of the call is enqueued, so a retired
  // group gets no new work. A plain member, as the CPU groups' and cross-process entries' word, for
  // the shared release pass (RetireEarlier).
  EntryWord entry;
  // The group's health record, for the engine to register (groups of the current links only).
  std::shared_ptr<GroupHealth> health_record() const { return health_; }

  // Timing ring per rank: how many calls may be in flight on the device, per rank, before the
  // oldest one's times are given up.
  static constexpr size_t kTimingSlots = 16;

 private:
  friend class GpuProfiler;
  struct Slot {
    Event start = nullptr;
    std::vector<Event> stop;  // per link
    std::vector<size_t> used;
    uint64_t record = 0;  // its timing record; 0 for a failed call (watched, never reported)
    // Published: set under the rank's slots_mu once every field above and below is filled; the
    // poll reads nothing else of a slot that is not busy (Enqueue fills it without the lock).
    bool busy = false;
    // The hang detector's: the call, its kind, each used link's deadline (seconds from the moment
    // a poll saw every rank's device reach the call, i.e. the ranges could run: start_board.h).
    uint64_t call = 0;
    Kind kind = Kind::kAllReduce;
    std::vector<double> budget;
    CallClock clock;
    // Recorded before stage 1's profile when the call runs one (`profiled`): the clock then starts
    // there, not at `start`, which times the call's own work after the profile.
    Event before = nullptr;
    bool profiled = false;
  };
  struct Rank {
    // The rank's timing slots are read by its device thread and by PollAll (another thread). Held
    // only to claim a slot and to publish it (Enqueue), never across the links' enqueues, which may
    // wait on the host (the pcie gate, NCCL's host calls): stats() and the watchdog poll meanwhile.
    std::mutex slots_mu;
    std::vector<Stream> side;  // per link
    ProfileRank profile;  // stage 1's stream and events
    std::vector<Slot> slots;
    size_t next_slot = 0;
    // The latest call this rank's host gave up before anything watched reached its stream. Put on
    // the board only once no earlier call is pending on its device (PollTimings): the board's word
    // is a max, and this rank's device may still be behind the calls before it.
    uint64_t gave_up = 0;
    // Pinned host word an injected hang's stream waits on (DeviceApi::WaitFlag); 0 until the hang
    // detector releases it, then 1 for good (the group is broken, nothing waits on it again).
    uint32_t* hang_flag = nullptr;
  };
  struct CallState {
    std::shared_ptr<const plan::Plan> plan;
    std::vector<plan::UnitRange> ranges;  // per link, of the call's virtual bytes
    uint64_t record = 0;                  // its timing record
    ProfileAction profile;                // stage 1's part of this call, if any
    uint64_t call = 0;                    // the group's call number (health, probes)
    std::vector<double> shares;           // the plan's, less unhealthy links, plus a probe
    bool masked = false;                  // shares differ from the plan's
    int probe = -1;                       // the link probed in this call
    std::vector<char> unhealthy;          // per link, at the call's start (the same for every rank)
    std::shared_ptr<const FaultSet> faults;  // the faults of this call, the same for every rank
    std::vector<plan::AlphaBeta> fits;       // stage 1's for the kind, empty without (predictions)
    std::string broken;                      // the group was broken when the call began: its error
    std::atomic<int> left{0};                // ranks that left Run (the last one ends the host part)
    // The agreement (Agree), written by every rank under mu.
    std::mutex mu;
    std::vector<std::vector<char>> failed;  // [round][source link]: its range was refused there
    std::vector<std::string> errors;        // per link, its first refusal
    std::vector<std::pair<size_t, size_t>> moves;  // (source, carrier), recorded by rank 0
    std::vector<std::string> unprepared;            // AgreeProfile: the ranks that could not, and why
    bool recorded = false;
  };
  // Per link, the ranges of the call's virtual bytes this rank enqueues on it (its own and those it
  // carries for failed links).
  using Assignment = std::vector<std::vector<plan::UnitRange>>;
  using Effects = std::vector<FaultyGpuChannel::Effect>;  // per link, this rank's injected device work

  Status EnsureSetup(int rank, std::string_view label);
  Status SetupAll();
  // `profile`: stage 1's phase runs first, with this rank's scratch (null: none in this call).
  void PollAllLocked();  // PollAll under release_mu_
  Status Enqueue(CallContext& ctx, int rank, const CallDesc& desc, Stream stream, const CallState& state,
                 const Assignment& work, const Effects& effects, ProfileScratch* profile);
  // The call runs stage 1's phase: every rank makes its scratch, then all agree, so that one that
  // cannot (out of memory) makes every rank skip the phase before any enqueues an NCCL operation of
  // it (the profile ends with a warning; the group stays usable). *run: the phase goes ahead.
  Status AgreeProfile(CallContext& ctx, int rank, Stream stream, CallState& state, ProfileScratch* scratch,
                      bool* run);
  // With faults injected: asks each link for this rank's ranges, agrees with the other ranks on
  // the refused ones and moves each to a carrier; an error when a range is left with no link.
  // *effects: the slow and hang faults that fired on the links that carry ranges.
  Status Agree(CallContext& ctx, int rank, const CallDesc& desc, CallState& state, Assignment* work,
               Effects* effects);
  // Predicted seconds of `message_bytes` (nccl-tests bytes) on link i: stage 1's fit, else the
  // link's rate measured in calls without injected delays, else a pessimistic 100 MB/s.
  double Predict(const CallState& state, size_t link, double message_bytes);
  // A range past its deadline (PollTimings, under the rank's slots_mu): health, the group broken,
  // the streams' hang flags released.
  void Hung(const Slot& slot, size_t link, double waited);
  // Peers that never reached the slot's call on their devices within the global timeout of this
  // rank's (start_board.h): the group broken, naming them, the streams' hang flags released.
  void PeersLate(const Slot& slot, const ClockReading& reading);
  // The break itself (the hang detector's, or a rank's stage 1 that could not be enqueued): `reason`
  // is what every later call's error says; `link`, when one link's range hung, becomes unhealthy.
  void Break(uint64_t call, const std::string& reason, std::optional<size_t> link);
  // Rank 0, once per call, after the agreement or a clean enqueue: health and the failover log.
  void RecordHealth(CallState& state, const CallDesc& desc, bool enqueued, double seconds);
  void PollTimings(int rank);
  // This rank's host gave `call` up before anything watched reached its stream (Rank::gave_up).
  void GaveUp(int rank, uint64_t call);
  std::string RankName(int rank) const;  // "rank 2 (device 2)", as the group's messages name it
  // Reads a slot whose events completed: true when it was read (or given up on error).
  bool ReadSlot(int rank, Slot& slot);
  void Report(const TimingRecord& record);

  const GroupInfo group_;
  const std::shared_ptr<const GpuLinkSet> links_;
  const std::vector<std::string> names_;
  DeviceApi& api_;
  SplitLog* const splits_;
  // How long its device threads spin before they sleep (GroupInfo::spin): at the rendezvous (comm_)
  // and at the locks they all take at every call (core/spin.h).
  const std::chrono::nanoseconds spin_;
  Communicator comm_;
  plan::Balancer balancer_;
  std::vector<std::unique_ptr<FaultyGpuChannel>> channels_;
  std::shared_ptr<GroupHealth> health_;
  std::vector<Rank> ranks_;
  TimingBook timings_;
  GpuProfiler profiler_;
  StartBoard board_;  // the latest call each rank's device reached (the hang detector's clocks)

  FaultCounter absent_calls_;  // the group's calls per rank, for injected rank:absent
  SetupOnce setup_;  // the group's set-up (streams, events, NCCL communicators, pinned pools)
  DeviceLedger ledger_{api_};  // what SetupAll made itself (the links keep their own)
  // Release against the watchdog and stats(): held by Release; Watch and PollAll only try it and
  // skip the group when it is held, so nothing polls an event Release destroys, and nothing waits
  // behind a release that waits on its device (the watchdog runs on while other groups are kept).
  std::mutex release_mu_;
  std::atomic<bool> released_all_{false};  // Release ran: nothing of the group is left to poll

  // Rates measured without injected delays, per link: seconds per nccl-tests byte (0: none yet).
  std::mutex rate_mu_;
  std::vector<double> clean_rate_;
  // The hang detector's verdict and the release of the group's communicators.
  mutable std::mutex broken_mu_;
  std::string broken_;            // set once: what every later call's error says
  Clock::time_point broken_at_;
  bool released_ = false;        // communicators aborted (Watch)
  int host_calls_ = 0;           // calls begun before the break whose ranks have not all left Run
};

// Per-rank ranges of recent calls (tests of "one split per call"); off unless enabled.
class SplitLog {
 public:
  void SetEnabled(bool on) { on_.store(on); }
  bool enabled() const { return on_.load(std::memory_order_relaxed); }
  void Add(SplitRecord record);
  std::vector<SplitRecord> Take();

 private:
  std::atomic<bool> on_{false};
  std::mutex mu_;
  std::vector<SplitRecord> records_;
};

}  // namespace flexlink::gpu
