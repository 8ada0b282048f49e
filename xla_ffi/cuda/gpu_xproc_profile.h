// Stage 1 for GPU groups whose ranks live in several processes (docs/multiprocess.md, "GPU groups
// across processes"): the in-process GPU profile (gpu_profile.h: every link alone at stage 1's
// sizes, an α-β fit per link, the fitted split timed against the fastest link alone, the measured
// threshold), with the decisions the leader's and the times travelling through the segment.
//
//   - The leader's balancer answers a group's first large call of a kind without fits with a
//     kProfile plan (the primary link alone). Before its arrival, the leader's rank 0 starts a
//     profile in that call's plan slot: profile id, phase 1 (every link alone), the top size and
//     min_share. Every rank of every process reads the slot after the arrival and enqueues the
//     same steps (the same NCCL operations in the same order) on its profile stream, forked from
//     XLA's stream and joined back before the call's own work. The host never waits for them.
//   - Before a later arrival, each rank whose phase completed on its device writes its per-step
//     times into its ProfileTimes of the segment (tag last, release). The leader, planning a later
//     call of the kind, takes every rank's times once all are there (the slowest rank's per step)
//     and fits the links; when a size splits, the next such call's slot asks for phase 2 with the
//     fits themselves (alpha/beta), from which every rank derives the same split steps
//     (SplitSteps). When phase 2's times are in, the leader installs the model and plans that call
//     from it. Meanwhile the kind's calls run on the primary link alone.
//   - Every rank makes its phase's scratch before any enqueues it, and the ranks agree through the
//     segment (GpuXprocGroup::AgreeProfile): one that cannot (out of memory) makes every rank skip
//     the phase, so nothing waits for its NCCL operations.
//   - A rank whose device failed the phase or could not make its scratch, or a profile with more
//     steps than the segment holds, turns stage 1 off for the group with a warning: its calls go
//     back to stage 2 from equal shares, as before stage 1 existed here.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"
#include "xla_ffi/cuda/device_api.h"
#include "xla_ffi/cuda/device_ledger.h"
#include "xla_ffi/cuda/gpu_link.h"
#include "xla_ffi/cuda/gpu_profile.h"
#include "xla_ffi/plan/balancer.h"
#include "xla_ffi/plan/tuning_cache.h"
#include "xla_ffi/xproc/layout.h"

namespace flexlink::xproc {
class ProcessGroup;
}

namespace flexlink::gpu {

class GpuXprocProfiler {
 public:
  // `cache_spec`: the used links' spec, the tuning cache's key with the group's ranks and processes.
  GpuXprocProfiler(xproc::ProcessGroup* segment, plan::Balancer* balancer, const GroupInfo* group,
                   std::vector<std::string> names, std::string cache_spec, DeviceApi* api);

  // Set-up of local rank `rank` on `device`: its profile stream and fork/join events, made through
  // the group's ledger (released with it).
  Status SetupRank(int rank, int device, DeviceLedger& ledger);
  // The engine's shutdown: whether the timing events stage 1 made for the local ranks have all
  // completed (never blocks), and their destruction.
  bool EventsDrained();
  Status DestroyEvents();
  // The leader's rank 0, before its arrival at a call whose plan is kProfile: fills the slot's
  // profile fields with the phase every rank enqueues in this call (none while one is on the
  // devices), or installs the finished model and replaces *plan with the plan made from it.
  void Decide(Kind kind, uint64_t message_bytes, std::shared_ptr<const plan::Plan>* plan, xproc::PlanSlot* slot);
  // Every local rank after the arrival, when the slot asks for a phase: its steps, and its scratch
  // made (PrepareProfile) before the ranks agree to run it (GpuXprocGroup::AgreeProfile).
  Status Prepare(int rank, Kind kind, const xproc::PlanSlot& slot, Stream stream, std::string_view label);
  // Once every rank of every process prepared: enqueues the phase (before the call's own work on
  // `stream`); `enqueue(link, work)` puts one link's pieces on a stream.
  Status Enqueue(int rank, Kind kind, std::span<const Stream> side,
                 const std::function<Status(size_t, const GpuWork&)>& enqueue, Stream stream, std::string_view label);
  // A prepared phase not run (a rank somewhere could not prepare its own): frees its scratch.
  void Release(int rank, Stream stream);
  // The leader's rank 0, when every rank skipped the call's phase of `kind`: stage 1 is off for the
  // group, with a warning saying `why` (as when a rank cannot time a phase).
  void Abandon(Kind kind, const std::string& why);
  // Every local rank before its arrival: the times of a phase it enqueued, into the segment once
  // its events completed. Never waits.
  void Publish(int rank);
  // For tests and messages: whether the leader has a profile in flight.
  bool busy() const { return session_ != nullptr; }

 private:
  enum class Gathered { kPending, kDone, kFailed };
  Gathered Gather(std::vector<double>* times, std::string* why) const;  // the leader
  void Ask(int phase, xproc::PlanSlot* slot) const;
  void Fail(Kind kind, const std::string& why);
  // The leader: stage 1 of `kind` from the tuning cache (the leader's process alone reads it; the
  // others learn the model from the plan slots, xproc/slot_model.h); false without an entry.
  bool LoadCached(Kind kind, uint64_t message_bytes);
  plan::CacheKey CacheKey() const;

  struct RankState {
    ProfileRank profile;
    uint64_t tag = 0;   // the phase enqueued and not yet published ((id << 2) | phase); 0: none
    size_t steps = 0;
    // Prepared and not yet enqueued or released: the phase's tag, sizes, steps and scratch.
    uint64_t prepared_tag = 0;
    std::vector<uint64_t> sizes;
    std::vector<ProfileStep> prepared;
    ProfileScratch scratch;
  };

  xproc::ProcessGroup& seg_;
  plan::Balancer& balancer_;
  const GroupInfo& group_;
  const std::vector<std::string> names_;
  const std::string cache_spec_;
  DeviceApi& api_;
  std::vector<RankState> ranks_;
  // The leader's rank 0 thread only.
  std::unique_ptr<ProfileSession> session_;
  uint32_t id_ = 0;
};

}  // namespace flexlink::gpu
