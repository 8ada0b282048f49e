// Stage 1 on the device: the first large call of a kind without fits profiles the group's links, as
// the CPU engine does (core/executor_profile.cc: each link alone at power-of-two sizes, an α-β fit
// per link, then the fitted split timed against the fastest link alone, the measured threshold, the
// tuning cache) — with one difference forced by the rule that the host never waits for the device:
// the profile is enqueued, on a stream of its own, *before* that call's work, and its times are read
// by later calls when its events have completed. So it runs in two phases, each enqueued by every
// rank in the same call (links alone; then the split check, once the fits are known) and read a few
// calls later; meanwhile calls of that kind run on the primary link alone (the balancer's kProfile
// plans have it), and the call that finds the second phase complete installs the fits and runs
// with the new plan. One profile runs at a time per group.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"
#include "xla_ffi/cuda/device_api.h"
#include "xla_ffi/plan/balancer.h"

namespace flexlink::gpu {

class GpuExecutor;
struct ProfileSession;

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
  // Every rank, after the arrival: enqueues the phase on the rank's profile stream, forked from
  // `stream` and joined back into it (the call's own work comes after).
  Status Enqueue(const ProfileAction& action, int rank, Stream stream, std::string_view label);
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
  bool failed_[kNumKinds] = {};  // a profile of this kind failed: its calls stay on the primary link
};

}  // namespace flexlink::gpu
