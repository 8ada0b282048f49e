// The GPU engine's collective cases, shared by the CPU-only test on the simulated device
// (gpu_sim_test.cc) and the GPU test (cuda_ranks_test.cc): every rank a thread with its own
// "XLA" stream and buffers, as XLA runs one thread per device; results checked against the
// independent reference (reference.h) after the streams ran.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tests/cpp/check.h"
#include "tests/cpp/reference.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/cuda/gpu_engine.h"

namespace flexlink::testing {

// What a test needs from a device beyond the engine's DeviceApi: buffers and synchronous copies.
struct Harness {
  gpu::DeviceApi* api = nullptr;
  int ranks = 2;
  std::function<int(int64_t)> device_of;
  std::function<void*(int device, size_t bytes)> alloc;
  std::function<void(void* device_dst, const void* host_src, size_t bytes)> upload;
  std::function<void(void* host_dst, const void* device_src, size_t bytes)> download;
  std::function<void(gpu::Stream)> sync;
  std::function<void(void* device_ptr)> free;  // optional: a case's buffers are freed after its check
  std::vector<gpu::Stream> streams;  // per rank: the stream XLA would hand the handler
  // Floats reduced by a real NCCL are not in rank order: compare them with a tolerance.
  bool nccl_floats_approx = false;
};

inline void MakeStreams(Harness& h) {
  h.streams.resize(h.ranks);
  for (int r = 0; r < h.ranks; ++r) {
    (void)h.api->SetDevice(h.device_of(r));
    (void)h.api->CreateStream(h.device_of(r), &h.streams[r]);
  }
}

struct Case {
  Kind kind = Kind::kAllReduce;
  ReduceOp op = ReduceOp::kSum;
  std::vector<DType> dtypes;                 // one per operand
  std::vector<std::vector<int64_t>> dims;    // input dims, one per operand
  int64_t axis = 0;
  std::vector<std::pair<int64_t, int64_t>> pairs;  // ppermute
  bool in_place = false;                     // all_reduce, ppermute, all_to_all: the output is the input
  uint64_t links_version = 0;                // the link set the call was lowered with (0: the current)
  std::string Name() const {
    std::string s(flexlink::Name(kind));
    if (Reduces(kind)) s += "(" + std::string(flexlink::Name(op)) + ")";
    for (size_t i = 0; i < dtypes.size(); ++i) {
      s += i ? ", " : " ";
      s += std::string(flexlink::Name(dtypes[i])) + FormatIds(dims[i]);
    }
    if (kind != Kind::kAllReduce && kind != Kind::kPpermute) s += " axis " + std::to_string(axis);
    if (in_place) s += " in place";
    return s;
  }
};

inline size_t Count(const std::vector<int64_t>& dims) {
  size_t c = 1;
  for (int64_t d : dims) c *= static_cast<size_t>(d);
  return c;
}

inline size_t OutCount(const Case& c, size_t i, int n) {
  const size_t in = Count(c.dims[i]);
  if (c.kind == Kind::kAllGather) return in * n;
  if (c.kind == Kind::kReduceScatter) return in / n;
  return in;
}

// nccl-tests bytes of the case (the balancer's size).
inline uint64_t CaseBytes(const Case& c, int n) {
  uint64_t b = 0;
  for (size_t i = 0; i < c.dims.size(); ++i) {
    const size_t in = Count(c.dims[i]), w = ByteWidth(c.dtypes[i]);
    switch (c.kind) {
      case Kind::kAllReduce:
      case Kind::kPpermute: b += in * w; break;
      case Kind::kAllGather: b += in * w * n; break;
      case Kind::kReduceScatter: b += in * w; break;
      case Kind::kAllToAll: b += in * w; break;
    }
  }
  return b;
}

inline std::vector<uint8_t> Expected(const Case& c, size_t i, int n, int rank, const std::vector<std::vector<uint8_t>>& x) {
  const DType t = c.dtypes[i];
  const size_t w = ByteWidth(t), in = Count(c.dims[i]), out = OutCount(c, i, n);
  std::vector<const uint8_t*> srcs;
  for (const auto& v : x) srcs.push_back(v.data());
  std::vector<uint8_t> y(out * w);
  size_t outer = 1;
  for (int64_t a = 0; a < c.axis && a < static_cast<int64_t>(c.dims[i].size()); ++a) outer *= c.dims[i][a];
  switch (c.kind) {
    case Kind::kAllReduce:
      for (size_t e = 0; e < in; ++e) RefReduce(t, c.op, srcs, e, &y[e * w]);
      break;
    case Kind::kAllGather: {
      const size_t inner = in / outer;
      for (size_t o = 0; o < outer; ++o)
        for (int k = 0; k < n; ++k)
          std::memcpy(&y[((o * n + k) * inner) * w], srcs[k] + o * inner * w, inner * w);
      break;
    }
    case Kind::kReduceScatter: {
      const size_t inner = out / outer;
      for (size_t o = 0; o < outer; ++o)
        for (size_t e = 0; e < inner; ++e) {
          std::vector<const uint8_t*> col;
          for (int k = 0; k < n; ++k) col.push_back(srcs[k] + ((o * n + rank) * inner + e) * w);
          RefReduce(t, c.op, col, 0, &y[(o * inner + e) * w]);
        }
      break;
    }
    case Kind::kPpermute: y = RefPpermute(c.pairs, srcs, in * w, rank); break;
    case Kind::kAllToAll: y = RefAllToAll(c.dims[i], c.axis, srcs, w, rank); break;
  }
  return y;
}

// Elements differing by more than a relative 1e-2 (floats of a real NCCL reduction).
inline size_t CountFar(DType t, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  size_t far = 0;
  const size_t w = ByteWidth(t);
  for (size_t e = 0; e * w < got.size(); ++e) {
    double a = 0, b = 0;
    if (t == DType::kF32) { float f, g; std::memcpy(&f, &got[e * 4], 4); std::memcpy(&g, &want[e * 4], 4); a = f; b = g; }
    else if (t == DType::kF64) { std::memcpy(&a, &got[e * 8], 8); std::memcpy(&b, &want[e * 8], 8); }
    else if (t == DType::kF16 || t == DType::kBF16) {
      uint16_t p, q;
      std::memcpy(&p, &got[e * 2], 2);
      std::memcpy(&q, &want[e * 2], 2);
      a = t == DType::kF16 ? RefHalfToFloat(p) : RefBf16ToFloat(p);
      b = t == DType::kF16 ? RefHalfToFloat(q) : RefBf16ToFloat(q);
    } else if (std::memcmp(&got[e * w], &want[e * w], w) != 0) { ++far; continue; }
    if (a != a && b != b) continue;
    if (!(std::abs(a - b) <= 1e-2 * (std::abs(b) + 1e-3))) ++far;
  }
  return far;
}

// One rank's call of `c` over its buffers (din/dout/out_dims per operand): the request the engine
// gets. `ops` holds the operands and must outlive the returned args, as must every span argument.
inline CollectiveArgs RankArgs(const Case& c, std::span<const int64_t> groups, std::span<const int64_t> sizes,
                               int64_t device, int64_t run, std::string_view label, std::span<const int64_t> pairs,
                               const std::vector<void*>& din, const std::vector<void*>& dout,
                               const std::vector<std::vector<int64_t>>& out_dims, std::vector<OperandRequest>* ops) {
  const size_t k = c.dims.size();
  ops->assign(k, OperandRequest{});
  for (size_t i = 0; i < k; ++i) {
    OperandRequest& o = (*ops)[i];
    o.in_dtype = o.out_dtype = c.dtypes[i];
    o.in_dims = c.dims[i];
    o.out_dims = c.kind == Kind::kAllReduce || c.kind == Kind::kPpermute || c.kind == Kind::kAllToAll
                     ? std::span<const int64_t>(c.dims[i])
                     : std::span<const int64_t>(out_dims[i]);
    o.in = din[i];
    o.out = dout[i];
  }
  CollectiveArgs a;
  a.groups = groups;
  a.group_sizes = sizes;
  a.device = device;
  a.run_id = run;
  a.label = label;
  a.request.kind = c.kind;
  a.request.reduction = Name(c.op);
  a.request.axis = c.axis;
  a.request.pairs = pairs;
  a.request.operands = *ops;
  a.links_version = c.links_version;
  return a;
}

// Runs `c` on every rank (a thread each) and returns each rank's status; outputs in *out.
// Inputs are RandomData seeded by (rank, operand, size), so Inputs() regenerates them for the check.
// `skip`: a rank that does not call (deadline tests). `inputs` ([rank][operand]): given inputs
// instead of the random ones (special values), which Inputs() then does not regenerate.
inline std::vector<Status> RunRanks(gpu::GpuEngine& engine, Harness& h, const Case& c,
                                    std::vector<std::vector<std::vector<uint8_t>>>* out, int skip = -1,
                                    const std::vector<std::vector<std::vector<uint8_t>>>* inputs = nullptr,
                                    const std::function<void(int)>& before_call = {}) {
  const int n = h.ranks;
  std::vector<int64_t> groups, sizes{n};
  for (int r = 0; r < n; ++r) groups.push_back(r);
  std::vector<int64_t> flat;
  for (const auto& [s, d] : c.pairs) flat.insert(flat.end(), {s, d});
  const size_t k = c.dims.size();
  std::vector<std::vector<void*>> din(n, std::vector<void*>(k)), dout(n, std::vector<void*>(k));
  std::vector<std::vector<std::vector<int64_t>>> out_dims(n, std::vector<std::vector<int64_t>>(k));
  out->assign(n, std::vector<std::vector<uint8_t>>(k));
  const int64_t run = NextRunId();
  std::vector<Status> status(n);
  std::vector<std::thread> threads;
  // Buffers and inputs first (the test's own synchronous copies), then the ranks' calls together.
  std::vector<std::vector<std::vector<uint8_t>>> xs(n, std::vector<std::vector<uint8_t>>(k));
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < k; ++i) {
      const size_t w = ByteWidth(c.dtypes[i]), in = Count(c.dims[i]), outc = OutCount(c, i, n);
      xs[r][i] = inputs ? (*inputs)[r][i] : RandomData(c.dtypes[i], in, static_cast<uint32_t>(1000 * r + 17 * i + in), false);
      din[r][i] = h.alloc(h.device_of(r), in * w);
      h.upload(din[r][i], xs[r][i].data(), in * w);
      dout[r][i] = c.in_place ? din[r][i] : h.alloc(h.device_of(r), outc * w);
      if (!c.in_place) {
        std::vector<uint8_t> garbage(outc * w, 0xCD);
        h.upload(dout[r][i], garbage.data(), outc * w);
      }
      out_dims[r][i] = {static_cast<int64_t>(outc)};
    }
  for (int r = 0; r < n; ++r)
    if (r != skip) threads.emplace_back([&, r] {
      std::vector<OperandRequest> ops;
      const CollectiveArgs a = RankArgs(c, groups, sizes, r, run, "test", flat, din[r], dout[r], out_dims[r], &ops);
      if (before_call) before_call(r);  // a rank held back (the shutdown's refusal)
      status[r] = engine.Run(a, h.streams[r]);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) h.sync(h.streams[r]);
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < k; ++i) {
      const size_t bytes = OutCount(c, i, n) * ByteWidth(c.dtypes[i]);
      (*out)[r][i].resize(bytes);
      h.download((*out)[r][i].data(), dout[r][i], bytes);
    }
  if (h.free)
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < k; ++i) {
        h.free(din[r][i]);
        if (dout[r][i] != din[r][i]) h.free(dout[r][i]);
      }
  return status;
}

inline std::vector<std::vector<uint8_t>> Inputs(const Case& c, size_t i, int n) {
  std::vector<std::vector<uint8_t>> xs(n);
  for (int r = 0; r < n; ++r)
    xs[r] = RandomData(c.dtypes[i], Count(c.dims[i]), static_cast<uint32_t>(1000 * r + 17 * i + Count(c.dims[i])), false);
  return xs;
}

// Runs `c` and checks every rank's results; `what` names the configuration in failures.
inline void CheckCase(gpu::GpuEngine& engine, Harness& h, const Case& c, const std::string& what, bool approx = false) {
  std::vector<std::vector<std::vector<uint8_t>>> out;
  const std::vector<Status> status = RunRanks(engine, h, c, &out);
  const int n = h.ranks;
  for (int r = 0; r < n; ++r)
    if (!status[r].ok()) {
      Expect(false, what + ": " + c.Name() + ": rank " + std::to_string(r) + ": " + status[r].message());
      return;
    }
  for (size_t i = 0; i < c.dims.size(); ++i) {
    const auto xs = Inputs(c, i, n);
    for (int r = 0; r < n; ++r) {
      const auto want = Expected(c, i, n, r, xs);
      const bool floaty = c.dtypes[i] == DType::kF16 || c.dtypes[i] == DType::kBF16 || c.dtypes[i] == DType::kF32 ||
                          c.dtypes[i] == DType::kF64;
      const size_t wrong = approx && floaty && Reduces(c.kind) ? CountFar(c.dtypes[i], out[r][i], want)
                                                              : CountWrong(c.dtypes[i], out[r][i], want);
      Expect(wrong == 0, what + ": " + c.Name() + ": operand " + std::to_string(i) + " rank " + std::to_string(r) +
                             ": " + std::to_string(wrong) + " wrong elements");
    }
  }
}

// Every kind over shapes that exercise the layouts: one operand and several, outer == 1 and > 1,
// sizes below, at and above a chunk, odd sizes.
inline std::vector<Case> StandardCases(int n, size_t big) {
  std::vector<Case> cases;
  const int64_t N = n;
  const std::vector<DType> all = {DType::kPred, DType::kS8,  DType::kS16, DType::kS32, DType::kS64,
                                  DType::kU8,   DType::kU16, DType::kU32, DType::kU64, DType::kF16,
                                  DType::kBF16, DType::kF32, DType::kF64, DType::kC64, DType::kC128};
  for (DType t : all) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMax, ReduceOp::kMin}) {
      if ((t == DType::kC64 || t == DType::kC128) && (op == ReduceOp::kMax || op == ReduceOp::kMin)) continue;
      cases.push_back({Kind::kAllReduce, op, {t}, {{1013}}, 0, {}, false});
      cases.push_back({Kind::kReduceScatter, op, {t}, {{3, N * 5, 7}}, 1, {}, false});
    }
    cases.push_back({Kind::kAllGather, ReduceOp::kSum, {t}, {{3, 5, 7}}, 1, {}, false});
    cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {t}, {{3, N * 2, 5}}, 1, {}, false});
  }
  const int64_t B = static_cast<int64_t>(big);
  // Large, several chunks, outer == 1 and > 1.
  cases.push_back({Kind::kAllReduce, ReduceOp::kSum, {DType::kF32}, {{B + 77}}, 0, {}, false});
  cases.push_back({Kind::kAllReduce, ReduceOp::kSum, {DType::kBF16}, {{B + 5}}, 0, {}, true});
  cases.push_back({Kind::kAllReduce, ReduceOp::kMax, {DType::kS16}, {{B / 2 + 3}}, 0, {}, false});
  cases.push_back({Kind::kAllGather, ReduceOp::kSum, {DType::kF32}, {{B / N + 3}}, 0, {}, false});
  cases.push_back({Kind::kAllGather, ReduceOp::kSum, {DType::kF16}, {{9, B / N / 9 + 1}}, 1, {}, false});
  cases.push_back({Kind::kReduceScatter, ReduceOp::kSum, {DType::kF32}, {{N * (B / N + 1)}}, 0, {}, false});
  cases.push_back({Kind::kReduceScatter, ReduceOp::kProd, {DType::kC64}, {{5, N * (B / N / 5 + 1)}}, 1, {}, false});
  cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {DType::kF32}, {{N * (B / N + 1)}}, 0, {}, false});
  cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {DType::kS64}, {{7, N * (B / N / 7 + 1)}}, 1, {}, false});
  // ppermute: a ring, a partial permutation with a fixed point and ranks without a source.
  std::vector<std::pair<int64_t, int64_t>> ring, partial;
  for (int r = 0; r < n; ++r) ring.push_back({r, (r + 1) % n});
  partial.push_back({0, 0});
  if (n > 2) partial.push_back({1, n - 1});
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, {DType::kF32}, {{B + 3}}, 0, ring, false});
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, {DType::kU8}, {{1001}}, 0, partial, false});
  // In place (XLA aliases the result to the operand, as the lowering asks): every rank overwrites
  // its input with its peers' inputs, so nothing may be overwritten before the peers read it.
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, {DType::kF32}, {{B + 3}}, 0, ring, true});
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, {DType::kU8}, {{B + 1001}}, 0, partial, true});
  cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {DType::kF32}, {{N * (B / N + 1)}}, 0, {}, true});
  cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {DType::kS64}, {{7, N * (B / N / 7 + 1)}}, 1, {}, true});
  cases.push_back({Kind::kAllReduce, ReduceOp::kSum, {DType::kF32}, {{B + 77}}, 0, {}, true});
  // Several operands of mixed dtypes and shapes in one call.
  cases.push_back({Kind::kAllReduce, ReduceOp::kSum, {DType::kF32, DType::kBF16, DType::kS32}, {{B / 3}, {7}, {1}}, 0, {}, false});
  cases.push_back({Kind::kAllGather, ReduceOp::kSum, {DType::kF32, DType::kS8}, {{4, B / 8}, {13}}, 1, {}, false});
  cases.push_back({Kind::kReduceScatter, ReduceOp::kSum, {DType::kF64, DType::kU16}, {{2, N * 9}, {2, N * 3}}, 1, {}, false});
  cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {DType::kF32, DType::kU8}, {{2, N * 64}, {3, N, 11}}, 1, {}, false});
  return cases;
}

// Stage 1 and stage 2 on the device, as a default configuration runs them (autotune on): the group's
// first all_reduce of 1 MiB runs stage 1's phases on the ranks' streams, later calls read their
// event times once complete, the fits are installed, and stage 2 plans from them. Every call's
// result is checked meanwhile. Returns the fitted model (empty on failure) for the caller to print.
inline std::optional<plan::CostModel> CheckStageOne(gpu::GpuEngine& engine, Harness& h, const std::string& links,
                                                    const std::string& what, bool approx, int* calls_out) {
  Status st = engine.ConfigureLinks(links);
  Expect(st.ok(), what + ": configure " + links + ": " + st.message());
  if (!st.ok()) return std::nullopt;
  const uint64_t autotune = AutotuneMinBytes(), tune_max = TuneMaxBytes();
  engine.SetAutotune(256 << 10);
  engine.SetTuneMax(1 << 20);
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {DType::kF32}, {{262144}}, 0, {}, false};  // 1 MiB
  std::vector<int64_t> group;
  for (int r = 0; r < h.ranks; ++r) group.push_back(r);
  int calls = 0;
  const int failed = g_failed;
  while (!engine.GroupModel(group).value_or(plan::CostModel()).Has(Kind::kAllReduce) && calls < 60 && g_failed == failed)
    CheckCase(engine, h, c, what + ": call " + std::to_string(++calls), approx);
  const std::optional<plan::CostModel> model = engine.GroupModel(group);
  const bool fitted = model && model->Has(Kind::kAllReduce) && model->ProfiledBytes(Kind::kAllReduce) > 0 &&
                      model->MeasuredThreshold(Kind::kAllReduce).has_value();
  Expect(fitted, what + ": stage 1's fits installed (after " + std::to_string(calls) + " calls)");
  if (fitted)
    for (const plan::AlphaBeta& f : model->Fits(Kind::kAllReduce))
      Expect(f.alpha >= 0 && f.beta > 0, what + ": a fit with a positive time per byte");
  // Stage 2 from the fits: more calls, each right, and no plan left waiting for a profile.
  for (int i = 0; i < 8; ++i) CheckCase(engine, h, c, what + ": after stage 1, call " + std::to_string(i + 1), approx);
  bool profiling = false;
  for (const auto& p : engine.SnapshotPlans()) profiling = profiling || p.plan.mode == plan::PlanMode::kProfile;
  Expect(!profiling, what + ": no plan waits for a profile any more");
  engine.SetAutotune(autotune);
  engine.SetTuneMax(tune_max);
  if (calls_out) *calls_out = calls;
  return fitted ? model : std::nullopt;
}

// Pins `shares` for the bucket of every case (so the ranges of the split are exactly these).
inline void PinShares(gpu::GpuEngine& engine, const Case& c, int n, const std::vector<double>& shares) {
  (void)engine.SetShares(c.kind, plan::BucketOf(CaseBytes(c, n)), shares, /*pinned=*/true);
}

}  // namespace flexlink::testing
