// Straggler detection (xla_ffi/core/stragglers.h): a rank that sleeps before every call is flagged
// with its lateness, the others are not; a fair run flags nobody; a rank that never arrives is
// counted absent; reset clears. Threads stand in for devices and call RunCollective, the entry point
// of the FFI handlers. Plain C++: prints "N passed, N failed", exits non-zero on any failure.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/engine.h"
#include "xla_ffi/core/stragglers.h"
#include "tests/cpp/check.h"

using namespace flexlink;
using namespace flexlink::testing;

namespace {

Status AllReduceF32(std::span<const int64_t> group, int64_t device, int64_t run, std::vector<float>& x,
                    std::vector<float>& y) {
  const std::vector<int64_t> sizes = {static_cast<int64_t>(group.size())};
  const std::vector<int64_t> dims = {static_cast<int64_t>(x.size())};
  CollectiveArgs a;
  a.groups = group;
  a.group_sizes = sizes;
  a.device = device;
  a.run_id = run;
  a.label = "straggler_test";
  a.request.reduction = "sum";
  OperandRequest op;
  op.in_dims = dims;
  op.out_dims = dims;
  op.in = x.data();
  op.out = y.data();
  a.request.operands = {&op, 1};
  return RunCollective(a);
}

// `calls` all_reduces on persistent threads, one per device of `group`; `before(rank, call)` runs
// on the rank's thread before each call. Returns whether every call succeeded with the right sum.
bool RunCalls(const std::vector<int64_t>& group, int calls, const std::function<void(int, int)>& before) {
  const int n = static_cast<int>(group.size());
  const int64_t run = NextRunId();
  std::vector<int> good(n, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      std::vector<float> x(64, 1.f), y(64, 0.f);
      for (int c = 0; c < calls; ++c) {
        before(r, c);
        good[r] += AllReduceF32(group, group[r], run, x, y).ok() && y[0] == static_cast<float>(n);
      }
    });
  for (auto& t : threads) t.join();
  bool ok = true;
  for (int r = 0; r < n; ++r) ok &= good[r] == calls;
  return ok;
}

const StragglerGroup* Find(const std::vector<StragglerGroup>& groups, const std::vector<int64_t>& devices) {
  for (const auto& g : groups)
    if (g.devices == devices) return &g;
  return nullptr;
}

// Independent of the engine's log-space sum: the textbook sum with binomial coefficients built up
// by multiplication (fine for the small n used here).
double TailByCoefficients(int k, int n, double p) {
  double sum = 0;
  for (int i = k; i <= n; ++i) {
    double c = 1;
    for (int j = 1; j <= i; ++j) c = c * (n - i + j) / j;
    sum += c * std::pow(p, i) * std::pow(1 - p, n - i);
  }
  return sum;
}

void TestBinomialTail() {
  bool ok = true;
  for (int n : {1, 5, 16, 40, 100})
    for (int k = 0; k <= n; ++k)
      for (double p : {0.125, 0.25, 0.5}) {
        const double want = TailByCoefficients(k, n, p), got = BinomialTail(k, n, p);
        if (std::fabs(got - want) > 1e-9 * std::max(1.0, want) && std::fabs(got - want) > 1e-12) {
          ok = false;
          std::printf("  tail(k=%d, n=%d, p=%g) = %g, want %g\n", k, n, p, got, want);
        }
      }
  Expect(ok, "BinomialTail matches the sum over binomial coefficients");
  Expect(BinomialTail(1000000, 1000000, 0.125) == 0.0 || BinomialTail(1000000, 1000000, 0.125) < 1e-300,
         "BinomialTail of a huge count underflows to ~0 without looping over it");
  Expect(BinomialTail(0, 10, 0.1) == 1.0 && BinomialTail(11, 10, 0.1) == 0.0, "BinomialTail edges");
}

void TestBuckets() {
  bool ok = true;
  int prev = -1;
  // Each value falls in a bucket whose middle is within 12.5% of it, and buckets grow with values.
  for (uint64_t ns = 1; ns < (uint64_t{1} << 41); ns = ns * 9 / 8 + 1) {
    const int b = StragglerTracker::Bucket(ns);
    const double mid = StragglerTracker::BucketMiddleSeconds(b) * 1e9;
    ok &= b >= prev && b < StragglerTracker::kBuckets;
    ok &= std::fabs(mid - static_cast<double>(ns)) <= (ns < 4 ? 1e-6 : 0.125 * ns + 1e-6);
    if (!ok) {
      std::printf("  ns %llu -> bucket %d, middle %g\n", static_cast<unsigned long long>(ns), b, mid);
      break;
    }
    prev = b;
  }
  Expect(ok, "log buckets: monotone, middle within 12.5%");
  Expect(StragglerTracker::Bucket(~uint64_t{0}) == StragglerTracker::kBuckets - 1, "the top bucket catches the rest");
}

// Rank 3 sleeps 5 ms before each call: it is last (nearly) always, flagged, about 5 ms late; the
// others are not flagged. 5 ms: more than a peer is descheduled for, mostly, with other tests
// running beside this one (Bazel).
void TestStragglerFlagged() {
  const std::vector<int64_t> group = {100, 101, 102, 103, 104, 105, 106, 107};
  const int calls = 40;
  const bool ok = RunCalls(group, calls, [](int rank, int) {
    if (rank == 3) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  });
  Expect(ok, "straggler run: every call correct");
  const auto groups = SnapshotStragglers();
  const StragglerGroup* g = Find(groups, group);
  Expect(g != nullptr, "the group is in the snapshot");
  if (!g) return;
  Expect(g->calls == static_cast<uint64_t>(calls), "calls counted: " + std::to_string(g->calls));
  const StragglerRank& s = g->ranks[3];
  std::printf("  straggler: rank 3 last in %llu of %llu (expected %.1f), p %.3g, late p50 %.3f ms p90 %.3f ms max %.3f ms\n",
              static_cast<unsigned long long>(s.last), static_cast<unsigned long long>(s.calls), s.expected_last,
              s.p_value, s.p50_s * 1e3, s.p90_s * 1e3, s.max_s * 1e3);
  Expect(s.device == 103 && s.expected_last == calls / 8.0, "rank 3 is device 103, expected last calls/8");
  // At least half (not all: on a loaded machine a peer can be descheduled for longer than the sleep).
  Expect(s.flagged && s.last >= calls / 2, "the sleeping rank is flagged (last " + std::to_string(s.last) + ")");
  // Slept 5 ms while the others arrived within microseconds; on 2 shared cores its peers may be
  // late too, so a wide band: at least a tenth of the sleep, far below the deadline.
  Expect(s.p50_s > 0.5e-3 && s.p50_s <= s.p90_s && s.p90_s <= s.max_s && s.max_s < 1.0,
         "its lateness: p50 >= 0.5 ms, p50 <= p90 <= max");
  bool others = true;
  uint64_t sum = 0;
  for (const auto& r : g->ranks) {
    sum += r.last;
    if (r.rank != 3) others &= !r.flagged;
  }
  Expect(others, "no other rank is flagged");
  Expect(sum == g->calls, "every call has exactly one last rank");
}

// No sleeps, many calls: whoever is last is down to scheduling, and nobody is flagged.
void TestFairRunFlagsNobody() {
  const std::vector<int64_t> group = {200, 201, 202, 203, 204, 205, 206, 207};
  const int calls = 1000;
  const bool ok = RunCalls(group, calls, [](int, int) {});
  Expect(ok, "fair run: every call correct");
  const StragglerGroup* g = nullptr;
  const auto groups = SnapshotStragglers();
  g = Find(groups, group);
  Expect(g != nullptr && g->calls == static_cast<uint64_t>(calls), "fair run: calls counted");
  if (!g) return;
  bool nobody = true;
  std::string counts;
  for (const auto& r : g->ranks) {
    nobody &= !r.flagged;
    char buf[96];
    std::snprintf(buf, sizeof buf, " %llu (p50 %.1f us, max %.1f us)", static_cast<unsigned long long>(r.last),
                  r.p50_s * 1e6, r.max_s * 1e6);
    counts += buf;
  }
  std::printf("  fair run: last per rank%s\n", counts.c_str());
  Expect(nobody, "fair run: nobody flagged (last per rank:" + counts + ")");
}

// The test's three conditions, fed directly: enough calls, the binomial tail against 1/n (with
// Bonferroni over the ranks), and the lateness floor.
void TestThresholds() {
  const std::vector<int64_t> devices = {400, 401, 402, 403, 404, 405, 406, 407};
  auto run = [&](int calls, int biased_last, uint64_t late_ns) {
    StragglerTracker t(devices);
    // Rank 5 is last `biased_last` times, the others share the rest round-robin.
    for (int c = 0, other = 0; c < calls; ++c)
      if (c < biased_last) t.RecordLast(5, late_ns);
      else {
        const int o = other++ % 7;
        t.RecordLast(o >= 5 ? o + 1 : o, 2000);
      }
    return t.Snapshot();
  };
  const double floor_ns = kStragglerMinLatenessS * 1e9;
  auto a = run(15, 15, 1000000);  // always last, 1 ms late, but only 15 calls
  Expect(!a.ranks[5].flagged && !a.ranks[5].significant, "fewer than 16 calls: never flagged");
  auto b = run(16, 16, 1000000);
  Expect(b.ranks[5].flagged && b.ranks[5].significant && std::fabs(b.ranks[5].p_value / std::pow(0.125, 16) - 1) < 1e-9,
         "16 calls, always last, 1 ms: flagged, p = (1/8)^16");
  auto c = run(400, 100, static_cast<uint64_t>(floor_ns / 10));  // 2x chance, far below the floor
  Expect(c.ranks[5].significant && !c.ranks[5].flagged, "significant but 5 us late: not flagged");
  auto d = run(400, 100, static_cast<uint64_t>(floor_ns * 4));
  Expect(d.ranks[5].flagged, "last 100 of 400 (expected 50), 200 us late: flagged");
  // 64 of 400 is P ~ 0.03 under chance: not enough for alpha / n.
  auto e = run(400, 64, static_cast<uint64_t>(floor_ns * 4));
  Expect(!e.ranks[5].significant && !e.ranks[5].flagged && e.ranks[5].p_value > 1e-3 / 8,
         "last 64 of 400: within chance, not flagged (p " + std::to_string(e.ranks[5].p_value) + ")");
  bool others = true;
  for (const auto& r : d.ranks) others &= r.rank == 5 || !r.flagged;
  Expect(others, "the round-robin ranks are not flagged");
  Expect(std::fabs(d.ranks[5].p50_s - floor_ns * 4e-9) <= 0.125 * floor_ns * 4e-9 &&
             d.ranks[5].max_s == floor_ns * 4e-9,
         "p50 within a bucket of the lateness, max exact");
}

// A rank that never arrives: the call times out, the rank is counted absent, nobody gets a "last".
void TestAbsent() {
  const double saved = TimeoutSeconds();
  SetTimeoutSeconds(0.2);
  const std::vector<int64_t> group = {300, 301, 302};
  const int64_t run = NextRunId();
  std::vector<std::thread> threads;
  std::vector<Status> st(3);
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      std::vector<float> x(16, 1.f), y(16);
      st[r] = AllReduceF32(group, group[r], run, x, y);
    });
  for (auto& t : threads) t.join();
  SetTimeoutSeconds(saved);
  Expect(!st[0].ok() && !st[1].ok(), "the call without rank 2 times out");
  const auto groups = SnapshotStragglers();
  const StragglerGroup* g = Find(groups, group);
  Expect(g && g->calls == 0 && g->ranks[2].absent == 1 && g->ranks[0].absent == 0 && g->ranks[1].absent == 0,
         "rank 2 counted absent once, the others not, no call completed");
}

void TestReset() {
  ResetStragglers();
  bool zero = true;
  for (const auto& g : SnapshotStragglers()) zero &= g.calls == 0;
  // After a reset the snapshot lists only groups with something counted: none.
  Expect(zero && SnapshotStragglers().empty(), "reset clears every group");
}

}  // namespace

int main() {
  const auto timed = [](const char* name, void (*f)()) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    std::printf("%-28s %.2f s\n", name,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  timed("TestBinomialTail", TestBinomialTail);
  timed("TestBuckets", TestBuckets);
  timed("TestStragglerFlagged", TestStragglerFlagged);
  timed("TestFairRunFlagsNobody", TestFairRunFlagsNobody);
  timed("TestThresholds", TestThresholds);
  timed("TestAbsent", TestAbsent);
  timed("TestReset", TestReset);
  return Summary();
}
