// The GPU engine's entry point: one rank's part of one collective call on a GPU, from the CUDA
// FFI handlers (cuda/handlers.cc) or a test driving ranks as threads (tests/cpp). The same checks
// and messages as the CPU engine (core/call.h, core/rendezvous.h), then the GPU executor of the
// group. An engine owns its link set, its groups and their state; the CUDA module has one, over
// the CUDA runtime and NCCL; the tests make theirs over the simulated device.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "xla_ffi/core/engine.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/status.h"
#include "xla_ffi/cuda/comm_api.h"
#include "xla_ffi/cuda/device_api.h"
#include "xla_ffi/cuda/gpu_executor.h"
#include "xla_ffi/cuda/gpu_link_set.h"
#include "xla_ffi/plan/balancer.h"

namespace flexlink::gpu {

// What GpuEngine::Shutdown did, group by group ("GPU group [0, 1, 2, 3] (links nccl;pcie)").
struct ShutdownReport {
  std::vector<std::string> released;  // every resource of the group released
  std::vector<std::string> kept;      // not drained in time: everything kept, with what was busy
  std::vector<std::string> errors;    // released, but a release call failed (the first error)
  bool again = false;                 // an earlier Shutdown ran: this one retried what it kept
};

struct GpuEngineOptions {
  // The CUDA device of a group member (its id in `groups`). Under XLA the ids are the handlers'
  // DeviceOrdinal, i.e. CUDA ordinals: identity. Tests put several ranks on one device.
  std::function<int(int64_t)> device_of = [](int64_t id) { return static_cast<int>(id); };
  // The process's engine is never destroyed (device threads may outlive exit handlers): its
  // watchdog is stopped by an exit handler instead, registered when it starts, i.e. after the CUDA
  // runtime's own (which then runs later), so it never polls a runtime that is going away.
  bool stop_watchdog_at_exit = false;
  // Tests only: a group of one rank runs through its links as any group does (NCCL with one rank,
  // the pcie link's slots), instead of the copy on XLA's stream it needs. NCCL puts at most one
  // rank of a communicator on a GPU, so on a machine with one GPU this is the only way the nccl
  // link's calls run (tests/cpp/cuda/cuda_ranks_test.cc; the CUDA module's
  // set_single_rank_through_links, tests/test_gpu.py). GpuEngine::SetSingleRankThroughLinks changes it.
  bool single_rank_through_links = false;
};

class GpuEngine {
 public:
  GpuEngine(DeviceApi* api, CommApi* comm, GpuEngineOptions options = {});
  ~GpuEngine();
  GpuEngine(const GpuEngine&) = delete;
  GpuEngine& operator=(const GpuEngine&) = delete;

  DeviceApi& api() { return api_; }
  CommApi& comm() { return comm_; }
  // This engine among all made in the process (registries key their groups by it, gpu_xproc.h).
  uint64_t serial() const { return serial_; }
  // The CUDA device of a group member id (GpuEngineOptions::device_of).
  int DeviceOf(int64_t id) const { return options_.device_of(id); }
  // Tests only (GpuEngineOptions::single_rank_through_links); calls already inside Run are unaffected.
  void SetSingleRankThroughLinks(bool on) { single_rank_through_links_.store(on, std::memory_order_relaxed); }

  // Returns once this rank's work is enqueued on `stream` (or with the error that stopped it).
  Status Run(const CollectiveArgs& args, Stream stream);

  // Ends the engine (jax_flexlink.shutdown(), and the interpreter's exit before jax's backends go;
  // gpu_release.cc says why only drained groups are released). From then on every call is refused
  // with an error saying so. Within `timeout_s` (clamped to [0, 1e6]): waits for the calls inside
  // Run on the host to return, then for every group's work to complete on its devices (the hang
  // detector still breaking hung ones), then releases each drained group: its NCCL communicators
  // finalized and destroyed, its streams, events, device and pinned memory and host registrations
  // freed; with every group released, the watchdog stopped and the device's shared pools freed. A
  // group that did not drain keeps everything, and so does one sharing a device with it, each named
  // in the report with why; calling Shutdown again retries those. The waits are bounded by the
  // deadline; the release itself is not entirely: a non-blocking communicator's finalize gets what
  // is left of it (at least 1 s), but a blocking one's, and cudaFree's implicit synchronisation of
  // the device, take as long as the device's other work (docs/cuda.md, "Shutdown").
  ShutdownReport Shutdown(double timeout_s);
  // Releases, as Shutdown does but with the engine left open, this process's groups of the link
  // sets before the current one (ConfigureLinks since), each holding its communicators, streams,
  // staging and pinned memory. Within `timeout_s`: retires each earlier group once no rank is inside
  // a call of it (its EntryWord, core/entry_word.h; one with a rank inside past the deadline is
  // kept), waits for the retired groups' work to complete on their devices, then releases each
  // drained one that shares no device with a group still running. A call lowered for an earlier set that comes later
  // (queued before the change, or an executable compiled before it) gets a new group of that set,
  // set up at its first call, which the next release releases in its turn. What it keeps is named in
  // the report with why, and a later call of this or Shutdown retries it. Groups across processes
  // are left: a program lowered under earlier links still runs on theirs (links_version).
  // `again` is always false. jax_flexlink.configure(links=...) calls it (runtime.py).
  ShutdownReport ReleaseEarlierLinks(double timeout_s);
  bool shut_down() const { return closed_.load(std::memory_order_acquire); }
  int CallsInside() const { return active_.load(); }  // ranks' calls inside Run now (tests, messages)
  // Whether any group (in this process or across processes) was made: the exit handler's test.
  bool HasGroups();

  // Links (kinds nccl, pcie; rdma is refused): calls must not be running while they change.
  Status ConfigureLinks(std::string_view spec);
  std::shared_ptr<const GpuLinkSet> CurrentLinks();
  // The same set, read on the call path without mu_ or a reference count: every XLA device thread
  // reads it at every call, and when a group's ranks did so under mu_ they met there right after
  // their previous call's rendezvous and slept on it (gpu_host_bench: docs/cuda.md, "The host path
  // of a call"). Valid for the engine's life: a replaced set is kept (retired_links_).
  const GpuLinkSet& Links();

  Status SetShares(Kind kind, uint64_t bucket_bytes, std::vector<double> shares, bool pinned);
  void ForgetModel(Kind kind);
  std::optional<plan::CostModel> GroupModel(std::span<const int64_t> devices);
  // Nominal fits (jax_flexlink.topology) for groups of `ranks` GPUs over the current links: their
  // plans start from these until stage 1 measures (plan::Balancer::SetSeed). Forgotten when the
  // links change.
  Status SetSeed(int ranks, plan::CostModel seed);
  void SetTuneMax(uint64_t bytes);
  void SetAutotune(uint64_t bytes);
  std::vector<PlanSnapshot> SnapshotPlans();
  // The shares set_shares gave for the current links ((kind, bucket) -> (shares, pinned)), for the
  // groups across processes registered later (gpu_xproc.cc).
  std::map<std::pair<Kind, uint64_t>, std::pair<std::vector<double>, bool>> ShareOverrides();
  // The seed given for groups of `ranks` GPUs over the current links, if any (gpu_xproc.cc).
  std::optional<plan::CostModel> SeedFor(int ranks);
  // Reads the completed timing events of every group's earlier calls into the balancer and the
  // statistics now, rather than at each group's next call; never waits for the device.
  void PollTimings();
  SplitLog& splits() { return splits_; }
  // The hang detector's thread (gpu_executor.h Watch, gpu_xproc.h Watch): started with the engine's
  // first group (in process or across processes), it polls every group's pending events every
  // kWatchTick, so that a hang is found even when no later call comes; stopped and joined by the
  // destructor.
  void StartWatchdog();

 private:
  // A call refused after the shutdown never arrives: its peers already inside the engine learn it
  // at once (its in-process call abandoned with `reason`, or its rank closed in the segment of a
  // group across processes), instead of at their deadline, which the shutdown would wait for.
  void TellRefused(const CollectiveArgs& args, std::string_view reason);
  Status RunOrThrow(const CollectiveArgs& args, Stream stream);
  // Polls until no call is inside Run; false at the deadline.
  bool WaitNoCallInside(std::chrono::steady_clock::time_point deadline);
  // The set of links of version `version` (0: the current one); InvalidArgument for one this engine
  // never made (a program lowered in another process).
  Status LinksAt(uint64_t version, std::string_view label, std::shared_ptr<const GpuLinkSet>* out);
  // The group of `devices` on link set `version` (0: the current one), entered for one call (the
  // caller leaves it with an Entered, core/entry_word.h). Each device thread caches its lookups, so that a call
  // takes no engine lock.
  Status GetGroup(uint64_t version, std::span<const int64_t> devices, std::string_view label, GpuExecutor** out);
  // GetGroup's lookup under mu_, making the group (host objects only; its set-up runs inside its
  // first call) when it does not exist, entered when `enter`; without the watchdog or the device
  // thread's cache. A group in groups_ is never retired (ReleaseEarlierLinks takes it out first).
  Status FindOrMakeGroup(const std::shared_ptr<const GpuLinkSet>& links, std::span<const int64_t> devices,
                         std::string_view label, bool enter, GpuExecutor** out);
  // Every group not released yet, of any link set, retired or not (the watchdog, PollTimings).
  std::vector<GpuExecutor*> LiveGroups();
  std::unique_ptr<GpuExecutor> MakeGroup(std::shared_ptr<const GpuLinkSet> links, const std::vector<int64_t>& ids);
  // Executors of the current link set (under mu_).
  template <class F>
  void ForEachCurrent(F&& f);

  static uint64_t NextSerial();
  void StopWatchdog();
  void WatchLoop();
  static constexpr double kWatchTick = 0.02;

  const uint64_t serial_;  // this engine among all made in the process (device threads' cache key)
  DeviceApi& api_;
  CommApi& comm_;
  const GpuEngineOptions options_;
  std::atomic<bool> single_rank_through_links_;
  SplitLog splits_;
  std::mutex mu_;
  std::shared_ptr<const GpuLinkSet> links_;
  std::atomic<const GpuLinkSet*> current_{nullptr};  // links_.get(), for Links()
  // Every set links_ held before: Links() may have handed one out just before it was replaced, and a
  // group made for it later holds it (host objects only: names, options; no device resources).
  std::vector<std::shared_ptr<const GpuLinkSet>> retired_links_;
  uint64_t next_version_ = 1;
  std::map<std::pair<Kind, uint64_t>, std::pair<std::vector<double>, bool>> overrides_;
  std::map<int, plan::CostModel> seeds_;  // by group size, for the current links
  // By (link-set version, ids). Reconfigured links make new groups; ReleaseEarlierLinks moves the
  // earlier sets' groups it retired to retired_, where they stay for the engine's life (device
  // threads cache raw pointers), released or, when kept, until a later release or the shutdown.
  std::map<std::pair<uint64_t, std::vector<int64_t>>, std::unique_ptr<GpuExecutor>> groups_;
  std::vector<std::pair<std::vector<int64_t>, std::unique_ptr<GpuExecutor>>> retired_;
  // Shutdown: set once; Run counts the calls inside it (`active_`) so that Shutdown waits for them.
  // Both sequentially consistent (Run: count in, then read closed_; Shutdown: set closed_, then read
  // the count), so either a call sees the door closed or the shutdown sees the call: no lock on
  // the call path.
  std::atomic<bool> closed_{false};
  std::atomic<int> active_{0};
  std::mutex shutdown_mu_;  // one Shutdown or ReleaseEarlierLinks at a time
  bool shutdown_ran_ = false;
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false;
  std::thread watchdog_;  // last: joined before anything it reads goes
};

}  // namespace flexlink::gpu
