// Tests of the planning layer (xla_ffi/plan): link specs, the α–β model, range cutting, the
// balancer (including a simulated convergence run on an H800-like link set) and the tuning cache.
// A plain program: each test case prints FAIL lines for its failed checks; the last line is
// "N passed, N failed" and the exit status is non-zero when anything failed.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <source_location>
#include <string>
#include <thread>
#include <vector>

#include "xla_ffi/core/config.h"
#include "xla_ffi/plan/balancer.h"
#include "xla_ffi/plan/cost_model.h"
#include "xla_ffi/plan/link_spec.h"
#include "xla_ffi/plan/ranges.h"
#include "xla_ffi/plan/tuning_cache.h"

using namespace flexlink;
using namespace flexlink::plan;

namespace {

int g_failed_checks = 0;

bool Check(bool ok, const std::string& what, std::source_location loc = std::source_location::current()) {
  if (!ok) {
    ++g_failed_checks;
    std::printf("  FAIL line %u: %s\n", static_cast<unsigned>(loc.line()), what.c_str());
  }
  return ok;
}

bool Near(double a, double b, double tol) { return std::abs(a - b) <= tol; }

// ---------------------------------------------------------------------------------------------- specs
const std::vector<std::string> kKinds = {"shm", "tcp", "emulated"};

void ExpectSpecError(const std::string& text, const std::string& must_contain) {
  std::vector<LinkSpec> links;
  Status s = ParseLinkSpecs(text, kKinds, &links);
  Check(!s.ok() && s.message().find(must_contain) != std::string::npos,
        "spec \"" + text + "\" should fail naming \"" + must_contain + "\", got: " + s.message());
}

void TestLinkSpec() {
  std::vector<LinkSpec> links;
  Check(ParseLinkSpecs("shm;tcp", kKinds, &links).ok() && links.size() == 2, "shm;tcp parses");
  Check(links[0].kind == "shm" && links[0].name == "shm" && links[1].name == "tcp", "name defaults to kind");
  const std::string h800 =
      "emulated:nvlink@gbps=2.0,latency_us=5;emulated:pcie@gbps=0.6,latency_us=10;"
      "emulated:nic@gbps=0.5,latency_us=15";
  Check(ParseLinkSpecs(h800, kKinds, &links).ok() && links.size() == 3, "emulated spec parses");
  Check(links[0].name == "nvlink" && links[2].kind == "emulated" && links[1].params.at("gbps") == "0.6" &&
            links[2].params.at("latency_us") == "15",
        "names and params");
  Check(FormatLinkSpecs(links) == h800, "canonical form of the emulated spec is itself");
  Check(ParseLinkSpecs("  shm ; emulated : x @ latency_us = 5 , gbps=1 ", kKinds, &links).ok() &&
            FormatLinkSpecs(links) == "shm;emulated:x@gbps=1,latency_us=5",
        "whitespace ignored, params sorted in the canonical form");
  Check(ParseLinkSpecs("anything:x", {}, &links).ok(), "no known kinds: any kind accepted");
  double v = 0;
  Check(ParseLinkSpecs(h800, kKinds, &links).ok() &&
            GetDoubleParam(links[0], "gbps", 1, 0, 1e6, &v).ok() && v == 2.0, "numeric param");
  Check(GetDoubleParam(links[0], "absent", 7, 0, 10, &v).ok() && v == 7, "absent param -> fallback");
  LinkSpec bad{"emulated", "nvlink", {{"gbps", "fast"}, {"latency_us", "-1"}}};
  Status s = GetDoubleParam(bad, "gbps", 1, 0, 1e6, &v);
  Check(!s.ok() && s.message().find("nvlink") != std::string::npos && s.message().find("fast") != std::string::npos,
        "non-numeric param names link and value: " + s.message());
  Check(!GetDoubleParam(bad, "latency_us", 0, 0, 1e6, &v).ok(), "out-of-range param");
  s = CheckParamKeys(LinkSpec{"emulated", "e", {{"gpbs", "1"}}}, {"gbps", "latency_us"});
  Check(!s.ok() && s.message().find("gpbs") != std::string::npos, "unknown param key: " + s.message());

  ExpectSpecError("", "empty");
  ExpectSpecError("  ", "empty");
  ExpectSpecError("shm;;tcp", "part 2 is empty");
  ExpectSpecError("shm;", "part 2 is empty");
  ExpectSpecError("shm;foo", "unknown link kind \"foo\"");
  ExpectSpecError("shm,tcp", "bad link kind \"shm,tcp\"");
  ExpectSpecError(":x", "bad link kind");
  ExpectSpecError("emulated:", "bad link name");
  ExpectSpecError("emulated:a b", "bad link name");
  ExpectSpecError("shm@", "'@' without parameters");
  ExpectSpecError("emulated@gbps", "\"gbps\" is not key=value");
  ExpectSpecError("emulated@=3", "bad parameter key");
  ExpectSpecError("emulated@gbps=", "bad value");
  ExpectSpecError("emulated@gbps=1=2", "bad value");
  ExpectSpecError("emulated@gbps=1,gbps=2", "\"gbps\" given twice");
  ExpectSpecError("shm;tcp;shm", "part 3 \"shm\": duplicate link name \"shm\"");
  ExpectSpecError("emulated:a@gbps=1;emulated:a@gbps=2", "duplicate link name \"a\"");
}

// ----------------------------------------------------------------------------------------- cost model
void TestFit() {
  const AlphaBeta truth{12e-6, 1.0 / 20e9};
  std::vector<Sample> exact, noisy;
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> noise(-0.02, 0.02);
  for (uint64_t b : ProfileSizes(1024, 256u << 20)) {
    exact.push_back({double(b), truth.Predict(b)});
    for (int r = 0; r < 3; ++r) noisy.push_back({double(b), truth.Predict(b) * (1 + noise(rng))});
  }
  AlphaBeta f;
  Check(FitAlphaBeta(exact, &f).ok() && Near(f.alpha, truth.alpha, 1e-9) && Near(f.beta / truth.beta, 1, 1e-9),
        "exact samples recover alpha and beta");
  Check(FitAlphaBeta(noisy, &f).ok() && Near(f.alpha / truth.alpha, 1, 0.05) && Near(f.beta / truth.beta, 1, 0.02),
        "2% noise: alpha within 5%, beta within 2%: alpha=" + std::to_string(f.alpha));
  std::vector<Sample> one_size = {{4096, 1e-5}, {4096, 1.1e-5}};
  Check(!FitAlphaBeta(one_size, &f).ok(), "one size cannot be fitted");
  std::vector<Sample> zero = {{4096, 0}, {8192, 1e-5}};
  Check(!FitAlphaBeta(zero, &f).ok(), "non-positive time rejected");
  std::vector<Sample> origin = {{1000, 1e-6}, {2000, 2.2e-6}};  // would give alpha < 0
  Check(FitAlphaBeta(origin, &f).ok() && f.alpha == 0 && f.beta > 0, "negative alpha clamped to 0");
  Check(ProfileSizes(1000, 5000) == std::vector<uint64_t>({1024, 2048, 4096, 5000}), "profile sizes");
  Check(BucketOf(0) == 0 && BucketOf(1) == 1 && BucketOf(4096) == 4096 && BucketOf(8191) == 4096, "buckets");
}

void TestEqualFinish() {
  std::vector<AlphaBeta> two = {{0, 1.0 / 3e9}, {0, 1.0 / 1e9}};
  auto s = EqualFinishShares(two, 1e8);
  Check(Near(s[0], 0.75, 1e-12) && Near(s[1], 0.25, 1e-12), "two links, no alpha: 3:1");
  std::vector<AlphaBeta> three = {{5e-6, 1 / 160e9}, {10e-6, 1 / 50e9}, {15e-6, 1 / 45e9}};
  s = EqualFinishShares(three, 64e6);
  double t0 = three[0].Predict(s[0] * 64e6);
  bool equal = true;
  for (int i = 0; i < 3; ++i) equal = equal && Near(three[i].Predict(s[i] * 64e6), t0, 1e-12);
  Check(equal && Near(s[0] + s[1] + s[2], 1, 1e-12), "three links with alpha finish together");
  Check(PredictSplit(three, s, 64e6) < three[FastestSingle(three, 64e6)].Predict(64e6), "split beats single");
  std::vector<AlphaBeta> slow = {{5e-6, 1 / 160e9}, {5e-6, 100 / 160e9}};
  s = EqualFinishShares(slow, 64e6);
  Check(s[1] > 0 && s[1] < 0.011, "100x slower link gets ~1/101: " + std::to_string(s[1]));
  std::vector<AlphaBeta> late = {{5e-6, 1 / 160e9}, {1e-3, 1 / 160e9}, {10e-6, 1 / 50e9}};
  s = EqualFinishShares(late, 1e6);  // fastest alone takes ~11 us; link 1's alpha is 1 ms
  Check(s[1] == 0 && s[0] > 0 && s[2] > 0 && Near(s[0] + s[2], 1, 1e-12), "alpha beyond finish time -> 0");
  s = EqualFinishShares(three, 0);
  Check(s[0] == 1, "zero bytes: smallest alpha");
}

void TestThreshold() {
  std::vector<AlphaBeta> links = {{5e-6, 1 / 160e9}, {10e-6, 1 / 50e9}, {15e-6, 1 / 45e9}};
  uint64_t t = SplitThreshold(links, 0);
  auto gain = [&](double b, double overhead) {
    auto s = EqualFinishShares(links, b);
    return links[FastestSingle(links, b)].Predict(b) - PredictSplit(links, s, b) - overhead;
  };
  // Without overhead, splitting starts when the fastest link alone would take as long as the second
  // link's latency: 5 us + N/160e9 = 10 us -> N = 800 kB.
  Check(Near(double(t), 800e3, 800e3 * 0.01), "threshold = 800 kB without overhead: " + std::to_string(t));
  uint64_t t2 = SplitThreshold(links, 20e-6);
  Check(t2 > t && gain(t2 * 0.98, 20e-6) <= 0 && gain(t2 * 1.02, 20e-6) > 0 && gain(1e9, 20e-6) > 0,
        "overhead raises the threshold to where the split starts winning: " + std::to_string(t2));
  Check(SplitThreshold(std::vector<AlphaBeta>{{5e-6, 1e-9}}, 0) == UINT64_MAX, "one link: never split");
  // A link with 1 s latency only helps once the fast link alone takes longer than 1 s (N > 160 GB).
  std::vector<AlphaBeta> useless = {{5e-6, 1 / 160e9}, {1.0, 1 / 160e9}};
  Check(Near(double(SplitThreshold(useless, 0)), 160e9, 160e9 * 0.01), "a 1 s latency link: threshold 160 GB");
}

void TestMeasuredThreshold() {
  const std::vector<double> sizes = {65536, 131072, 262144, 524288};
  const std::vector<double> alone = {1.0, 2.0, 4.0, 8.0};
  auto thr = [&](std::vector<double> split) {
    return MeasuredSplitThreshold(sizes, alone, split, 0.02, 5000);
  };
  Check(thr({2, 3, 5, 9}) == kNeverSplit, "split loses everywhere: never");
  Check(thr({0.5, 1, 2, 8.5}) == kNeverSplit, "loses at the largest profiled size: never");
  Check(thr({0.5, 1, 2, 7.9}) == kNeverSplit, "1% faster is not the 2% a split must win by");
  Check(thr({2, 3, 3, 6}) == 262144, "wins from 256 KiB on");
  Check(thr({0.5, 2.5, 3, 6}) == 262144, "a win below a loss does not count (every larger size must win)");
  Check(thr({0.5, 1, 2, 4}) == 5000, "wins everywhere: the fits' prediction below the smallest size");
  Check(MeasuredSplitThreshold(sizes, alone, std::vector<double>{0.5, 1, 2, 4}, 0.02, 1 << 20) == 65536,
        "wins everywhere: capped at the smallest profiled size");
  Check(thr({0, 0, 3, 6}) == 262144 && thr({2, 3, 5, 0}) == kNeverSplit,
        "a size where no split ran (one link got everything) counts as a loss");
}

// ------------------------------------------------------------------------------------------- ranges
void TestRanges() {
  std::mt19937 rng(11);
  const size_t widths[] = {1, 2, 4, 8, 16};
  bool cover = true, aligned = true, zero_empty = true, same = true, close = true, tail_mid = false;
  for (int trial = 0; trial < 3000; ++trial) {
    uint64_t units = rng() % 20000;
    size_t w = widths[rng() % 5];
    std::vector<double> shares(1 + rng() % 4);
    for (double& s : shares) s = (rng() % 4 == 0) ? 0 : (rng() % 1000) / 1000.0;
    auto r = CutRanges(units, w, shares);
    same = same && r.size() == shares.size() && CutRanges(units, w, shares)[0].end == r[0].end;
    uint64_t pos = 0, block = 64 / w;
    double total = 0;
    size_t last_used = shares.size();
    for (size_t i = 0; i < shares.size(); ++i)
      if (shares[i] > 0) total += shares[i], last_used = i;
    for (size_t i = 0; i < r.size(); ++i) {
      cover = cover && r[i].begin == pos && r[i].end >= r[i].begin;
      pos = r[i].end;
      if (r[i].end != units) aligned = aligned && (r[i].end * w) % 64 == 0;
      if (shares[i] <= 0 && !(last_used == shares.size() && i == 0)) zero_empty = zero_empty && r[i].empty();
      if (shares[i] > 0 && i != last_used && total > 0)
        close = close && std::abs(double(r[i].size()) - shares[i] / total * units) <= 2.0 * block;
    }
    cover = cover && pos == units;
    if (last_used < shares.size() && (units * w) % 64 != 0 && r[last_used].size() > 0 && r[last_used].begin > 0)
      tail_mid = true;
  }
  Check(cover, "ranges cover [0, units) exactly and in order");
  Check(aligned, "every boundary but the total's end is 64-byte aligned");
  Check(zero_empty, "zero-share links get empty ranges");
  Check(same, "deterministic");
  Check(close, "range sizes within two cache lines of share * units");
  Check(tail_mid, "some cases end mid-cache-line (total not aligned)");
  auto r = CutRanges(1000, 4, std::vector<double>{0.5, 0, 0.5, 0});
  Check(r[0].begin == 0 && r[0].end == 496 && r[1].empty() && r[2].begin == 496 && r[2].end == 1000 &&
            r[3].begin == 1000 && r[3].empty(),
        "1000 floats 50/0/50/0 -> [0,496) [] [496,1000) []");
  r = CutRanges(5, 4, std::vector<double>{0.6, 0.4});
  Check(r[0].empty() && r[1].begin == 0 && r[1].end == 5, "less than a cache line: the last used link takes all");
  r = CutRanges(100, 8, std::vector<double>{0, 0});
  Check(r[0].end == 100 && r[1].empty(), "no positive share: link 0");
}

// ------------------------------------------------------------------------------------------ balancer
// A simulated link set: each link's time for its range follows the true α–β model times a uniform
// ±noise factor; `contention` multiplies every time when more than one link is used (links that share
// CPU cores, as shm and tcp do on a 2-core machine).
struct SimLink {
  double alpha;  // s
  double bw;     // bytes/s
};

struct Sim {
  std::vector<SimLink> links;
  double noise = 0.02;
  double contention = 1.0;
  std::mt19937 rng{1234};

  std::vector<double> Times(const std::vector<double>& shares, double bytes) {
    std::uniform_real_distribution<double> u(-noise, noise);
    size_t used = 0;
    for (double s : shares) used += s > 0;
    std::vector<double> t(links.size(), 0.0);
    for (size_t i = 0; i < links.size(); ++i) {
      if (shares[i] <= 0) continue;
      t[i] = (links[i].alpha + shares[i] * bytes / links[i].bw) * (1 + u(rng)) * (used > 1 ? contention : 1);
    }
    return t;
  }
  std::vector<AlphaBeta> Truth() const {
    std::vector<AlphaBeta> f;
    for (const auto& l : links) f.push_back({l.alpha, 1 / l.bw});
    return f;
  }
  CostModel Model(const std::vector<std::string>& names, Kind kind) const {
    CostModel m(names);
    auto truth = Truth();
    for (size_t i = 0; i < names.size(); ++i) m.Set(kind, i, truth[i]);
    return m;
  }
};

// One call: plan at the rendezvous, simulated link times, report. Returns the call's time.
double Call(Balancer& b, Sim& sim, Kind kind, uint64_t bytes) {
  auto plan = b.PlanFor(kind, bytes);
  std::vector<double> t = sim.Times(plan->shares, double(bytes));
  double call = 0;
  for (double x : t) call = std::max(call, x);
  b.Report(*plan, bytes, t, call);
  return call;
}

double MaxError(const std::vector<double>& a, const std::vector<double>& b) {
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i) e = std::max(e, std::abs(a[i] - b[i]));
  return e;
}

std::string Shares(const std::vector<double>& s) {
  std::string out;
  for (double x : s) out += (out.empty() ? "" : "/") + std::to_string(x).substr(0, 5);
  return out;
}

// Runs `calls` calls; returns the number of calls after which the shares stayed within `tol` of
// `optimum` until the end (calls + 1 if they never did).
int ConvergeCalls(Balancer& b, Sim& sim, Kind kind, uint64_t bytes, int calls, const std::vector<double>& optimum,
                  double tol, double* final_error) {
  int settled_at = calls + 1;
  for (int c = 1; c <= calls; ++c) {
    Call(b, sim, kind, bytes);
    double err = MaxError(b.PlanFor(kind, bytes)->shares, optimum);
    if (err > tol) settled_at = calls + 1;
    else if (settled_at > calls) settled_at = c;
    *final_error = err;
  }
  return settled_at;
}

void TestBalancerBasics() {
  Sim sim{{{5e-6, 160e9}, {10e-6, 50e9}}};
  std::vector<std::string> names = {"a", "b"};
  Balancer b(names);
  Check(!b.SetModel(CostModel({"x", "y"})).ok(), "model for another link set rejected");
  Check(b.SetModel(sim.Model(names, Kind::kAllReduce)).ok(), "model accepted");
  uint64_t threshold = b.SplitThresholdBytes(Kind::kAllReduce);
  Check(threshold > 0 && b.SplitThresholdBytes(Kind::kAllGather) == 0, "threshold per kind");
  auto small = b.PlanFor(Kind::kAllReduce, threshold / 2);
  Check(small->mode == PlanMode::kSingle && small->shares[0] == 1, "below the threshold: fastest link alone");
  auto big = b.PlanFor(Kind::kAllReduce, 64 << 20);
  Check(big->mode == PlanMode::kConverging && big->shares[1] > 0.2 && big->epoch > small->epoch,
        "above: stage-1 split");
  Check(b.PlanFor(Kind::kAllReduce, (64 << 20) + 5)->epoch == big->epoch, "same bucket, same plan");
  std::vector<double> t = {1e-3, 3e-3};
  auto first = b.Report(*big, 64 << 20, t, 3e-3);
  Check(first.changed && !first.stale && first.reason.find("all_reduce 64 MiB") != std::string::npos,
        "report changes the plan: " + first.reason);
  Check(b.Report(*big, 64 << 20, t, 3e-3).stale, "a report for an old epoch is ignored");
  Check(!b.SetShares(Kind::kAllGather, 1 << 20, {1.0}, true).ok() &&
            !b.SetShares(Kind::kAllGather, 1 << 20, {-1.0, 2.0}, true).ok() &&
            !b.SetShares(Kind::kAllGather, 1 << 20, {0.0, 0.0}, true).ok(),
        "bad shares rejected");
  Check(b.SetShares(Kind::kAllGather, 1 << 20, {3, 1}, true).ok(), "pin 75/25");
  auto pinned = b.PlanFor(Kind::kAllGather, 1 << 20);
  Check(pinned->mode == PlanMode::kPinned && pinned->shares[0] == 0.75, "pinned plan normalised");
  Check(!b.Report(*pinned, 1 << 20, std::vector<double>{1.0, 1e-6}, 1.0).changed &&
            b.PlanFor(Kind::kAllGather, 1 << 20)->epoch == pinned->epoch,
        "a pinned plan is not adapted");
  Check(b.Plans().size() == 3, "three plans listed");
  Check(b.Describe(*pinned) == "all_gather 1 MiB [pinned] a=0.750 b=0.250", "describe: " + b.Describe(*pinned));
  Check(b.SetModel(sim.Model(names, Kind::kAllReduce)).ok() && b.Plans().size() == 1, "new model keeps only pinned");
}

void TestConvergence() {
  // H800-like: NVLink : PCIe : NIC = 160 : 50 : 45, small latencies, ±2% noise, 64 MiB AllReduce.
  Sim sim{{{5e-6, 160e9}, {10e-6, 50e9}, {15e-6, 45e9}}};
  std::vector<std::string> names = {"nvlink", "pcie", "nic"};
  const uint64_t bytes = 64 << 20;
  Balancer b(names);
  // A deliberately wrong stage 1: the bandwidths reversed (NIC believed to be the 160 link).
  Sim wrong{{{5e-6, 45e9}, {10e-6, 50e9}, {15e-6, 160e9}}};
  Check(b.SetModel(wrong.Model(names, Kind::kAllReduce)).ok(), "wrong model set");
  auto opt = EqualFinishShares(sim.Truth(), double(bytes));
  auto start = b.PlanFor(Kind::kAllReduce, bytes)->shares;
  double err = 0;
  int n1 = ConvergeCalls(b, sim, Kind::kAllReduce, bytes, 60, opt, 0.03, &err);
  auto settled = b.PlanFor(Kind::kAllReduce, bytes);
  std::printf("  start %s  optimum %s  -> within 3 points after %d calls, %s [%s], error %.4f\n",
              Shares(start).c_str(), Shares(opt).c_str(), n1, Shares(settled->shares).c_str(),
              std::string(Name(settled->mode)).c_str(), err);
  Check(n1 <= 30 && settled->mode == PlanMode::kSettled, "converged within 30 calls and settled");
  for (int c = 0; c < 60; ++c) Call(b, sim, Kind::kAllReduce, bytes);
  Check(b.PlanFor(Kind::kAllReduce, bytes)->epoch == settled->epoch, "a settled plan does not move with noise");

  sim.links[0].bw = 40e9;  // NVLink degrades to 40
  opt = EqualFinishShares(sim.Truth(), double(bytes));
  int n2 = ConvergeCalls(b, sim, Kind::kAllReduce, bytes, 60, opt, 0.03, &err);
  auto after = b.PlanFor(Kind::kAllReduce, bytes);
  std::printf("  nvlink 160->40: optimum %s -> within 3 points after %d calls, %s [%s], error %.4f\n",
              Shares(opt).c_str(), n2, Shares(after->shares).c_str(), std::string(Name(after->mode)).c_str(), err);
  Check(n2 <= 30 && after->mode == PlanMode::kSettled, "re-converged within 30 calls after a speed change");

  sim.links[2].bw = 0.45e9;  // NIC 100x slower
  opt = EqualFinishShares(sim.Truth(), double(bytes));
  int n3 = ConvergeCalls(b, sim, Kind::kAllReduce, bytes, 60, opt, 0.03, &err);
  auto slow = b.PlanFor(Kind::kAllReduce, bytes);
  std::printf("  nic 45->0.45: optimum %s -> within 3 points after %d calls, %s [%s]\n", Shares(opt).c_str(), n3,
              Shares(slow->shares).c_str(), std::string(Name(slow->mode)).c_str());
  Check(n3 <= 30 && slow->shares[2] < 0.01, "a 100x slower link ends with ~0 share");

  // The dropped NIC is re-probed after retry_calls = 64 calls of the settled plan, with the share it
  // would need at its last measured speed (cheap while it stays slow).
  double slow_total = 0;
  for (int c = 0; c < 100; ++c) slow_total += Call(b, sim, Kind::kAllReduce, bytes);
  double best = PredictSplit(sim.Truth(), opt, double(bytes));
  std::printf("  100 calls with the NIC dropped, re-probes included: mean call / optimum %.3f\n",
              slow_total / 100 / best);
  Check(slow_total / 100 < 1.1 * best, "re-probing a slow dropped link costs little");

  sim.links[2].bw = 45e9;  // the NIC recovers: found again when re-probed, then re-converged
  opt = EqualFinishShares(sim.Truth(), double(bytes));
  // Found at the next re-probe: its interval has doubled to 128 calls of the settled plan.
  int n4 = ConvergeCalls(b, sim, Kind::kAllReduce, bytes, 200, opt, 0.03, &err);
  auto back = b.PlanFor(Kind::kAllReduce, bytes);
  std::printf("  nic 0.45->45 while dropped: re-probed, within 3 points after %d calls, %s [%s]\n", n4,
              Shares(back->shares).c_str(), std::string(Name(back->mode)).c_str());
  Check(n4 <= 128 + 30 && back->mode == PlanMode::kSettled, "a recovered dropped link is re-probed and used again");
}

void TestConvergenceLatencyBound() {
  // Sizes where α is much of the time. Without a model the step is the throughput rule, which moves a
  // latency-bound link's time little per step; with a stage-1 model whose bandwidths are wrong (but
  // whose α is right) the step uses α and lands near the optimum at once.
  // At 1 MiB the optimal split is predicted only ~3% faster than NVLink alone, inside the noise and
  // the 2% minimum gain: ending on NVLink alone is as right as the split there.
  Sim truth{{{5e-6, 160e9}, {10e-6, 50e9}, {15e-6, 45e9}}};
  Sim wrong{{{5e-6, 45e9}, {10e-6, 50e9}, {15e-6, 160e9}}};
  std::vector<std::string> names = {"nvlink", "pcie", "nic"};
  for (bool model : {false, true}) {
    for (uint64_t bytes : {uint64_t(1) << 20, uint64_t(2) << 20, uint64_t(4) << 20}) {
      Sim sim = truth;
      Balancer b(names);
      if (model) {
        Check(b.SetModel(wrong.Model(names, Kind::kAllGather)).ok(), "model set");
        Check(b.SetShares(Kind::kAllGather, bytes, {0.2, 0.2, 0.6}, false).ok(), "wrong start");
      }
      auto opt = EqualFinishShares(sim.Truth(), double(bytes));
      double err = 0;
      int n = ConvergeCalls(b, sim, Kind::kAllGather, bytes, 60, opt, 0.03, &err);
      auto plan = b.PlanFor(Kind::kAllGather, bytes);
      std::printf("  %llu KiB, %s: optimum %s -> within 3 points after %d calls, %s [%s]\n",
                  (unsigned long long)(bytes >> 10), model ? "wrong model, 20/20/60 start" : "no model, equal start",
                  Shares(opt).c_str(), n, Shares(plan->shares).c_str(), std::string(Name(plan->mode)).c_str());
      bool alone = plan->shares[0] == 1 && bytes == (1 << 20);
      Check(n <= 30 || alone, "latency-bound size converges within 30 calls");
    }
  }
}

void TestFallback() {
  // shm 10 GB/s and tcp 3 GB/s alone, but both run on the same 2 cores: used together each is half
  // as fast. The model (profiled alone) predicts a win; measurement says otherwise.
  Sim sim{{{3e-6, 10e9}, {20e-6, 3e9}}};
  sim.contention = 2.0;
  std::vector<std::string> names = {"shm", "tcp"};
  Balancer b(names);
  Check(b.SetModel(sim.Model(names, Kind::kAllReduce)).ok(), "model set");
  const int calls = 1000;
  double worst = 0;
  for (uint64_t bytes = 4096; bytes <= (64u << 20); bytes *= 4) {
    double single = sim.links[0].alpha + bytes / sim.links[0].bw, total = 0;
    for (int c = 0; c < calls; ++c) total += Call(b, sim, Kind::kAllReduce, bytes);
    worst = std::max(worst, total / calls / single);
  }
  auto plan = b.PlanFor(Kind::kAllReduce, 16 << 20);
  std::printf("  4 KiB..64 MiB, %d calls each: worst mean call / shm alone %.4f; 16 MiB plan %s\n", calls, worst,
              b.Describe(*plan).c_str());
  Check(worst <= 1.05, "never slower than the best single link by more than 5% on average, at any size");
  Check(plan->shares[0] == 1 || plan->mode == PlanMode::kConverging, "falls back to shm alone");

  // Without contention the split wins and stays.
  sim.contention = 1.0;
  const uint64_t bytes = 16 << 20;
  Balancer b2(names);
  Check(b2.SetModel(sim.Model(names, Kind::kAllReduce)).ok(), "model set");
  for (int c = 0; c < 100; ++c) Call(b2, sim, Kind::kAllReduce, bytes);
  auto kept = b2.PlanFor(Kind::kAllReduce, bytes);
  Check(kept->mode == PlanMode::kSettled && kept->shares[1] > 0.15, "a winning split is kept: " + b2.Describe(*kept));
}

void TestNoModel() {
  Sim sim{{{5e-6, 160e9}, {10e-6, 50e9}}};
  Balancer b({"nvlink", "pcie"});
  const uint64_t bytes = 32 << 20;
  auto opt = EqualFinishShares(sim.Truth(), double(bytes));
  Check(b.PlanFor(Kind::kReduceScatter, bytes)->shares[0] == 0.5, "no model: equal shares");
  for (int c = 0; c < 40; ++c) Call(b, sim, Kind::kReduceScatter, bytes);
  auto plan = b.PlanFor(Kind::kReduceScatter, bytes);
  Check(plan->mode == PlanMode::kSettled && MaxError(plan->shares, opt) <= 0.03,
        "no model: a trial measures the single link, then the split settles: " + b.Describe(*plan));
}

// set_shares(pinned=False) starts stage 2 over: a single link's rate measured before (nvlink alone,
// fast) must not send the new split back to it once it has become slow.
void TestSetSharesStartsOver() {
  Sim sim{{{5e-6, 100e9}, {10e-6, 1e9}}};
  Balancer b({"nvlink", "pcie"});
  const uint64_t bytes = 32 << 20;
  for (int c = 0; c < 60; ++c) Call(b, sim, Kind::kAllReduce, bytes);
  auto before = b.PlanFor(Kind::kAllReduce, bytes);
  Check(before->shares[0] == 1, "a fast nvlink alone: " + b.Describe(*before));
  sim.links[0].bw = 0.5e9;  // nvlink now half pcie's speed
  Check(b.SetShares(Kind::kAllReduce, BucketOf(bytes), {0.5, 0.5}, /*pinned=*/false).ok(), "set_shares");
  for (int c = 0; c < 60; ++c) Call(b, sim, Kind::kAllReduce, bytes);
  auto after = b.PlanFor(Kind::kAllReduce, bytes);
  const std::vector<double> opt = EqualFinishShares(sim.Truth(), double(bytes));
  Check(after->mode != PlanMode::kFallback && MaxError(after->shares, opt) <= 0.05,
        "after set_shares, the split of the slowed link set (optimum " + Shares(opt) + "): " + b.Describe(*after));
}

// A fallback whose link alone slows down (a degraded link) retries the split at once, not at its
// next retry interval: within a few calls the plan is the slowed link set's split.
void TestFallbackLinkSlowsDown() {
  Sim sim{{{5e-6, 100e9}, {10e-6, 1e9}}};
  Balancer b({"nvlink", "pcie"});
  const uint64_t bytes = 32 << 20;
  // 100 calls: the first retry of the split (after 64 calls alone) lost again, and the next one is
  // 128 calls away.
  for (int c = 0; c < 100; ++c) Call(b, sim, Kind::kAllReduce, bytes);
  auto before = b.PlanFor(Kind::kAllReduce, bytes);
  Check(before->mode == PlanMode::kFallback && before->shares[0] == 1, "a fast nvlink alone: " + b.Describe(*before));
  sim.links[0].bw = 0.5e9;  // nvlink now half pcie's speed
  const std::vector<double> opt = EqualFinishShares(sim.Truth(), double(bytes));
  int calls = 0;
  double err = 1;
  while (calls < 60 && (err = MaxError(b.PlanFor(Kind::kAllReduce, bytes)->shares, opt)) > 0.05) {
    Call(b, sim, Kind::kAllReduce, bytes);
    ++calls;
  }
  std::printf("  nvlink alone slowed 200x: the split within 0.05 of the optimum after %d calls\n", calls);
  Check(err <= 0.05 && calls <= 30, "the split of the slowed link set (optimum " + Shares(opt) + ") after " +
                                        std::to_string(calls) + " calls: " + b.Describe(*b.PlanFor(Kind::kAllReduce, bytes)));
  // Noise alone does not retry a fallback: with +-30% per call, the same 500 calls with and without
  // the rule put the same number of calls on nvlink alone.
  auto single_calls = [&](double slowdown) {
    Sim steady{{{5e-6, 100e9}, {10e-6, 1e9}}};
    steady.noise = 0.3;
    BalancerOptions o;
    o.fallback_slowdown = slowdown;
    Balancer c({"nvlink", "pcie"}, o);
    int single = 0;
    for (int k = 0; k < 500; ++k) {
      single += c.PlanFor(Kind::kAllReduce, bytes)->shares[0] == 1;
      Call(c, steady, Kind::kAllReduce, bytes);
    }
    return single;
  };
  const int with_rule = single_calls(BalancerOptions().fallback_slowdown), without = single_calls(0);
  Check(with_rule == without, "30% noise: " + std::to_string(with_rule) + " calls on nvlink alone with the rule, " +
                                  std::to_string(without) + " without");
}

void TestProfileMode() {
  BalancerOptions o;
  o.profile_from_bytes = 1 << 20;
  Balancer b({"a", "b"}, o);
  auto small = b.PlanFor(Kind::kAllReduce, 64 << 10);
  Check(small->mode == PlanMode::kSingle && small->shares[0] == 1, "no fits, small: the primary alone");
  auto large = b.PlanFor(Kind::kAllReduce, 4 << 20);
  Check(large->mode == PlanMode::kProfile, "no fits, large: profile first");
  b.Report(*large, 4 << 20, std::vector<double>{1e-3, 0}, 1e-3);
  Check(b.PlanFor(Kind::kAllReduce, 4 << 20)->mode == PlanMode::kProfile, "reports do not end profiling");
  Check(b.SetShares(Kind::kAllGather, 4 << 20, {0.3, 0.7}, true).ok() &&
            b.PlanFor(Kind::kAllGather, 4 << 20)->mode == PlanMode::kPinned,
        "a pinned bucket is not profiled");
  CostModel m({"a", "b"});
  m.Set(Kind::kAllReduce, 0, {10e-6, 1 / 2e9});
  m.Set(Kind::kAllReduce, 1, {10e-6, 1 / 1e9});
  m.SetMeasuredThreshold(Kind::kAllReduce, 2 << 20);
  Check(b.MergeModel(m).ok() && b.SplitThresholdBytes(Kind::kAllReduce) == (2u << 20),
        "merged: the measured threshold wins over the fits'");
  auto after = b.PlanFor(Kind::kAllReduce, 4 << 20);
  Check(after->mode == PlanMode::kConverging && Near(after->shares[0], 2.0 / 3, 0.01),
        "merged fits re-seed the bucket: " + b.Describe(*after));
  Check(b.PlanFor(Kind::kAllReduce, 1 << 20)->mode == PlanMode::kSingle, "below the measured threshold: single");
  Check(b.PlanFor(Kind::kAllGather, 4 << 20)->mode == PlanMode::kPinned &&
            b.PlanFor(Kind::kReduceScatter, 4 << 20)->mode == PlanMode::kProfile,
        "other kinds keep their plans (pinned) or still profile (no fits)");
  m.SetMeasuredThreshold(Kind::kAllReduce, kNeverSplit);
  Check(b.MergeModel(m).ok() && b.PlanFor(Kind::kAllReduce, 64 << 20)->mode == PlanMode::kSingle,
        "never split: every size single");
  m.SetMeasuredThreshold(Kind::kAllReduce, 2 << 20);
  m.SetProfiledBytes(Kind::kAllReduce, 1 << 20);
  Check(b.MergeModel(m).ok(), "merge with a profiled size");
  Check(b.PlanFor(Kind::kAllReduce, 8 << 20)->mode == PlanMode::kConverging,
        "8x the profiled size: the fits extrapolate");
  Check(b.PlanFor(Kind::kAllReduce, 16 << 20)->mode == PlanMode::kProfile,
        "16x the profiled size: profile again, up to the size seen");
  m.SetProfiledBytes(Kind::kAllReduce, 16 << 20);
  Check(b.MergeModel(m).ok() && b.PlanFor(Kind::kAllReduce, uint64_t{1} << 34)->mode == PlanMode::kConverging,
        "profiled up to the configured maximum: never again");
  b.ForgetKind(Kind::kAllReduce);
  Check(b.PlanFor(Kind::kAllReduce, 64 << 20)->mode == PlanMode::kProfile &&
            b.SplitThresholdBytes(Kind::kAllReduce) == 0 && !b.Model().MeasuredThreshold(Kind::kAllReduce),
        "forgotten fits: stage 1 again");
  b.SetProfileFromBytes(0);
  Check(b.PlanFor(Kind::kReduceScatter, 4 << 20)->mode == PlanMode::kProfile,
        "an existing plan stays");
  Check(b.PlanFor(Kind::kReduceScatter, 8 << 20)->mode == PlanMode::kConverging,
        "profiling off: new buckets start from equal shares");
  b.StopProfiling();
  Check(b.PlanFor(Kind::kReduceScatter, 4 << 20)->mode == PlanMode::kConverging,
        "stopped: a bucket planned kProfile is planned again");
}

void TestSeed() {
  BalancerOptions o;
  o.profile_from_bytes = 1 << 20;
  Balancer b({"a", "b"}, o);
  Check(b.PlanFor(Kind::kAllGather, 256 << 10)->mode == PlanMode::kSingle, "no seed, small: the primary alone");
  CostModel seed({"a", "b"});
  seed.Set(Kind::kAllGather, 0, {10e-6, 1 / 2e9});
  seed.Set(Kind::kAllGather, 1, {10e-6, 1 / 1e9});
  Check(!b.SetSeed(CostModel({"a", "c"})).ok(), "a seed for another link set is refused");
  Check(b.SetSeed(seed).ok(), "seed installed");
  auto small = b.PlanFor(Kind::kAllGather, 256 << 10);
  auto opt = EqualFinishShares(seed.Fits(Kind::kAllGather), double(256 << 10));
  Check(small->mode == PlanMode::kConverging && MaxError(small->shares, opt) < 1e-9 && Near(small->shares[0], 2.0 / 3, 0.02),
        "seeded, small: the seed's equal-finish split replaces the plan made before: " + b.Describe(*small));
  Check(b.PlanFor(Kind::kAllGather, 1 << 10)->mode == PlanMode::kSingle &&
            b.PlanFor(Kind::kAllGather, 1 << 10)->shares[0] == 1,
        "seeded, below the seed's predicted threshold: the fastest link alone");
  Check(b.PlanFor(Kind::kAllGather, 4 << 20)->mode == PlanMode::kProfile,
        "seeded, large: stage 1 still runs (the seed is not a measurement)");
  Check(b.PlanFor(Kind::kAllReduce, 256 << 10)->mode == PlanMode::kSingle &&
            b.PlanFor(Kind::kAllReduce, 256 << 10)->shares[0] == 1,
        "a kind the seed lacks: the primary alone");
  Check(!b.Model().Has(Kind::kAllGather) && b.SplitThresholdBytes(Kind::kAllGather) == 0,
        "the seed is not the model (nothing for the tuning cache)");
  CostModel measured({"a", "b"});
  measured.Set(Kind::kAllGather, 0, {10e-6, 1 / 1e9});
  measured.Set(Kind::kAllGather, 1, {10e-6, 1 / 3e9});
  Check(b.MergeModel(measured).ok(), "stage 1's fits merged");
  auto after = b.PlanFor(Kind::kAllGather, 256 << 10);
  Check(after->mode == PlanMode::kConverging && Near(after->shares[0], 0.25, 0.02),
        "measured fits replace the seed: " + b.Describe(*after));
  b.SetProfileFromBytes(0);
  Check(b.PlanFor(Kind::kReduceScatter, 4 << 20)->shares[0] == 0.5, "stage 2 alone, no seed: equal shares");
  seed.Set(Kind::kReduceScatter, 0, {10e-6, 1 / 3e9});
  seed.Set(Kind::kReduceScatter, 1, {10e-6, 1 / 1e9});
  Check(b.SetSeed(seed).ok(), "seed with reduce_scatter");
  auto rs = b.PlanFor(Kind::kReduceScatter, 4 << 20);
  Check(rs->mode == PlanMode::kConverging && Near(rs->shares[0], 0.75, 0.02),
        "stage 2 alone: starts from the seed's split: " + b.Describe(*rs));
}

void TestThreads() {
  Sim proto{{{5e-6, 160e9}, {10e-6, 50e9}, {15e-6, 45e9}}};
  Balancer b({"a", "b", "c"});
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      Sim sim = proto;
      sim.rng.seed(t);
      for (int c = 0; c < 300; ++c) {
        uint64_t bytes = uint64_t(1) << (16 + (c + t) % 6);
        auto plan = b.PlanFor(Kind::kAllReduce, bytes);
        double sum = 0;
        for (double s : plan->shares) sum += s;
        if (!Near(sum, 1, 1e-9)) ++bad;
        auto times = sim.Times(plan->shares, double(bytes));
        b.Report(*plan, bytes, times, 0);
      }
    });
  }
  for (auto& th : threads) th.join();
  Check(bad == 0 && b.Plans().size() == 6, "concurrent PlanFor/Report keep plans consistent");
}

// --------------------------------------------------------------------------------------------- cache
void WriteText(const std::filesystem::path& p, const std::string& text) { std::ofstream(p) << text; }

void TestCache() {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("flexlink_plan_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::string path = (dir / "sub" / "tune.json").string();
  std::string warning;
  TuneRecord rec;
  rec.key = {HostName(), "shm; tcp", 2};
  rec.model = CostModel({"shm", "tcp"});
  rec.model.Set(Kind::kAllReduce, 0, {3.25e-6, 1 / 9.87654321e9});
  rec.model.Set(Kind::kAllReduce, 1, {2.1e-5, 1 / 2.5e9});
  rec.model.Set(Kind::kAllGather, 0, {1e-6, 1e-10});
  rec.model.Set(Kind::kAllGather, 1, {2e-6, 3e-10});
  rec.max_bytes = 1 << 26;
  rec.model.SetMeasuredThreshold(Kind::kAllReduce, kNeverSplit);
  rec.model.SetMeasuredThreshold(Kind::kAllGather, 262144);
  rec.model.SetProfiledBytes(Kind::kAllReduce, 1 << 20);
  TuneRecord other = rec;
  other.key.ranks = 4;
  other.model.Set(Kind::kAllReduce, 0, {9e-6, 1e-9});
  TuneRecord got;
  Check(!LoadTuning(path, rec.key, &got, &warning) && warning.empty(), "missing file: not found, no warning");
  Check(StoreTuning(path, rec, &warning).ok() && warning.empty(), "store creates directories");
  Check(StoreTuning(path, other, &warning).ok(), "store a second key");
  Check(LoadTuning(path, {rec.key.host, "shm;tcp", 2}, &got, &warning) && warning.empty(), "load (normalised key)");
  Check(got.model.links() == rec.model.links() && got.max_bytes == rec.max_bytes &&
            got.model.Fits(Kind::kAllReduce)[0].beta == rec.model.Fits(Kind::kAllReduce)[0].beta &&
            got.model.Fits(Kind::kAllReduce)[1].alpha == rec.model.Fits(Kind::kAllReduce)[1].alpha &&
            got.model.Has(Kind::kAllGather) && !got.model.Has(Kind::kReduceScatter),
        "fits round-trip bit-exactly");
  Check(got.model.MeasuredThreshold(Kind::kAllReduce) == kNeverSplit &&
            got.model.MeasuredThreshold(Kind::kAllGather) == 262144u &&
            !got.model.MeasuredThreshold(Kind::kReduceScatter),
        "measured thresholds round-trip (never included)");
  Check(got.model.ProfiledBytes(Kind::kAllReduce) == (1u << 20) &&
            got.model.ProfiledBytes(Kind::kAllGather) == rec.max_bytes,
        "profiled sizes round-trip; without one, the entry's max_bytes");
  Check(LoadTuning(path, other.key, &got, &warning) && got.model.Fits(Kind::kAllReduce)[0].alpha == 9e-6,
        "ranks are part of the key");
  Check(!LoadTuning(path, {rec.key.host, "shm;tcp", 8}, &got, &warning) && warning.empty(), "unknown key");
  Check(StoreTuning(path, rec, &warning).ok() && LoadTuning(path, other.key, &got, &warning), "replace keeps others");
  // A group across processes has an entry of its own: the same link names are other paths there.
  TuneRecord across = rec;
  across.key.processes = 2;
  across.model.Set(Kind::kAllReduce, 0, {7e-6, 2e-9});
  Check(!LoadTuning(path, across.key, &got, &warning) && warning.empty(),
        "an in-process entry does not answer for a group across processes");
  Check(StoreTuning(path, across, &warning).ok() && LoadTuning(path, across.key, &got, &warning) &&
            got.model.Fits(Kind::kAllReduce)[0].alpha == 7e-6 && got.key.processes == 2 &&
            LoadTuning(path, rec.key, &got, &warning) && got.model.Fits(Kind::kAllReduce)[0].alpha == 3.25e-6,
        "processes are part of the key; both entries kept");
  {
    CacheKey three = across.key;
    three.processes = 3;
    Check(!LoadTuning(path, three, &got, &warning) && warning.empty(), "other processes: not found");
  }

  WriteText(path, "{\"version\": 1, \"entries\": [ {");
  Check(!LoadTuning(path, rec.key, &got, &warning) && warning.find("corrupt") != std::string::npos,
        "corrupt file ignored with a warning: " + warning);
  Check(StoreTuning(path, rec, &warning).ok() && warning.find("replacing") != std::string::npos &&
            LoadTuning(path, rec.key, &got, &warning),
        "store over a corrupt file replaces it");
  WriteText(path, std::string(100000, '['));
  Check(!LoadTuning(path, rec.key, &got, &warning) && !warning.empty(), "deep nesting: warning, no crash");
  WriteText(path, "\x01\xff garbage");
  Check(!LoadTuning(path, rec.key, &got, &warning) && !warning.empty(), "binary garbage: warning");
  Check(StoreTuning(path, rec, &warning).ok(), "restore");
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t at = text.find("\"beta_s_per_byte\": ");
  text.replace(at, 20, "\"beta_s_per_byte\": -");
  WriteText(path, text);
  Check(!LoadTuning(path, rec.key, &got, &warning) && warning.find("entry") != std::string::npos,
        "entry with a negative beta ignored: " + warning);
  int leftovers = 0;
  for (const auto& e : fs::directory_iterator(dir / "sub")) leftovers += e.path().filename() != "tune.json";
  Check(leftovers == 0, "no temporary files left behind");
  Check(ResolveCachePath("", "/home/u") == "/home/u/.cache/jax_flexlink/tune.json" &&
            ResolveCachePath("/x/t.json", "/home/u") == "/x/t.json",
        "cache path resolution");
  fs::remove_all(dir);
}

// The kinds added later (ppermute, all_to_all) have fits and thresholds of their own, stored by name
// next to the others; an entry without them (this literal is what a build before them wrote, in
// format version 2, which is still read: its entries are of groups inside one process) still loads,
// and a plan of one kind never answers for another.
void TestCacheNewKinds() {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("flexlink_plan_test_kinds_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "tune.json").string();
  const std::string host = HostName();
  WriteText(path, "{\"format\": \"jax_flexlink tuning cache\", \"version\": 2, \"entries\": [{\"host\": \"" + host +
                      "\", \"links\": \"shm;tcp\", \"ranks\": 8, \"fingerprint\": \"" + HostFingerprint() +
                      "\", \"engine\": \"" + kEngineRevision + "\", \"max_bytes\": 1048576, \"link_names\": [\"shm\", "
                      "\"tcp\"], \"fits\": {\"all_reduce\": [{\"link\": \"shm\", \"alpha_s\": 1e-4, "
                      "\"beta_s_per_byte\": 6.7e-10, \"gbps\": 11.9}, {\"link\": \"tcp\", \"alpha_s\": 2e-4, "
                      "\"beta_s_per_byte\": 3.1e-9, \"gbps\": 2.5}]}, \"split_min_bytes\": {\"all_reduce\": -1}, "
                      "\"profiled_bytes\": {\"all_reduce\": 1048576}}]}");
  TuneRecord got;
  std::string warning;
  Check(LoadTuning(path, {host, "shm;tcp", 8}, &got, &warning) && warning.empty() &&
            got.model.Has(Kind::kAllReduce) && !got.model.Has(Kind::kPpermute) && !got.model.Has(Kind::kAllToAll),
        "an entry from before ppermute/all_to_all loads: " + warning);
  {
    CacheKey across{host, "shm;tcp", 8};
    across.processes = 2;
    Check(!LoadTuning(path, across, &got, &warning) && warning.empty(),
          "a version-2 entry is of a group inside one process");
  }
  TuneRecord rec = got;
  rec.model.Set(Kind::kPpermute, 0, {5e-6, 1e-10});
  rec.model.Set(Kind::kPpermute, 1, {7e-6, 4e-10});
  rec.model.Set(Kind::kAllToAll, 0, {8e-6, 2e-10});
  rec.model.Set(Kind::kAllToAll, 1, {9e-6, 5e-10});
  rec.model.SetMeasuredThreshold(Kind::kAllToAll, 65536);
  rec.model.SetProfiledBytes(Kind::kPpermute, 1 << 22);
  Check(StoreTuning(path, rec, &warning).ok() && warning.empty(), "store the new kinds (over a version-2 file)");
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Check(text.find("\"version\": 3") != std::string::npos, "rewritten as version 3");
  Check(text.find("\"ppermute\"") != std::string::npos && text.find("\"all_to_all\"") != std::string::npos,
        "the new kinds are stored by name");
  Check(LoadTuning(path, {host, "shm;tcp", 8}, &got, &warning) && got.model.Has(Kind::kPpermute) &&
            got.model.Fits(Kind::kPpermute)[1].beta == 4e-10 && got.model.Fits(Kind::kAllToAll)[0].alpha == 8e-6 &&
            got.model.MeasuredThreshold(Kind::kAllToAll) == 65536u && !got.model.MeasuredThreshold(Kind::kPpermute) &&
            got.model.ProfiledBytes(Kind::kPpermute) == (1u << 22) &&
            got.model.MeasuredThreshold(Kind::kAllReduce) == kNeverSplit,
        "ppermute / all_to_all fits and thresholds round-trip, all_reduce's kept");
  Balancer b({"shm", "tcp"});
  Check(b.SetShares(Kind::kPpermute, 1 << 20, {0.25, 0.75}, true).ok(), "pin ppermute");
  Check(b.PlanFor(Kind::kPpermute, 1 << 20)->shares[1] == 0.75 && b.PlanFor(Kind::kAllToAll, 1 << 20)->shares[1] == 0.5 &&
            b.PlanFor(Kind::kAllReduce, 1 << 20)->shares[1] == 0.5 && b.PlanFor(Kind::kAllToAll, 1 << 20)->kind == Kind::kAllToAll,
        "plans are per kind");
  Check(std::string(Name(Kind::kPpermute)) == "ppermute" && ParseKind("all_to_all") == Kind::kAllToAll,
        "kind names");
  fs::remove_all(dir);
}
}  // namespace

// ------------------------------------------------------------------------------ cache: bad input
// Every way a cache file can be wrong: never a crash, never trusted, a warning naming the file and
// what was wrong, and stage 1 can store over it afterwards (except over a newer format or a directory).
std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string Replaced(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  if (at == std::string::npos) return "<" + from + " not in the file>";
  return text.replace(at, from.size(), to);
}

void TestCacheBadInput() {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("flexlink_plan_test_bad_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "tune.json").string();
  TuneRecord rec;
  rec.key = {HostName(), "shm;tcp", 8};
  rec.model = CostModel({"shm", "tcp"});
  rec.model.Set(Kind::kAllReduce, 0, {3.25e-6, 1e-10});
  rec.model.Set(Kind::kAllReduce, 1, {2.5e-5, 4e-10});
  rec.model.SetMeasuredThreshold(Kind::kAllReduce, 65536);
  rec.model.SetProfiledBytes(Kind::kAllReduce, 1 << 20);
  rec.max_bytes = 1 << 20;
  std::string warning;
  TuneRecord got;
  Check(StoreTuning(path, rec, &warning).ok() && LoadTuning(path, rec.key, &got, &warning) && warning.empty(),
        "the valid file loads (positive control)");
  const std::string good = ReadText(path);
  Check(good.find("\"fingerprint\": \"" + HostFingerprint() + "\"") != std::string::npos &&
            good.find(std::string("\"engine\": \"") + kEngineRevision + "\"") != std::string::npos &&
            good.find("\"version\": 3") != std::string::npos && good.find("\"processes\": 1") != std::string::npos,
        "entries carry the fingerprint and engine revision, the file its format version");
  Check(HostFingerprint().find("cpus=") != std::string::npos && HostFingerprint() == HostFingerprint(),
        "fingerprint: " + HostFingerprint());

  struct Case {
    const char* name;
    std::string text;
    const char* says;  // fragment of the warning
  };
  const Case cases[] = {
      {"truncated", good.substr(0, good.size() / 2), "corrupt"},
      {"empty", "", "empty"},
      {"not json", "tuning cache, honest", "corrupt"},
      {"NaN literal", Replaced(good, "\"alpha_s\": 3.24", "\"alpha_s\": NaN, \"x\": 3.25"), "corrupt"},
      {"overflowing number", Replaced(good, "\"alpha_s\": 3.24", "\"alpha_s\": 1e999, \"x\": 3.25"), "corrupt"},
      {"a list", "[1, 2]", "not a JSON object"},
      {"no version", "{\"entries\": []}", "version"},
      {"version as text", Replaced(good, "\"version\": 3", "\"version\": \"3\""), "version"},
      {"entries not a list", Replaced(good, "\"entries\": [", "\"entries\": {\"x\": ["), "corrupt"},
      {"an entry not an object", "{\"version\": 2, \"entries\": [7]}", "entry 1 is not an object"},
      {"alpha as text", Replaced(good, "\"alpha_s\": 3.24", "\"alpha_s\": \"3.25\", \"x\": 3.25"), "alpha_s"},
      {"negative beta", Replaced(good, "\"beta_s_per_byte\": 1", "\"beta_s_per_byte\": -1"), "beta_s_per_byte"},
      {"absurd alpha", Replaced(good, "\"alpha_s\": 3.24", "\"alpha_s\": 1e300, \"x\": 3.25"), "alpha_s"},
      {"absurd beta", Replaced(good, "\"beta_s_per_byte\": 1", "\"beta_s_per_byte\": 1e-300, \"x\": 1"), "beta_s_per_byte"},
      {"zero beta", Replaced(good, "\"beta_s_per_byte\": 1", "\"beta_s_per_byte\": 0, \"x\": 1"), "beta_s_per_byte"},
      {"negative max_bytes", Replaced(good, "\"max_bytes\": ", "\"max_bytes\": -"), "max_bytes"},
      {"fractional max_bytes", Replaced(good, "\"max_bytes\": 1048576", "\"max_bytes\": 1048576.5"), "max_bytes"},
      {"bad threshold", Replaced(good, "\"all_reduce\": 65536", "\"all_reduce\": -2"), "split_min_bytes"},
      {"absurd profiled size", Replaced(good, "\"all_reduce\": 1048576", "\"all_reduce\": 1e300"), "profiled_bytes"},
      {"unknown collective", Replaced(good, "\"fits\": {", "\"fits\": {\"broadcast\": [], "), "broadcast"},
      {"fits not per link", Replaced(good, "\"fits\": {", "\"fits\": {\"all_gather\": [], "), "one per link"},
      {"other link names", Replaced(good, "\"link_names\": [\n        \"shm\"", "\"link_names\": [\n        \"nvlink\""),
       "link_names"},
      {"another machine", Replaced(good, "\"fingerprint\": \"", "\"fingerprint\": \"elsewhere;"), "another machine"},
      {"no fingerprint", Replaced(good, "\"fingerprint\": ", "\"fingerprint_was\": "), "no host fingerprint"},
      {"another engine", Replaced(good, std::string("\"") + kEngineRevision + "\"", "\"flexlink-engine-0\""),
       "engine revision"},
      {"processes as text", Replaced(good, "\"processes\": 1", "\"processes\": \"1\""), "processes"},
      {"zero processes", Replaced(good, "\"processes\": 1", "\"processes\": 0"), "processes"},
      {"more processes than ranks", Replaced(good, "\"processes\": 1", "\"processes\": 9"), "processes"},
      {"format version 1", Replaced(good, "\"version\": 3", "\"version\": 1"), "out of date"},
      {"format version 2.5", Replaced(good, "\"version\": 3", "\"version\": 2.5"), "out of date"},
      {"format version 4", Replaced(good, "\"version\": 3", "\"version\": 4"), "newer jax_flexlink"},
  };
  for (const Case& c : cases) {
    WriteText(path, c.text);
    got = TuneRecord();
    const bool found = LoadTuning(path, rec.key, &got, &warning);
    Check(!found && !got.model.Has(Kind::kAllReduce), std::string(c.name) + ": not used");
    Check(warning.find(c.says) != std::string::npos && warning.find(path) != std::string::npos,
          std::string(c.name) + ": the warning names the file and says \"" + c.says + "\": " + warning);
    const bool newer = std::string(c.name) == "format version 4";
    Status stored = StoreTuning(path, rec, &warning);
    if (newer) {
      Check(!stored.ok() && ReadText(path) == c.text, "a newer format's file is left alone: " + stored.message());
    } else {
      Check(stored.ok() && LoadTuning(path, rec.key, &got, &warning) && warning.empty(),
            std::string(c.name) + ": stage 1 stores over it and the result loads");
    }
  }

  // Another host's entry in a shared file is someone else's, not corruption: not found, no warning.
  WriteText(path, Replaced(good, "\"host\": \"" + HostName() + "\"", "\"host\": \"other-host\""));
  Check(!LoadTuning(path, rec.key, &got, &warning) && warning.empty(), "another host's entry: not ours, quietly");
  // An entry for other ranks or another link set is not ours either.
  WriteText(path, good);
  Check(!LoadTuning(path, {HostName(), "shm;tcp", 4}, &got, &warning) && warning.empty() &&
            !LoadTuning(path, {HostName(), "shm;emulated:e@gbps=1", 8}, &got, &warning) && warning.empty(),
        "other ranks / link set: not found, no warning");

  // Not a file: a directory at the path is reported and never replaced.
  fs::remove(path);
  fs::create_directories(path);
  Check(!LoadTuning(path, rec.key, &got, &warning) && warning.find("directory") != std::string::npos,
        "a directory at the path: " + warning);
  Status stored = StoreTuning(path, rec, &warning);
  Check(!stored.ok() && stored.message().find("not a regular file") != std::string::npos && fs::is_directory(path),
        "store refuses a directory: " + stored.message());
  fs::remove_all(path);

  // A path that cannot be written (its "directory" is a file): an error naming it, nothing created.
  const std::string blocked = (dir / "plain_file" / "tune.json").string();
  WriteText(dir / "plain_file", "x");
  stored = StoreTuning(blocked, rec, &warning);
  Check(!stored.ok() && stored.message().find("cannot write the tuning cache next to " + blocked) != std::string::npos,
        "an unwritable path: " + stored.message());
  fs::remove(dir / "plain_file");

  // Unreadable (as root, permissions do not stop reads: then the file simply loads).
  WriteText(path, good);
  fs::permissions(path, fs::perms::none);
  const bool root_reads = std::ifstream(path).good();
  const bool found_unreadable = LoadTuning(path, rec.key, &got, &warning);
  Check(root_reads ? found_unreadable : (!found_unreadable && warning.find("cannot open") != std::string::npos),
        "an unreadable file: " + (root_reads ? std::string("(root reads it)") : warning));
  fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write);

  // Several hundred MB (sparse): refused from its size, without reading it.
  fs::resize_file(path, uint64_t{300} << 20);
  const auto t0 = std::chrono::steady_clock::now();
  Check(!LoadTuning(path, rec.key, &got, &warning) && warning.find("more than a tuning cache") != std::string::npos,
        "a 300 MB file: " + warning);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Check(secs < 1.0, "refused in bounded time: " + std::to_string(secs) + " s");
  Check(StoreTuning(path, rec, &warning).ok() && fs::file_size(path) < 100000 && LoadTuning(path, rec.key, &got, &warning),
        "and replaced by stage 1's store");

  // Concurrent writers and readers: a reader never sees half a file.
  std::atomic<int> torn{0}, loads{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> writers;
  for (int w = 0; w < 3; ++w) {
    writers.emplace_back([&, w] {
      TuneRecord r = rec;
      r.key.ranks = 2 + w;
      std::string warn;
      for (int i = 0; i < 40; ++i) (void)StoreTuning(path, r, &warn);
    });
  }
  std::thread reader([&] {
    std::string warn;
    TuneRecord g;
    while (!stop.load()) {
      (void)LoadTuning(path, rec.key, &g, &warn);
      if (!warn.empty()) ++torn;
      ++loads;
    }
  });
  for (auto& t : writers) t.join();
  stop = true;
  reader.join();
  Check(torn == 0 && loads > 0, "concurrent stores: " + std::to_string(loads) + " loads, " + std::to_string(torn) +
                                    " saw a broken file");
  int leftovers = 0;
  for (const auto& e : fs::directory_iterator(dir)) leftovers += e.path().filename() != "tune.json";
  Check(leftovers == 0, "no temporary files left behind");
  fs::remove_all(dir);
}

// FLEXLINK_* byte counts read by the engine (FLEXLINK_XPROC_SLOT_BYTES) follow Python's grammar;
// tests/test_bad_input.py checks the same table against config.parse_bytes.
void TestByteCounts() {
  const std::pair<const char*, int64_t> table[] = {
      {"4194304", 4194304}, {"4M", 4 << 20}, {" 64k ", 64 << 10}, {"1GiB", int64_t{1} << 30}, {"2 MB", 2 << 20},
      {"0", 0},             {"", -1},        {"-1", -1},          {"4.5M", -1},              {"1e6", -1},
      {"4MiBs", -1},        {"M", -1},       {"0x10", -1},        {"4 4M", -1},               {"99999999999999999999", -1},
      {"9999999999G", -1},  {"\xef\xbc\x91M", -1},  // fullwidth digit one
  };
  for (const auto& [text, want] : table) {
    uint64_t got = 0;
    const bool ok = ParseByteCount(text, &got);
    Check(want < 0 ? !ok : (ok && got == static_cast<uint64_t>(want)), std::string("ParseByteCount(\"") + text + "\")");
  }
  Check(!ValidTimeoutSeconds(0) && !ValidTimeoutSeconds(-1) && !ValidTimeoutSeconds(std::nan("")) &&
            !ValidTimeoutSeconds(INFINITY) && !ValidTimeoutSeconds(1e300) && ValidTimeoutSeconds(1e-3) &&
            ValidTimeoutSeconds(kMaxTimeoutSeconds),
        "timeouts: finite, positive, at most 1e6 s");
}

int main() {
  const std::pair<const char*, std::function<void()>> tests[] = {
      {"link_spec", TestLinkSpec},       {"fit", TestFit},
      {"equal_finish", TestEqualFinish}, {"threshold", TestThreshold},
      {"ranges", TestRanges},            {"balancer_basics", TestBalancerBasics},
      {"convergence", TestConvergence},  {"convergence_latency", TestConvergenceLatencyBound},
      {"fallback", TestFallback},
      {"no_model", TestNoModel},         {"threads", TestThreads},
      {"set_shares_starts_over", TestSetSharesStartsOver}, {"fallback_link_slows_down", TestFallbackLinkSlowsDown},
      {"measured_threshold", TestMeasuredThreshold}, {"profile_mode", TestProfileMode},
      {"seed", TestSeed},
      {"cache", TestCache},              {"cache_new_kinds", TestCacheNewKinds},
      {"cache_bad_input", TestCacheBadInput}, {"byte_counts", TestByteCounts},
  };
  int passed = 0, failed = 0;
  for (const auto& [name, fn] : tests) {
    int before = g_failed_checks;
    std::printf("[ RUN  ] %s\n", name);
    fn();
    bool ok = g_failed_checks == before;
    std::printf("[ %s ] %s\n", ok ? " OK " : "FAIL", name);
    (ok ? passed : failed)++;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
