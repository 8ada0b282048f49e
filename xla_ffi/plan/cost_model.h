// The α–β cost model of stage 1: a link's time for one sub-collective of `bytes` (per-rank message
// bytes, the nccl-tests "size") is  t = α + β·bytes, fitted per link and per collective kind from
// profiled samples. From the fits follow the two stage-1 decisions:
//  - the split of N bytes that makes every used link finish at the same time (water-filling: a link
//    whose α alone exceeds the common finish time gets nothing), and
//  - the size below which the fastest single link beats any split (small calls use one link).
// Free functions take the fits of a link set as a span so they are testable without a CostModel;
// CostModel only stores fits per (kind, link).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"

namespace flexlink::plan {

using flexlink::kNumKinds;  // collective kinds (core/types.h)
inline size_t KindIndex(Kind k) { return static_cast<size_t>(k); }

struct AlphaBeta {
  double alpha = 0;  // seconds per call (latency, launch, synchronisation)
  double beta = 0;   // seconds per byte (1 / bandwidth)
  double Predict(double bytes) const { return alpha + beta * bytes; }
  double bytes_per_second() const { return beta > 0 ? 1.0 / beta : 0; }
};

struct Sample {
  double bytes = 0;
  double seconds = 0;
};

// Least-squares fit of seconds = α + β·bytes. Residuals are weighted by 1/seconds², i.e. the fit
// minimises *relative* error: profiling sizes are powers of two spanning many decades, and a plain
// fit would let the largest sizes decide everything, leaving α (which only shows at small sizes) as
// noise. α < 0 is clamped to 0 (refit through the origin); β is kept positive (a link must cost
// something per byte or the split degenerates). Needs samples at two or more distinct sizes.
Status FitAlphaBeta(std::span<const Sample> samples, AlphaBeta* out);

// FitAlphaBeta's fit, else (fewer than two distinct sizes, which stage 1's size lists never give) a
// line through the origin and the last sample, so that a profile always leaves a usable fit.
AlphaBeta FitOrLine(std::span<const Sample> samples);

// A link's time for `bytes` without a fit: a deliberately pessimistic 100 MB/s, so that a large call
// run before any fit exists is not declared hung at the floor of its link's deadline (docs/faults.md).
inline constexpr double kUnfittedBytesPerSecond = 100e6;
inline double UnfittedSeconds(double bytes) { return bytes / kUnfittedBytesPerSecond; }
// fits[link]'s prediction, or UnfittedSeconds when there are no fits.
inline double PredictOrUnfitted(std::span<const AlphaBeta> fits, size_t link, double bytes) {
  return link < fits.size() ? fits[link].Predict(bytes) : UnfittedSeconds(bytes);
}

// Powers of two in [min_bytes, max_bytes] (the profiling sizes); max_bytes is included when it is
// not a power of two so the largest size seen is profiled too.
std::vector<uint64_t> ProfileSizes(uint64_t min_bytes, uint64_t max_bytes);

// Size bucket of a call: the largest power of two <= bytes (0 for 0). Plans are per bucket, so a
// bucket covers [b, 2b).
uint64_t BucketOf(uint64_t bytes);

// Shares (summing to 1) of `bytes` across `links` that equalise α_i + β_i·share_i·bytes over the
// used links; links whose α is not below the common finish time get 0. bytes <= 0 puts everything
// on the link with the smallest α.
std::vector<double> EqualFinishShares(std::span<const AlphaBeta> links, double bytes);

// Predicted time of a split: the slowest used link (share > 0).
double PredictSplit(std::span<const AlphaBeta> links, std::span<const double> shares, double bytes);

// Index of the link with the smallest predicted time for `bytes` alone.
size_t FastestSingle(std::span<const AlphaBeta> links, double bytes);

// Smallest size from which the equal-finish split, charged `split_overhead_s` when it uses more
// than one link (fan-out and join of the executor), is predicted faster than the fastest single link
// at that size and every larger one. 0: always split; UINT64_MAX: never (e.g. one link).
uint64_t SplitThreshold(std::span<const AlphaBeta> links, double split_overhead_s);
inline constexpr uint64_t kNeverSplit = UINT64_MAX;

// Stage 1's measured threshold. `sizes` ascending (bytes), `alone[i]` the best single link's time at
// sizes[i], `split[i]` the timed split's (<= 0 or not finite: no split was run there, e.g. the fits
// gave one link everything). The split wins at a size when it is `min_gain` faster than alone. The
// result is the smallest size from which it wins at every larger profiled size; kNeverSplit when it
// loses at the largest; when it wins at all of them, `predicted` (the fits' threshold) capped at
// sizes[0], since nothing below was measured.
uint64_t MeasuredSplitThreshold(std::span<const double> sizes, std::span<const double> alone,
                                std::span<const double> split, double min_gain, uint64_t predicted);

// Fits of one link set, per collective kind. Link order is the link-spec order (primary first).
class CostModel {
 public:
  CostModel() = default;
  explicit CostModel(std::vector<std::string> links);

  const std::vector<std::string>& links() const { return links_; }
  size_t num_links() const { return links_.size(); }

  void Set(Kind kind, size_t link, AlphaBeta fit);
  // True when every link has a fit for `kind`.
  bool Has(Kind kind) const;
  // Valid only when Has(kind).
  std::span<const AlphaBeta> Fits(Kind kind) const { return fits_[KindIndex(kind)]; }
  // The split threshold stage 1 measured (splits timed against the best link alone), which wins over
  // the fits' prediction: links that slow each other down (two links sharing two CPU cores) look
  // fine one at a time. kNeverSplit: no profiled size was split faster. Unset: predict from the fits.
  void SetMeasuredThreshold(Kind kind, uint64_t bytes) { measured_[KindIndex(kind)] = bytes; }
  std::optional<uint64_t> MeasuredThreshold(Kind kind) const { return measured_[KindIndex(kind)]; }
  // The largest size stage 1 profiled for `kind` (0: unknown). Calls far beyond it profile again.
  void SetProfiledBytes(Kind kind, uint64_t bytes) { profiled_[KindIndex(kind)] = bytes; }
  uint64_t ProfiledBytes(Kind kind) const { return profiled_[KindIndex(kind)]; }
  // Copies `other`'s fits and measured threshold for `kind` (same links).
  void CopyKind(const CostModel& other, Kind kind);
  // Forgets the fits and measured threshold of `kind`.
  void ClearKind(Kind kind);

 private:
  std::vector<std::string> links_;
  std::array<std::vector<AlphaBeta>, kNumKinds> fits_;
  std::array<std::vector<bool>, kNumKinds> fitted_;
  std::array<std::optional<uint64_t>, kNumKinds> measured_;
  std::array<uint64_t, kNumKinds> profiled_{};
};

}  // namespace flexlink::plan
