// The engine's entry point: one rank's part of one collective call. The FFI handlers and engine_run
// both end here, so they share every check, message and code path.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"
#include "xla_ffi/plan/balancer.h"

namespace flexlink {

struct CollectiveArgs {
  std::span<const int64_t> groups;       // every group's global device ids, concatenated
  std::span<const int64_t> group_sizes;  // size of each group
  int64_t device = 0;                    // this rank's global device id
  int64_t run_id = 0;                    // identical on all devices of one launch
  std::string_view label;                // names the collective in errors
  CallRequest request;                   // buffers, shapes, dtypes, reduction, axis
  // The running engine's link set when the call was lowered (0: not said; then the current one).
  // CPU: the set every rank of the call runs on (core/link_set.h). CUDA: picks the GPU group across
  // processes set up for it (cuda/gpu_xproc.h, FindGpuXprocGroup).
  uint64_t links_version = 0;
};

// Blocks until this rank's part of the call is done (or failed); see docs/interfaces.md.
Status RunCollective(const CollectiveArgs& args);

// Makes sure the configured links exist (so stats list them before the first call).
void EnsureLinks();

// Releases the in-process groups of earlier link sets that no rank is inside and whose workers are
// idle: their channels (tcp sockets), worker threads and balancers. A call that still comes for such
// a set (its program was lowered before) gets a new group. configure(links=...) calls it, so that
// reconfiguring again and again does not pile up threads and sockets.
struct ReleasedGroups {
  int released = 0;
  int kept = 0;  // busy now: tried again at the next release
};
ReleasedGroups ReleaseEarlierGroups();

// Sets a (collective, size bucket)'s link shares on every group of the current link set, present and
// future (pinned: kept as given; else a starting point for stage 2).
Status SetShares(Kind kind, uint64_t bucket_bytes, std::vector<double> shares, bool pinned);

// Stage 1: installs per-link fits on every group of the current link set, present and future.
Status InstallModel(plan::CostModel model);
// Forgets `kind`'s stage-1 fits everywhere (the current model and every group's balancer), so that
// the next large call of that kind on a group runs stage 1 again.
void ForgetModel(Kind kind);
// The model (fits, measured thresholds) of the group `devices` of the current link set; nullopt if
// that group has not been made.
std::optional<plan::CostModel> GroupModel(std::span<const int64_t> devices);
// Sets config TuneMaxBytes and applies it to every group's balancer.
void SetTuneMax(uint64_t max_bytes);
// Sets config AutotuneMinBytes and applies it to every group's balancer (0: stage 1 only from tune()).
void SetAutotune(uint64_t min_bytes);

struct PlanSnapshot {
  std::vector<int64_t> group;
  plan::Plan plan;
  std::vector<std::string> links;
};
// Every plan of every group of the current link set.
std::vector<PlanSnapshot> SnapshotPlans();

}  // namespace flexlink
