#include "xla_ffi/core/stragglers.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <map>
#include <mutex>

namespace flexlink {
namespace {

// Every live tracker. Taken only when a communicator is made or destroyed and by snapshots, never
// on a call.
struct TrackerList {
  std::mutex mu;
  std::vector<StragglerTracker*> trackers;
};

TrackerList& Trackers() {
  static auto* list = new TrackerList();
  return *list;
}

enum : int { kLast = 0, kAbsent = 1, kMaxNs = 2, kHist = 3 };

double LogPmf(uint64_t i, uint64_t n, double log_p, double log_q) {
  const double di = static_cast<double>(i), dn = static_cast<double>(n);
  return std::lgamma(dn + 1) - std::lgamma(di + 1) - std::lgamma(dn - di + 1) + di * log_p + (dn - di) * log_q;
}

}  // namespace

double BinomialTail(uint64_t k, uint64_t n, double p) {
  if (k == 0) return 1.0;
  if (k > n) return 0.0;
  if (p <= 0) return 0.0;
  if (p >= 1) return 1.0;
  const double log_p = std::log(p), log_q = std::log1p(-p);
  if (static_cast<double>(k) <= static_cast<double>(n) * p) {
    // Below the mean the tail is large: 1 - P(X < k), k terms.
    double below = 0;
    for (uint64_t i = 0; i < k; ++i) below += std::exp(LogPmf(i, n, log_p, log_q));
    return std::clamp(1.0 - below, 0.0, 1.0);
  }
  // Above the mean the terms fall at least geometrically: stop once they no longer count.
  double sum = 0;
  for (uint64_t i = k; i <= n; ++i) {
    const double term = std::exp(LogPmf(i, n, log_p, log_q));
    sum += term;
    if (term <= sum * 1e-17) break;
  }
  return std::min(sum, 1.0);
}

StragglerTracker::StragglerTracker(std::span<const int64_t> devices)
    : devices_(devices.begin(), devices.end()),
      n_(static_cast<int>(devices.size())),
      counters_(new std::atomic<uint64_t>[static_cast<size_t>(n_) * kStride]) {
  for (size_t i = 0; i < static_cast<size_t>(n_) * kStride; ++i) counters_[i].store(0, std::memory_order_relaxed);
  TrackerList& list = Trackers();
  std::lock_guard<std::mutex> lock(list.mu);
  list.trackers.push_back(this);
}

StragglerTracker::~StragglerTracker() {
  TrackerList& list = Trackers();
  std::lock_guard<std::mutex> lock(list.mu);
  list.trackers.erase(std::find(list.trackers.begin(), list.trackers.end(), this));
}

int StragglerTracker::Bucket(uint64_t ns) {
  if (ns < 4) return static_cast<int>(ns);
  const int msb = std::min(63 - std::countl_zero(ns), kBuckets / 4);  // clamped: ~2.4 h and above
  if (msb == kBuckets / 4) return kBuckets - 1;
  return 4 * (msb - 1) + static_cast<int>((ns >> (msb - 2)) & 3);
}

double StragglerTracker::BucketMiddleSeconds(int bucket) {
  if (bucket < 4) return bucket * 1e-9;
  const int msb = bucket / 4 + 1, sub = bucket % 4;
  const double width = std::ldexp(1.0, msb - 2);
  return ((4 + sub) * width + width / 2) * 1e-9;
}

void StragglerTracker::RecordLast(int rank, uint64_t late_ns) {
  // Relaxed: counters only, read by snapshots that tolerate a call in flight.
  calls_.fetch_add(1, std::memory_order_relaxed);
  std::atomic<uint64_t>* row = Row(rank);
  row[kLast].fetch_add(1, std::memory_order_relaxed);
  row[kHist + Bucket(late_ns)].fetch_add(1, std::memory_order_relaxed);
  uint64_t seen = row[kMaxNs].load(std::memory_order_relaxed);
  while (late_ns > seen && !row[kMaxNs].compare_exchange_weak(seen, late_ns, std::memory_order_relaxed)) {
  }
}

void StragglerTracker::RecordAbsent(int rank) { Row(rank)[kAbsent].fetch_add(1, std::memory_order_relaxed); }

void StragglerTracker::Reset() {
  calls_.store(0, std::memory_order_relaxed);
  for (size_t i = 0; i < static_cast<size_t>(n_) * kStride; ++i) counters_[i].store(0, std::memory_order_relaxed);
}

void StragglerTracker::AddTo(std::vector<uint64_t>* raw, uint64_t* calls) const {
  raw->resize(static_cast<size_t>(n_) * kStride, 0);
  *calls += calls_.load(std::memory_order_relaxed);
  for (int r = 0; r < n_; ++r)
    for (int i = 0; i < kStride; ++i) {
      uint64_t& into = (*raw)[static_cast<size_t>(r) * kStride + i];
      const uint64_t v = Row(r)[i].load(std::memory_order_relaxed);
      into = i == kMaxNs ? std::max(into, v) : into + v;
    }
}

StragglerGroup StragglerTracker::Summarize(std::span<const int64_t> devices, const std::vector<uint64_t>& raw,
                                           uint64_t calls) {
  StragglerGroup g;
  g.devices.assign(devices.begin(), devices.end());
  const int n = static_cast<int>(devices.size());
  g.calls = calls;
  for (int r = 0; r < n; ++r) {
    const uint64_t* row = &raw[static_cast<size_t>(r) * kStride];
    StragglerRank s;
    s.rank = r;
    s.device = devices[r];
    s.calls = calls;
    s.last = row[kLast];
    s.absent = row[kAbsent];
    s.expected_last = n ? static_cast<double>(calls) / n : 0.0;
    s.p_value = n ? BinomialTail(s.last, calls, 1.0 / n) : 1.0;
    s.significant = calls >= kStragglerMinCalls && s.p_value < kStragglerAlpha / n;
    s.max_s = row[kMaxNs] * 1e-9;
    // Quantiles from the histogram: the bucket holding the ceil(q * last)-th lateness.
    uint64_t counted = 0;
    for (int b = 0; b < kBuckets; ++b) counted += row[kHist + b];
    auto quantile = [&](double q) {
      if (counted == 0) return 0.0;
      const uint64_t want = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(q * counted)));
      uint64_t seen = 0;
      for (int b = 0; b < kBuckets; ++b)
        if ((seen += row[kHist + b]) >= want) return std::min(BucketMiddleSeconds(b), s.max_s);
      return s.max_s;
    };
    s.p50_s = quantile(0.5);
    s.p90_s = quantile(0.9);
    s.flagged = s.significant && s.p50_s >= kStragglerMinLatenessS;
    g.ranks.push_back(s);
  }
  return g;
}

StragglerGroup StragglerTracker::Snapshot() const {
  std::vector<uint64_t> raw;
  uint64_t calls = 0;
  AddTo(&raw, &calls);
  return Summarize(devices_, raw, calls);
}

std::vector<StragglerGroup> SnapshotStragglers() {
  std::map<std::vector<int64_t>, std::pair<std::vector<uint64_t>, uint64_t>> merged;
  {
    TrackerList& list = Trackers();
    std::lock_guard<std::mutex> lock(list.mu);
    for (const StragglerTracker* t : list.trackers) {
      auto& [raw, calls] = merged[std::vector<int64_t>(t->devices().begin(), t->devices().end())];
      t->AddTo(&raw, &calls);
    }
  }
  std::vector<StragglerGroup> out;
  for (const auto& [devices, counts] : merged)
    if (counts.second > 0 || std::any_of(counts.first.begin(), counts.first.end(), [](uint64_t v) { return v; }))
      out.push_back(StragglerTracker::Summarize(devices, counts.first, counts.second));
  return out;
}

void ResetStragglers() {
  TrackerList& list = Trackers();
  std::lock_guard<std::mutex> lock(list.mu);
  for (StragglerTracker* t : list.trackers) t->Reset();
}

}  // namespace flexlink
