// Engine tests: std::threads stand in for devices and call the same entry point as the FFI handlers
// (flexlink::RunCollective). Results are checked against references computed here, independently of
// the engine's kernels. Plain C++: prints "N passed, N failed" and exits non-zero on any failure.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <dirent.h>
#include <sys/mman.h>
#endif

#include "xla_ffi/core/communicator.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/engine.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/link_set.h"
#include "xla_ffi/core/pages.h"
#include "xla_ffi/core/reduce.h"
#include "xla_ffi/core/spin.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/links/shm.h"
#include "tests/cpp/check.h"
#include "tests/cpp/reference.h"

using namespace flexlink;
using namespace flexlink::testing;

namespace {

struct Spec {
  Kind kind = Kind::kAllReduce;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  std::vector<std::vector<int64_t>> groups = {{0, 1, 2, 3, 4, 5, 6, 7}};
  std::vector<int64_t> in_dims;  // per rank
  int64_t axis = 0;
  bool in_place = false;
  bool with_nan = false;
  std::vector<std::pair<int64_t, int64_t>> pairs;  // ppermute
  // With in_place: the devices whose output is nevertheless a separate buffer (bit d = device d).
  uint32_t separate_devices = 0;
  bool InPlace(int64_t device) const { return in_place && !(separate_devices >> device & 1); }
};

std::string Describe(const Spec& s) {
  std::string d = std::string(Name(s.kind)) + (Reduces(s.kind) ? "(" + std::string(Name(s.op)) + ") " : " ") +
                  std::string(Name(s.dtype)) + " dims[";
  for (auto x : s.in_dims) d += std::to_string(x) + ",";
  d += "] axis " + std::to_string(s.axis) + " groups " + std::to_string(s.groups.size()) + " of " +
       std::to_string(s.groups[0].size());
  if (s.in_place) d += " in-place";
  if (s.in_place && s.separate_devices) d += " (not on devices mask " + std::to_string(s.separate_devices) + ")";
  if (s.kind == Kind::kPpermute) {
    d += " pairs";
    for (const auto& [a, b] : s.pairs) d += " " + std::to_string(a) + "->" + std::to_string(b);
  }
  return d;
}

size_t Prod(const std::vector<int64_t>& d) {
  size_t p = 1;
  for (auto x : d) p *= static_cast<size_t>(x);
  return p;
}

// Runs `spec` on one thread per device; returns every device's output (indexed by device id).
std::vector<std::vector<uint8_t>> RunSpec(const Spec& s, const std::vector<std::vector<uint8_t>>& inputs,
                                          std::vector<Status>* statuses, int64_t run_id) {
  std::vector<int64_t> flat, sizes;
  for (const auto& g : s.groups) {
    flat.insert(flat.end(), g.begin(), g.end());
    sizes.push_back(static_cast<int64_t>(g.size()));
  }
  const size_t devices = static_cast<size_t>(*std::max_element(flat.begin(), flat.end())) + 1;
  std::vector<std::vector<uint8_t>> outs(devices);
  std::vector<std::vector<uint8_t>> ins = inputs;
  statuses->assign(devices, Status());
  std::vector<std::thread> threads;
  for (const auto& g : s.groups) {
    const int64_t n = static_cast<int64_t>(g.size());
    for (int64_t dev : g) {
      std::vector<int64_t> out_dims = s.in_dims;
      if (s.kind == Kind::kAllGather) out_dims = {static_cast<int64_t>(Prod(s.in_dims)) * n};
      if (s.kind == Kind::kReduceScatter) out_dims[s.axis] /= n;
      outs[dev].assign(Prod(out_dims) * ByteWidth(s.dtype), 0xAB);
      threads.emplace_back([&, dev, out_dims] {
        CollectiveArgs a;
        a.groups = flat;
        a.group_sizes = sizes;
        a.device = dev;
        a.run_id = run_id;
        a.label = "engine_test";
        a.request.kind = s.kind;
        a.request.reduction = Name(s.op);
        a.request.axis = s.axis;
        std::vector<int64_t> flat_pairs;
        for (const auto& [src, dst] : s.pairs) flat_pairs.insert(flat_pairs.end(), {src, dst});
        a.request.pairs = flat_pairs;
        OperandRequest x;
        x.in_dtype = x.out_dtype = s.dtype;
        x.in_dims = s.in_dims;
        x.out_dims = out_dims;
        x.in = ins[dev].data();
        x.out = s.InPlace(dev) ? ins[dev].data() : outs[dev].data();
        a.request.operands = {&x, 1};
        (*statuses)[dev] = RunCollective(a);
      });
    }
  }
  for (auto& t : threads) t.join();
  for (size_t d = 0; d < devices; ++d)
    if (s.InPlace(static_cast<int64_t>(d))) outs[d] = ins[d];
  return outs;
}

std::vector<uint8_t> Reference(const Spec& s, const std::vector<std::vector<uint8_t>>& in,
                               const std::vector<int64_t>& group, int rank) {
  const size_t n = group.size(), w = ByteWidth(s.dtype), count = Prod(s.in_dims);
  size_t outer = 1;
  for (int64_t i = 0; i < s.axis; ++i) outer *= static_cast<size_t>(s.in_dims[i]);
  std::vector<const uint8_t*> srcs;
  for (int64_t d : group) srcs.push_back(in[d].data());
  std::vector<uint8_t> out;
  if (s.kind == Kind::kPpermute) return RefPpermute(s.pairs, srcs, count * w, rank);
  if (s.kind == Kind::kAllToAll) return RefAllToAll(s.in_dims, s.axis, srcs, w, rank);
  if (s.kind == Kind::kAllReduce) {
    out.resize(count * w);
    for (size_t i = 0; i < count; ++i) RefReduce(s.dtype, s.op, srcs, i, &out[i * w]);
  } else if (s.kind == Kind::kAllGather) {
    const size_t inner = outer ? count / outer : 0;
    out.resize(count * n * w);
    for (size_t o = 0; o < outer; ++o)
      for (size_t k = 0; k < n; ++k)
        std::memcpy(&out[((o * n + k) * inner) * w], srcs[k] + o * inner * w, inner * w);
  } else {
    const size_t out_count = count / n, inner = outer ? out_count / outer : 0;
    out.resize(out_count * w);
    std::vector<uint8_t> tmp(w);
    for (size_t o = 0; o < outer; ++o)
      for (size_t i = 0; i < inner; ++i)
        RefReduce(s.dtype, s.op, srcs, (o * n + rank) * inner + i, &out[(o * inner + i) * w]);
  }
  return out;
}

void CheckSpec(const Spec& s) {
  size_t devices = 0;  // one past the largest device id
  for (const auto& g : s.groups)
    for (int64_t d : g) devices = std::max(devices, static_cast<size_t>(d) + 1);
  std::vector<std::vector<uint8_t>> inputs(devices);
  for (size_t d = 0; d < devices; ++d)
    inputs[d] = RandomData(s.dtype, Prod(s.in_dims), static_cast<uint32_t>(d * 7919 + Prod(s.in_dims)),
                           s.with_nan);
  std::vector<Status> st;
  auto outs = RunSpec(s, inputs, &st, NextRunId());
  bool ok = true;
  std::string why;
  for (const auto& g : s.groups)
    for (size_t r = 0; r < g.size(); ++r) {
      const int64_t dev = g[r];
      if (!st[dev].ok()) {
        ok = false;
        why = st[dev].message();
        break;
      }
      const size_t wrong = CountWrong(s.dtype, outs[dev], Reference(s, inputs, g, static_cast<int>(r)));
      if (wrong) {
        ok = false;
        why = "device " + std::to_string(dev) + ": " + std::to_string(wrong) + " wrong elements";
        break;
      }
    }
  // The exchange kinds in place: bitwise the out-of-place call's result too.
  if (ok && s.in_place && (s.kind == Kind::kPpermute || s.kind == Kind::kAllToAll)) {
    Spec separate = s;
    separate.in_place = false;
    const auto want = RunSpec(separate, inputs, &st, NextRunId());
    for (const auto& g : s.groups)
      for (int64_t dev : g)
        if (ok && (!st[dev].ok() || outs[dev] != want[dev])) {
          ok = false;
          why = "device " + std::to_string(dev) + ": differs from the out-of-place call " + st[dev].message();
        }
  }
  Expect(ok, Describe(s) + ": " + why);
}

// Runs f(device) on threads for devices [0, n) and returns their statuses.
std::vector<Status> OnThreads(int n, const std::function<Status(int)>& f) {
  std::vector<Status> st(n);
  std::vector<std::thread> threads;
  for (int d = 0; d < n; ++d) threads.emplace_back([&, d] { st[d] = f(d); });
  for (auto& t : threads) t.join();
  return st;
}

Status AllReduceF32(std::span<const int64_t> group, int64_t device, int64_t run, std::vector<float>& x,
                    std::vector<float>& y, std::string_view label = "engine_test", uint64_t links_version = 0) {
  const std::vector<int64_t> sizes = {static_cast<int64_t>(group.size())};
  const std::vector<int64_t> dims = {static_cast<int64_t>(x.size())};
  const std::vector<int64_t> odims = {static_cast<int64_t>(y.size())};
  CollectiveArgs a;
  a.groups = group;
  a.group_sizes = sizes;
  a.device = device;
  a.run_id = run;
  a.label = label;
  a.request.reduction = "sum";
  OperandRequest op;
  op.in_dims = dims;
  op.out_dims = odims;
  op.in = x.data();
  op.out = y.data();
  a.request.operands = {&op, 1};
  a.links_version = links_version;
  return RunCollective(a);
}

// Bytes the link `name` has moved so far (0 before its first call).
uint64_t LinkBytes(std::string_view name) {
  for (const LinkStatsSnapshot& s : SnapshotLinkStats())
    if (s.name == name) return s.bytes;
  return 0;
}

}  // namespace

void TestKindsDtypesOps() {
  const DType all[] = {DType::kPred, DType::kS8, DType::kS16, DType::kS32, DType::kS64,
                       DType::kU8,   DType::kU16, DType::kU32, DType::kU64, DType::kF16,
                       DType::kBF16, DType::kF32, DType::kF64, DType::kC64, DType::kC128};
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMax, ReduceOp::kMin};
  // Sizes: 0-d, tiny, not divisible by 8, and big enough for the large (non-staged) path.
  const std::vector<std::vector<int64_t>> shapes = {{}, {5}, {3, 37}, {70001}};
  for (DType t : all)
    for (ReduceOp op : ops) {
      const bool complex = t == DType::kC64 || t == DType::kC128;
      if (complex && (op == ReduceOp::kMax || op == ReduceOp::kMin)) continue;
      for (const auto& shape : shapes)
        for (bool in_place : {false, true}) {
          Spec s;
          s.kind = Kind::kAllReduce;
          s.dtype = t;
          s.op = op;
          s.in_dims = shape;
          s.in_place = in_place;
          s.with_nan = (op == ReduceOp::kMax || op == ReduceOp::kMin);
          CheckSpec(s);
        }
      Spec rs;
      rs.kind = Kind::kReduceScatter;
      rs.dtype = t;
      rs.op = op;
      rs.in_dims = {3, 8 * 5, 7};  // outer 3, block 5x7 per rank
      rs.axis = 1;
      CheckSpec(rs);
      rs.in_dims = {8 * 3001};
      rs.axis = 0;
      CheckSpec(rs);
      rs.in_dims = {1001, 8};  // scatter along the last axis: one-element rows, packed path
      rs.axis = 1;
      CheckSpec(rs);
    }
  for (DType t : all)
    for (const auto& [dims, axis] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
             {{}, 0}, {{5}, 0}, {{5}, 1}, {{3, 37}, 1}, {{3, 37}, 2}, {{4, 20001}, 1}, {{70001}, 0}}) {
      Spec s;
      s.kind = Kind::kAllGather;
      s.dtype = t;
      s.in_dims = dims;
      s.axis = axis;
      CheckSpec(s);
    }
}

void TestGroups() {
  for (Kind kind : {Kind::kAllReduce, Kind::kAllGather, Kind::kReduceScatter})
    for (auto groups : std::vector<std::vector<std::vector<int64_t>>>{
             {{0, 2, 4, 6}, {1, 3, 5, 7}}, {{7, 6, 5, 4}, {3, 2, 1, 0}}, {{0, 1, 2}, {3, 4, 5, 6, 7}}}) {
      if (kind == Kind::kReduceScatter && groups[0].size() != groups[1].size()) continue;
      for (int64_t count : {12, 60000}) {
        Spec s;
        s.kind = kind;
        s.groups = groups;
        s.in_dims = {count};
        CheckSpec(s);
      }
    }
  // Uneven group sizes with a shape that divides both.
  Spec s;
  s.kind = Kind::kReduceScatter;
  s.groups = {{0, 1, 2}, {3, 4, 5, 6, 7}};
  s.in_dims = {15 * 11};
  CheckSpec(s);
}

// Same inputs, many runs, small and large paths, different staging sizes: identical bits.
void TestDeterminism() {
  const int n = 8;
  const size_t count = 300001;
  std::vector<std::vector<float>> x(n, std::vector<float>(count));
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1e3f);
  for (auto& v : x)
    for (auto& f : v) f = nd(rng);
  std::vector<int64_t> group = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<std::vector<float>> first;
  const size_t saved = ShmStagingBytes();
  bool same = true;
  for (int trial = 0; trial < 6; ++trial) {
    // trial 0-2: large path; 3-5: everything staged (one rank reduces whole call).
    SetShmStagingBytes(trial < 3 ? 0 : count * sizeof(float));
    std::vector<std::vector<float>> y(n, std::vector<float>(count));
    const int64_t run = NextRunId();
    auto st = OnThreads(n, [&](int d) { return AllReduceF32(group, d, run, x[d], y[d]); });
    for (auto& s : st) same &= s.ok();
    if (trial == 0) first = y;
    for (int d = 0; d < n; ++d) same &= std::memcmp(first[0].data(), y[d].data(), count * 4) == 0;
  }
  SetShmStagingBytes(saved);
  Expect(same, "all_reduce float32 is bitwise identical across runs, ranks and paths");
}

void TestMismatch() {
  const int n = 4;
  std::vector<int64_t> group = {0, 1, 2, 3};
  std::vector<std::vector<float>> x(n), y(n);
  for (int d = 0; d < n; ++d) x[d] = y[d] = std::vector<float>(d == 2 ? 50 : 100, 1.f);
  const int64_t run = NextRunId();
  auto st = OnThreads(n, [&](int d) { return AllReduceF32(group, d, run, x[d], y[d]); });
  bool all_failed = true, names_it = true;
  for (auto& s : st) {
    all_failed &= !s.ok();
    names_it &= s.message().find("disagree") != std::string::npos &&
                s.message().find("rank 2") != std::string::npos;
  }
  Expect(all_failed && names_it, "a shape mismatch fails every rank and names the odd rank: " +
                                     st[0].message());
}

void TestDeadline() {
  const double saved = TimeoutSeconds();
  SetTimeoutSeconds(0.3);
  const int n = 4;
  std::vector<int64_t> group = {10, 11, 12, 13};
  std::vector<std::vector<float>> x(n, std::vector<float>(1000, 1.f)), y = x;
  const int64_t run = NextRunId();
  const auto start = std::chrono::steady_clock::now();
  // Device 12 (rank 2) never arrives.
  auto st = OnThreads(n, [&](int d) {
    return d == 2 ? Status() : AllReduceF32(group, 10 + d, run, x[d], y[d], "psum over axes ('x',)");
  });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string& m = st[0].message();
  Expect(!st[0].ok() && !st[1].ok() && !st[3].ok(), "ranks waiting for a missing rank time out");
  Expect(st[0].code() == StatusCode::kDeadlineExceeded, "timeout is DeadlineExceeded");
  Expect(m.find("rank 2 (device 12)") != std::string::npos && m.find("psum over axes") != std::string::npos &&
             m.find("[10, 11, 12, 13]") != std::string::npos && m.find("link shm") != std::string::npos,
         "timeout message names label, group, missing rank and link: " + m);
  Expect(waited < 5.0, "timeout honours the deadline");
  // The missing rank turns up late: it must fail at once, not hang.
  const auto late_start = std::chrono::steady_clock::now();
  Status late = AllReduceF32(group, 12, run, x[2], y[2]);
  const double late_wait =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - late_start).count();
  Expect(!late.ok() && late.message().find("abandoned") != std::string::npos && late_wait < 0.25,
         "a late arrival at an abandoned call fails at once: " + late.message());
  // A fresh run on the same group works again.
  SetTimeoutSeconds(saved);
  const int64_t run2 = NextRunId();
  auto ok = OnThreads(n, [&](int d) { return AllReduceF32(group, 10 + d, run2, x[d], y[d]); });
  bool fine = true;
  for (int d = 0; d < n; ++d) fine &= ok[d].ok() && y[d][0] == 4.f;
  Expect(fine, "the group works again in the next run");
}

void TestValidation() {
  std::vector<float> x(8, 1.f), y(8);
  std::vector<int64_t> group = {0, 1};
  Status s = AllReduceF32(group, 5, NextRunId(), x, y);
  Expect(!s.ok() && s.message().find("device 5 is not in any group") != std::string::npos,
         "device not in a group: " + s.message());
  std::vector<int64_t> ids = {0, 1, 2}, sizes = {2, 2};
  std::vector<int64_t> dims = {8};
  CollectiveArgs a;
  a.groups = ids;
  a.group_sizes = sizes;
  a.request.reduction = "sum";
  OperandRequest op;
  op.in_dims = op.out_dims = dims;
  op.in = x.data();
  op.out = y.data();
  a.request.operands = {&op, 1};
  s = RunCollective(a);
  Expect(!s.ok() && s.message().find("add up to 4") != std::string::npos, "bad group sizes: " + s.message());
  sizes = {3};
  a.group_sizes = sizes;  // the vector was reassigned: refresh the view
  op.in_dtype = op.out_dtype = DType::kC64;
  a.request.reduction = "max";
  s = RunCollective(a);
  Expect(!s.ok() && s.message().find("complex") != std::string::npos, "complex max: " + s.message());
  op.in_dtype = op.out_dtype = DType::kF32;
  a.request.reduction = "mean";
  s = RunCollective(a);
  Expect(!s.ok() && s.message().find("unknown reduction 'mean'") != std::string::npos,
         "unknown reduction: " + s.message());
  a.request.reduction = "sum";
  a.request.kind = Kind::kReduceScatter;
  std::vector<int64_t> odims = {3};
  op.out_dims = odims;
  s = RunCollective(a);
  Expect(!s.ok() && s.message().find("split evenly") != std::string::npos, "bad scatter: " + s.message());
  // Zero-size: returns at once with no rendezvous even though the other ranks never come.
  std::vector<int64_t> zero = {0, 4};
  a.request.kind = Kind::kAllReduce;
  op.in_dims = op.out_dims = zero;
  s = RunCollective(a);
  Expect(s.ok(), "zero-size call returns at once: " + s.message());
}

// Many calls back to back on one group and run: the per-device call counter keeps them apart, and
// alternating sizes exercises staging reuse while slow ranks still read the previous call.
void TestManyCalls() {
  const int n = 8;
  std::vector<int64_t> group = {0, 1, 2, 3, 4, 5, 6, 7};
  const int64_t run = NextRunId();
  auto st = OnThreads(n, [&](int d) {
    for (int call = 0; call < 200; ++call) {
      const size_t count = (call % 3 == 0) ? 40000 : 1 + call;
      std::vector<float> x(count, static_cast<float>(d + call)), y(count);
      Status s = AllReduceF32(group, d, run, x, y);
      if (!s.ok()) return s;
      const float want = static_cast<float>(28 + 8 * call);
      for (float v : y)
        if (v != want) return Status::Internal("call " + std::to_string(call) + " wrong");
    }
    return Status();
  });
  bool ok = true;
  std::string why;
  for (auto& s : st)
    if (!s.ok()) ok = false, why = s.message();
  Expect(ok, "200 back-to-back calls of mixed sizes: " + why);
}

// The link interface the multi-path executor will use: a call's units cut into ranges (ending
// mid-cache-line, one empty), each run by Channel::Run after one arrival. The union must equal the
// whole call, bitwise.
void TestRanges() {
  const int n = 8;
  std::vector<int64_t> ids = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<std::pair<int64_t, int64_t>> shift = {{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}, {5, 6}, {7, 0}};
  for (int variant = 0; variant < 9; ++variant) {
    // 0 all_reduce, 1/3 all_gather (long / 3-element rows), 2/4 reduce_scatter (long / 3-element rows),
    // 5/6 all_to_all (long / 3-element rows), 7 ppermute (rank 6 without a source), 8 all_to_all
    // [1000, 8] (one-element rows).
    const Kind kind = variant == 0 ? Kind::kAllReduce
                      : variant == 7 ? Kind::kPpermute
                      : variant >= 5 ? Kind::kAllToAll
                      : variant % 2 ? Kind::kAllGather : Kind::kReduceScatter;
    const int64_t inner = variant == 3 || variant == 4 || variant == 6 ? 3 : variant == 8 ? 1 : 333;
    const int64_t outer = variant == 3 || variant == 4 || variant == 6 || variant == 8 ? 1000 : 7;
    Communicator comm(ids);
    comm.AddChannel(std::make_unique<ShmChannel>(n, "shm"));
    Spec s;
    s.kind = kind;
    s.dtype = DType::kF32;
    s.in_dims = kind == Kind::kAllReduce || kind == Kind::kPpermute ? std::vector<int64_t>{10007}
                : kind == Kind::kAllGather ? std::vector<int64_t>{outer, inner}
                                           : std::vector<int64_t>{outer, 8 * inner};
    s.axis = kind == Kind::kAllReduce || kind == Kind::kPpermute ? 0 : 1;
    if (kind == Kind::kPpermute) s.pairs = shift;
    std::vector<std::vector<uint8_t>> in(n), out(n);
    const size_t count = Prod(s.in_dims);
    const size_t out_count = kind == Kind::kAllGather ? count * n : kind == Kind::kReduceScatter ? count / n : count;
    for (int d = 0; d < n; ++d) {
      in[d] = RandomData(DType::kF32, count, 77 + d, false);
      out[d].assign(out_count * 4, 0);
    }
    const int64_t run = NextRunId();
    auto st = OnThreads(n, [&](int d) {
      CallDesc desc;
      desc.kind = kind;
      Part p;
      p.dtype = DType::kF32;
      p.in = in[d].data();
      p.out = out[d].data();
      p.units = kind == Kind::kReduceScatter ? out_count : kind == Kind::kAllToAll ? count / n : count;
      p.outer = kind == Kind::kAllReduce || kind == Kind::kPpermute ? 1 : static_cast<size_t>(outer);
      p.inner = p.units / p.outer;
      desc.AddPart(p);
      if (kind == Kind::kPpermute) {
        desc.sources.assign(n, -1);
        for (const auto& [src, dst] : shift) desc.sources[dst] = static_cast<int32_t>(src);
      }
      auto call = comm.Join(d, run, "ranges");
      FLEXLINK_RETURN_IF_ERROR(call->Arrive(d, desc, "shm"));
      const size_t u = p.units;
      const size_t cuts[] = {0, 13, 13, u / 3 + 5, u - 1, u};  // includes an empty range
      for (size_t c = 0; c + 1 < std::size(cuts); ++c) {
        const Piece piece{0, UnitRange{cuts[c], cuts[c + 1]}};
        FLEXLINK_RETURN_IF_ERROR(comm.channel(0).Run(*call, d, 0, {&piece, 1}));
      }
      return Status();
    });
    bool ok = true;
    for (int d = 0; d < n; ++d)
      ok &= st[d].ok() && CountWrong(DType::kF32, out[d], Reference(s, in, ids, d)) == 0;
    Expect(ok, std::string(Name(kind)) + " (inner " + std::to_string(inner) +
                   ") over five uneven unit ranges equals the whole call");
  }
}

// Large calls: 4.4 and 8.4 MB per rank in place (the latter with streaming stores), and an
// all_gather with 9.6 MB of output per rank.
// The one-pass kernel that stores a reduction to several destinations (shm all_reduce): every dtype
// and op, destinations at different offsets from a cache line (the streamed tiles follow the first
// destination's lines, the others take plain stores), lengths around the 64-byte tile, streaming off
// or on for some destinations, and a destination that is one of the sources (in place, streamed too).
// Bitwise against the reference.
void TestReduceToKernel() {
  const DType all[] = {DType::kPred, DType::kS8,  DType::kS16, DType::kS32, DType::kS64,
                       DType::kU8,   DType::kU16, DType::kU32, DType::kU64, DType::kF16,
                       DType::kBF16, DType::kF32, DType::kF64, DType::kC64, DType::kC128};
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMax, ReduceOp::kMin};
  const size_t counts[] = {1, 3, 31, 64, 65, 1000, 4099};
  for (DType t : all)
    for (ReduceOp op : ops) {
      const ReduceToKernel kernel = GetReduceToKernel(t, op);
      const bool complex = t == DType::kC64 || t == DType::kC128;
      if (complex && (op == ReduceOp::kMax || op == ReduceOp::kMin)) {
        Expect(kernel == nullptr, std::string("no ReduceTo kernel for complex ") + std::string(Name(op)));
        continue;
      }
      const size_t w = ByteWidth(t);
      for (size_t count : counts)
        for (int nsrc : {2, 5, 8})
          for (bool stream : {false, true})
            for (bool in_place : {false, true}) {
              std::vector<std::vector<uint8_t>> in(nsrc);
              std::vector<const uint8_t*> ref_srcs;
              for (int k = 0; k < nsrc; ++k) {
                in[k] = RandomData(t, count, static_cast<uint32_t>(k * 131 + count), op == ReduceOp::kMax);
                ref_srcs.push_back(in[k].data());
              }
              std::vector<uint8_t> want(count * w);
              for (size_t i = 0; i < count; ++i) RefReduce(t, op, ref_srcs, i, &want[i * w]);
              // Destinations in one 64-byte-aligned arena at offsets w*{0,1,3,...} past line starts.
              const int ndst = 4;
              const size_t stride = (count * w + 64 + 127) / 64 * 64;
              std::vector<uint8_t> arena(stride * ndst + 64);
              uint8_t* base = arena.data() + (64 - reinterpret_cast<uintptr_t>(arena.data()) % 64) % 64;
              const size_t offsets[ndst] = {w, 0, 3 * w, 48 % (16 * w) / w * w};
              std::vector<std::vector<uint8_t>> work = in;  // sources the kernel may overwrite
              std::vector<const void*> srcs;
              for (auto& v : work) srcs.push_back(v.data());
              std::vector<void*> dsts;
              for (int d = 0; d < ndst; ++d) dsts.push_back(base + d * stride + offsets[d] % 64);
              if (in_place) dsts[1] = work[1].data();
              const uint8_t flags[ndst] = {1, 1, 0, 1};  // streamed and cached destinations mixed
              kernel(srcs.data(), nsrc, dsts.data(), ndst, count, stream ? flags : nullptr);
              size_t wrong = 0;
              for (int d = 0; d < ndst; ++d) {
                std::vector<uint8_t> got(static_cast<uint8_t*>(dsts[d]), static_cast<uint8_t*>(dsts[d]) + count * w);
                wrong += CountWrong(t, got, want);
              }
              Expect(wrong == 0, "ReduceTo " + std::string(Name(t)) + " " + std::string(Name(op)) + " count " +
                                     std::to_string(count) + " nsrc " + std::to_string(nsrc) +
                                     (stream ? " stream" : "") + (in_place ? " in-place" : "") + ": " +
                                     std::to_string(wrong) + " wrong");
            }
    }
}

#if defined(__linux__)
// Resident 4 KiB pages of [p, p + bytes) (page-aligned p).
size_t ResidentPages(const char* p, size_t bytes) {
  std::vector<unsigned char> v((bytes + 4095) / 4096);
  if (mincore(const_cast<char*>(p), bytes, v.data()) != 0) return 0;
  size_t r = 0;
  for (unsigned char x : v) r += x & 1;
  return r;
}
#endif

// OutputFaults faults in every missing page of an output whose ends are resident (a malloc chunk
// from a trimmed glibc heap looks like that), through its unaligned head, whole 2 MiB blocks and
// tail, and leaves the bytes already there as they were.
void TestOutputFaultsTheMiddle() {
#if defined(__linux__)
  const size_t page = 4096, bytes = (size_t{5} << 20) + 3 * page;
  void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  Expect(m != MAP_FAILED, "mmap for the residency test");
  if (m == MAP_FAILED) return;
  char* p = static_cast<char*>(m);
  p[0] = 1;
  p[bytes - 1] = 2;
  Expect(ResidentPages(p, bytes) == 2, "only the two touched pages are resident before");
  OutputFaults faults(1);
  faults.Publish(0, p + 100, bytes - 100, /*aliases_input=*/false);  // an unaligned output
  faults.Help(0);
  faults.Withdraw(0);
  Expect(ResidentPages(p, bytes) == bytes / page, "every page between the resident ends faulted in");
  Expect(p[0] == 1 && p[bytes - 1] == 2, "bytes already written are unchanged");
  munmap(m, bytes);
#endif
}

#if defined(__linux__)
// Whether this kernel collapses an anonymous range into a huge page on request (MADV_COLLAPSE).
bool KernelCollapses() {
  const size_t huge = size_t{2} << 20;
  void* m = mmap(nullptr, 2 * huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return false;
  char* region = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(m) + huge - 1) & ~(huge - 1));
  region[0] = 1;
  const bool ok = madvise(region, huge, 25 /* MADV_COLLAPSE */) == 0;
  munmap(m, 2 * huge);
  return ok;
}
#endif

// The partial huge pages at an output's ends (XLA's outputs start just past a 2 MiB boundary, a
// malloc chunk header before them): with huge pages on, an end that is mostly missing becomes one
// huge page (MADV_COLLAPSE, where the kernel has it) instead of hundreds of small faults; a nearly
// resident end is touched; every byte already there, the output's and its neighbours', is kept; with
// huge pages off nothing is collapsed.
void TestOutputFaultsCollapseEnds() {
#if defined(__linux__)
  const size_t huge = size_t{2} << 20, page = 4096;
  const bool collapses = KernelCollapses();
  if (!collapses) std::printf("note: this kernel has no MADV_COLLAPSE; checking the fallback only\n");
  const bool saved_huge = HugePageOutputs();
  for (bool huge_on : {true, false}) {
    SetHugePageOutputs(huge_on);
    const size_t map_bytes = 12 * huge;
    void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    Expect(m != MAP_FAILED, "mmap for the collapse test");
    if (m == MAP_FAILED) break;
    char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(m) + huge - 1) & ~(huge - 1));
    // base: [neighbour 320 B][head: rest of huge page 0][blocks 1-2][tail: half of huge page 3]
    // [neighbour after it]; huge page 4 has one resident page only in its last 4 KiB.
    char* out = base + 320;
    const size_t bytes = 3 * huge + huge / 2 - 320;
    std::memset(base, 0x11, 320);                         // the chunk before, and the header
    std::memset(out + 10 * page, 0x22, page);             // the output's bytes already written
    std::memset(out + bytes, 0x33, 100);                  // the chunk after
    OutputFaults faults(1);
    faults.Publish(0, out, bytes, /*aliases_input=*/false);
    faults.Help(0);
    faults.Withdraw(0);
    const size_t out_pages = (320 + bytes + page - 1) / page;
    Expect(ResidentPages(base, out_pages * page) == out_pages, "every page of the output is resident");
    if (huge_on && collapses)
      Expect(ResidentPages(base, 4 * huge) == 4 * huge / page, "the ends' huge pages are whole");
    bool kept = true;
    for (size_t i = 0; i < 320; ++i) kept &= base[i] == 0x11;
    for (size_t i = 0; i < page; ++i) kept &= out[10 * page + i] == 0x22;
    for (size_t i = 0; i < 100; ++i) kept &= out[bytes + i] == 0x33;
    Expect(kept, "bytes already there (the output's, the neighbours') are unchanged");
    const size_t expected = huge_on && collapses ? 2 : 0;
    Expect(faults.ends_collapsed(0) == expected,
           "ends collapsed into huge pages: " + std::to_string(faults.ends_collapsed(0)) + ", expected " +
               std::to_string(expected) + (huge_on ? " (huge pages on)" : " (huge pages off)"));
    munmap(m, map_bytes);
  }
  {
    // A nearly resident head (fewer missing pages than a collapse is worth) is touched instead.
    SetHugePageOutputs(true);
    const size_t map_bytes = 8 * huge;
    void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    Expect(m != MAP_FAILED, "mmap for the collapse test");
    if (m != MAP_FAILED) {
      char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(m) + huge - 1) & ~(huge - 1));
      char* out = base + huge - 16 * page;  // a 16-page head
      const size_t bytes = 2 * huge + 16 * page;
      OutputFaults faults(1);
      faults.Publish(0, out, bytes, false);
      faults.Help(0);
      faults.Withdraw(0);
      Expect(ResidentPages(out, bytes) == bytes / page, "a short head and tail are touched in");
      Expect(faults.ends_collapsed(0) == 0, "short ends are not collapsed");
      munmap(m, map_bytes);
    }
  }
  SetHugePageOutputs(saved_huge);
#endif
}

// Ranks fault each other's outputs: one rank publishes and never helps, another helps and faults
// all of it; a rank that writes its output while a helper still faults it keeps every byte it wrote
// (a plain store as the touch would zero some); after Withdraw nobody claims more of an output.
void TestOutputFaultsShared() {
#if defined(__linux__)
  const size_t bytes = size_t{8} << 20;
  auto map = [&] {
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return m == MAP_FAILED ? nullptr : static_cast<char*>(m);
  };
  char* a = map();
  char* b = map();
  Expect(a && b, "mmap for the shared-faults test");
  if (!a || !b) return;
  {
    OutputFaults faults(2);
    faults.Publish(0, a, bytes, false);
    faults.Publish(1, b, bytes, false);
    faults.Help(1);  // rank 1 alone faults both
    Expect(ResidentPages(a, bytes) == bytes / 4096, "a helper faulted in another rank's output");
    faults.Withdraw(0);
    faults.Withdraw(1);
  }
  munmap(a, bytes);
  munmap(b, bytes);
  for (int round = 0; round < 4; ++round) {
    a = map();
    if (!a) return;
    OutputFaults faults(2);
    faults.Publish(0, a, bytes, false);
    std::thread helper([&] { faults.Help(1); });
    // The owner writes from the end, toward the blocks the helper claims first.
    for (size_t off = bytes; off > 0; off -= 4096) std::memset(a + off - 4096, 0x5a, 4096);
    helper.join();
    faults.Withdraw(0);
    size_t wrong = 0;
    for (size_t i = 0; i < bytes; ++i) wrong += a[i] != 0x5a;
    Expect(wrong == 0, "bytes the owner wrote survive a concurrent helper (" + std::to_string(wrong) +
                           " changed, round " + std::to_string(round) + ")");
    munmap(a, bytes);
  }
  a = map();
  if (!a) return;
  {
    OutputFaults faults(2);
    faults.Publish(0, a, bytes, false);
    faults.Withdraw(0);
    faults.Help(1);
    Expect(ResidentPages(a, bytes) == 0, "no block is claimed after Withdraw");
  }
  munmap(a, bytes);
  // A call of several operands publishes each large output (one too small to bother with, one that is
  // its own input): a helper faults every one of the others, and Withdraw stops claims on all of them.
  a = map();
  b = map();
  char* c = map();
  Expect(a && b && c, "mmap for the multi-output test");
  if (!a || !b || !c) return;
  {
    OutputFaults faults(2);
    const OutputRegion regions[] = {{a, bytes, false}, {b + 8192, 4096, false}, {b + (4 << 20), 4 << 20, true},
                                    {c, bytes, false}};
    Expect(faults.Publish(0, regions), "several outputs published");
    faults.Help(1);
    Expect(ResidentPages(a, bytes) == bytes / 4096 && ResidentPages(c, bytes) == bytes / 4096,
           "a helper faulted in every large output of another rank");
    Expect(ResidentPages(b, bytes) == 0, "the small output and the aliased one were left alone");
    faults.Withdraw(0);
  }
  munmap(a, bytes);
  munmap(b, bytes);
  munmap(c, bytes);
#endif
}

// A rank waiting at the rendezvous helps fault in the output of a rank that starts later (the
// last rank to start no longer faults alone), returns only once that rank arrives, and still times
// out at the deadline, naming it, when the late rank publishes its output but never arrives.
void TestArriveHelpsFault() {
#if defined(__linux__)
  const size_t bytes = size_t{64} << 20;
  const bool saved_huge = HugePageOutputs();
  SetHugePageOutputs(false);  // small pages: each 2 MiB block takes a while, so the waiter gets some
  for (bool arrives : {true, false}) {
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    Expect(m != MAP_FAILED, "mmap for the arrive-helps test");
    if (m == MAP_FAILED) break;
    const double saved_timeout = TimeoutSeconds();
    if (!arrives) SetTimeoutSeconds(0.5);
    Communicator comm({30, 31});
    const int64_t run = NextRunId();
    std::shared_ptr<CallContext> call = comm.Join(0, run, "arrive-helps");
    Expect(comm.Join(1, run, "arrive-helps") == call, "both ranks join the same call");
    CallDesc desc;
    float in[4] = {}, out0[4] = {};
    Part part;
    part.units = part.inner = 4;
    part.in = in;
    part.out = out0;
    desc.AddPart(part);
    Status waiter;
    std::thread rank0([&] { waiter = call->Arrive(0, desc, "shm"); });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 0 is waiting by now
    const OutputRegion late_output{m, bytes, /*aliases_input=*/false};
    call->PublishOutputs(1, {&late_output, 1});
    Status late;
    if (arrives) late = call->Arrive(1, desc, "shm");
    rank0.join();
    call->WithdrawOutputs(1);  // waits for blocks still being faulted
    const size_t resident = ResidentPages(static_cast<char*>(m), bytes);
    SetTimeoutSeconds(saved_timeout);
    const size_t by0 = call->output_faults().blocks_faulted(0);
    const size_t by1 = call->output_faults().blocks_faulted(1);
    Expect(resident == bytes / 4096, "the late rank's output is resident");
    Expect(by0 + by1 == bytes / (size_t{2} << 20), "every block faulted once (" + std::to_string(by0) + " + " +
                                                   std::to_string(by1) + ")");
    Expect(by0 > 0, "the waiting rank helped (" + std::to_string(by0) + " of " + std::to_string(by0 + by1) +
                        " blocks)");
    if (arrives) {
      Expect(waiter.ok() && late.ok(), "both arrive: " + waiter.message() + late.message());
    } else {
      Expect(waiter.code() == StatusCode::kDeadlineExceeded &&
                 waiter.message().find("rank 1 (device 31)") != std::string::npos,
             "helping does not stop the deadline naming the missing rank: " + waiter.message());
    }
    munmap(m, bytes);
  }
  SetHugePageOutputs(saved_huge);
#endif
}

void TestLarge() {
  Spec big;
  big.in_dims = {1100001};
  big.in_place = true;
  CheckSpec(big);
  big.in_dims = {2100001};
  CheckSpec(big);
  big.in_place = false;
  big.dtype = DType::kBF16;
  CheckSpec(big);
  Spec gather;
  gather.kind = Kind::kAllGather;
  gather.in_dims = {3, 100001};
  gather.axis = 1;
  CheckSpec(gather);
}

// ---- k-operand calls: one rendezvous, one plan over the total bytes, results of k separate calls.

struct Operand {
  DType dtype = DType::kF32;
  std::vector<int64_t> in_dims;
  bool in_place = false;
};

struct MultiSpec {
  Kind kind = Kind::kAllReduce;
  ReduceOp op = ReduceOp::kSum;
  std::vector<int64_t> group = {0, 1, 2, 3, 4, 5, 6, 7};
  int64_t axis = 0;
  std::vector<Operand> operands;
  std::vector<std::pair<int64_t, int64_t>> pairs;  // ppermute
  std::string what;  // names the case in failures
};

// What the engine is asked to write for one operand: all_gather's output is flat (only its size is
// checked), reduce_scatter's has dimension `axis` divided by n.
std::vector<int64_t> OutDims(Kind kind, const std::vector<int64_t>& in, int64_t axis, int64_t n) {
  if (kind == Kind::kAllGather) return {static_cast<int64_t>(Prod(in)) * n};
  std::vector<int64_t> out = in;
  if (kind == Kind::kReduceScatter) out[axis] /= n;
  return out;
}

// The single-operand spec of operand i (for the reference and the separate calls).
Spec OperandSpec(const MultiSpec& m, size_t i) {
  Spec s;
  s.kind = m.kind;
  s.op = m.op;
  s.dtype = m.operands[i].dtype;
  s.groups = {m.group};
  s.in_dims = m.operands[i].in_dims;
  s.axis = m.axis;
  s.in_place = m.operands[i].in_place;
  s.with_nan = m.op == ReduceOp::kMax || m.op == ReduceOp::kMin;
  s.pairs = m.pairs;
  return s;
}

// inputs[i][device]: operand i's input on `device` (device ids 0..7).
using Inputs = std::vector<std::vector<std::vector<uint8_t>>>;

Inputs MultiInputs(const MultiSpec& m, uint32_t seed) {
  Inputs in(m.operands.size(), std::vector<std::vector<uint8_t>>(8));
  for (size_t i = 0; i < m.operands.size(); ++i)
    for (int64_t d : m.group)
      in[i][d] = RandomData(m.operands[i].dtype, Prod(m.operands[i].in_dims),
                            static_cast<uint32_t>(seed + 131 * i + 7919 * d), OperandSpec(m, i).with_nan);
  return in;
}

// One call of all operands, a thread per device; returns outs[i][device] and every device's status.
Inputs RunMulti(const MultiSpec& m, const Inputs& inputs, std::vector<Status>* st, int64_t run_id,
                const std::vector<size_t>* operand_count = nullptr) {
  const int64_t n = static_cast<int64_t>(m.group.size());
  const std::vector<int64_t> sizes = {n};
  const size_t k = m.operands.size();
  Inputs ins = inputs, outs(k, std::vector<std::vector<uint8_t>>(8));
  std::vector<std::vector<std::vector<int64_t>>> out_dims(8, std::vector<std::vector<int64_t>>(k));
  for (size_t i = 0; i < k; ++i)
    for (int64_t d : m.group) {
      out_dims[d][i] = OutDims(m.kind, m.operands[i].in_dims, m.axis, n);
      outs[i][d].assign(Prod(out_dims[d][i]) * ByteWidth(m.operands[i].dtype), 0xAB);
    }
  st->assign(8, Status());
  std::vector<std::thread> threads;
  for (int64_t dev : m.group)
    threads.emplace_back([&, dev] {
      std::vector<OperandRequest> ops(k);
      for (size_t i = 0; i < k; ++i) {
        const Operand& o = m.operands[i];
        ops[i].in_dtype = ops[i].out_dtype = o.dtype;
        ops[i].in_dims = o.in_dims;
        ops[i].out_dims = out_dims[dev][i];
        ops[i].in = ins[i][dev].data();
        ops[i].out = o.in_place ? ins[i][dev].data() : outs[i][dev].data();
      }
      CollectiveArgs a;
      a.groups = m.group;
      a.group_sizes = sizes;
      a.device = dev;
      a.run_id = run_id;
      a.label = "engine_test";
      a.request.kind = m.kind;
      a.request.reduction = Name(m.op);
      a.request.axis = m.axis;
      std::vector<int64_t> flat_pairs;
      for (const auto& [src, dst] : m.pairs) flat_pairs.insert(flat_pairs.end(), {src, dst});
      a.request.pairs = flat_pairs;
      const size_t mine = operand_count ? (*operand_count)[dev] : k;
      a.request.operands = std::span<const OperandRequest>(ops).first(mine);
      (*st)[dev] = RunCollective(a);
    });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < k; ++i)
    if (m.operands[i].in_place) outs[i] = ins[i];
  return outs;
}

// The call's results against the independent reference and against k separate calls, bitwise.
void CheckMulti(const MultiSpec& m, uint32_t seed = 17) {
  const Inputs inputs = MultiInputs(m, seed);
  std::vector<Status> st;
  const Inputs outs = RunMulti(m, inputs, &st, NextRunId());
  std::string why;
  for (int64_t d : m.group)
    if (why.empty() && !st[d].ok()) why = "device " + std::to_string(d) + ": " + st[d].message();
  for (size_t i = 0; i < m.operands.size() && why.empty(); ++i) {
    const Spec one = OperandSpec(m, i);
    std::vector<Status> st1;
    const auto separate = RunSpec(one, inputs[i], &st1, NextRunId());
    for (size_t r = 0; r < m.group.size() && why.empty(); ++r) {
      const int64_t d = m.group[r];
      const size_t wrong = CountWrong(one.dtype, outs[i][d], Reference(one, inputs[i], m.group, static_cast<int>(r)));
      if (wrong) why = "operand " + std::to_string(i) + " device " + std::to_string(d) + ": " + std::to_string(wrong) + " wrong elements";
      else if (!st1[d].ok()) why = "separate call of operand " + std::to_string(i) + ": " + st1[d].message();
      else if (CountWrong(one.dtype, outs[i][d], separate[d]) != 0)
        why = "operand " + std::to_string(i) + " device " + std::to_string(d) + " differs from its separate call";
    }
  }
  Expect(why.empty(), std::string(Name(m.kind)) + (Reduces(m.kind) ? "(" + std::string(Name(m.op)) + ")" : "") + " of " +
                          std::to_string(m.operands.size()) + " operands, " + m.what + ": " + why);
}

// Gradient-like leaves: matrices, vectors, a 0-d counter, several dtypes. kSmall: all 13 together
// below the staging size (16 KiB); kMedium: above it in sum, every part small; kBig: a third of the
// parts far above it.
enum class LeafSize { kSmall, kMedium, kBig };

std::vector<Operand> Leaves(size_t k, LeafSize size, bool complex_ok) {
  const std::vector<Operand> pool = {
      {DType::kF32, {64, 33}},   {DType::kBF16, {7}},      {DType::kS32, {}},        {DType::kF16, {5, 3}},
      {DType::kF64, {1000}},     {DType::kU8, {17}},       {DType::kPred, {3}},      {DType::kC64, {9}},
      {DType::kS64, {2, 2}},     {DType::kBF16, {4099}},   {DType::kF32, {1}},       {DType::kU16, {129}},
      {DType::kS8, {31}},
  };
  std::vector<Operand> out;
  for (size_t i = 0; i < k; ++i) {
    Operand o = pool[i % pool.size()];
    if (!complex_ok && o.dtype == DType::kC64) o.dtype = DType::kF32;
    if (size == LeafSize::kSmall && Prod(o.in_dims) > 64) o.in_dims = {static_cast<int64_t>(33 + i)};
    if (size == LeafSize::kBig && i % 3 == 1) o.in_dims = {70001 + static_cast<int64_t>(i)};
    out.push_back(o);
  }
  return out;
}

std::string SizeName(LeafSize s) {
  return s == LeafSize::kSmall ? "staged" : s == LeafSize::kMedium ? "small parts, direct" : "some large parts";
}

void TestMultiOperandAllReduce() {
  for (size_t k = 1; k <= 13; ++k)
    for (LeafSize size : {LeafSize::kSmall, LeafSize::kMedium, LeafSize::kBig}) {
      MultiSpec m;
      m.operands = Leaves(k, size, true);
      m.what = "mixed dtypes and shapes, " + SizeName(size);
      CheckMulti(m, static_cast<uint32_t>(k));
    }
  // In-place subsets (result i aliases operand i for some i), every op, NaNs for max/min.
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMax, ReduceOp::kMin})
    for (LeafSize size : {LeafSize::kSmall, LeafSize::kMedium, LeafSize::kBig}) {
      MultiSpec m;
      m.op = op;
      m.operands = Leaves(13, size, op == ReduceOp::kSum || op == ReduceOp::kProd);
      for (size_t i : {0, 2, 3, 7, 10}) m.operands[i].in_place = true;
      m.what = "in-place subset, " + SizeName(size);
      CheckMulti(m, 40 + static_cast<uint32_t>(op));
    }
  // Many small parts that together exceed the staging size: the direct path over many tiny pieces.
  MultiSpec many;
  for (int i = 0; i < 13; ++i) many.operands.push_back({i % 2 ? DType::kF32 : DType::kBF16, {513 + i}});
  many.what = "13 parts of ~2 KiB (direct path)";
  CheckMulti(many);
  // Zero-size parts among others; an uneven group.
  MultiSpec zeros;
  zeros.operands = {{DType::kF32, {0}}, {DType::kS32, {5}}, {DType::kF64, {3, 0}}, {DType::kU8, {70001}}};
  zeros.what = "with zero-size parts";
  CheckMulti(zeros);
  MultiSpec three;
  three.group = {5, 2, 7};
  three.operands = Leaves(6, LeafSize::kBig, true);
  three.what = "group of 3";
  CheckMulti(three);
}

void TestMultiOperandGatherScatter() {
  for (int64_t axis : {0, 1}) {
    MultiSpec g;
    g.kind = Kind::kAllGather;
    g.axis = axis;
    g.operands = {{DType::kF32, {3, 37}}, {DType::kBF16, {1, 5}}, {DType::kS32, {4, 20001}},
                  {DType::kU8, {2, 1}},   {DType::kC128, {7, 3}}, {DType::kF16, {1000, 3}}};
    g.what = "axis " + std::to_string(axis);
    CheckMulti(g);
    MultiSpec r;
    r.kind = Kind::kReduceScatter;
    r.axis = axis;
    r.op = axis ? ReduceOp::kMax : ReduceOp::kSum;
    r.operands = {{DType::kF32, {8, 8 * 5}}, {DType::kBF16, {16, 8}}, {DType::kS64, {8, 8 * 3001}},
                  {DType::kU16, {24, 8}},    {DType::kF64, {8, 8}}};
    r.what = "axis " + std::to_string(axis);
    CheckMulti(r);
  }
}

// A group whose ranks spin before they sleep (Communicator::SetSpin, as the GPU engine's groups do
// where every rank has a core): the same results and the same deadlines as sleeping at once. Here 4
// ranks share 2 cores, so most spins run out and the waits end on the condition variable; the spin
// only shortens the wake-up, the condition variable stays the wait's guarantee. Calls of mixed sizes
// (the staged path: the arrival alone; the direct one: arrival and barrier; in place: WaitProgress),
// then a rank that never comes.
void TestSpinningRendezvous() {
  const int n = 4;
  Communicator comm({60, 61, 62, 63});
  comm.SetSpin(std::chrono::microseconds(50));
  comm.AddChannel(std::make_unique<ShmChannel>(n, "shm"));
  const int64_t run = NextRunId();
  auto st = OnThreads(n, [&](int d) {
    for (int call = 0; call < 300; ++call) {
      const size_t count = call % 5 == 0 ? 70001 : 1 + call;  // 280 KB: the direct path
      std::vector<float> x(count, static_cast<float>(d + call)), y(count, -1.f);
      CallDesc desc;
      Part p;
      p.in = x.data();
      p.out = call % 7 == 0 ? x.data() : y.data();  // in place too
      p.units = p.inner = count;
      desc.AddPart(p);
      Status s = comm.channel(0).RunAlone(*comm.Join(d, run, "spinning"), d, desc);
      if (!s.ok()) return s;
      const float want = static_cast<float>(6 + 4 * call);
      for (float v : call % 7 == 0 ? x : y)
        if (v != want) return Status::Internal("call " + std::to_string(call) + ": " + std::to_string(v));
    }
    return Status();
  });
  std::string why;
  for (const Status& s : st)
    if (!s.ok()) why = s.message();
  Expect(why.empty(), "spinning ranks: 300 back-to-back calls of mixed sizes, in place too: " + why);

  const double saved = TimeoutSeconds();
  SetTimeoutSeconds(0.3);
  const int64_t run2 = NextRunId();
  std::vector<std::vector<float>> x(n, std::vector<float>(1000, 1.f)), y = x;
  auto late = OnThreads(n, [&](int d) {
    if (d == 2) return Status();
    CallDesc desc;
    Part p;
    p.in = x[d].data();
    p.out = y[d].data();
    p.units = p.inner = x[d].size();
    desc.AddPart(p);
    return comm.channel(0).RunAlone(*comm.Join(d, run2, "spinning"), d, desc);
  });
  SetTimeoutSeconds(saved);
  for (int d : {0, 1, 3})
    Expect(late[d].code() == StatusCode::kDeadlineExceeded &&
               late[d].message().find("waiting for rank 2 (device 62) to arrive") != std::string::npos,
           "spinning ranks time out naming the missing rank: " + late[d].message());
}

// LockSpinning (core/spin.h): mutual exclusion whether the lock comes during the spin, after it (a
// holder that keeps it 3 ms, past a 50 us spin, so the waiter blocks), or without one (spin 0).
void TestLockSpinning() {
  for (const auto spin : {std::chrono::nanoseconds(0), std::chrono::nanoseconds(50000)}) {
    std::mutex mu;
    int64_t counter = 0;  // plain: only mutual exclusion keeps the increments whole
    const int threads = 4, rounds = 20000;
    (void)OnThreads(threads, [&](int) {
      for (int i = 0; i < rounds; ++i) {
        const std::unique_lock<std::mutex> lock = LockSpinning(mu, spin);
        counter = counter + 1;
      }
      return Status();
    });
    Expect(counter == int64_t{threads} * rounds, "LockSpinning with spin " + std::to_string(spin.count()) +
                                                     " ns: " + std::to_string(counter) + " increments of " +
                                                     std::to_string(threads * rounds));
  }
  std::mutex mu;
  std::unique_lock<std::mutex> held(mu);
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    const std::unique_lock<std::mutex> lock = LockSpinning(mu, std::chrono::microseconds(50));
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(3));
  Expect(!got.load(), "LockSpinning does not take a lock another thread holds");
  held.unlock();
  waiter.join();
  Expect(got.load(), "LockSpinning takes the lock once the holder released it, after its spin ran out");
}

// SpinBudget, the spin every waiter runs: ready at once reads no clock and succeeds; never ready
// fails no sooner than the budget; a zero or spent budget checks once; the budget is shared by the
// Untils of one object.
void TestSpinBudget() {
  int polls = 0;
  Expect(SpinBudget(std::chrono::microseconds(50)).Until([&] { return ++polls == 3; }) && polls == 3,
         "SpinBudget: ready on the 3rd poll succeeds there (polls " + std::to_string(polls) + ")");
  polls = 0;
  Expect(!SpinBudget(std::chrono::nanoseconds(0)).Until([&] { return ++polls > 1; }) && polls == 1,
         "SpinBudget: a zero budget checks once (polls " + std::to_string(polls) + ")");
  const auto spin = std::chrono::milliseconds(2);
  SpinBudget budget(spin);
  const auto start = std::chrono::steady_clock::now();
  polls = 0;
  Expect(!budget.Until([&] { return ++polls < 0; }), "SpinBudget: never ready fails");
  const auto took = std::chrono::steady_clock::now() - start;
  Expect(took >= spin && polls > 64, "SpinBudget: a failed spin lasts its budget (" +
                                         std::to_string(std::chrono::duration<double, std::micro>(took).count()) +
                                         " us, " + std::to_string(polls) + " polls)");
  polls = 0;
  Expect(!budget.Until([&] { return ++polls < 0; }) && polls == 1,
         "SpinBudget: a spent budget checks once (polls " + std::to_string(polls) + ")");
  SpinBudget shared(std::chrono::seconds(10));  // ends when the flag is seen, 200 us in
  std::atomic<bool> flag{false};
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    flag = true;
  });
  const bool seen = shared.Until([&] { return flag.load(); });
  setter.join();
  Expect(seen, "SpinBudget: a flag another thread sets is seen");
}

// A call runs on the link set its program was lowered with (CollectiveArgs::links_version), not on
// whatever is current when each rank arrives: jax may still run calls of a program lowered before
// configure(links=...) returned.
void TestLinksVersion() {
  const std::vector<int64_t> group = {0, 1, 2, 3};
  const int n = 4;
  const size_t count = 1 << 16;  // 256 KiB per rank, split in halves by pinned shares
  auto run = [&](uint64_t version, int64_t run_id, const std::string& what, bool switch_links = true) {
    std::vector<std::vector<float>> xs(n), ys(n);
    for (int r = 0; r < n; ++r) {
      xs[r].assign(count, static_cast<float>(r + 1));
      ys[r].assign(count, -1.0f);
    }
    std::vector<Status> st = OnThreads(n, [&](int r) {
      // Half the ranks switch the current set while the others may already be in the call.
      if (switch_links && r % 2 == 1) (void)ConfigureLinks(r == 1 ? "shm;tcp:t" : "shm");
      return AllReduceF32(group, r, run_id, xs[r], ys[r], "engine_test", version);
    });
    bool ok = true;
    for (int r = 0; r < n; ++r) {
      ok = ok && st[r].ok();
      if (!st[r].ok()) std::printf("  rank %d: %s\n", r, st[r].message().c_str());
      for (size_t i = 0; ok && i < count; ++i) ok = ys[r][i] == 10.0f;
    }
    Expect(ok, what);
  };
  Expect(ConfigureLinks("shm;tcp:t").ok(), "configure shm;tcp:t");
  const uint64_t with_tcp = CurrentLinkSet()->version;
  Expect(SetShares(Kind::kAllReduce, count * sizeof(float), {0.5, 0.5}, true).ok(), "pin shares 0.5/0.5");
  run(with_tcp, 900, "a call on the current set (makes its group, with the pinned shares)", false);
  Expect(ConfigureLinks("shm").ok(), "configure shm");
  const uint64_t alone = CurrentLinkSet()->version;
  Expect(alone > with_tcp, "a new link set has a newer version");
  const uint64_t tcp_before = LinkBytes("t");
  run(with_tcp, 901, "a call on an earlier link set while the current one changes");
  Expect(LinkBytes("t") > tcp_before, "the earlier set's second link carried part of the call");
  const uint64_t tcp_after = LinkBytes("t");
  run(alone, 902, "a call on the later set (shm alone) while the current one changes");
  Expect(LinkBytes("t") == tcp_after, "shm alone: nothing more on t");
  std::vector<float> x(8, 1.0f), y(8);
  const int64_t one[] = {0, 1};
  Status unknown = AllReduceF32(one, 0, 903, x, y, "engine_test", 1u << 30);
  Expect(unknown.code() == StatusCode::kInvalidArgument &&
             unknown.message().find("never configured") != std::string::npos,
         "an unknown link set is an error naming it: " + unknown.message());
  Expect(ConfigureLinks("shm").ok(), "configure shm");
}

// Groups of earlier link sets are released once idle (their workers and tcp sockets), and a call that
// still comes for such a set gets a new group.
void TestReleaseEarlierGroups() {
  const std::vector<int64_t> group = {0, 1, 2};
  const int n = 3;
  auto run = [&](uint64_t version, int64_t run_id, const std::string& what) {
    std::vector<std::vector<float>> xs(n, std::vector<float>(4096, 2.0f)), ys(n, std::vector<float>(4096));
    std::vector<Status> st =
        OnThreads(n, [&](int r) { return AllReduceF32(group, r, run_id, xs[r], ys[r], "engine_test", version); });
    bool ok = true;
    for (int r = 0; r < n; ++r) ok = ok && st[r].ok() && ys[r][0] == 6.0f && ys[r][4095] == 6.0f;
    Expect(ok, what);
  };
  auto threads = [] {
    int count = 0;
    if (DIR* d = opendir("/proc/self/task")) {
      while (dirent* e = readdir(d)) count += e->d_name[0] != '.';
      closedir(d);
    }
    return count;
  };
  Expect(ConfigureLinks("shm;tcp:t").ok(), "configure shm;tcp:t");
  const uint64_t first = CurrentLinkSet()->version;
  run(first, 911, "a call on shm;tcp:t");
  const int with_group = threads();
  Expect(ConfigureLinks("shm").ok(), "configure shm");
  const ReleasedGroups r = ReleaseEarlierGroups();
  Expect(r.released >= 1 && r.kept == 0, "the idle group of the earlier set is released (" +
                                              std::to_string(r.released) + " released, " + std::to_string(r.kept) +
                                              " kept)");
  Expect(threads() <= with_group - (n - 1), "its " + std::to_string(n - 1) + " workers are gone (threads " +
                                                std::to_string(with_group) + " -> " + std::to_string(threads()) + ")");
  run(first, 912, "a later call lowered for the released set runs on a new group");
  run(first, 913, "and again");
  Expect(ReleaseEarlierGroups().released == 1, "that group is released in turn");
  Expect(ReleaseEarlierGroups().released == 0, "nothing left to release");
}

// The staged path stages all parts of a small call together: the arrival is its only rendezvous
// (no barrier at all), and the direct path has one barrier for all parts, not one per part.
void TestMultiOperandRendezvous() {
  const int n = 8;
  std::vector<int64_t> ids = {0, 1, 2, 3, 4, 5, 6, 7};
  Communicator comm(ids);
  comm.AddChannel(std::make_unique<ShmChannel>(n, "shm"));
  const size_t saved = ShmStagingBytes();
  for (bool staged : {true, false}) {
    SetShmStagingBytes(staged ? 16 << 10 : 0);
    std::vector<std::vector<std::vector<float>>> in(n, std::vector<std::vector<float>>(13)), out = in;
    for (int d = 0; d < n; ++d)
      for (int i = 0; i < 13; ++i) {
        in[d][i].assign(17 + i, static_cast<float>(d + i));
        out[d][i].assign(17 + i, -1.f);
      }
    const int64_t run = NextRunId();
    std::shared_ptr<CallContext> ctx;
    auto st = OnThreads(n, [&](int d) {
      CallDesc desc;
      for (int i = 0; i < 13; ++i) {
        Part p;
        p.in = in[d][i].data();
        p.out = out[d][i].data();
        p.units = p.inner = in[d][i].size();
        desc.AddPart(p);
      }
      auto call = comm.Join(d, run, "rendezvous");
      if (d == 0) ctx = call;
      return comm.channel(0).RunAlone(*call, d, desc);
    });
    bool ok = true;
    for (int d = 0; d < n; ++d) {
      ok &= st[d].ok();
      for (int i = 0; i < 13; ++i)
        for (float v : out[d][i]) ok &= v == static_cast<float>(28 + 8 * i);
    }
    Expect(ok, std::string("13 small parts ") + (staged ? "staged" : "direct") + ": correct");
    Expect(ctx && ctx->barriers_passed(0) == (staged ? 0u : 1u),
           std::string("13 small parts ") + (staged ? "staged: no barrier after the arrival"
                                                    : "direct: one barrier for all parts") +
               " (barriers passed: " + std::to_string(ctx ? ctx->barriers_passed(0) : 99) + ")");
  }
  SetShmStagingBytes(saved);
}

// Ranks that disagree on the number of operands (or on one operand's shape) all fail, before any
// buffer is read, naming the call on both sides.
void TestMultiOperandMismatch() {
  MultiSpec m;
  m.group = {0, 1, 2, 3};
  m.operands = {{DType::kF32, {100}}, {DType::kS32, {7}}, {DType::kF16, {3}}};
  const Inputs inputs = MultiInputs(m, 3);
  std::vector<Status> st;
  const std::vector<size_t> counts = {3, 3, 2, 3, 0, 0, 0, 0};
  RunMulti(m, inputs, &st, NextRunId(), &counts);
  bool all = true;
  for (int d = 0; d < 4; ++d)
    all &= !st[d].ok() && st[d].message().find("disagree") != std::string::npos &&
           st[d].message().find("of 2 operands") != std::string::npos &&
           st[d].message().find("of 3 operands") != std::string::npos;
  Expect(all, "a different operand count on one rank fails every rank: " + st[0].message());
  // Rank 3 passes a 6-element second operand.
  std::vector<Status> st2;
  std::vector<std::thread> threads;
  const int64_t run = NextRunId();
  st2.assign(4, Status());
  for (int d = 0; d < 4; ++d)
    threads.emplace_back([&, d] {
      std::vector<std::vector<uint8_t>> bufs(3);
      std::vector<OperandRequest> ops(3);
      std::vector<std::vector<int64_t>> dims(3);
      for (int i = 0; i < 3; ++i) {
        dims[i] = (d == 3 && i == 1) ? std::vector<int64_t>{6} : m.operands[i].in_dims;
        bufs[i].assign(Prod(dims[i]) * ByteWidth(m.operands[i].dtype), 1);
        ops[i].in_dtype = ops[i].out_dtype = m.operands[i].dtype;
        ops[i].in_dims = ops[i].out_dims = dims[i];
        ops[i].in = ops[i].out = bufs[i].data();
      }
      const std::vector<int64_t> sizes = {4};
      CollectiveArgs a;
      a.groups = m.group;
      a.group_sizes = sizes;
      a.device = d;
      a.run_id = run;
      a.request.reduction = "sum";
      a.request.operands = ops;
      st2[d] = RunCollective(a);
    });
  for (auto& t : threads) t.join();
  all = true;
  for (int d = 0; d < 4; ++d) all &= !st2[d].ok() && st2[d].message().find("rank 3") != std::string::npos;
  Expect(all, "one operand of another shape on one rank fails every rank: " + st2[0].message());
}

using Pairs = std::vector<std::pair<int64_t, int64_t>>;
Pairs Shift(int n, int by);  // ring shift by `by` (below)

// With several links the executor cuts one set of ranges over all parts (boundaries inside parts) and
// each link runs the pieces of its range; the results stay bitwise those of separate calls.
void TestMultiOperandAcrossLinks() {
  Expect(ConfigureLinks("shm;tcp;shm:b").ok(), "configure shm;tcp;shm:b");
  SetAutotune(0);
  SetRecordSplits(true);
  for (Kind kind : kAllKinds) {
    MultiSpec m;
    m.kind = kind;
    m.axis = kind == Kind::kAllReduce || kind == Kind::kPpermute ? 0 : 1;
    if (kind == Kind::kAllReduce || kind == Kind::kPpermute) m.operands = Leaves(13, LeafSize::kBig, true);
    else if (kind == Kind::kAllGather)
      m.operands = {{DType::kF32, {3, 7001}}, {DType::kBF16, {2, 5}}, {DType::kS32, {1, 30001}}, {DType::kU8, {5, 999}}};
    else
      m.operands = {{DType::kF32, {3, 8 * 7001}}, {DType::kBF16, {2, 8 * 5}}, {DType::kS32, {1, 8 * 30001}},
                    {DType::kU8, {5, 8 * 999}}};
    // The plan of this call's bucket: pinned shares that put boundaries inside parts.
    CallDesc probe;
    probe.kind = kind;
    for (const Operand& o : m.operands) {
      Part p;
      p.dtype = o.dtype;
      p.units = Prod(o.in_dims) / (kind == Kind::kReduceScatter || kind == Kind::kAllToAll ? 8 : 1);
      probe.AddPart(p);
    }
    if (kind == Kind::kPpermute) m.pairs = {{0, 3}, {3, 0}, {1, 2}, {2, 7}, {7, 1}, {5, 5}};
    uint64_t bytes = 0;
    for (const Part& p : probe.parts)
      bytes += p.bytes() * (kind == Kind::kAllReduce || kind == Kind::kPpermute ? 1 : 8);
    uint64_t bucket = 1;
    while (bucket * 2 <= bytes) bucket *= 2;
    Expect(SetShares(kind, bucket, {0.37, 0.21, 0.42}, true).ok(), "pinned shares");
    m.what = "split 37/21/42 over shm, tcp, shm:b";
    (void)TakeSplitRecords();
    CheckMulti(m);
    // Some boundary between links falls strictly inside a part (else the test would not test it).
    bool inside = false;
    for (const SplitRecord& r : TakeSplitRecords())
      for (const auto& [begin, end] : r.ranges)
        for (const Part& p : probe.parts)
          inside |= begin > p.offset && begin < p.offset + p.bytes();
    Expect(inside, std::string(Name(kind)) + ": a range boundary falls inside a part");
    if (kind != Kind::kPpermute && kind != Kind::kAllToAll) continue;
    // In place over the same split: a subset of the operands, then all of them (every link's range
    // runs its own in-place protocol: shm on two lanes, tcp through its sockets).
    for (size_t i = 0; i < m.operands.size(); i += 2) m.operands[i].in_place = true;
    m.what = "in-place subset, split 37/21/42 over shm, tcp, shm:b";
    CheckMulti(m);
    for (Operand& o : m.operands) o.in_place = true;
    m.what = "all in place, split 37/21/42 over shm, tcp, shm:b";
    CheckMulti(m);
    if (kind == Kind::kPpermute) {
      m.pairs = Shift(8, 1);
      m.what = "all in place, ring +1, split 37/21/42 over shm, tcp, shm:b";
      CheckMulti(m);
    }
  }
  SetRecordSplits(false);
  Expect(ConfigureLinks("shm").ok(), "configure shm");
}

// ---- ppermute and all_to_all.

const DType kAllDTypes[] = {DType::kPred, DType::kS8,  DType::kS16, DType::kS32, DType::kS64,
                            DType::kU8,   DType::kU16, DType::kU32, DType::kU64, DType::kF16,
                            DType::kBF16, DType::kF32, DType::kF64, DType::kC64, DType::kC128};

Pairs Shift(int n, int by) {
  Pairs p;
  for (int r = 0; r < n; ++r) p.push_back({r, ((r + by) % n + n) % n});
  return p;
}

void TestPpermute() {
  // Every dtype, lengths from one element to the direct path, odd and not a multiple of a line.
  for (DType t : kAllDTypes)
    for (int64_t len : {1, 3, 17, 4099, 70001}) {
      Spec s;
      s.kind = Kind::kPpermute;
      s.dtype = t;
      s.in_dims = {len};
      s.pairs = Shift(8, 1);
      CheckSpec(s);
    }
  // Pair sets on 8 ranks: identity, shifts ±1 and +3, swaps, a reversal, partial ones with ranks that
  // receive zeros, none at all; small (staged) and large (direct) sizes, 2-D shapes.
  const std::vector<Pairs> sets = {
      {{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 5}, {6, 6}, {7, 7}},
      Shift(8, 1), Shift(8, -1), Shift(8, 3),
      {{0, 1}, {1, 0}},
      {{0, 7}, {1, 6}, {2, 5}, {3, 4}, {4, 3}, {5, 2}, {6, 1}, {7, 0}},
      {{0, 3}, {5, 1}, {2, 2}},
      {{7, 0}},
      {},
  };
  for (const Pairs& pairs : sets)
    for (const auto& dims : std::vector<std::vector<int64_t>>{{5, 7}, {300001}, {333, 77}}) {
      Spec s;
      s.kind = Kind::kPpermute;
      s.dtype = dims.size() == 1 ? DType::kF32 : DType::kBF16;
      s.in_dims = dims;
      s.pairs = pairs;
      CheckSpec(s);
    }
  // Groups of 1 (with and without the identity pair), 2, odd sizes, and several groups at once (the
  // pairs apply in every group, ranks being positions in each group).
  struct G {
    std::vector<std::vector<int64_t>> groups;
    Pairs pairs;
  };
  for (const G& g : std::vector<G>{{{{3}}, {{0, 0}}},
                                   {{{3}}, {}},
                                   {{{6, 2}}, {{0, 1}, {1, 0}}},
                                   {{{6, 2}}, {{1, 0}}},
                                   {{{4, 1, 6}}, Shift(3, 1)},
                                   {{{0, 1, 2, 3, 4}}, Shift(5, -2)},
                                   {{{0, 2, 4, 6}, {1, 3, 5, 7}}, Shift(4, 1)},
                                   {{{7, 6, 5}, {4, 3, 2, 1, 0}}, {{0, 2}, {2, 1}}}})
    for (int64_t len : {9, 60001}) {
      Spec s;
      s.kind = Kind::kPpermute;
      s.dtype = DType::kS32;
      s.groups = g.groups;
      s.in_dims = {len};
      s.pairs = g.pairs;
      CheckSpec(s);
    }
}

void TestAllToAll() {
  // Every dtype; every axis position of 1-, 2- and 3-D shapes, with outer and inner of 1.
  for (DType t : kAllDTypes)
    for (const auto& [dims, axis] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
             {{8}, 0}, {{8 * 5}, 0}, {{3, 8 * 7}, 1}, {{16, 3, 5}, 0}, {{2, 8, 3}, 1}, {{2, 3, 8 * 4}, 2},
             {{3, 8}, 1}, {{8, 1}, 0}, {{1, 8, 1}, 1}}) {
      Spec s;
      s.kind = Kind::kAllToAll;
      s.dtype = t;
      s.in_dims = dims;
      s.axis = axis;
      CheckSpec(s);
    }
  // n = 2..8, odd included; large calls (direct path, streaming) with long and short rows.
  for (int n = 2; n <= 8; ++n) {
    std::vector<int64_t> group;
    for (int r = 0; r < n; ++r) group.push_back(7 - r);
    for (const auto& [dims, axis] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
             {{5, n * 3}, 1}, {{n * 30011}, 0}, {{1001, n * 3}, 1}, {{3, n, 7}, 1}}) {
      Spec s;
      s.kind = Kind::kAllToAll;
      s.dtype = n % 2 ? DType::kF16 : DType::kF64;
      s.groups = {group};
      s.in_dims = dims;
      s.axis = axis;
      CheckSpec(s);
    }
  }
  Spec two;
  two.kind = Kind::kAllToAll;
  two.groups = {{0, 2, 4, 6}, {1, 3, 5, 7}};
  two.in_dims = {3, 4 * 1001};
  two.axis = 1;
  CheckSpec(two);
  Spec big;
  big.kind = Kind::kAllToAll;
  big.in_dims = {8 * 140001};
  CheckSpec(big);
}

// ---- ppermute and all_to_all in place (shm's direct path: chunks of 256 KiB per rank announced
// pairwise, links/shm_inplace.h; the staged path below 16 KiB): against the reference and the
// out-of-place call, bitwise (CheckSpec).

void TestPpermuteInPlace() {
  // Every dtype width (1, 2, 4, 8, 16 bytes), from one element to many chunks, ring +1 and -1.
  for (DType t : kAllDTypes)
    for (int64_t len : {1, 17, 4099, 300001})
      for (int by : {1, -1}) {
        Spec s;
        s.kind = Kind::kPpermute;
        s.dtype = t;
        s.in_dims = {len};
        s.pairs = Shift(8, by);
        s.in_place = true;
        CheckSpec(s);
      }
  // Pair sets: identity, shifts, pairs (swaps), a reversal, partial ones with zero-filled ranks and
  // ranks that only send, none at all; staged, one chunk, several chunks (not a multiple of a chunk),
  // 2-D shapes.
  const std::vector<Pairs> sets = {
      {{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 5}, {6, 6}, {7, 7}},
      Shift(8, 1), Shift(8, -1), Shift(8, 3),
      {{0, 1}, {1, 0}, {2, 3}, {3, 2}, {4, 5}, {5, 4}, {6, 7}, {7, 6}},
      {{0, 1}, {1, 0}},
      {{0, 7}, {1, 6}, {2, 5}, {3, 4}, {4, 3}, {5, 2}, {6, 1}, {7, 0}},
      {{0, 3}, {5, 1}, {2, 2}},
      {{0, 1}, {1, 2}, {2, 3}},
      {{7, 0}},
      {},
  };
  for (const Pairs& pairs : sets)
    for (const auto& dims : std::vector<std::vector<int64_t>>{{5, 7}, {30001}, {333, 777}, {1000003}}) {
      Spec s;
      s.kind = Kind::kPpermute;
      s.dtype = dims.size() == 1 ? DType::kF32 : DType::kBF16;
      s.in_dims = dims;
      s.pairs = pairs;
      s.in_place = true;
      CheckSpec(s);
    }
  // In place on some ranks only (the others have separate outputs); groups of 2, 3, 5 and two groups.
  for (uint32_t separate : {0x01u, 0x5Au, 0xFEu}) {
    Spec s;
    s.kind = Kind::kPpermute;
    s.dtype = DType::kS16;
    s.in_dims = {400003};
    s.pairs = Shift(8, 1);
    s.in_place = true;
    s.separate_devices = separate;
    CheckSpec(s);
    s.pairs = {{0, 3}, {3, 0}, {5, 6}};
    CheckSpec(s);
  }
  struct G {
    std::vector<std::vector<int64_t>> groups;
    Pairs pairs;
  };
  for (const G& g : std::vector<G>{{{{6, 2}}, {{0, 1}, {1, 0}}},
                                   {{{4, 1, 6}}, Shift(3, 1)},
                                   {{{0, 1, 2, 3, 4}}, Shift(5, -2)},
                                   {{{0, 2, 4, 6}, {1, 3, 5, 7}}, Shift(4, 1)},
                                   {{{3}}, {}}})
    for (int64_t len : {9, 200001}) {
      Spec s;
      s.kind = Kind::kPpermute;
      s.dtype = DType::kS32;
      s.groups = g.groups;
      s.in_dims = {len};
      s.pairs = g.pairs;
      s.in_place = true;
      CheckSpec(s);
    }
}

void TestAllToAllInPlace() {
  // Every dtype width; every axis position, outer and inner of 1, one element per block, staged and
  // direct, chunks cutting rows.
  for (DType t : kAllDTypes)
    for (const auto& [dims, axis] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
             {{8}, 0}, {{3, 8 * 7}, 1}, {{2, 8, 3}, 1}, {{1, 8, 1}, 1}, {{8 * 30011}, 0},
             {{3, 8 * 20011}, 1}, {{1001, 8, 13}, 1}, {{40, 33, 8 * 5}, 2}}) {
      Spec s;
      s.kind = Kind::kAllToAll;
      s.dtype = t;
      s.in_dims = dims;
      s.axis = axis;
      s.in_place = true;
      CheckSpec(s);
    }
  // n = 2..8, odd included; many chunks with long rows and with short ones; some ranks out of place.
  for (int n = 2; n <= 8; ++n) {
    std::vector<int64_t> group;
    for (int r = 0; r < n; ++r) group.push_back(7 - r);
    for (const auto& [dims, axis] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
             {{5, n * 3}, 1}, {{n * 130011}, 0}, {{20001, n * 3}, 1}, {{3, n, 70001}, 1}}) {
      Spec s;
      s.kind = Kind::kAllToAll;
      s.dtype = n % 2 ? DType::kF16 : DType::kF64;
      s.groups = {group};
      s.in_dims = dims;
      s.axis = axis;
      s.in_place = true;
      CheckSpec(s);
      s.separate_devices = 0x55;
      CheckSpec(s);
    }
  }
  Spec two;
  two.kind = Kind::kAllToAll;
  two.groups = {{0, 2, 4, 6}, {1, 3, 5, 7}};
  two.in_dims = {3, 4 * 100001};
  two.axis = 1;
  two.in_place = true;
  CheckSpec(two);
}

// A rank that arrives at an in-place ppermute but never runs its part: the rank whose buffer it
// should read waits for it, and fails at the deadline naming the collective, the group, the rank
// and the link; the next call on the group works.
void TestInPlaceDeadline() {
  const double saved = TimeoutSeconds();
  SetTimeoutSeconds(0.3);
  const int n = 3;
  Communicator comm({40, 41, 42});
  comm.AddChannel(std::make_unique<ShmChannel>(n, "shm"));
  const size_t len = 300000;  // several chunks
  for (Kind kind : {Kind::kPpermute, Kind::kAllToAll}) {
    std::vector<std::vector<float>> buf(n, std::vector<float>(len * n, 1.f));
    std::vector<CallDesc> descs(n);
    for (int r = 0; r < n; ++r) {
      descs[r].kind = kind;
      if (kind == Kind::kPpermute) descs[r].sources = {2, 0, 1};  // 0 -> 1 -> 2 -> 0
      Part p;
      p.units = kind == Kind::kPpermute ? len * n : len;
      p.inner = p.units;
      p.in = p.out = buf[r].data();
      descs[r].AddPart(p);
    }
    const int64_t run = NextRunId();
    const auto t0 = std::chrono::steady_clock::now();
    auto st = OnThreads(n, [&](int r) {
      auto call = comm.Join(r, run, "ppermute over axes ('x',)");
      Status s = call->Arrive(r, descs[r], "shm");
      const Piece piece{0, {0, descs[r].parts[0].units}};
      if (s.ok() && r != 2) s = comm.channel(0).Run(*call, r, 0, {&piece, 1});
      return s;
    });
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Rank 1 waits for rank 2 (its reader); rank 0 waits for rank 1, which is stuck behind rank 2.
    // Both deadlines fall together, and the first to fire fails the call for every waiter with its
    // message: it names rank 2, or rank 1 waiting for it (1 run in ~10 here).
    const std::string& m = st[1].message();
    const bool names_a_waited_rank =
        m.find("rank 2 (device 42)") != std::string::npos || m.find("rank 1 (device 41)") != std::string::npos;
    Expect(st[1].code() == StatusCode::kDeadlineExceeded && m.find("ppermute over axes") != std::string::npos &&
               names_a_waited_rank && m.find("[40, 41, 42]") != std::string::npos &&
               m.find("link shm") != std::string::npos && m.find("in-place") != std::string::npos,
           std::string(Name(kind)) + " in place: the deadline names label, group, missing rank, link: " + m);
    Expect(took < 3, std::string(Name(kind)) + " in place: deadline honoured (" + std::to_string(took) + " s)");
  }
  SetTimeoutSeconds(saved);
  // The group works again (a fresh run).
  std::vector<std::vector<float>> buf(n, std::vector<float>(len));
  for (int r = 0; r < n; ++r) std::fill(buf[r].begin(), buf[r].end(), static_cast<float>(r));
  const int64_t run = NextRunId();
  auto st = OnThreads(n, [&](int r) {
    CallDesc d;
    d.kind = Kind::kPpermute;
    d.sources = {2, 0, 1};
    Part p;
    p.units = p.inner = len;
    p.in = p.out = buf[r].data();
    d.AddPart(p);
    auto call = comm.Join(r, run, "after");
    return comm.channel(0).RunAlone(*call, r, d);
  });
  bool ok = true;
  for (int r = 0; r < n; ++r) ok &= st[r].ok() && buf[r][0] == static_cast<float>((r + 2) % 3) && buf[r][len - 1] == buf[r][0];
  Expect(ok, "in-place ppermute after a timed-out one works: " + st[0].message());
}

// The ordering guard itself: one rank starts its part late (after its peers could have finished
// theirs), so any rank that overwrote its buffer without waiting for its readers would hand the late
// rank the wrong bytes. Deterministic: without CallContext::WaitProgress before each chunk's write
// (links/shm_inplace.cc) this fails for every late rank that reads someone's buffer (checked by
// removing it). Several chunks, each rank in turn the late one, and a late rank whose output is
// separate (it still reads an in-place peer).
void TestInPlaceOrdering() {
  const int n = 4;
  Communicator comm({50, 51, 52, 53});
  comm.AddChannel(std::make_unique<ShmChannel>(n, "shm"));
  const size_t len = 4 * 75001;  // per rank, n blocks of all_to_all; several 256 KiB chunks
  for (Kind kind : {Kind::kPpermute, Kind::kAllToAll})
    for (int late = 0; late < n; ++late)
      for (bool late_separate : {false, true}) {
        std::vector<std::vector<uint32_t>> buf(n, std::vector<uint32_t>(len)), sep(n, std::vector<uint32_t>(len));
        for (int r = 0; r < n; ++r)
          for (size_t i = 0; i < len; ++i) buf[r][i] = static_cast<uint32_t>(r) << 24 | static_cast<uint32_t>(i);
        const std::vector<std::vector<uint32_t>> x = buf;
        std::vector<CallDesc> descs(n);
        for (int r = 0; r < n; ++r) {
          descs[r].kind = kind;
          if (kind == Kind::kPpermute) descs[r].sources = {3, 0, 1, 2};  // ring +1
          Part p;
          p.dtype = DType::kU32;
          p.outer = 1;
          p.units = kind == Kind::kPpermute ? len : len / n;
          p.inner = p.units;
          p.in = buf[r].data();
          p.out = late_separate && r == late ? sep[r].data() : buf[r].data();
          descs[r].AddPart(p);
        }
        const int64_t run = NextRunId();
        auto st = OnThreads(n, [&](int r) {
          auto call = comm.Join(r, run, "ordering");
          Status s = call->Arrive(r, descs[r], "shm");
          if (r == late) std::this_thread::sleep_for(std::chrono::milliseconds(60));
          const Piece piece{0, {0, descs[r].parts[0].units}};
          if (s.ok()) s = comm.channel(0).Run(*call, r, 0, {&piece, 1});
          return s;
        });
        bool ok = true;
        std::string why;
        for (int r = 0; r < n && ok; ++r) {
          const std::vector<uint32_t>& got = late_separate && r == late ? sep[r] : buf[r];
          for (size_t i = 0; i < len && ok; ++i) {
            uint32_t want;
            if (kind == Kind::kPpermute) {
              want = x[(r + n - 1) % n][i];
            } else {  // [n, len / n]: block j of rank r is block r of rank j
              const size_t b = len / n, j = i / b;
              want = x[j][r * b + i % b];
            }
            if (!st[r].ok() || got[i] != want) {
              ok = false;
              why = "rank " + std::to_string(r) + " element " + std::to_string(i) + " " + st[r].message();
            }
          }
        }
        Expect(ok, std::string(Name(kind)) + " in place, rank " + std::to_string(late) + " late" +
                       (late_separate ? " (separate output)" : "") + ": every rank read its sources' bytes " +
                       "before they were overwritten: " + why);
      }
}

// In place on emulated links (over shm and over tcp), the call split between them.
void TestInPlaceEmulated() {
  Expect(ConfigureLinks("emulated:e1@gbps=100;emulated:e2@gbps=100,base=tcp").ok(), "configure emulated links");
  SetAutotune(0);
  for (Kind kind : {Kind::kPpermute, Kind::kAllToAll}) {
    Spec s;
    s.kind = kind;
    s.in_dims = kind == Kind::kPpermute ? std::vector<int64_t>{500001} : std::vector<int64_t>{7, 8 * 9001};
    s.axis = kind == Kind::kPpermute ? 0 : 1;
    s.pairs = kind == Kind::kPpermute ? Shift(8, -1) : Pairs{};
    s.in_place = true;
    const uint64_t bytes = Prod(s.in_dims) * 4;
    uint64_t bucket = 1;
    while (bucket * 2 <= bytes) bucket *= 2;
    Expect(SetShares(kind, bucket, {0.55, 0.45}, true).ok(), "pinned shares");
    CheckSpec(s);
    s.separate_devices = 0x0F;
    CheckSpec(s);
  }
  Expect(ConfigureLinks("shm").ok(), "configure shm");
}

// Every rank of a group runs f(rank) -> Status on its own thread; returns the statuses.
std::vector<Status> CallOnGroup(const std::vector<int64_t>& group, const std::vector<int64_t>& sizes,
                                const std::function<void(int, CollectiveArgs&)>& fill) {
  const int64_t run = NextRunId();
  return OnThreads(static_cast<int>(group.size()), [&](int r) {
    CollectiveArgs a;
    a.groups = group;
    a.group_sizes = sizes;
    a.device = group[r];
    a.run_id = run;
    a.label = "engine_test";
    fill(r, a);
    return RunCollective(a);
  });
}

bool AllFailWith(const std::vector<Status>& st, const std::string& text) {
  bool all = true;
  for (const Status& s : st) all &= !s.ok() && s.message().find(text) != std::string::npos;
  return all;
}

void TestExchangeValidation() {
  const std::vector<int64_t> group = {0, 1, 2, 3}, sizes = {4};
  std::vector<float> x(24, 1.f), y(24);
  std::vector<int64_t> dims = {24};
  OperandRequest op;
  op.in_dims = op.out_dims = dims;
  op.in = x.data();
  op.out = y.data();
  auto one = [&](Kind kind, std::vector<int64_t> pairs, int64_t axis = 0) {
    CollectiveArgs a;
    a.groups = group;
    a.group_sizes = sizes;
    a.label = "engine_test";
    a.request.kind = kind;
    a.request.pairs = pairs;
    a.request.axis = axis;
    a.request.operands = {&op, 1};
    return RunCollective(a);
  };
  Status s = one(Kind::kPpermute, {0, 1, 2});
  Expect(!s.ok() && s.message().find("flattened") != std::string::npos, "odd pair list: " + s.message());
  s = one(Kind::kPpermute, {0, 4});
  Expect(!s.ok() && s.message().find("outside the group of 4") != std::string::npos, "rank out of range: " + s.message());
  s = one(Kind::kPpermute, {-1, 2});
  Expect(!s.ok() && s.message().find("outside the group") != std::string::npos, "negative rank: " + s.message());
  s = one(Kind::kPpermute, {0, 1, 0, 2});
  Expect(!s.ok() && s.message().find("sources must be unique") != std::string::npos, "duplicate source: " + s.message());
  s = one(Kind::kPpermute, {0, 1, 2, 1});
  Expect(!s.ok() && s.message().find("destinations must be unique") != std::string::npos,
         "duplicate destination: " + s.message());
  // In place is the output being the input buffer itself; any other overlap is an error.
  std::vector<float> xy(25);
  op.in = xy.data();
  op.out = xy.data() + 1;
  s = one(Kind::kPpermute, {0, 1});
  Expect(!s.ok() && s.message().find("overlaps the input") != std::string::npos &&
             s.message().find("the input buffer itself") != std::string::npos,
         "ppermute, output overlapping the input: " + s.message());
  s = one(Kind::kAllToAll, {});
  Expect(!s.ok() && s.message().find("overlaps the input") != std::string::npos, "all_to_all, overlap: " + s.message());
  op.in = x.data();
  op.out = y.data();
  std::vector<int64_t> odd = {3, 7};
  op.in_dims = op.out_dims = odd;
  std::vector<float> x21(21), y21(21);
  op.in = x21.data();
  op.out = y21.data();
  s = one(Kind::kAllToAll, {}, 1);
  Expect(!s.ok() && s.message().find("split evenly into 4 blocks") != std::string::npos, "a2a not divisible: " + s.message());
  s = one(Kind::kAllToAll, {}, 2);
  Expect(!s.ok() && s.message().find("axis 2 out of range") != std::string::npos, "a2a axis: " + s.message());
  // Uneven groups: all_to_all needs groups of one size.
  const std::vector<int64_t> ids = {0, 1, 2, 3, 4}, uneven = {2, 3};
  CollectiveArgs a;
  a.groups = ids;
  a.group_sizes = uneven;
  a.request.kind = Kind::kAllToAll;
  a.request.operands = {&op, 1};
  s = RunCollective(a);
  Expect(!s.ok() && s.message().find("same size") != std::string::npos, "a2a uneven groups: " + s.message());
  // Ranks that disagree on the pairs all fail, naming both pair lists.
  std::vector<std::vector<float>> bx(4, std::vector<float>(10, 1.f)), by = bx;
  const std::vector<int64_t> shift = {0, 1, 1, 2, 2, 3, 3, 0}, other = {0, 1, 1, 2, 2, 3, 3, 1};
  std::vector<int64_t> d10 = {10};
  auto st = CallOnGroup(group, sizes, [&](int r, CollectiveArgs& c) {
    thread_local OperandRequest o;
    o.in_dims = o.out_dims = d10;
    o.in = bx[r].data();
    o.out = by[r].data();
    c.request.kind = Kind::kPpermute;
    c.request.pairs = r == 2 ? std::span<const int64_t>(other).first(6) : std::span<const int64_t>(shift);
    c.request.operands = {&o, 1};
  });
  Expect(AllFailWith(st, "disagree") && st[0].message().find("0->1, 1->2, 2->3, 3->0") != std::string::npos &&
             st[0].message().find("rank 2") != std::string::npos,
         "mismatched pair lists fail every rank: " + st[0].message());
  // A ppermute whose rank never arrives: the deadline names the collective, group, rank and link.
  const double saved = TimeoutSeconds();
  SetTimeoutSeconds(0.3);
  const std::vector<int64_t> late_group = {20, 21, 22};
  std::vector<std::vector<float>> lx(3, std::vector<float>(100, 1.f)), ly = lx;
  const int64_t run = NextRunId();
  auto late = OnThreads(3, [&](int r) {
    if (r == 1) return Status();
    const std::vector<int64_t> three = {3}, d100 = {100}, pairs = {0, 1, 1, 2, 2, 0};
    OperandRequest o;
    o.in_dims = o.out_dims = d100;
    o.in = lx[r].data();
    o.out = ly[r].data();
    CollectiveArgs c;
    c.groups = late_group;
    c.group_sizes = three;
    c.device = late_group[r];
    c.run_id = run;
    c.label = "ppermute over axes ('x',)";
    c.request.kind = Kind::kPpermute;
    c.request.pairs = pairs;
    c.request.operands = {&o, 1};
    return RunCollective(c);
  });
  SetTimeoutSeconds(saved);
  const std::string& m = late[0].message();
  Expect(late[0].code() == StatusCode::kDeadlineExceeded && m.find("ppermute over axes") != std::string::npos &&
             m.find("rank 1 (device 21)") != std::string::npos && m.find("[20, 21, 22]") != std::string::npos &&
             m.find("link shm") != std::string::npos,
         "ppermute deadline names label, group, missing rank, link: " + m);
}

// An allocation that fails (here: an absurd staging size) is an error of every rank that hits it,
// not an abort of the process; the next call works again.
void TestOutOfMemoryIsAnError() {
  const size_t saved = ShmStagingBytes();
  SetShmStagingBytes(size_t{1} << 60);
  std::vector<int64_t> group = {0, 1, 2, 3};
  std::vector<std::vector<float>> x(4, std::vector<float>(10, 1.f)), y = x;
  const int64_t run = NextRunId();
  auto st = OnThreads(4, [&](int d) { return AllReduceF32(group, d, run, x[d], y[d]); });
  SetShmStagingBytes(saved);
  Expect(AllFailWith(st, "out of memory"), "a failed allocation is an error on every rank: " + st[0].message());
  const int64_t run2 = NextRunId();
  auto ok = OnThreads(4, [&](int d) { return AllReduceF32(group, d, run2, x[d], y[d]); });
  bool fine = true;
  for (int d = 0; d < 4; ++d) fine &= ok[d].ok() && y[d][0] == 4.f;
  Expect(fine, "the group works again after a failed allocation");
}

void TestMultiOperandExchange() {
  for (LeafSize size : {LeafSize::kSmall, LeafSize::kMedium, LeafSize::kBig}) {
    MultiSpec p;
    p.kind = Kind::kPpermute;
    p.operands = Leaves(13, size, true);
    p.pairs = {{0, 1}, {1, 2}, {2, 0}, {4, 4}, {6, 7}};
    p.what = "partial pairs, " + SizeName(size);
    CheckMulti(p);
    // In-place subsets: results 0, 1, 4, 7 and 10 alias their operands (1, 4 and 10 are the large
    // ones with kBig), in a partial permutation and in a ring.
    for (size_t i : {0, 1, 4, 7, 10}) p.operands[i].in_place = true;
    p.what = "partial pairs, in-place subset, " + SizeName(size);
    CheckMulti(p);
    p.pairs = {{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}, {5, 6}, {6, 7}, {7, 0}};
    p.what = "ring +1, in-place subset, " + SizeName(size);
    CheckMulti(p);
    for (Operand& o : p.operands) o.in_place = true;
    p.what = "ring +1, all in place, " + SizeName(size);
    CheckMulti(p);
  }
  for (int64_t axis : {0, 1}) {
    MultiSpec a;
    a.kind = Kind::kAllToAll;
    a.axis = axis;
    a.operands = {{DType::kF32, {8, 8 * 5}, true}, {DType::kBF16, {16, 8}}, {DType::kS64, {8, 8 * 30001}, true},
                  {DType::kU16, {24, 8}, true},    {DType::kC64, {8, 8}},   {DType::kPred, {8, 8 * 70001}}};
    a.what = "in-place subset, axis " + std::to_string(axis);
    CheckMulti(a);
  }
  for (int64_t axis : {0, 1}) {
    MultiSpec a;
    a.kind = Kind::kAllToAll;
    a.axis = axis;
    a.operands = {{DType::kF32, {8, 8 * 5}}, {DType::kBF16, {16, 8}}, {DType::kS64, {8, 8 * 3001}},
                  {DType::kU16, {24, 8}},    {DType::kC64, {8, 8}},   {DType::kPred, {8, 8 * 7}}};
    a.what = "axis " + std::to_string(axis);
    CheckMulti(a);
  }
}

// Runs a test function and prints how long it took (the suite's slow parts show at a glance).
// `engine_test NAME...` runs only the test functions whose names contain one of the NAMEs; `=NAME`
// only the one of that name (TestPpermute without TestPpermuteInPlace).
int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  SelectTests(argc, argv);
  Timed("TestOutputFaultsTheMiddle", TestOutputFaultsTheMiddle);
  Timed("TestOutputFaultsCollapseEnds", TestOutputFaultsCollapseEnds);
  Timed("TestOutputFaultsShared", TestOutputFaultsShared);
  Timed("TestArriveHelpsFault", TestArriveHelpsFault);
  Timed("TestReduceToKernel", TestReduceToKernel);
  Timed("TestRanges", TestRanges);
  Timed("TestLarge", TestLarge);
  Timed("TestValidation", TestValidation);
  Timed("TestKindsDtypesOps", TestKindsDtypesOps);
  Timed("TestGroups", TestGroups);
  Timed("TestDeterminism", TestDeterminism);
  Timed("TestMismatch", TestMismatch);
  Timed("TestManyCalls", TestManyCalls);
  Timed("TestDeadline", TestDeadline);
  Timed("TestMultiOperandAllReduce", TestMultiOperandAllReduce);
  Timed("TestMultiOperandGatherScatter", TestMultiOperandGatherScatter);
  Timed("TestMultiOperandRendezvous", TestMultiOperandRendezvous);
  Timed("TestSpinningRendezvous", TestSpinningRendezvous);
  Timed("TestLockSpinning", TestLockSpinning);
  Timed("TestSpinBudget", TestSpinBudget);
  Timed("TestMultiOperandMismatch", TestMultiOperandMismatch);
  Timed("TestPpermute", TestPpermute);
  Timed("TestAllToAll", TestAllToAll);
  Timed("TestPpermuteInPlace", TestPpermuteInPlace);
  Timed("TestAllToAllInPlace", TestAllToAllInPlace);
  Timed("TestInPlaceDeadline", TestInPlaceDeadline);
  Timed("TestInPlaceOrdering", TestInPlaceOrdering);
  Timed("TestExchangeValidation", TestExchangeValidation);
  Timed("TestMultiOperandExchange", TestMultiOperandExchange);
  Timed("TestOutOfMemoryIsAnError", TestOutOfMemoryIsAnError);
  Timed("TestMultiOperandAcrossLinks", TestMultiOperandAcrossLinks);
  Timed("TestInPlaceEmulated", TestInPlaceEmulated);
  Timed("TestLinksVersion", TestLinksVersion);
  Timed("TestReleaseEarlierGroups", TestReleaseEarlierGroups);
  return Summary();
}
