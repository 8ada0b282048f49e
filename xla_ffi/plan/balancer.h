// The two-stage load balancer: which fraction of a call's bytes each link carries.
//
// Plans are per (collective kind, size bucket) (cost_model.h BucketOf). Stage 1 seeds a plan from the
// α–β model: below the model's split threshold the call uses the fastest single link; above it, the
// equal-finish split. Stage 2 refines a split after every call from the per-link times the executor
// measured: each measured link i is given the line through its measured point (share_i, t_i) with
// intercept α_i (the model's, capped; 0 without a model), and the target is the equal-finish split of
// those lines. Its fixed point is "all links finish together" whatever α is used (α only sets the
// step size; α = 0 is the throughput rule share ∝ share/time). The step toward the target is whole
// far from balance (halved whenever it overshoots) and damped near balance (noise). A plan settles
// when targets and times stay within tolerances and then stops changing; a settled plan whose
// targets or times drift beyond wider tolerances for a few calls (a link got slower or faster)
// re-converges. Links whose share falls below a floor are dropped, and re-probed with a small share
// after an interval that doubles each time (a dropped link cannot be measured otherwise).
// A guard compares the split's measured call time with the best single link alone (model prediction,
// else a short measured trial) and falls back to that link when the split does not win, retrying
// the split after an interval that doubles each time it loses again. docs/planning.md has the
// reasoning and the constants.
//
// Calls and epochs: the engine asks for the plan once per call at the rendezvous (PlanFor, one
// thread) and hands the same immutable Plan to every rank, so all ranks cut identical ranges. After
// the call one thread calls Report with that Plan and the measured times. Every change of a plan makes
// a new Plan object with a new epoch (unique across the balancer), so a report for a plan that has
// since changed is recognised and ignored, and a change takes effect at the next PlanFor, i.e. at the
// same call for all ranks. Across processes one balancer must decide: e.g. the process of rank 0
// plans and reports, broadcasts its Plan's shares (and epoch) with the call's rendezvous, and the
// other processes cut by the received shares (CutRanges) without consulting their own balancer.
//
// Thread safety: every public method is internally locked (one mutex; each call is O(links) work
// plus a map lookup), so device threads and the Python control surface may call concurrently. Plan
// objects are immutable and shared, so a Plan obtained from PlanFor stays valid while held.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"
#include "xla_ffi/plan/cost_model.h"

namespace flexlink::plan {

enum class PlanMode : uint8_t {
  kSingle,      // below the split threshold: the fastest single link, not adapted
  kConverging,  // stage 2 moving shares toward equal finish times
  kSettled,     // shares frozen; watching for speed changes and for losing to a single link
  kTrial,       // a few calls on the best single link alone, to measure it
  kFallback,    // the split lost to the best single link; that link alone until the next retry
  kPinned,      // shares set by the user (SetShares pinned); never adapted
  kProfile,     // no fits for this kind yet and the call is large: the engine runs stage 1 first,
                // installs its fits (MergeModel) and asks again
};
std::string_view Name(PlanMode mode);

struct Plan {
  Kind kind = Kind::kAllReduce;
  uint64_t bucket_bytes = 0;
  uint64_t epoch = 0;  // unique per Plan object; a changed plan has a larger epoch
  PlanMode mode = PlanMode::kConverging;
  std::vector<double> shares;  // per link (link-spec order), >= 0, summing to 1
};

struct BalancerOptions {
  double damping = 0.5;            // step toward the target when the links are nearly balanced
  double far_spread = 0.5;         // time spread (slowest/fastest − 1) above which the step is whole
  double settle_tolerance = 0.02;  // balanced: max |target − share| below this (share units)...
  double settle_spread = 0.06;     // ...and time spread below this (above ±2% noise)...
  int settle_calls = 3;            // ...for this many consecutive calls settles the plan
  int max_converge_calls = 40;     // settle anyway after this many calls (links noisier than the tolerance)
  // A settled plan re-converges when, on link times averaged over change_calls calls, its targets are
  // change_tolerance off or its time spread exceeds change_spread, twice in a row. Both tolerances
  // double (up to 8x) for a plan that only settled by max_converge_calls (noisy links).
  double change_tolerance = 0.05;
  double change_spread = 0.15;
  int change_calls = 4;
  double max_alpha_fraction = 0.8;  // model α used in the step is capped at this fraction of a link's time
  double min_share = 0.005;        // a share below this is set to 0 (the link is dropped from the plan)
  double min_split_gain = 0.02;    // keep a split only if it is this much faster than the best single link
  double fallback_margin = 0.03;   // a settled split this much slower than the single link is re-checked
  double fallback_slowdown = 0.5;  // a fallback's link alone this much slower than before: retry the split
  int trial_calls = 2;             // calls of a single-link trial
  int retry_calls = 64;            // first retry of a split after a fallback, or re-probe of dropped
  int max_retry_calls = 4096;      // links of a settled split; doubles each time up to max_retry_calls
  double probe_share = 0.02;       // most share a dropped link gets back when re-probed
  double split_overhead_s = 5e-6;  // executor cost of using more than one link (for the threshold)
  // The next two are starting values: SetProfileFromBytes / SetProfileMaxBytes change them later.
  // Without fits for a kind: calls from this size (nccl-tests bytes) get a kProfile plan, smaller ones
  // the primary link alone (presumed fastest until stage 1 says otherwise). 0: no stage 1 from the
  // engine; every size starts from equal shares and stage 2 alone finds the split.
  uint64_t profile_from_bytes = 0;
  // With fits: a call whose bucket is at least reprofile_factor x the largest size profiled for its
  // kind, when that is below profile_max_bytes, runs stage 1 again ("up to the largest size seen").
  uint64_t profile_max_bytes = 16 << 20;
  uint64_t reprofile_factor = 16;
};

class Balancer {
 public:
  explicit Balancer(std::vector<std::string> links, BalancerOptions options = {});

  const std::vector<std::string>& links() const { return links_; }
  const BalancerOptions& options() const { return options_; }

  // Installs stage-1 results (link order must match). Plans that are not pinned are discarded and
  // re-seeded from the new model at their next call.
  Status SetModel(CostModel model);
  // Installs `model`'s fits (and measured threshold) for the kinds it has, keeping the other kinds';
  // the plans of those kinds that are not pinned are re-seeded at their next call.
  Status MergeModel(const CostModel& model);
  // Installs nominal fits (the machine's link rates, e.g. from jax_flexlink.topology) as the seed of
  // kinds stage 1 has not measured: their calls below the profiling size are planned from it instead
  // of taking the primary link alone, while a large call still runs stage 1, whose fits then replace
  // the seed. Seed kinds count as unprofiled, and the seed never reaches the tuning cache.
  Status SetSeed(CostModel seed);
  // Forgets `kind`'s fits; its plans that are not pinned start over (stage 1 again, see PlanFor).
  void ForgetKind(Kind kind);
  // A copy of the current model (fits per kind, measured thresholds).
  CostModel Model() const;
  // Stage 1's fits for `kind` (not the nominal seed's) into *out; false without them. `measured` and
  // `profiled`, when given, get the kind's measured split threshold and profiled size.
  bool FitsFor(Kind kind, std::vector<AlphaBeta>* out, std::optional<uint64_t>* measured = nullptr,
               uint64_t* profiled = nullptr) const;
  // Change BalancerOptions::profile_from_bytes / profile_max_bytes for plans made from now on.
  void SetProfileFromBytes(uint64_t bytes);
  // Stage 1 off for good (a profile failed): SetProfileFromBytes(0), and the buckets already
  // planned kProfile, of every kind, are planned again (from equal shares or fits).
  void StopProfiling();
  void SetProfileMaxBytes(uint64_t bytes);
  // Size (per-rank bytes) from which a call of `kind` is split; 0 without a model for `kind`.
  uint64_t SplitThresholdBytes(Kind kind) const;

  // The plan for a call of `kind` with `bytes` per rank; creates it on the first call of its bucket
  // (from the model if there is one for `kind`; else, see BalancerOptions::profile_from_bytes, a
  // kProfile plan, the primary alone, or equal shares that stage 2 then corrects).
  std::shared_ptr<const Plan> PlanFor(Kind kind, uint64_t bytes);

  struct Outcome {
    bool stale = false;    // the plan had changed since; nothing learnt
    bool changed = false;  // the next PlanFor of this bucket returns a new plan
    std::string reason;    // when changed: one log line (FLEXLINK_DEBUG=INFO)
  };
  // Stage 2: `link_seconds[i]` is link i's time for its range (ignored for links with no range or a
  // time <= 0), `call_seconds` the whole call's time (<= 0: the slowest link's time).
  Outcome Report(const Plan& plan, uint64_t bytes, std::span<const double> link_seconds,
                 double call_seconds);

  // Sets a bucket's shares (one per link, >= 0, positive sum; normalised). Pinned: kept as given
  // until SetShares(pinned=false) or Clear; not pinned: a starting point that stage 2 adapts,
  // having forgotten what it measured of the bucket before (single links' rates included).
  Status SetShares(Kind kind, uint64_t bucket_bytes, std::vector<double> shares, bool pinned);
  void Clear();  // forgets every plan (the model stays)

  // Every plan, ordered by (kind, bucket); for stats() and tests.
  std::vector<std::shared_ptr<const Plan>> Plans() const;
  // "all_reduce 64 MiB [settled] nvlink=0.627 pcie=0.196 nic=0.177"
  std::string Describe(const Plan& plan) const;

 private:
  // A plan and what stage 2 has learnt about its bucket.
  struct Entry {
    std::shared_ptr<const Plan> plan;
    std::vector<double> split;   // the split to return to after a trial or a fallback
    std::vector<double> seed;    // the stage-1 (or user-given) starting split
    int settled_calls = 0;       // calls since the plan last changed
    std::vector<double> link_rate;  // last measured bytes/s of each link within a split (0: never)
    std::vector<double> window;  // rates (bytes/s) of the most recent split calls
    int converge_calls = 0, settle_count = 0, change_count = 0;
    double step = 1.0;            // far-from-balance step; halved when the target overshoots
    double slack = 1.0;           // multiplies the change tolerances; doubled for noisy links
    std::vector<double> last_dev; // target − share of the previous call (overshoot detection)
    std::vector<std::vector<double>> recent;  // settled: link times of the last change_calls calls
    size_t single_link = 0;       // link of kSingle / kTrial / kFallback
    size_t fastest_link = 0;      // highest measured per-link rate in the last split call
    double single_rate = 0;       // measured rate of single_link alone (0: never measured)
    bool single_fresh = false;    // measured since the last detected speed change
    double single_sum = 0;        // this trial/fallback phase: sum and count of rates
    int single_calls = 0;
    std::vector<double> single_recent;  // fallback: the rates of its last change_calls calls
    int retry_calls = 0;          // length of the current / next fallback
  };
  using Key = std::pair<size_t, uint64_t>;

  // Stage 2's view of one call (or of averaged calls) of a split.
  struct Assessment {
    bool valid = false;          // some used link was measured
    std::vector<double> target;  // equal-finish shares for the measured times
    std::vector<double> dev;     // target − share
    double max_dev = 0;          // max |dev|
    size_t worst = 0;            // link of max |dev|
    double spread = 0;           // slowest / fastest measured time − 1
    size_t fastest = 0;          // highest measured throughput share/time
    std::vector<double> rate;    // measured bytes/s per link (0: not measured)
  };

  Entry& EntryFor(Kind kind, uint64_t bytes);
  Assessment Assess(const Entry& e, uint64_t bytes, std::span<const double> link_seconds) const;
  void Install(Entry& e, PlanMode mode, std::vector<double> shares);
  // The fastest single link below `threshold`, else the equal-finish split of `fits`, converging.
  void InstallFromFits(Entry& e, std::span<const AlphaBeta> fits, uint64_t threshold, uint64_t bytes);
  void OnSplitCall(Entry& e, uint64_t bytes, std::span<const double> link_seconds, double rate,
                   Outcome* out);
  void OnSingleCall(Entry& e, uint64_t bytes, double rate, Outcome* out);
  void Decide(Entry& e, uint64_t bytes, Outcome* out);
  // Resets stage 2's state and installs `shares` as a converging plan.
  void Reconverge(Entry& e, std::vector<double> shares);
  // The split to retry: the last one (or the seed, if it collapsed) with dropped links given
  // probe_share again.
  std::vector<double> Reopen(const Entry& e) const;
  void StartTrial(Entry& e, uint64_t bytes, Outcome* out, std::string_view why);
  void UpdateThresholds();
  // Forgets the plans that are not pinned (of one kind, or of all): they are re-seeded at their next
  // call from the model as it is now.
  void DropPlans(std::optional<size_t> kind);
  // Predicted rate of the best single link (0 without a model) and which link that is.
  double ModelSingleRate(Kind kind, uint64_t bytes, size_t* link) const;

  const std::vector<std::string> links_;
  const BalancerOptions options_;
  mutable std::mutex mu_;
  CostModel model_;
  CostModel seed_;  // nominal fits for kinds without stage-1 fits (SetSeed); never measured
  std::array<uint64_t, kNumKinds> thresholds_{};
  std::map<Key, Entry> entries_;
  uint64_t next_epoch_ = 1;
  uint64_t profile_from_bytes_;
  uint64_t profile_max_bytes_;
};

}  // namespace flexlink::plan
