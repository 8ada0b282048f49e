// Small helpers on share vectors (one fraction per link), shared by the balancer's files.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <vector>

#include "xla_ffi/core/status.h"

namespace flexlink::plan {

inline std::vector<double> OneHot(size_t n, size_t i) {
  std::vector<double> v(n, 0.0);
  v[i] = 1.0;
  return v;
}

inline size_t CountUsed(const std::vector<double>& shares) {
  return std::count_if(shares.begin(), shares.end(), [](double s) { return s > 0; });
}

inline double Mean(const std::vector<double>& v) {
  return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / v.size();
}

inline void Normalise(std::vector<double>& shares) {
  double sum = std::accumulate(shares.begin(), shares.end(), 0.0);
  if (sum > 0) {
    for (double& s : shares) s /= sum;
  }
}

// Drops shares below the floor and renormalises. A dropped link would otherwise keep a sliver that
// costs it a full α per call and a worker wake-up for almost no bytes. If every share is below the
// floor the largest one is kept.
inline void DropBelow(std::vector<double>& shares, double min_share) {
  if (shares.empty()) return;
  size_t largest = std::max_element(shares.begin(), shares.end()) - shares.begin();
  for (size_t i = 0; i < shares.size(); ++i) {
    if (shares[i] < min_share && i != largest) shares[i] = 0;
  }
  Normalise(shares);
}

// Checks user-given shares (finite, >= 0, not all 0) and scales them to sum 1. Done once, on the
// thread that sets them, before they are stored for groups made later: those are made on XLA's
// device threads, where a denormal share (1e-311) reads as 0, so a vector of such shares was
// refused there and the pin silently dropped (docs/testing.md). Normalised, its sum is 1 on every
// thread.
inline Status NormaliseShares(std::vector<double>& shares) {
  double sum = 0;
  for (double s : shares) {
    if (!(s >= 0) || !std::isfinite(s)) return Status::InvalidArgument("flexlink: plan shares must be finite and >= 0");
    sum += s;
  }
  if (!(sum > 0)) return Status::InvalidArgument("flexlink: plan shares must not all be 0");
  for (double& s : shares) s /= sum;
  return Status::Ok();
}

}  // namespace flexlink::plan
