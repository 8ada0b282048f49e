// Several links across processes (docs/xproc.md, "Several links and plan agreement"): a group whose
// ranks live in several processes splits each call across the links of the current link set that can
// span processes: the shared segment plays the shm link (the link set's first link of kind shm; the
// segment is always there, it carries the arrival), and every link of kind tcp is its cross-process
// ring (tcp_xproc.h, connected by the Python glue or a test). Any other link (emulated: an in-process
// model) is left out, and stats say which and why (XprocLinksOf, module.cc's xproc_groups).
//
// One plan per call, decided by the leader (rank 0; its process owns the group's plan::Balancer):
//   1. the leader asks PlanFor(kind, bytes) and writes the plan into the header's plan slot call & 1;
//   2. every rank arrives (ProcessGroup::Arrive: fingerprint + barrier, whose acquire on the
//      leader's counter makes the slot visible), reads the slot (its call number is checked) and cuts
//      identical ranges with plan::CutRanges;
//   3. the ranges run concurrently: the segment's on the device thread (ProcessGroup::RunPieces),
//      each tcp range on a per-(link, local rank) LinkWorker;
//   4. each rank writes its per-link seconds into its times slot call & 1;
//   5. at call + 1, after the arrival, the leader reads every rank's times of `call`, takes the
//      slowest per link and Reports them with call's plan: a change takes effect at the next PlanFor,
//      which is the same call for every rank because every rank reads the leader's slot.
// The parity argument for both slots is in layout.h (PlanSlot, TimesSlot).
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/engine.h"
#include "xla_ffi/core/status.h"
#include "xla_ffi/plan/balancer.h"

namespace flexlink::xproc {

class ProcessGroup;

struct XprocLinks {
  std::vector<std::string> links;                              // used, in link-set order; [0] is the segment
  std::vector<std::pair<std::string, std::string>> left_out;   // (link, why)
};

// The links the group would use under the current link set (also before any call).
XprocLinks XprocLinksOf(ProcessGroup* group);

// Runs one call of `group` for local rank `rank`: split across its links by the leader's plan, or,
// with one usable link, on the segment alone. `links_version`: the link set the call's program was
// lowered with (0: the current one; core/link_set.h), so that a configure(links=...) while calls are
// queued cannot give two processes' ranks of one call different links.
Status RunXprocCall(ProcessGroup* group, int rank, const CallDesc& desc, std::string_view label, int64_t run_id,
                    uint64_t links_version = 0);

// Releases this process's part of the cross-process groups of earlier link sets that no local rank
// is inside and whose tcp workers are idle: their worker threads and the leader's balancer (the
// segment and the tcp rings belong to the group, not to a link set, and stay). Local only: nothing
// of a peer process is touched, and a call that still comes for such a set (its program was lowered
// before) gets a new entry here, which plans from the leader's slot as before; the call numbers
// used by fault injection go on. configure(links=...) calls it beside ReleaseEarlierGroups.
ReleasedGroups ReleaseEarlierXprocEntries();

// Injected rank:absent across processes (core/faults.h): local rank `rank` never arrives at the
// group's call `call`. The other ranks' deadline fails the group, their report naming it; this rank
// returns that (it polls the segment's abort word, at most 1.5 x the timeout: nothing else of the
// call is its to wait on). The CPU groups' RunXprocCall and the GPU groups' (cuda/gpu_xproc.h).
Status StayAway(ProcessGroup* group, int rank, uint64_t call, std::string_view label);

// The leader's plans of this process's cross-process groups (those whose rank 0 is local) under the
// current link set, for SnapshotPlans.
std::vector<PlanSnapshot> SnapshotXprocPlans();
// The cross-process group's model as this process knows it (GroupModel, jax_flexlink.tune()): the
// leader's balancer's in the leader's process; elsewhere the fits stage 1 across processes computed
// (the same in every process). nullopt: not such a group, one link, or nothing known.
std::optional<plan::CostModel> XprocGroupModel(std::span<const int64_t> devices);
// Forgets `kind`'s fits of every cross-process group of the current link set (ForgetModel).
void ForgetXprocKind(Kind kind);
// Applies `f` to every leader balancer of the current link set (SetShares, InstallModel, ...).
Status ForEachXprocBalancer(const std::function<Status(plan::Balancer&)>& f);

}  // namespace flexlink::xproc
