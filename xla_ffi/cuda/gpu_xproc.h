// GPU groups whose ranks live in several processes of one host (docs/multiprocess.md, "GPU groups
// across processes"). The in-process GPU executor (gpu_executor.h) meets its ranks' host threads in
// process memory and makes every rank's NCCL communicator from one thread; across processes neither
// is possible, so this executor reuses the CPU side's cross-process segment (xla_ffi/xproc/) for
// everything host-side and NCCL's own cross-process communicators for the bytes:
//
//   - set-up (at lowering, Python's processes.py): the leader process (the one with rank 0) creates
//     the group's segment and one NCCL identity per nccl link (CommApi::NewId); the segment name
//     and the identities travel through jax.distributed's key-value store; every other member
//     process attaches the segment with the identities (CreateGpuXprocGroup/AttachGpuXprocGroup);
//   - per call, every local rank on its own device thread:
//       1. the leader (rank 0) asks its balancer for the call's plan and writes it into the
//          segment's plan slot (call & 1), as the CPU's XprocExecutor does;
//       2. arrival: ProcessGroup::ArriveWithoutData, the segment's barrier with the fingerprint
//          check, liveness of every peer process (a dead one is named before the deadline, and the
//          failure is written into the segment so every process fails at once) and the deadline;
//       3. the group's first call sets up every local rank, from one thread, while the others wait:
//          NCCL communicators with non-blocking ncclCommInitRankConfig for all local ranks inside
//          one ncclGroupStart/End, polled until every process has joined against the deadline,
//          the peers' liveness and the abort word, aborted otherwise, with an error naming the
//          missing ranks (CommApi::InitRanks), streams, events, scratch; then a second barrier, so
//          that a set-up failure in one process fails every process's call with its reason;
//       4. every rank reads the leader's plan from the slot, checks it is for this call and as many
//          links, cuts identical ranges (plan::CutRanges) and enqueues each link's range (one link:
//          on XLA's stream; several: on side streams forked from it and joined back with events).
//          The host never waits for the device.
// Links: every nccl link of the link set current at set-up, and one pcie link, which stages through
// the segment itself (pcie_xproc.h: registered as pinned memory in every process, devices ordered
// with stream memory operations on flags in it). Stage 2: every rank's event times reach the
// leader's balancer through the segment's times slots (WriteTimes/GatherTimes below), and stats()
// counts the calls there; `error` faults fail over across processes (Agree), `slow` and `hang` go on
// the device as in one process, and a hang detector breaks the group in every process. Health
// (docs/faults.md, "GPU groups across processes"): the leader's GroupHealth decides which links a
// plan leaves out and when one is probed, and says so in the plan slot; every process's first local
// rank records the same refusals, failovers, probes and event-time rates into its own GroupHealth,
// so stats()["health"] gives the same verdicts in every process. Stage 1:
// gpu_xproc_profile.h (the leader decides, every rank enqueues the same profile phase in the same
// call, the times come back through the segment).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/faults.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/engine.h"
#include "xla_ffi/core/status.h"
#include "xla_ffi/cuda/comm_api.h"
#include "xla_ffi/cuda/device_api.h"
#include "xla_ffi/cuda/device_ledger.h"
#include "xla_ffi/cuda/gpu_faults.h"
#include "xla_ffi/cuda/gpu_link.h"
#include "xla_ffi/cuda/gpu_link_set.h"
#include "xla_ffi/cuda/gpu_xproc_profile.h"
#include "xla_ffi/cuda/setup_once.h"
#include "xla_ffi/cuda/start_board.h"
#include "xla_ffi/plan/balancer.h"
#include "xla_ffi/plan/ranges.h"

namespace flexlink::xproc {
class ProcessGroup;
}

namespace flexlink::gpu {

class GpuEngine;
class NcclChannel;
class SplitLog;

// How messages name the link of such a group.
inline constexpr std::string_view kGpuXprocLink = "GPU group across processes";

class GpuXprocGroup {
 public:
  // `group.devices[r]`: the CUDA device of local rank r (-1 for other processes' ranks);
  // `comm_ids`: one per nccl link of `links`, in link order.
  GpuXprocGroup(std::unique_ptr<xproc::ProcessGroup> segment, GroupInfo group,
                std::shared_ptr<const GpuLinkSet> links, std::vector<CommId> comm_ids, plan::BalancerOptions options,
                DeviceApi* api, SplitLog* splits);
  ~GpuXprocGroup();
  GpuXprocGroup(const GpuXprocGroup&) = delete;
  GpuXprocGroup& operator=(const GpuXprocGroup&) = delete;

  // Local rank `rank`'s part of one call: returns once its work is enqueued on `stream`.
  Status Run(int rank, const CallDesc& desc, Stream stream, std::string_view label, int64_t run_id);
  // The watchdog's tick (GpuEngine): every local rank's pending ranges against their deadlines, and
  // once the group is broken (here or in another process), this process's communicators aborted
  // when none of its ranks is inside a call (or 1.5 x the timeout after the break). Never blocks on
  // the device.
  void Watch();

  const GroupInfo& group() const { return group_; }
  xproc::ProcessGroup& segment() { return *segment_; }
  // The balancer over the used links; only the leader process's plans count.
  plan::Balancer& balancer() { return balancer_; }
  const std::vector<std::string>& links() const { return used_names_; }
  // The engine's link set the group was set up with: its version and spec.
  uint64_t link_version() const { return links_->version; }
  const std::string& links_spec() const { return links_->spec; }
  const std::vector<std::pair<std::string, std::string>>& left_out() const { return left_out_; }
  bool leader() const;
  // The group's model in this process: the leader's balancer's, else the leader's as the plan slots
  // carried it (xproc/slot_model.h).
  plan::CostModel Model() const;
  // Forgets `kind`'s model (forget_model, tune()): the balancer's, and what this process learned.
  void ForgetKind(Kind kind);
  std::optional<std::string> broken() const;
  // Stage 1 (the leader's decisions, every rank's enqueue and times).
  GpuXprocProfiler& profiler() { return *profiler_; }
  // The engine's shutdown (gpu_release.cc), as GpuExecutor's: with no local rank inside a call and
  // the watchdog stopped. Release ends this process's communicators and releases what its set-up
  // made, including the segment's registration as pinned memory; the segment stays mapped (host
  // memory of this process only: its name was unlinked once every process had mapped it), and the
  // group refuses later calls. Close, earlier (once no call of this process is inside the engine):
  // this process's ranks arrive at nothing more, and the other processes' waits for them fail at
  // once naming the shutdown (xproc::ProcessGroup::Close), not at their deadline.
  // CloseRank: one local rank, whose call the closed engine refused (it arrives at nothing more).
  void Close();
  void CloseRank(int rank);
  bool Drained(std::string* busy);
  bool Idle(std::string* busy);  // GpuExecutor::Idle's, for this process's part
  Status Release(double timeout_s);
  bool released() const { return released_all_.load(std::memory_order_acquire); }

 private:
  Status EnsureSetup(int rank, const CallDesc& desc, std::string_view label, int64_t run_id);
  Status SetupLocal(const CallDesc& desc, std::string_view label, int64_t run_id);
  void MarkJoining(size_t link);                   // this process's ranks started joining link's communicator
  std::vector<int> NotJoining(size_t link) const;  // other processes' ranks that have not
  // Per used link: the ranges it runs this call (its own; after a failover, others' too).
  using Assignment = std::vector<std::vector<plan::UnitRange>>;
  using Effects = std::vector<FaultyGpuChannel::Effect>;  // per used link, this rank's injected device work
  // `fits`: the leader's fits for the call's kind, from the plan slot (empty: none), from which every
  // process predicts a range's time alike (injected slow delays, the hang detector's deadlines).
  struct Timed;
  // Local rank `rank`'s timing entry for `call` (ring of kTimed), claimed before stage 1's phase.
  Timed& Claim(int rank, uint64_t call);
  Status Enqueue(int rank, Timed& timed, const CallDesc& desc, Stream stream, const std::vector<plan::UnitRange>& ranges,
                 const Assignment& work, const Effects& effects, std::span<const plan::AlphaBeta> fits,
                 std::string_view label, uint64_t call, int64_t run_id);
  // The call runs stage 1's phase: every rank makes its scratch, then all agree through the
  // segment, so that one that cannot (out of memory) makes every rank of every process skip the
  // phase before any enqueues an NCCL operation of it (stage 1 then ends with the leader's
  // warning; the group stays usable). *run: the phase goes ahead.
  Status AgreeProfile(int rank, const CallDesc& desc, const xproc::PlanSlot& slot, Stream stream,
                      std::string_view label, uint64_t call, int64_t run_id, bool* run);
  // `error` faults and failover across processes (docs/faults.md, "GPU links"): the in-process
  // GpuExecutor::Agree's rounds with the segment's barrier in place of process memory. Round 0: each
  // rank asks each of its ranges' links whether it may enqueue (the injected error refuses at the
  // host, before anything reaches a stream) and writes the refused links as a mask into its times
  // slot (failed[round & 1], as the CPU XprocExecutor does); a barrier (SyncWithoutData); every rank
  // ORs every rank's mask, so all choose the same carriers (FailoverCarrier over the leader's
  // shares), and round r asks the carriers, until nothing is pending or no link is left (then every
  // rank fails the call alike, enqueuing nothing, and the group stays usable). Run only when the
  // leader's process has faults injected (it says so in the plan slot, kAgreeBit of `unhealthy`),
  // so every rank runs the same barriers.
  // An admitted range's injected slow and hang faults go into *effects (FaultyGpuChannel::Admit's
  // rule), as in one process. `unhealthy`: the leader's unhealthy links (never carriers); *refused_links:
  // the links refused on any rank in any round. The first local rank records the refusals and
  // failovers into this process's health and failover log, the same in every process.
  Status Agree(int rank, const CallDesc& desc, const std::vector<plan::UnitRange>& ranges, uint32_t unhealthy,
               std::string_view label, uint64_t call, int64_t run_id, Assignment* work, bool* moved,
               uint32_t* refused_links, Effects* effects);
  // The plan slot's `unhealthy` word for these groups: bits 0..7 the leader's unhealthy links, and
  // two flags for every rank: kAgreeBit (run the fault agreement: the leader's process has faults
  // injected), kMaskedBit (the call's shares are not the plan's: unhealthy links left out or a
  // probe, so no process takes its times as evidence of a link's bandwidth).
  static constexpr uint32_t kAgreeBit = 1u << 31;
  static constexpr uint32_t kMaskedBit = 1u << 30;
  static constexpr uint32_t kLinkBits = 0xffu;  // one per link, up to xproc::kMaxXprocLinks

  // Stage 2 across processes. Every local rank times its calls with its own events (a ring of
  // kTimed; their start/stop also fork and join the side streams) and, before each arrival, writes
  // the latest call whose events completed into its times slot of the arriving call's parity (the
  // CPU XprocExecutor's slots and parity argument: rewritten two arrivals later, after every
  // process's first local rank read it right after this one). Each process's first local rank
  // gathers every rank's times per call it recorded and, once all n have reported one, the leader
  // reports the slowest rank's time per link to its balancer and to the link statistics (stats()),
  // and every process judges each link's rate against the leader's fits from the call's slot
  // (degraded): the same times, fits and rule everywhere, so the same verdict. Only that rank's
  // device thread touches `planned_`.
  static constexpr size_t kTimed = 4;
  struct Timed {
    uint64_t call = 0;  // 0: free
    Event start = nullptr;
    std::vector<Event> stop;  // per used link
    std::vector<char> used;   // per used link: had a range
    // The hang detector's (as the in-process executor's slots): the call's kind, each used link's
    // deadline (seconds from the moment a poll saw every rank's device reach the call, in any
    // process: start_board.h), and its clock.
    Kind kind = Kind::kAllReduce;
    std::vector<double> budget;
    CallClock clock;
    // Recorded before stage 1's phase when the call runs one (`profiled`): the clock then starts
    // there, not at `start`, which times the call's own work after the phase.
    Event before = nullptr;
    bool profiled = false;
  };
  struct Rank {
    std::vector<Stream> side;  // per used link
    std::mutex timed_mu;       // the device thread and the engine's watchdog read `timed`
    std::vector<Timed> timed;  // kTimed, by call % kTimed
    bool ready = false;        // passed the set-up barrier (only its own device thread reads it)
    // Pinned host word an injected hang's stream waits on (DeviceApi::WaitFlag): 0 until the hang
    // detector releases it, then 1 for good (the group is broken).
    uint32_t* hang_flag = nullptr;
  };
  struct Planned {  // a process's record of a call, until every rank reported it
    uint64_t call = 0;
    std::shared_ptr<const plan::Plan> plan;  // the leader's, for stage 2; null elsewhere or when not the plan's
    bool evidence = false;                   // the plan's own ranges ran: its times judge bandwidth
    uint64_t message_bytes = 0;
    std::vector<uint64_t> link_bytes;    // per used link: its range's input bytes (stats' convention)
    std::vector<uint64_t> link_message;  // per used link: its range's nccl-tests bytes (health)
    std::vector<plan::AlphaBeta> fits;   // the leader's fits of the call's slot (empty: none)
    int heard = 0;                       // ranks that reported it
    std::vector<double> seconds;         // per used link: the slowest rank's so far
    double call_seconds = 0;
  };
  // The hang detector (docs/faults.md, "GPU links"): the rank's oldest pending call's ranges
  // against their deadlines; past it, Hung breaks the group in every process (the segment's abort
  // word, whose reason every later call of every process reports) and releases the hang flags.
  void PollHangs(int rank);
  void Hung(const Timed& t, int rank, size_t link, double waited);
  // Peers that never reached the call on their devices within the global timeout of this rank's.
  void PeersLate(const Timed& t, int rank, const ClockReading& reading);
  // The break (once per process): `reason` into the segment's abort word, for every process's later
  // calls; `link`, when one link's range hung, unhealthy in this process's health.
  void Break(uint64_t call, int rank, const std::string& reason, std::optional<size_t> link);
  void ReleaseHangFlags();  // every local rank's flag, for good
  void WriteTimes(int rank, uint64_t call);   // before the arrival of `call`
  void GatherTimes(uint64_t call);            // each process's first local rank, after the arrival of `call`
  // After a call's agreement and enqueue, on the first local rank of every process: links that ran
  // are listed, and an unhealthy one that carried its range (a probe) is re-admitted.
  void RecordEnqueued(uint64_t call, const std::vector<plan::UnitRange>& ranges, uint32_t unhealthy,
                      uint32_t refused);
  std::vector<Planned> planned_;              // ring of 2 * kTimed + 2, by call
  std::vector<FaultCounter> fault_calls_;     // per used link: each local rank's ranges admitted

  std::unique_ptr<xproc::ProcessGroup> segment_;
  const GroupInfo group_;
  const std::shared_ptr<const GpuLinkSet> links_;
  DeviceApi& api_;
  SplitLog* const splits_;
  std::vector<std::unique_ptr<GpuChannel>> channels_;  // per used link (NcclChannel)
  std::vector<CommId> comm_ids_;                       // per used link
  std::vector<std::string> used_names_;
  std::vector<std::pair<std::string, std::string>> left_out_;
  plan::Balancer balancer_;
  std::shared_ptr<GroupHealth> health_;  // null with one used link: nothing to fail over to
  std::unique_ptr<GpuXprocProfiler> profiler_;
  mutable std::mutex learned_mu_;
  plan::CostModel learned_;  // not the leader: the leader's model, from the slots
  std::vector<int> local_;  // local ranks, ascending
  std::vector<Rank> ranks_;
  FaultCounter absent_calls_;  // the group's calls per local rank, for injected rank:absent
  // Every rank's latest call reached on its device, in the segment's rank blocks (start_board.h).
  std::unique_ptr<StartBoard> board_;

  SetupOnce setup_;  // this process's part of the set-up (SetupLocal)
  DeviceLedger ledger_{api_};  // what SetupLocal made itself (the links keep their own)
  std::mutex release_mu_;  // Release against the watchdog's Watch (GpuExecutor's)
  std::atomic<bool> released_all_{false};

  // The break (this process's hang detector, or another process's through the segment) and the
  // release of this process's communicators once none of its ranks is inside a call (Watch).
  std::atomic<int> inside_{0};  // local ranks between their arrival and the end of their enqueue
  std::mutex broken_mu_;
  bool hung_ = false;       // this process's detector fired (once)
  bool released_ = false;   // communicators aborted
  std::chrono::steady_clock::time_point broken_at_;
};

// The hang detector's tick for the GPU groups across processes of `engine` (its watchdog thread).
void WatchGpuXprocGroups(const GpuEngine& engine);
// Every GPU group across processes registered for `engine` (never erased: the pointers stay valid).
std::vector<GpuXprocGroup*> GpuXprocGroupsOf(const GpuEngine& engine);

// The links of a link set a group across processes uses (nccl, one pcie) and the rest with the reason.
struct GpuXprocLinks {
  std::vector<size_t> used;  // link indices, in link-set order
  std::vector<size_t> nccl;  // those of kind nccl (one NCCL identity each)
  std::vector<std::pair<std::string, std::string>> left_out;
};
GpuXprocLinks GpuXprocLinksOf(const GpuLinkSet& links);

// This process's GPU groups across processes, per engine. Create: makes the segment (this process
// must hold rank 0: the leader) and one NCCL identity per used link; Attach: maps the segment made
// by the leader, with its identities. `local_devices`: the group's ids run by this process;
// `processes`: how many processes own `devices` (0: not known; xproc::ProcessGroup::Create).
Status CreateGpuXprocGroup(GpuEngine& engine, std::span<const int64_t> devices, std::span<const int64_t> local_devices,
                           int processes, std::string* segment_name, std::vector<CommId>* comm_ids);
Status AttachGpuXprocGroup(GpuEngine& engine, const std::string& segment_name, std::span<const CommId> comm_ids,
                           std::span<const int64_t> devices, std::span<const int64_t> local_devices);
// The registered group of `engine` with exactly these devices that a call lowered when the engine's
// link set had version `lowered` runs on: the newest one set up at or before it (a group is set up
// at lowering, so every process picks the same one for a program, whenever its calls execute);
// lowered 0 (not said) or none that old: the newest. nullptr when none. A group keeps the links it
// was set up with: when `current` (the engine's link set now) is given and its spec differs, a
// warning says so once per group and link set.
GpuXprocGroup* FindGpuXprocGroup(const GpuEngine& engine, std::span<const int64_t> devices, uint64_t lowered = 0,
                                 const GpuLinkSet* current = nullptr);

// The engine's controls, reaching its groups across processes (GpuEngine::SetShares, ForgetModel,
// SnapshotPlans call these; set_shares/configure from Python go through them). Shares are given in
// `names` order (the engine's current links) and applied to each group's used links of those names,
// renormalised; a group made over another link set is skipped. Every process's balancer gets them;
// only the leader's plans count, so the plans listed are the leader processes' groups'.
Status SetGpuXprocShares(const GpuEngine& engine, const std::vector<std::string>& names, Kind kind,
                         uint64_t bucket_bytes, const std::vector<double>& shares, bool pinned);
void ForgetGpuXprocModel(const GpuEngine& engine, Kind kind);
// seed_model's fits for groups of `ranks` GPUs (`seed` over the engine's current links): each such
// group gets the fits of the links it uses, the plans it makes from then on start from them.
void SetGpuXprocSeed(const GpuEngine& engine, int ranks, const plan::CostModel& seed);
// configure's autotune_min_bytes and tune_max_bytes (stage 1's sizes) for these groups' balancers.
void SetGpuXprocProfileBytes(const GpuEngine& engine, uint64_t from_bytes, uint64_t max_bytes);
void AppendGpuXprocPlans(const GpuEngine& engine, std::vector<PlanSnapshot>* out);

struct GpuXprocInfo {
  std::string name;
  std::vector<int64_t> devices, local_devices;
  std::vector<std::string> links;
  std::vector<std::pair<std::string, std::string>> left_out;
  uint64_t calls = 0;
  std::optional<std::string> broken;
};
std::vector<GpuXprocInfo> GpuXprocGroups(const GpuEngine& engine);

}  // namespace flexlink::gpu
