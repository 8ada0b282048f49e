#include "xla_ffi/plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace flexlink::plan {
namespace {

// The smallest β a fit may return: 1e-15 s/B is 1 PB/s, far beyond any link, yet keeps 1/β finite.
constexpr double kMinBeta = 1e-15;

double SafeBeta(const AlphaBeta& f) { return std::max(f.beta, kMinBeta); }

}  // namespace

Status FitAlphaBeta(std::span<const Sample> samples, AlphaBeta* out) {
  double max_x = 0;
  for (const Sample& s : samples) {
    if (!(s.bytes >= 0) || !(s.seconds > 0) || !std::isfinite(s.bytes) || !std::isfinite(s.seconds)) {
      return Status::InvalidArgument("flexlink: cost model: sample (" + std::to_string(s.bytes) + " B, " +
                                     std::to_string(s.seconds) + " s) is not a valid measurement");
    }
    max_x = std::max(max_x, s.bytes);
  }
  if (samples.empty() || max_x <= 0) {
    return Status::InvalidArgument("flexlink: cost model: no samples with bytes > 0 to fit");
  }
  // Bytes are scaled to [0, 1] so the normal equations stay well conditioned over 2^0..2^40.
  double sw = 0, swx = 0, swxx = 0, swy = 0, swxy = 0;
  for (const Sample& s : samples) {
    double x = s.bytes / max_x, y = s.seconds, w = 1.0 / (y * y);
    sw += w;
    swx += w * x;
    swxx += w * x * x;
    swy += w * y;
    swxy += w * x * y;
  }
  double det = sw * swxx - swx * swx;
  if (!(det > 1e-12 * sw * swxx)) {
    return Status::InvalidArgument("flexlink: cost model: samples at two or more distinct sizes are needed");
  }
  double alpha = (swy * swxx - swx * swxy) / det;
  double beta = (sw * swxy - swx * swy) / det;
  if (alpha < 0) {  // through the origin
    alpha = 0;
    beta = swxy / swxx;
  }
  if (beta <= 0) {  // flat: pure latency
    beta = 0;
    alpha = swy / sw;
  }
  out->alpha = alpha;
  out->beta = std::max(beta / max_x, kMinBeta);
  return Status::Ok();
}

AlphaBeta FitOrLine(std::span<const Sample> samples) {
  AlphaBeta fit;
  if (FitAlphaBeta(samples, &fit).ok() || samples.empty()) return fit;
  const Sample& last = samples.back();
  return AlphaBeta{0, last.bytes > 0 ? last.seconds / last.bytes : 0};
}

std::vector<uint64_t> ProfileSizes(uint64_t min_bytes, uint64_t max_bytes) {
  std::vector<uint64_t> sizes;
  uint64_t b = std::max<uint64_t>(BucketOf(std::max<uint64_t>(min_bytes, 1)), 1);
  if (b < min_bytes) b <<= 1;
  for (; b <= max_bytes && b != 0; b <<= 1) sizes.push_back(b);
  if (max_bytes >= min_bytes && (sizes.empty() || sizes.back() != max_bytes)) sizes.push_back(max_bytes);
  return sizes;
}

uint64_t BucketOf(uint64_t bytes) {
  if (bytes == 0) return 0;
  uint64_t b = 1;
  while (b <= bytes / 2) b <<= 1;
  return b;
}

std::vector<double> EqualFinishShares(std::span<const AlphaBeta> links, double bytes) {
  size_t n = links.size();
  std::vector<double> shares(n, 0.0);
  if (n == 0) return shares;
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  // Water-filling: with links sorted by α, the used set is a prefix, grown while the next link's α is
  // below the common finish time T of the current set, where Σ (T − α_i)/β_i = bytes.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return links[a].alpha != links[b].alpha ? links[a].alpha < links[b].alpha
                                            : SafeBeta(links[a]) < SafeBeta(links[b]);
  });
  if (!(bytes > 0)) {
    shares[order[0]] = 1.0;
    return shares;
  }
  double sum_inv = 0, sum_a_over_b = 0, t = 0;
  size_t used = 0;
  for (size_t k = 0; k < n; ++k) {
    const AlphaBeta& f = links[order[k]];
    if (k > 0 && f.alpha >= t) break;
    sum_inv += 1.0 / SafeBeta(f);
    sum_a_over_b += f.alpha / SafeBeta(f);
    t = (bytes + sum_a_over_b) / sum_inv;
    used = k + 1;
  }
  double total = 0;
  for (size_t k = 0; k < used; ++k) {
    const AlphaBeta& f = links[order[k]];
    double s = std::max(0.0, (t - f.alpha) / (SafeBeta(f) * bytes));
    shares[order[k]] = s;
    total += s;
  }
  for (double& s : shares) s /= total;  // exact sum 1 despite rounding
  return shares;
}

double PredictSplit(std::span<const AlphaBeta> links, std::span<const double> shares, double bytes) {
  double t = 0;
  for (size_t i = 0; i < links.size() && i < shares.size(); ++i) {
    if (shares[i] > 0) t = std::max(t, links[i].Predict(shares[i] * bytes));
  }
  return t;
}

size_t FastestSingle(std::span<const AlphaBeta> links, double bytes) {
  size_t best = 0;
  for (size_t i = 1; i < links.size(); ++i) {
    if (links[i].Predict(bytes) < links[best].Predict(bytes)) best = i;
  }
  return best;
}

uint64_t SplitThreshold(std::span<const AlphaBeta> links, double split_overhead_s) {
  if (links.size() < 2) return kNeverSplit;
  auto gain = [&](double bytes) {
    std::vector<double> s = EqualFinishShares(links, bytes);
    size_t used = std::count_if(s.begin(), s.end(), [](double x) { return x > 0; });
    if (used < 2) return 0.0;  // the split degenerates to one link: no gain, no overhead
    double split = PredictSplit(links, s, bytes) + split_overhead_s;
    return links[FastestSingle(links, bytes)].Predict(bytes) - split;
  };
  // Scan a quarter-octave grid from 1 B to 2^50 B and keep the last size at which splitting loses;
  // the answer lies between it and the next grid point. Scanning all of it (rather than stopping at
  // the first win) keeps the "and every larger size" promise when the gain is not monotone.
  constexpr int kSteps = 4 * 50;
  auto grid = [](int k) { return std::exp2(k / 4.0); };
  int last_loss = -1;
  for (int k = 0; k <= kSteps; ++k) {
    if (!(gain(grid(k)) > 0)) last_loss = k;
  }
  if (last_loss == kSteps) return kNeverSplit;
  if (last_loss < 0) return 0;
  double lo = grid(last_loss), hi = grid(last_loss + 1);  // gain(lo) <= 0 < gain(hi)
  for (int i = 0; i < 60 && hi - lo > 1; ++i) {
    double mid = 0.5 * (lo + hi);
    (gain(mid) > 0 ? hi : lo) = mid;
  }
  return static_cast<uint64_t>(std::ceil(hi));
}

uint64_t MeasuredSplitThreshold(std::span<const double> sizes, std::span<const double> alone,
                                std::span<const double> split, double min_gain, uint64_t predicted) {
  auto wins = [&](size_t i) {
    return split[i] > 0 && std::isfinite(split[i]) && split[i] < (1 - min_gain) * alone[i];
  };
  size_t from = sizes.size();
  while (from > 0 && wins(from - 1)) --from;
  if (sizes.empty() || from == sizes.size()) return kNeverSplit;
  if (from == 0) return std::min(predicted, static_cast<uint64_t>(sizes[0]));
  return static_cast<uint64_t>(sizes[from]);
}

CostModel::CostModel(std::vector<std::string> links) : links_(std::move(links)) {
  for (size_t k = 0; k < kNumKinds; ++k) {
    fits_[k].assign(links_.size(), AlphaBeta{});
    fitted_[k].assign(links_.size(), false);
  }
}

void CostModel::Set(Kind kind, size_t link, AlphaBeta fit) {
  fits_[KindIndex(kind)].at(link) = fit;
  fitted_[KindIndex(kind)].at(link) = true;
}

void CostModel::CopyKind(const CostModel& other, Kind kind) {
  const size_t k = KindIndex(kind);
  fits_[k] = other.fits_[k];
  fitted_[k] = other.fitted_[k];
  measured_[k] = other.measured_[k];
  profiled_[k] = other.profiled_[k];
}

void CostModel::ClearKind(Kind kind) {
  const size_t k = KindIndex(kind);
  fits_[k].assign(links_.size(), AlphaBeta{});
  fitted_[k].assign(links_.size(), false);
  measured_[k].reset();
  profiled_[k] = 0;
}

bool CostModel::Has(Kind kind) const {
  const auto& f = fitted_[KindIndex(kind)];
  return !f.empty() && std::all_of(f.begin(), f.end(), [](bool b) { return b; });
}

}  // namespace flexlink::plan
