// Stage 1 across processes (docs/xproc.md, "Stage 1 across processes"): the first large call of a
// kind without fits on a cross-process group with several links profiles them, as the in-process
// engine does (core/executor_profile.cc: every link alone at power-of-two sizes, an α-β fit per link,
// then the fitted split timed against the fastest link alone, giving the measured split threshold).
//
// The leader's balancer answers such a call with a kProfile plan; the leader's plan slot carries the
// mode, so every rank of every process runs the same profile in the same call, on scratch buffers,
// after the call's arrival. What makes the decision the leader's and every rank's alike: after each
// size, every rank publishes its best time per run in its times slot and passes a barrier of the
// segment; every rank then takes the slowest rank's time per run (a collective's time) from all the
// slots, so every rank fits the same numbers the same way, times the same splits, and reaches the
// same threshold. The leader installs the model in its balancer; the call itself runs on the
// segment alone (the kProfile plan's shares), and the next call of the kind is planned from the fits.
//
// The times slots are free here: a round's slot is this call's (free until the call's end, as for
// RebuildProbedRings) or, alternating, the previous call's, which every rank has finished reading
// once all passed the first round's barrier (the leader reads it right after the arrival); a rank
// rewrites a round's slot two rounds later, after a barrier that every reader of the round reached.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"
#include "xla_ffi/plan/balancer.h"
#include "xla_ffi/plan/cost_model.h"

namespace flexlink {
class LinkWorker;
class TcpChannel;
}  // namespace flexlink

namespace flexlink::xproc {

class ProcessGroup;

// The group's links as the executor resolved them.
struct ProfiledLinks {
  ProcessGroup* group = nullptr;
  std::vector<std::string> names;
  std::vector<TcpChannel*> tcp;  // per link; nullptr: the segment
  // [link][rank]: the tcp links' workers of this process's ranks (the split runs use them).
  std::vector<std::vector<std::unique_ptr<LinkWorker>>>* workers = nullptr;
};

struct ProfileOutcome {
  bool ok = false;          // false: a link failed on some rank; nothing to install
  plan::CostModel model;    // the fits and the measured threshold for the kind (when ok)
  std::string summary;      // for the leader's log: fits, per-size best alone / split, the threshold
  std::string why_not;      // when not ok: which link, at which size
};

// Every local rank of call `call`, after its arrival, when the leader's plan slot says kProfile.
// An error only where the segment itself failed (the group is then broken, as for any call); a link
// that fails inside the profile makes *out not ok, the same on every rank.
Status ProfileAcrossProcesses(const ProfiledLinks& links, int rank, uint64_t call, Kind kind,
                              uint64_t message_bytes, const plan::BalancerOptions& options,
                              std::string_view label, int64_t run_id, ProfileOutcome* out);

}  // namespace flexlink::xproc
