// Straggler detection (docs/diagnose.md): per group, which rank arrived last at each call's
// rendezvous and how late it was, and the test that flags a rank that is last far more often than
// chance. Recorded once per call by the last rank to arrive, with relaxed atomics only: no lock and
// no allocation on the hot path beyond what the arrival already takes.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace flexlink {

// One rank of one group, as stats()["stragglers"] reports it.
struct StragglerRank {
  int rank = 0;
  int64_t device = 0;
  uint64_t calls = 0;          // calls of the group whose arrival completed
  uint64_t last = 0;           // of those, calls where this rank arrived last
  uint64_t absent = 0;         // calls abandoned at the arrival with this rank missing
  double expected_last = 0;    // calls / group size
  double p_value = 1;          // P(last >= observed) for a fair group (binomial, p = 1/size)
  bool significant = false;    // calls >= kStragglerMinCalls and p_value < kStragglerAlpha / size
  bool flagged = false;        // significant and p50_s >= kStragglerMinLatenessS
  // How long after the previous arrival this rank came, over the calls where it was last (seconds;
  // 0 when it never was): the middle of its log-bucket (<= 12.5% off), max exact.
  double p50_s = 0, p90_s = 0, max_s = 0;
};

struct StragglerGroup {
  std::vector<int64_t> devices;  // rank order
  uint64_t calls = 0;
  std::vector<StragglerRank> ranks;
};

// The test: flag when at least this many calls were seen, the binomial tail is below
// kStragglerAlpha / size (Bonferroni over the group's ranks: a fair group flags anyone with
// probability < kStragglerAlpha per look), and the rank's median lateness is at least
// kStragglerMinLatenessS. The floor is there because arrival order among ranks that arrive within a
// lock hand-off of each other is the scheduler's, not the job's: on this 2-core VM, 8 threads with
// no work between calls arrive ~3 us apart at the median and one of them is last 2-3x more often
// than chance in about half the runs (measured, docs/diagnose.md). Such a rank costs nothing.
inline constexpr uint64_t kStragglerMinCalls = 16;
inline constexpr double kStragglerAlpha = 1e-3;
inline constexpr double kStragglerMinLatenessS = 50e-6;

// P(X >= k) for X ~ Binomial(n, p); exact summation in log space (k > n p: the terms fall
// geometrically, so the sum stops early).
double BinomialTail(uint64_t k, uint64_t n, double p);

class StragglerTracker {
 public:
  explicit StragglerTracker(std::span<const int64_t> devices);
  ~StragglerTracker();
  StragglerTracker(const StragglerTracker&) = delete;
  StragglerTracker& operator=(const StragglerTracker&) = delete;

  // At a call's last arrival: `rank` came `late_ns` after the arrival before it.
  void RecordLast(int rank, uint64_t late_ns);
  // A call abandoned at the arrival (deadline) without `rank`; off the hot path.
  void RecordAbsent(int rank);
  void Reset();
  StragglerGroup Snapshot() const;
  // Adds this tracker's counters to `raw` (size() * kStride values, rank-major) and `calls`: how
  // trackers of the same group are merged before their quantiles are taken.
  void AddTo(std::vector<uint64_t>* raw, uint64_t* calls) const;
  static StragglerGroup Summarize(std::span<const int64_t> devices, const std::vector<uint64_t>& raw,
                                  uint64_t calls);
  int size() const { return n_; }
  std::span<const int64_t> devices() const { return devices_; }

  // Log-bucket histogram: 4 linear sub-buckets per power of two of nanoseconds.
  static constexpr int kBuckets = 4 * 42;
  static int Bucket(uint64_t ns);
  static double BucketMiddleSeconds(int bucket);
  // Per rank: [last, absent, max_ns, histogram[kBuckets]].
  static constexpr int kStride = 3 + kBuckets;

 private:
  const std::vector<int64_t> devices_;
  const int n_;
  std::atomic<uint64_t> calls_{0};
  std::unique_ptr<std::atomic<uint64_t>[]> counters_;
  std::atomic<uint64_t>* Row(int rank) const { return &counters_[static_cast<size_t>(rank) * kStride]; }
};

// Every live tracker (every communicator), merged by group: a group that was rebuilt for another
// link set reports its calls under both together.
std::vector<StragglerGroup> SnapshotStragglers();
void ResetStragglers();

}  // namespace flexlink
