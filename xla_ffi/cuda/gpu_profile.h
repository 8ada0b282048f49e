// Stage 1 on the device: the first large call of a kind without fits profiles the group's links, as
// the CPU engine does (core/executor_profile.cc: each link alone at power-of-two sizes, an α-β fit
// per link, then the fitted split timed against the fastest link alone, the measured threshold, the
// tuning cache) — with one difference forced by the rule that the host never waits for the device:
// the profile is enqueued, on a stream of its own, *before* that call's work, and its times are read
// by later calls when its events have completed. So it runs in two phases, each enqueued by every
// rank in the same call (links alone; then the split check, once the fits are known) and read a few
// calls later; meanwhile calls of that kind run on the primary link alone (the balancer's kProfile
// plans have it), and the call that finds the second phase complete installs the fits and runs
// with the new plan. One profile runs at a time per group. Each rank makes a phase's scratch before
// any enqueues it, and the ranks agree first (GpuExecutor::AgreeProfile): a rank that cannot makes
// them all skip the phase, which ends stage 1 for the group with a warning (stage 2 from equal
// shares), instead of leaving its peers' NCCL operations waiting for its own.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"
#include "xla_ffi/cuda/device_api.h"
#include "xla_ffi/cuda/gpu_link.h"
#include "xla_ffi/plan/cost_model.h"
#include "xla_ffi/plan/balancer.h"

namespace flexlink::gpu {

class GpuExecutor;

// One timed run of stage 1.
struct ProfileStep {
  size_t size = 0;              // index into the session's sizes
  size_t rep = 0;
  size_t link = 0;              // alone: the link
  std::vector<double> shares;   // split steps: the fitted split
  bool paired = false;          // phase 1: the fastest link alone, paired with the split after it
};

// Stage 1's arithmetic on the device, whoever gathers the times: the in-process profiler below and
// the one of GPU groups across processes (gpu_xproc_profile.h). `times` holds, per step of the
// current phase, the slowest rank's seconds (a collective is as fast as its slowest rank).
struct ProfileSession {
  static constexpr int kWarmup = 1, kIters = 2;
  Kind kind = Kind::kAllReduce;
  std::vector<uint64_t> sizes;  // message sizes (nccl-tests bytes), ascending
  int phase = 0;                // 0: every link alone; 1: the fitted split against the fastest link alone
  std::vector<ProfileStep> steps;    // of the current phase
  std::vector<double> times;         // per step: the slowest rank's seconds
  std::vector<int> enqueued;         // in-process: per rank, the phase it enqueued (-1: none yet)
  std::vector<char> read;            // in-process: per rank, read its events of the current phase
  std::vector<double> alone;         // [link][size][rep]
  std::vector<double> split, paired; // [size][rep]
  plan::CostModel model;
  std::chrono::steady_clock::time_point started;
  bool failed = false;
  std::string why;  // in-process: the first reason it failed, for the warning

  static size_t reps() { return static_cast<size_t>(kWarmup + kIters); }
  // Phase 0 for `kind` up to `top` (ProfileTopBytes) over `names`: sizes, tables and steps.
  void Begin(Kind k, uint64_t top, const std::vector<std::string>& names);
  // Phase 0's times are in: fits every link (into `model`) and, when a size splits, makes phase 1
  // (true); false: nothing to time against the fastest link, Finish next.
  bool FitAlone(int n, double min_share);
  // The last phase's times are in: the measured split threshold, set in `model` with the profiled
  // size; the model is then complete for `kind`.
  uint64_t Finish(int n, const plan::BalancerOptions& options);
};

// Phase 0's steps: every link alone at every size, each size's repetitions (the untimed warm-up
// only below kCoarseProfileBytes).
std::vector<ProfileStep> AloneSteps(size_t links, std::span<const uint64_t> sizes);
// Phase 1's steps from phase 0's fits: at each size whose equal-finish split uses two links or
// more, each timed repetition of the fastest link alone followed by the split. A function of its
// arguments only, so that every process of a group across processes derives the same steps from
// the fits the leader hands out.
std::vector<ProfileStep> SplitSteps(Kind kind, std::span<const plan::AlphaBeta> fits, std::span<const uint64_t> sizes,
                                    int n, double min_share);

// A rank's means of running stage 1: a stream of its own, forked from XLA's stream and joined back,
// and start/stop events per step (made when a phase first needs them).
struct ProfileRank {
  Stream stream = nullptr;
  Event fork = nullptr, join = nullptr;
  std::vector<Event> events;
};
// A rank's scratch for one phase, made before the ranks agree to run it (PrepareProfile): a rank
// that cannot make it (its GPU out of memory, say) is then known to every rank before any of them
// enqueues one of the phase's NCCL operations, so all skip the phase and the group stays usable.
struct ProfileScratch {
  void* in = nullptr;
  void* out = nullptr;
  bool forked = false;  // the profile stream has work forked from XLA's: Enqueue or Release joins it
};
// Makes what `steps` (of sizes `sizes`) need for `rank` of a group of n over `links` links on
// device `device`: their events, and zeroed scratch on pr's stream, forked from `stream`. On an
// error nothing is left: what was allocated is freed and the stream joined back.
Status PrepareProfile(DeviceApi& api, int device, ProfileRank& pr, size_t links, Kind kind,
                      std::span<const uint64_t> sizes, size_t steps, int n, Stream stream, ProfileScratch* scratch);
// Enqueues the prepared `steps` on pr's stream, split steps' links on `side`; `enqueue(link, work)`
// puts one link's pieces on a stream. Frees the scratch and joins the stream back into `stream` on
// every way out.
Status EnqueueProfileSteps(DeviceApi& api, ProfileRank& pr, ProfileScratch& scratch, std::span<const Stream> side,
                           const std::function<Status(size_t, const GpuWork&)>& enqueue, Kind kind,
                           std::span<const uint64_t> sizes, std::span<const ProfileStep> steps, int n, int rank,
                           Stream stream, std::string_view label);
// A prepared phase not run (a peer could not prepare its own): frees the scratch, joins the stream.
Status ReleaseProfile(DeviceApi& api, ProfileRank& pr, ProfileScratch& scratch, Stream stream);
// The engine's shutdown (gpu_release.cc): whether the timing events PrepareProfile made for pr have
// all completed (never blocks), and their destruction (pr's stream and fork/join events are the
// set-up's, released with it).
bool ProfileEventsDrained(DeviceApi& api, const ProfileRank& pr);
Status DestroyProfileEvents(DeviceApi& api, ProfileRank& pr);
// kPending while the phase's last step is on the device; kDone with each step's seconds; kError
// when the device failed it (*times then unset).
Poll ReadProfileTimes(DeviceApi& api, const ProfileRank& pr, size_t steps, std::vector<double>* times);

// What stage 1 enqueues in one call (nothing when `session` is null).
struct ProfileAction {
  std::shared_ptr<ProfileSession> session;
  int phase = 0;  // 0: every link alone; 1: the fitted split against the fastest link alone
};

class GpuProfiler {
 public:
  explicit GpuProfiler(GpuExecutor* executor) : ex_(*executor) {}
  // The call's first rank, when its plan is kProfile: starts a profile, starts its second phase,
  // or finishes it (installing the fits; *plan is then the new plan for this call) — or, with fits
  // from the tuning cache, installs those. Otherwise nothing (the call runs on the primary link).
  ProfileAction Decide(Kind kind, uint64_t message_bytes, std::shared_ptr<const plan::Plan>* plan);
  // Every rank, after the arrival: makes the phase's scratch (PrepareProfile), before the ranks
  // agree to run it.
  Status Prepare(const ProfileAction& action, int rank, Stream stream, ProfileScratch* scratch);
  // Every rank, once all prepared: enqueues the phase on the rank's profile stream, forked from
  // `stream` and joined back into it (the call's own work comes after).
  Status Enqueue(const ProfileAction& action, int rank, ProfileScratch& scratch, Stream stream, std::string_view label);
  // The phase will not complete (a rank could not prepare it, or did not reach it): the kind's next
  // call ends the profile with a warning saying `why`, and the group's calls go to stage 2 from
  // equal shares (as a group across processes does). The first reason given is kept.
  void Abandon(const ProfileAction& action, const std::string& why);
  // Every rank, at each call: reads this rank's events of a phase in flight once they completed.
  void Poll(int rank);
  // For tests: whether a profile is in flight.
  bool busy() const;

 private:
  bool LoadCachedFits(Kind kind, uint64_t needed_bytes);
  void Finish(ProfileSession& s);

  GpuExecutor& ex_;
  mutable std::mutex mu_;
  std::shared_ptr<ProfileSession> session_;
};

}  // namespace flexlink::gpu
