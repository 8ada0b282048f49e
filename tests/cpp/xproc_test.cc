// Cross-process engine tests (xla_ffi/xproc/, docs/xproc.md): the parent forks P processes, one of
// them creates the group's segment and passes its name on, the others attach; then every process
// runs its ranks (one thread each) through flexlink::RunCollective, the FFI handlers' entry point,
// and checks the results against references computed here from every rank's (regenerated) input.
// Children report their counts through a pipe and their exit status; the parent never creates a
// thread (fork stays safe), reaps every child, and an alarm() backstops any hang.
//
//   xproc_test            the tests
//   xproc_test --bench    median time per call, AllReduce f32 and AllGather, 2 and 4 processes
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <sys/random.h>

#include <map>
#include <set>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/engine.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/faults.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/link_set.h"
#include "xla_ffi/core/profile_calls.h"
#include "xla_ffi/links/tcp.h"
#include "xla_ffi/links/tcp_xproc.h"
#include "xla_ffi/plan/cost_model.h"
#include "xla_ffi/plan/tuning_cache.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/core/stragglers.h"
#include "xla_ffi/xproc/process_group.h"
#include "xla_ffi/xproc/registry.h"
#include "xla_ffi/xproc/segment.h"
#include "xla_ffi/xproc/xproc_executor.h"
#include "tests/cpp/check.h"
#include "tests/cpp/reference.h"

using namespace flexlink;
using namespace flexlink::testing;

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kFirstDevice = 100;  // device ids differ from ranks, so messages must map them
constexpr size_t kNameBytes = 64;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// ---- pipes with deadlines -------------------------------------------------------------------

bool ReadFull(int fd, void* buf, size_t n, int timeout_ms) {
  char* p = static_cast<char*>(buf);
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (n > 0) {
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    if (left <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    if (poll(&pfd, 1, left) <= 0) continue;
    const ssize_t r = read(fd, p, n);
    if (r <= 0) return false;  // EOF: the writer died
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool WriteFull(int fd, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    const ssize_t r = write(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// ---- one process's view -------------------------------------------------------------------

struct Proc {
  int index = 0, procs = 0, per_proc = 0;
  std::vector<int64_t> devices;  // the whole group, rank order
  std::vector<int> ranks;        // this process's ranks
  std::string name;
  std::string token;  // what the parent compares across processes (e.g. an error message)
  int n() const { return static_cast<int>(devices.size()); }
};

struct Operand {
  DType dtype = DType::kF32;
  std::vector<int64_t> in_dims;
};

struct Case {
  Kind kind = Kind::kAllReduce;
  ReduceOp op = ReduceOp::kSum;
  std::vector<Operand> operands;
  int64_t axis = 0;
  std::vector<std::pair<int64_t, int64_t>> pairs;
  bool in_place = false;
  uint32_t seed = 1;
};

size_t Prod(const std::vector<int64_t>& d) {
  size_t p = 1;
  for (auto x : d) p *= static_cast<size_t>(x);
  return p;
}

std::vector<int64_t> OutDims(const Case& c, const Operand& o, int n) {
  std::vector<int64_t> d = o.in_dims;
  if (c.kind == Kind::kAllGather) d[c.axis] *= n;
  if (c.kind == Kind::kReduceScatter) d[c.axis] /= n;
  return d;
}

std::string Describe(const Case& c, int n) {
  std::string s = std::string(Name(c.kind));
  if (Reduces(c.kind)) s += "(" + std::string(Name(c.op)) + ")";
  for (const auto& o : c.operands) {
    s += " " + std::string(Name(o.dtype)) + "[";
    for (auto x : o.in_dims) s += std::to_string(x) + ",";
    s += "]";
  }
  s += " axis " + std::to_string(c.axis) + " n " + std::to_string(n);
  if (c.in_place) s += " in place";
  for (const auto& [a, b] : c.pairs) s += " " + std::to_string(a) + "->" + std::to_string(b);
  return s;
}

std::vector<uint8_t> Input(const Case& c, size_t operand, int rank) {
  const Operand& o = c.operands[operand];
  return RandomData(o.dtype, Prod(o.in_dims), c.seed * 7919u + static_cast<uint32_t>(operand * 131 + rank), false);
}

// The expected output of `rank` for one operand, from every rank's input.
std::vector<uint8_t> Reference(const Case& c, size_t operand, int n, int rank) {
  const Operand& op = c.operands[operand];
  std::vector<std::vector<uint8_t>> in;
  for (int r = 0; r < n; ++r) in.push_back(Input(c, operand, r));
  std::vector<const uint8_t*> srcs;
  for (auto& v : in) srcs.push_back(v.data());
  const size_t w = ByteWidth(op.dtype), count = Prod(op.in_dims);
  size_t outer = 1;
  for (int64_t i = 0; i < c.axis; ++i) outer *= static_cast<size_t>(op.in_dims[i]);
  std::vector<uint8_t> out;
  switch (c.kind) {
    case Kind::kPpermute: return RefPpermute(c.pairs, srcs, count * w, rank);
    case Kind::kAllToAll: return RefAllToAll(op.in_dims, c.axis, srcs, w, rank);
    case Kind::kAllReduce:
      out.resize(count * w);
      for (size_t i = 0; i < count; ++i) RefReduce(op.dtype, c.op, srcs, i, &out[i * w]);
      return out;
    case Kind::kAllGather: {
      const size_t inner = count / outer;
      out.resize(count * n * w);
      for (size_t o = 0; o < outer; ++o)
        for (int k = 0; k < n; ++k)
          std::memcpy(&out[((o * n + k) * inner) * w], srcs[k] + o * inner * w, inner * w);
      return out;
    }
    case Kind::kReduceScatter: {
      const size_t out_count = count / n, inner = out_count / outer;
      out.resize(out_count * w);
      for (size_t o = 0; o < outer; ++o)
        for (size_t i = 0; i < inner; ++i)
          RefReduce(op.dtype, c.op, srcs, (o * n + rank) * inner + i, &out[(o * inner + i) * w]);
      return out;
    }
  }
  return out;
}

// One rank's call of `c` on operand buffers `ins` -> `outs` (outs unused where in place).
Status CallOn(const Proc& p, int rank, const Case& c, const std::vector<void*>& ins, const std::vector<void*>& outs) {
  const int n = p.n();
  std::vector<std::vector<int64_t>> out_dims;
  std::vector<OperandRequest> ops(c.operands.size());
  for (size_t i = 0; i < c.operands.size(); ++i) out_dims.push_back(OutDims(c, c.operands[i], n));
  for (size_t i = 0; i < c.operands.size(); ++i) {
    OperandRequest& o = ops[i];
    o.in_dtype = o.out_dtype = c.operands[i].dtype;
    o.in_dims = c.operands[i].in_dims;
    o.out_dims = out_dims[i];
    o.in = ins[i];
    o.out = c.in_place ? ins[i] : outs[i];
  }
  std::vector<int64_t> flat_pairs;
  for (const auto& [s, d] : c.pairs) flat_pairs.insert(flat_pairs.end(), {s, d});
  const std::vector<int64_t> sizes = {n};
  CollectiveArgs a;
  a.groups = p.devices;
  a.group_sizes = sizes;
  a.device = p.devices[rank];
  a.run_id = 7;
  a.label = "xproc_test";
  a.request.kind = c.kind;
  a.request.reduction = Name(c.op);
  a.request.axis = c.axis;
  a.request.pairs = flat_pairs;
  a.request.operands = ops;
  return RunCollective(a);
}

Status Call(const Proc& p, int rank, const Case& c, std::vector<std::vector<uint8_t>>& ins,
            std::vector<std::vector<uint8_t>>& outs) {
  std::vector<void*> in, out;
  for (auto& v : ins) in.push_back(v.data());
  for (auto& v : outs) out.push_back(v.data());
  return CallOn(p, rank, c, in, out);
}

// Runs f(rank) for this process's ranks, one thread each.
void OnRanks(const Proc& p, const std::function<void(int)>& f) {
  std::vector<std::thread> threads;
  for (int r : p.ranks) threads.emplace_back([&, r] { f(r); });
  for (auto& t : threads) t.join();
}

// Runs `c` on every local rank and checks each output against the reference. Returns the outputs.
std::vector<std::vector<std::vector<uint8_t>>> CheckCase(const Proc& p, const Case& c) {
  const int n = p.n();
  std::vector<std::vector<std::vector<uint8_t>>> results(n);
  std::vector<Status> st(n);
  std::vector<std::vector<std::vector<uint8_t>>> ins(n), outs(n);
  for (int r : p.ranks)
    for (size_t i = 0; i < c.operands.size(); ++i) {
      ins[r].push_back(Input(c, i, r));
      outs[r].emplace_back(Prod(OutDims(c, c.operands[i], n)) * ByteWidth(c.operands[i].dtype), 0xAB);
    }
  OnRanks(p, [&](int r) { st[r] = Call(p, r, c, ins[r], outs[r]); });
  for (int r : p.ranks) {
    std::string why;
    for (size_t i = 0; i < c.operands.size() && st[r].ok() && why.empty(); ++i) {
      const auto& got = c.in_place ? ins[r][i] : outs[r][i];
      const size_t wrong = CountWrong(c.operands[i].dtype, got, Reference(c, i, n, r));
      if (wrong) why = "operand " + std::to_string(i) + ": " + std::to_string(wrong) + " wrong elements";
    }
    if (!st[r].ok()) why = st[r].message();
    Expect(why.empty(), Describe(c, n) + " rank " + std::to_string(r) + ": " + why);
    results[r] = c.in_place ? ins[r] : outs[r];
  }
  return results;
}

// ---- the cases ------------------------------------------------------------------------------

const DType kDtypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16, DType::kS32,
                         DType::kS8,  DType::kU8,  DType::kPred, DType::kC64};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMax, ReduceOp::kMin};

bool Supported(DType t, ReduceOp op) {
  return !((t == DType::kC64 || t == DType::kC128) && (op == ReduceOp::kMax || op == ReduceOp::kMin));
}

// With a 64 KiB slot, `big` units span several steps for every dtype of 2+ bytes, and odd counts
// leave a partial last step.
std::vector<Case> Cases(int n, bool full) {
  std::vector<Case> cases;
  uint32_t seed = 1;
  const int64_t big = full ? 40001 : 20011;
  for (DType t : kDtypes)
    for (ReduceOp op : kOps) {
      if (!Supported(t, op)) continue;
      cases.push_back({Kind::kAllReduce, op, {{t, {op == ReduceOp::kSum ? big : 1003}}}, 0, {}, false, seed++});
      if (full || op == ReduceOp::kSum)
        cases.push_back({Kind::kReduceScatter, op, {{t, {3, n * 2341}}}, 1, {}, false, seed++});
    }
  for (DType t : kDtypes) {
    cases.push_back({Kind::kAllGather, ReduceOp::kSum, {{t, {3, 7001}}}, 1, {}, false, seed++});
    cases.push_back({Kind::kAllGather, ReduceOp::kSum, {{t, {big}}}, 0, {}, false, seed++});
    cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {{t, {5, n * 1201}}}, 1, {}, false, seed++});
    std::vector<std::pair<int64_t, int64_t>> shift;
    for (int r = 0; r < n; ++r) shift.push_back({r, (r + 1) % n});
    cases.push_back({Kind::kPpermute, ReduceOp::kSum, {{t, {big}}}, 0, shift, false, seed++});
  }
  // Partial permutations: some ranks receive nothing (zeros), some send nothing, one to itself.
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, {{DType::kF32, {30011}}}, 0, {{0, 1}}, false, seed++});
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, {{DType::kS32, {999}}}, 0,
                   n > 2 ? std::vector<std::pair<int64_t, int64_t>>{{1, 0}, {n - 1, n - 1}}
                         : std::vector<std::pair<int64_t, int64_t>>{{1, 1}},
                   false, seed++});
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, {{DType::kF32, {513}}}, 0, {}, false, seed++});
  // In place.
  cases.push_back({Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {50021}}}, 0, {}, true, seed++});
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, {{DType::kF64, {20001}}}, 0, {{0, n - 1}, {n - 1, 0}}, true, seed++});
  cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {{DType::kF32, {3, n * 4001}}}, 1, {}, true, seed++});
  // Multi-part calls: mixed dtypes, tiny and multi-step parts, a zero-size part.
  cases.push_back({Kind::kAllReduce, ReduceOp::kSum,
                   {{DType::kF32, {40001}}, {DType::kBF16, {7}}, {DType::kS32, {1}}, {DType::kF64, {0}}, {DType::kU8, {70001}}},
                   0, {}, false, seed++});
  cases.push_back({Kind::kAllReduce, ReduceOp::kMax, {{DType::kF16, {5, 3}}, {DType::kS8, {12345}}}, 0, {}, false, seed++});
  cases.push_back({Kind::kAllGather, ReduceOp::kSum, {{DType::kF32, {2, 9001}}, {DType::kPred, {1, 13}}, {DType::kC64, {4, 3}}},
                   1, {}, false, seed++});
  cases.push_back({Kind::kReduceScatter, ReduceOp::kSum, {{DType::kF32, {2, n * 5003}}, {DType::kS32, {1, n * 3}}}, 1, {}, false, seed++});
  cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {{DType::kBF16, {n * 2, 3001}}, {DType::kU8, {n}}}, 0, {}, false, seed++});
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, {{DType::kF32, {25001}}, {DType::kBF16, {3}}}, 0, {{0, 1}, {1, 0}}, false, seed++});
  return cases;
}

// ---- scenarios run in the children ------------------------------------------------------------

void Correctness(Proc& p, bool full) {
  for (const Case& c : Cases(p.n(), full)) CheckCase(p, c);
  // Bitwise determinism: the same call again gives the same bits (float sums in fixed rank order).
  const Case det{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {100003}}}, 0, {}, false, 99};
  const auto a = CheckCase(p, det), b = CheckCase(p, det);
  for (int r : p.ranks) Expect(a[r] == b[r], "determinism: rank " + std::to_string(r) + " differs between runs");
  const auto groups = xproc::ProcessGroups();
  Expect(groups.size() == 1 && groups[0].slot_bytes == (64 << 10) && !groups[0].broken &&
             groups[0].calls == Cases(p.n(), full).size() + 2,
         "xproc groups(): one group, 64 KiB slots, every call counted, not broken: " +
             (groups.empty() ? std::string("none")
                             : std::to_string(groups.size()) + " groups, slot " + std::to_string(groups[0].slot_bytes) +
                                   ", calls " + std::to_string(groups[0].calls) + ", broken " + groups[0].broken.value_or("no")));
}

// What the group's ranks agreed for direct `kind` (all_gather or all_reduce; ProcessGroup::AgreeDirect),
// as this process reports it: `from` bytes per rank (UINT64_MAX: never, with `reason` in the refusal).
void DirectAgreed(Kind kind, uint64_t from, const std::string& reason = "") {
  const auto groups = xproc::ProcessGroups();
  const bool reduce = kind == Kind::kAllReduce;
  const std::string name = std::string("direct ") + (reduce ? "all_reduce" : "all_gather");
  const auto agreed = groups.empty() ? std::nullopt : reduce ? groups[0].direct_reduce_from : groups[0].direct_from;
  const std::string refusal = groups.empty() ? "" : reduce ? groups[0].direct_reduce_refusal : groups[0].direct_refusal;
  Expect(groups.size() == 1 && agreed == from,
         name + " agreed from " + std::to_string(from) + " bytes: " +
             (!agreed ? std::string("not agreed") : std::to_string(*agreed) + " (" + refusal + ")"));
  if (from == UINT64_MAX)
    Expect(refusal.find(reason) != std::string::npos, name + " off: the reason says '" + reason + "': " + refusal);
  else
    Expect(refusal.empty(), name + " on: no reason given: " + refusal);
}

// Every arrival publishes its thread's CPU in the segment, which a waiting peer reads to decide
// whether to poll for it (ProcessGroup::WaitArrived): unknown (-1) before a rank's first arrival, a
// CPU of this machine after it, for this process's ranks and, after a call, the other processes'.
void ArrivalCpus(Proc& p) {
  xproc::ProcessGroup* g = xproc::FindProcessGroup(p.devices);
  Expect(g != nullptr, "the group is registered");
  if (!g) return;
  Expect(g->away_poll() == xproc::AwayPoll() && (SpinMicros() != kAutoSpin || xproc::AwayPoll() == xproc::kAwayPoll),
         "the group polls for AwayPoll() (kAwayPoll, 100 us, unless FLEXLINK_SPIN_US is set): " +
             std::to_string(g->away_poll().count()) + " ns");
  for (int r : p.ranks)  // a peer of another process may have arrived already
    Expect(g->arrival_cpu(r) == -1, "rank " + std::to_string(r) + "'s CPU unknown before its first arrival: " +
                                        std::to_string(g->arrival_cpu(r)));
  CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {1000}}}, 0, {}, false, 21});
  const long cpus = sysconf(_SC_NPROCESSORS_CONF);
  for (int r = 0; r < p.n(); ++r)
    Expect(g->arrival_cpu(r) >= 0 && g->arrival_cpu(r) < cpus,
           "rank " + std::to_string(r) + " arrived from CPU " + std::to_string(g->arrival_cpu(r)) + " of " +
               std::to_string(cpus));
}

// FLEXLINK_SPIN_US decides the away-poll's length where it is set; 0 turns it off (sleep after the
// yields, the wait before session 40).
void AwayPollSetting() {
  const int64_t was = SpinMicros();
  SetSpinMicros(kAutoSpin);
  Expect(xproc::AwayPoll() == std::chrono::microseconds(100), "default away-poll: 100 us");
  SetSpinMicros(0);
  Expect(xproc::AwayPoll().count() == 0, "FLEXLINK_SPIN_US=0: no away-poll");
  SetSpinMicros(250);
  Expect(xproc::AwayPoll() == std::chrono::microseconds(250), "FLEXLINK_SPIN_US=250: 250 us");
  SetSpinMicros(was);
}

// FLEXLINK_XPROC_SLOT_BYTES (SetXprocSlotBytes) decides a group's slot where it is set; unset (0),
// each kind of group takes its own default: CPU groups kCpuSlotBytes (ChooseSlotBytes with request
// 0), GPU groups' pcie staging what they pass to XprocSlotBytesOr. The clamps apply either way.
void SlotSetting() {
  const size_t was = XprocSlotBytes();
  size_t slot = 0;
  SetXprocSlotBytes(0);
  Expect(xproc::ChooseSlotBytes(2, 0, &slot).ok() && slot == xproc::kCpuSlotBytes && slot == (size_t{1} << 20),
         "unset: a CPU group's slot is 1 MiB, got " + std::to_string(slot));
  Expect(XprocSlotBytesOr(size_t{4} << 20) == (size_t{4} << 20), "unset: the caller's default");
  SetXprocSlotBytes(size_t{256} << 10);
  Expect(xproc::ChooseSlotBytes(2, 0, &slot).ok() && slot == (size_t{256} << 10), "set to 256K: 256 KiB");
  Expect(XprocSlotBytesOr(size_t{4} << 20) == (size_t{256} << 10), "set to 256K: the setting, not the default");
  Expect(xproc::ChooseSlotBytes(2, size_t{128} << 10, &slot).ok() && slot == (size_t{128} << 10),
         "a group's own request wins over the setting");
  SetXprocSlotBytes(1000);
  Expect(xproc::ChooseSlotBytes(2, 0, &slot).ok() && slot == (size_t{64} << 10), "set below 64 KiB: clamped to 64 KiB");
  SetXprocSlotBytes(was);
}

void Mismatch(Proc& p) {
  const int n = p.n();
  std::vector<Status> st(n);
  std::vector<std::vector<uint8_t>> outs(n);
  OnRanks(p, [&](int r) {
    Case c{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {r == 1 ? 100 : 99}}}, 0, {}, false, 5};
    std::vector<std::vector<uint8_t>> in = {Input(c, 0, r)}, out = {std::vector<uint8_t>(100 * 4, 0xAB)};
    st[r] = Call(p, r, c, in, out);
    outs[r] = out[0];
  });
  for (int r : p.ranks) {
    const std::string& m = st[r].message();
    Expect(st[r].code() == StatusCode::kInvalidArgument && m.find("ranks disagree") != std::string::npos &&
               m.find("float32[99 per rank]") != std::string::npos && m.find("float32[100 per rank]") != std::string::npos &&
               m.find("rank 1 (device 101)") != std::string::npos,
           "mismatch names both calls: " + m);
    Expect(std::all_of(outs[r].begin(), outs[r].end(), [](uint8_t b) { return b == 0xAB; }),
           "mismatch: rank " + std::to_string(r) + "'s output untouched");
    if (r == p.ranks[0]) p.token = m;
    Expect(m == p.token, "mismatch: the same message on every rank of a process");
  }
  // The group stays usable: every rank failed at the same step.
  CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {70001}}}, 0, {}, false, 6});
}

// Rank `victim`'s process dies: by _exit before the call, or SIGKILL while it waits inside the call.
void PeerDies(Proc& p, int victim, bool sigkill) {
  CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {1000}}}, 0, {}, false, 11});
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {300000}}}, 0, {}, false, 12};
  if (p.index == victim) {
    if (!sigkill) _exit(42);
    std::thread killer([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      raise(SIGKILL);
    });
    std::vector<std::vector<uint8_t>> in = {Input(c, 0, p.ranks[0])}, out = {in[0]};
    (void)Call(p, p.ranks[0], c, in, out);
    killer.join();
    _exit(43);  // not reached: the call cannot complete without rank 0, which comes later
  }
  if (sigkill && p.index == 0) std::this_thread::sleep_for(std::chrono::milliseconds(800));
  const int n = p.n();
  std::vector<Status> st(n);
  std::vector<double> secs(n);
  OnRanks(p, [&](int r) {
    std::vector<std::vector<uint8_t>> in = {Input(c, 0, r)}, out = {in[0]};
    const auto t = Clock::now();
    st[r] = Call(p, r, c, in, out);
    secs[r] = Since(t);
  });
  const std::string dead = "rank " + std::to_string(victim) + " (device " + std::to_string(kFirstDevice + victim) + ", pid ";
  for (int r : p.ranks) {
    const std::string& m = st[r].message();
    Expect(!st[r].ok() && m.find(dead) != std::string::npos && m.find(" exited") != std::string::npos &&
               m.find("xproc_test") != std::string::npos && m.find("on group [100, ") != std::string::npos,
           "dead peer named: " + m);
    Expect(secs[r] < TimeoutSeconds() / 2, "dead peer found in " + std::to_string(secs[r]) + " s, well before the deadline");
  }
  // Later calls fail at once with the original reason.
  OnRanks(p, [&](int r) {
    std::vector<std::vector<uint8_t>> in = {Input(c, 0, r)}, out = {in[0]};
    const auto t = Clock::now();
    st[r] = Call(p, r, c, in, out);
    secs[r] = Since(t);
  });
  for (int r : p.ranks)
    Expect(st[r].code() == StatusCode::kFailedPrecondition && st[r].message().find("broken") != std::string::npos &&
               st[r].message().find(dead) != std::string::npos && secs[r] < 0.5,
           "later call fails at once: " + st[r].message());
}

// Rank 1's process never calls: the others time out naming it; it then finds the group broken.
void Deadline(Proc& p) {
  const Case c{Kind::kAllGather, ReduceOp::kSum, {{DType::kF32, {4096}}}, 0, {}, false, 21};
  const int n = p.n();
  std::vector<Status> st(n);
  std::vector<double> secs(n);
  if (p.index == 1) std::this_thread::sleep_for(std::chrono::duration<double>(TimeoutSeconds() + 1.0));
  OnRanks(p, [&](int r) {
    std::vector<std::vector<uint8_t>> in = {Input(c, 0, r)}, out = {std::vector<uint8_t>(in[0].size() * n)};
    const auto t = Clock::now();
    st[r] = Call(p, r, c, in, out);
    secs[r] = Since(t);
  });
  for (int r : p.ranks) {
    const std::string& m = st[r].message();
    if (p.index == 1) {
      Expect(st[r].code() == StatusCode::kFailedPrecondition && m.find("broken") != std::string::npos &&
                 m.find("timed out") != std::string::npos && secs[r] < 0.5,
             "the late rank finds the group broken at once: " + m);
    } else {
      // The first local rank to time out reports the deadline; a second one of the same process may
      // see that report first (the abort word) and fail with it.
      const std::string missing = "waiting for rank " + std::to_string(p.per_proc) + " (device " +
                                  std::to_string(kFirstDevice + p.per_proc) + ", pid ";
      Expect((st[r].code() == StatusCode::kDeadlineExceeded ||
              (st[r].code() == StatusCode::kInternal && m.find("reported") != std::string::npos)) &&
                 m.find("timed out after") != std::string::npos && m.find(missing) != std::string::npos &&
                 m.find("all_gather float32[4096 per rank") != std::string::npos &&
                 secs[r] > TimeoutSeconds() * 0.9 && secs[r] < TimeoutSeconds() + 1.0,
             "deadline names the missing rank: " + m);
    }
  }
}


// ---- several links across processes (xproc/xproc_executor.h) ---------------------------------

uint64_t Fnv(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

uint64_t LinkBytes(const std::string& name) {
  for (const auto& l : SnapshotLinkStats())
    if (l.name == name) return l.bytes;
  return 0;
}

// Every case on the segment + tcp (stage 2 from equal shares: both links carry bytes), against the
// reference, then the same cases on the segment alone: bit for bit the same.
void MultiLinkCorrectness(Proc& p) {
  Expect(ConfigureLinks("shm;tcp").ok(), "configure shm;tcp");
  SetAutotune(0);  // no stage 1: every call split from equal shares, so that both links carry bytes
  xproc::ProcessGroup* g = xproc::FindProcessGroup(p.devices);
  Expect(g != nullptr, "the group is registered");
  if (!g) return;
  const xproc::XprocLinks links = xproc::XprocLinksOf(g);
  Expect(links.links == std::vector<std::string>{"shm", "tcp"} && links.left_out.empty(),
         "the group's links are shm and tcp");
  const uint64_t shm0 = LinkBytes("shm"), tcp0 = LinkBytes("tcp");
  const std::vector<Case> cases = Cases(p.n(), false);
  std::vector<std::vector<std::vector<std::vector<uint8_t>>>> split;
  for (const Case& c : cases) split.push_back(CheckCase(p, c));
  if (p.index == 0) {  // the leader's process records the links' calls
    Expect(LinkBytes("shm") > shm0 && LinkBytes("tcp") > tcp0,
           "both links carried bytes: shm +" + std::to_string(LinkBytes("shm") - shm0) + ", tcp +" +
               std::to_string(LinkBytes("tcp") - tcp0));
    bool found = false;
    for (const auto& snap : SnapshotPlans())
      found |= snap.group == p.devices && snap.links == std::vector<std::string>{"shm", "tcp"};
    Expect(found, "SnapshotPlans shows the cross-process group's plans");
  }
  Expect(ConfigureLinks("shm").ok(), "configure shm");
  for (size_t k = 0; k < cases.size(); ++k) {
    const auto alone = CheckCase(p, cases[k]);
    for (int r : p.ranks)
      Expect(alone[r] == split[k][r], Describe(cases[k], p.n()) + " rank " + std::to_string(r) +
                                          ": split across shm+tcp is bitwise the segment alone's");
  }
}

// Pinned 0.7/0.3 through the leader's balancer (SetShares), and a tcp-kind link that is not
// connected plus an emulated link: both left out, with reasons.
void MultiLinkPinned(Proc& p) {
  Expect(ConfigureLinks("shm;tcp").ok(), "configure shm;tcp");
  const int64_t count = 1 << 20;  // 4 MiB f32
  Expect(SetShares(Kind::kAllReduce, count * 4, {0.7, 0.3}, true).ok(), "set_shares 0.7/0.3 pinned");
  SetRecordSplits(true);
  (void)TakeSplitRecords();
  const uint64_t shm0 = LinkBytes("shm"), tcp0 = LinkBytes("tcp");
  for (int i = 0; i < 3; ++i)
    CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 31u + i});
  // One more call: the leader reports a call's times after the next call's arrival.
  CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 40});
  const auto recs = TakeSplitRecords();
  SetRecordSplits(false);
  bool all_pinned = !recs.empty();
  for (const auto& r : recs) {
    const double total = static_cast<double>(r.ranges.back().second);
    all_pinned &= r.ranges.size() == 2 && std::abs(r.ranges[0].second / total - 0.7) < 0.01;
  }
  Expect(all_pinned, "every call cut 0.7/0.3 (" + std::to_string(recs.size()) + " records)");
  if (p.index == 0) {
    const uint64_t ds = LinkBytes("shm") - shm0, dt = LinkBytes("tcp") - tcp0;
    Expect(ds > 0 && dt > 0 && std::abs(static_cast<double>(dt) / (ds + dt) - 0.3) < 0.02,
           "link byte counters follow 0.7/0.3: shm +" + std::to_string(ds) + ", tcp +" + std::to_string(dt));
    bool pinned = false;
    for (const auto& snap : SnapshotPlans())
      pinned |= snap.group == p.devices && snap.plan.mode == plan::PlanMode::kPinned;
    Expect(pinned, "SnapshotPlans shows the pinned plan");
  }
  // Links that cannot span processes are left out and say why.
  Expect(ConfigureLinks("shm;tcp;tcp:other;emulated:nic@gbps=10").ok(), "configure four links");
  const xproc::XprocLinks links = xproc::XprocLinksOf(xproc::FindProcessGroup(p.devices));
  Expect(links.links == std::vector<std::string>{"shm", "tcp"} && links.left_out.size() == 2 &&
             links.left_out[0].first == "other" && links.left_out[0].second.find("not connected") != std::string::npos &&
             links.left_out[1].first == "nic" && links.left_out[1].second.find("cannot span processes") != std::string::npos,
         "left out: tcp:other (not connected) and emulated:nic (in-process)");
  CheckCase(p, {Kind::kAllGather, ReduceOp::kSum, {{DType::kBF16, {3, 70001}}}, 1, {}, false, 41});
}

// Stage 2 across processes: ≥30 converging calls; every rank of every process cut the same ranges
// at every call (this process's records hashed into the token the parent compares), and the plan
// moved at least once.
void MultiLinkAgreement(Proc& p) {
  Expect(ConfigureLinks("shm;tcp").ok(), "configure shm;tcp");
  SetAutotune(0);  // stage 2 alone, from equal shares (stage 1 on this host says: never split)
  SetRecordSplits(true);
  (void)TakeSplitRecords();
  const int calls = 40;
  // Checked against the reference at the first and the last call (the reference is slow); in
  // between every call must succeed.
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {int64_t{1} << 20}}}, 0, {}, false, 50};
  CheckCase(p, c);
  std::vector<std::vector<std::vector<uint8_t>>> ins(p.n()), outs(p.n());
  for (int r : p.ranks) ins[r] = {Input(c, 0, r)}, outs[r] = {std::vector<uint8_t>(ins[r][0].size())};
  std::vector<Status> st(p.n());
  for (int i = 0; i < calls - 2; ++i) {
    OnRanks(p, [&](int r) { st[r] = Call(p, r, c, ins[r], outs[r]); });
    for (int r : p.ranks) Expect(st[r].ok(), "converging call: " + st[r].message());
  }
  CheckCase(p, c);
  const auto recs = TakeSplitRecords();
  SetRecordSplits(false);
  std::map<uint64_t, std::set<std::vector<std::pair<uint64_t, uint64_t>>>> by_call;
  for (const auto& r : recs) by_call[r.call].insert(r.ranges);
  bool agree = by_call.size() == static_cast<size_t>(calls) && recs.size() == by_call.size() * p.ranks.size();
  std::string seq;
  std::set<std::vector<std::pair<uint64_t, uint64_t>>> distinct;
  for (const auto& [c, sets] : by_call) {
    agree &= sets.size() == 1;
    seq += std::to_string(c) + ":";
    for (const auto& [b, e] : *sets.begin()) seq += std::to_string(b) + "-" + std::to_string(e) + ",";
    distinct.insert(*sets.begin());
  }
  Expect(agree, "this process's ranks cut the same ranges at every call (" + std::to_string(recs.size()) + " records)");
  Expect(distinct.size() >= 2, "stage 2 moved the split (" + std::to_string(distinct.size()) + " distinct splits)");
  char tok[96];
  std::snprintf(tok, sizeof tok, "splits %016llx distinct %zu", static_cast<unsigned long long>(Fnv(seq)), distinct.size());
  p.token = tok;
  if (p.index == 0) {
    const auto& last = *by_call.rbegin()->second.begin();
    std::printf("    agreement: last split shm [%llu, %llu) tcp [%llu, %llu) of %llu bytes\n",
                (unsigned long long)last[0].first, (unsigned long long)last[0].second,
                (unsigned long long)last[1].first, (unsigned long long)last[1].second,
                (unsigned long long)last.back().second);
  }
}

// A process SIGKILLed inside a split call: the others fail fast, naming what went wrong.
void MultiLinkPeerDies(Proc& p, int victim) {
  Expect(ConfigureLinks("shm;tcp").ok(), "configure shm;tcp");
  Expect(SetShares(Kind::kAllReduce, 300000 * 4, {0.5, 0.5}, true).ok(), "pinned split");
  CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {1000}}}, 0, {}, false, 11});
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {300000}}}, 0, {}, false, 12};
  if (p.index == victim) {
    std::thread killer([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      raise(SIGKILL);
    });
    std::vector<std::vector<uint8_t>> in = {Input(c, 0, p.ranks[0])}, out = {in[0]};
    (void)Call(p, p.ranks[0], c, in, out);
    killer.join();
    _exit(43);
  }
  if (p.index == 0) std::this_thread::sleep_for(std::chrono::milliseconds(800));
  const int n = p.n();
  std::vector<Status> st(n);
  std::vector<double> secs(n);
  OnRanks(p, [&](int r) {
    std::vector<std::vector<uint8_t>> in = {Input(c, 0, r)}, out = {in[0]};
    const auto t = Clock::now();
    st[r] = Call(p, r, c, in, out);
    secs[r] = Since(t);
  });
  for (int r : p.ranks) {
    const std::string& m = st[r].message();
    Expect(!st[r].ok() && m.find("xproc_test") != std::string::npos && secs[r] < TimeoutSeconds() / 2,
           "split call with a dead peer fails fast (" + std::to_string(secs[r]) + " s): " + m);
    Expect(m.find("device " + std::to_string(kFirstDevice + victim)) != std::string::npos || m.find("exited") != std::string::npos ||
               m.find("closed") != std::string::npos,
           "the error says what failed: " + m);
  }
  OnRanks(p, [&](int r) {
    std::vector<std::vector<uint8_t>> in = {Input(c, 0, r)}, out = {in[0]};
    const auto t = Clock::now();
    st[r] = Call(p, r, c, in, out);
    secs[r] = Since(t);
  });
  for (int r : p.ranks)
    Expect(!st[r].ok() && secs[r] < 0.5, "a later call fails at once: " + st[r].message());
}

// ---- failover, per-link deadlines and health across processes (docs/faults.md) -----------------

LinkHealthSnapshot HealthOf(const Proc& p, const std::string& link) {
  for (const auto& h : SnapshotHealth())
    if (h.link == link && h.group == FormatIds(p.devices)) return h;
  return {};
}

bool Has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A real stall (no injected fault): process 1's rank stops writing to its tcp socket mid-call
// (TcpChannel::StallSendsForTest). Its peers wait on real sockets until the lane's own deadline
// (0.3 s here, the global one is 30 s), the ring breaks, and the range fails over to the segment in
// the same call: exact everywhere, well before the global deadline; the error names the collective,
// the group, the link and the rank waited for.
void MultiLinkRealStall(Proc& p) {
  Expect(ConfigureLinks("shm;tcp").ok(), "configure shm;tcp");
  const int64_t count = 300000;
  Expect(SetShares(Kind::kAllReduce, count * 4, {0.5, 0.5}, true).ok(), "pinned split");
  HealthOptions o = GetHealthOptions();
  o.link_timeout_s = 0.3;
  o.probe_calls = 2;  // the probe (below): 2 group calls after the failure
  SetHealthOptions(o);
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 21};
  CheckCase(p, c);
  if (p.index == 1)
    if (TcpChannel* ring = CrossProcessTcp(p.devices, "tcp")) ring->StallSendsForTest(p.ranks[0], 1);
  const uint64_t before = FailoverCount();
  const auto t0 = Clock::now();
  CheckCase(p, c);
  const double secs = Since(t0);
  if (p.index == 0) std::printf("    real tcp stall across processes: failed over after %.3f s\n", secs);
  Expect(secs < 0.3 + 3, "the stalled ring's range failed over at the link's deadline (" + std::to_string(secs) +
                             " s; global " + std::to_string(TimeoutSeconds()) + " s)");
  Expect(FailoverCount() == before + 1, "one failover recorded in this process");
  const LinkHealthSnapshot h = HealthOf(p, "tcp");
  Expect(h.state == LinkState::kUnhealthy, "tcp unhealthy in every process: " + h.reason);
  Expect(Has(h.reason, "xproc_test: all_reduce") && Has(h.reason, FormatIds(p.devices)) && Has(h.reason, "link tcp"),
         "the reason names the collective, group and link: " + h.reason);
  // With one rank per process, rank 0 is the one waiting for the stalled rank 1's bytes (with more,
  // which rank's error a process records first depends on the ring's order of failure).
  if (p.index == 0 && p.per_proc == 1)
    Expect(Has(h.reason, "missed its deadline of 0.3 s") &&
               Has(h.reason, "waiting for rank 1 (device " + std::to_string(p.devices[1]) + ", another process)"),
           "the reason names the link's deadline and the peer waited for: " + h.reason);
  CheckCase(p, c);  // the next call: the segment alone (the broken ring is out until its probe)
  TcpChannel* ring = CrossProcessTcp(p.devices, "tcp");
  Expect(ring && !ring->health().ok() && ring->reconnects() == 0, "the ring stays broken while tcp is out");
  // The probe's call rebuilds the ring in every process (new listeners, ports through the segment,
  // the job's token), the probe succeeds and tcp is re-admitted everywhere; the calls after it split
  // over both links again, exactly and without a failover.
  int calls = 0;
  while (HealthOf(p, "tcp").state != LinkState::kHealthy && calls < 6) {
    CheckCase(p, c);
    ++calls;
  }
  const LinkHealthSnapshot back = HealthOf(p, "tcp");
  if (p.index == 0)
    std::printf("    the probe %d call(s) later reconnected the ring (%llu local reconnects): %s\n", calls,
                static_cast<unsigned long long>(ring ? ring->reconnects() : 0), back.reason.c_str());
  Expect(back.state == LinkState::kHealthy && Has(back.reason, "re-admitted") && ring &&
             ring->reconnects() == static_cast<uint64_t>(p.per_proc) && ring->health().ok(),
         "the probe reconnected the ring and re-admitted tcp: " + back.reason);
  const uint64_t now = FailoverCount();
  for (int i = 0; i < 3; ++i) CheckCase(p, c);
  Expect(FailoverCount() == now && HealthOf(p, "tcp").state == LinkState::kHealthy,
         "the reconnected ring carries its ranges (no failover)");
  SetHealthOptions(HealthOptions{});
}

// Two links: tcp fails (injected error), its range goes to the segment, whose re-run fails too
// (injected at its next call): no link is left, every rank fails alike with each link's report, and
// the group stays usable (the next call, both links back after their probe-by-plan, is exact).
void MultiLinkNoCarrier(Proc& p) {
  Expect(ConfigureLinks("shm;tcp").ok(), "configure shm;tcp");
  const int64_t count = 300000;
  Expect(SetShares(Kind::kAllReduce, count * 4, {0.5, 0.5}, true).ok(), "pinned split");
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 22};
  CheckCase(p, c);
  // Counted from the faults' setting on: tcp's own range is its call 1, shm's own range its call 1,
  // the re-run on shm its call 2.
  Expect(SetFaults("tcp:error@at_call=1;shm:error@at_call=2").ok(), "inject tcp then shm");
  std::vector<Status> st(p.n());
  OnRanks(p, [&](int r) {
    std::vector<std::vector<uint8_t>> in = {Input(c, 0, r)}, out = {in[0]};
    st[r] = Call(p, r, c, in, out);
  });
  for (int r : p.ranks) {
    const std::string& m = st[r].message();
    Expect(!st[r].ok() && Has(m, "no link could carry the bytes of call 2") && Has(m, "all_reduce on group " + FormatIds(p.devices)) &&
               Has(m, "shm: ") && Has(m, "link shm of cross-process group " + FormatIds(p.devices) + ": injected error at its call 2") &&
               Has(m, "tcp: ") && Has(m, "link tcp of cross-process group " + FormatIds(p.devices) + ": injected error at its call 1"),
           "no carrier: the error names each link's report: " + m);
    p.token = m;
  }
  Expect(SetFaults("").ok(), "clear faults");
  CheckCase(p, c);
}

// Three links (shm;tcp;tcp:tcp2, pinned 0.2/0.3/0.5): tcp fails, its carrier tcp2 (the largest
// share) fails the re-run, and the second round's carrier, the segment, carries it: exact, two rounds.
void MultiLinkTwoRounds(Proc& p) {
  Expect(ConfigureLinks("shm;tcp;tcp:tcp2").ok(), "configure shm;tcp;tcp:tcp2");
  const xproc::XprocLinks links = xproc::XprocLinksOf(xproc::FindProcessGroup(p.devices));
  Expect(links.links == std::vector<std::string>{"shm", "tcp", "tcp2"}, "three cross-process links");
  const int64_t count = 300000;
  Expect(SetShares(Kind::kAllReduce, count * 4, {0.2, 0.3, 0.5}, true).ok(), "pinned split");
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 23};
  CheckCase(p, c);
  Expect(SetFaults("tcp:error@at_call=1;tcp2:error@at_call=2").ok(), "inject tcp, then tcp2's re-run");
  const uint64_t before = FailoverCount();
  CheckCase(p, c);
  Expect(FailoverCount() == before + 1, "one range moved");
  const auto recent = RecentFailovers();
  Expect(!recent.empty() && recent.back().link == "tcp" && recent.back().to == "shm",
         "tcp's range ended on shm after tcp2 failed it: " + (recent.empty() ? "" : recent.back().to));
  Expect(HealthOf(p, "tcp").state == LinkState::kUnhealthy && HealthOf(p, "tcp2").state == LinkState::kUnhealthy &&
             HealthOf(p, "shm").state == LinkState::kHealthy,
         "tcp and tcp2 unhealthy, shm healthy");
  Expect(SetFaults("").ok(), "clear faults");
  CheckCase(p, c);
}

// Degraded across processes: fits installed (the leader's model: shm 2 GB/s, tcp 0.2 GB/s), shares
// pinned 0.5/0.5; clean calls leave tcp healthy; tcp:slow@factor=50 makes its observed rate a
// fraction of the fit's, and after degrade_calls (8) calls every process marks it degraded with the
// same evidence, one call after the call that decided it. Then unpinned: stage 2 moves load off it.
void MultiLinkDegraded(Proc& p) {
  Expect(ConfigureLinks("shm;tcp").ok(), "configure shm;tcp");
  const int64_t count = 1 << 18;  // 1 MiB f32: tcp's half is above health's 256 KiB of evidence
  Expect(SetShares(Kind::kAllReduce, count * 4, {0.5, 0.5}, true).ok(), "pinned split");
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 24};
  CheckCase(p, c);  // the group's executor (and the leader's balancer) exist before the fits come
  plan::CostModel model({"shm", "tcp"});
  model.Set(Kind::kAllReduce, 0, plan::AlphaBeta{50e-6, 1 / 2e9});
  model.Set(Kind::kAllReduce, 1, plan::AlphaBeta{50e-6, 1 / 0.2e9});
  Expect(InstallModel(model).ok(), "install fits");
  for (int i = 0; i < 10; ++i) CheckCase(p, c);
  LinkHealthSnapshot h = HealthOf(p, "tcp");
  Expect(h.state == LinkState::kHealthy && h.expected_bps > 0 && h.observed_bps > 0,
         "clean calls: tcp healthy, with the fit's and the observed rate (" + std::to_string(h.observed_bps) + " of " +
             std::to_string(h.expected_bps) + " B/s)");
  Expect(SetFaults("tcp:slow@factor=50").ok(), "slow tcp 50x");
  int calls = 0;
  for (; calls < 14 && HealthOf(p, "tcp").state != LinkState::kDegraded; ++calls) CheckCase(p, c);
  h = HealthOf(p, "tcp");
  if (p.index == 0) std::printf("    degraded after %d slowed calls: %s\n", calls, h.reason.c_str());
  Expect(h.state == LinkState::kDegraded && Has(h.reason, "over the last 8 calls") && Has(h.reason, "% of the profiled"),
         "tcp degraded with evidence after " + std::to_string(calls) + " calls: " + h.reason);
  p.token = std::string(Name(h.state)) + " since call " + std::to_string(h.since_call) + ": " +
            h.reason.substr(0, h.reason.find(" GB/s"));
  // Stage 2 moves load away once the shares are the balancer's again (the fits' split first).
  Expect(ConfigureLinks("shm;tcp").ok(), "reconfigure: a new executor, unpinned");
  Expect(InstallModel(model).ok(), "install fits again");
  Expect(SetFaults("tcp:slow@factor=50").ok(), "slow tcp 50x");
  auto tcp_share = [&] {
    for (const auto& snap : SnapshotPlans())
      if (snap.group == p.devices && snap.plan.shares.size() == 2) return snap.plan.shares[1];
    return -1.0;
  };
  CheckCase(p, c);
  const double first = tcp_share();
  for (int i = 0; i < 16; ++i) CheckCase(p, c);
  const double last = tcp_share();
  if (p.index == 0) {
    std::printf("    stage 2 under tcp slow x50: tcp share %.3f -> %.3f\n", first, last);
    Expect(first > 0 && last >= 0 && last < first * 0.7, "stage 2 moved load off the slow link: tcp share " +
                                                           std::to_string(first) + " -> " + std::to_string(last));
  }
  Expect(SetFaults("").ok(), "clear faults");
}

// This process's leader model of its cross-process group (empty links: none; only the leader's
// process has one).
plan::CostModel LeaderModel() {
  plan::CostModel model;
  (void)xproc::ForEachXprocBalancer([&](plan::Balancer& b) {
    model = b.Model();
    return Status::Ok();
  });
  return model;
}

bool LeaderPlans(const Proc& p, plan::PlanMode mode) {
  for (const auto& snap : SnapshotPlans())
    if (snap.group == p.devices && snap.plan.mode == mode) return true;
  return false;
}

// Stage 1 across processes: the first large all_reduce profiles shm and tcp in every process inside
// the call (xproc_profile.h); the leader ends with fits for both links, the profiled size and a
// measured threshold; the call and the next ones are exact, and the next ones do not profile again.
void MultiLinkStageOne(Proc& p) {
  Expect(ConfigureLinks("shm;tcp").ok(), "configure shm;tcp");
  SetAutotune(1 << 20);
  SetTuneMax(2 << 20);
  SetRecordSplits(true);
  (void)TakeSplitRecords();
  const int64_t count = int64_t{1} << 19;  // 2 MiB f32
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 61};
  const auto t0 = Clock::now();
  CheckCase(p, c);
  const double first = Since(t0);
  if (p.index == 0) {
    const plan::CostModel m = LeaderModel();
    Expect(m.links() == std::vector<std::string>{"shm", "tcp"} && m.Has(Kind::kAllReduce),
           "the leader has stage-1 fits for all_reduce on shm and tcp");
    if (m.Has(Kind::kAllReduce)) {
      const auto fits = m.Fits(Kind::kAllReduce);
      Expect(fits[0].beta > 0 && fits[1].beta > 0, "both fits have a bandwidth");
      Expect(m.ProfiledBytes(Kind::kAllReduce) == (2u << 20), "profiled up to 2 MiB (tune max): " +
                                                                   std::to_string(m.ProfiledBytes(Kind::kAllReduce)));
      Expect(m.MeasuredThreshold(Kind::kAllReduce).has_value(), "the split threshold was measured");
      std::printf("    stage 1 across processes (%.3f s for the first call): shm %.3g GB/s, tcp %.3g GB/s, %s\n",
                  first, fits[0].bytes_per_second() * 1e-9, fits[1].bytes_per_second() * 1e-9,
                  SplitThresholdText(m.MeasuredThreshold(Kind::kAllReduce).value_or(0)).c_str());
    }
  } else {
    Expect(LeaderModel().links().empty(), "only the leader's process has a balancer");
  }
  for (int i = 0; i < 4; ++i) CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false,
                                            static_cast<uint32_t>(62 + i)});
  // Every process reports the leader's model (the plan slots carry it, slot_model.h); the leader
  // stored it in the tuning cache under the group's key, processes included.
  const std::optional<plan::CostModel> here = xproc::XprocGroupModel(p.devices);
  Expect(here && here->Has(Kind::kAllReduce) && here->ProfiledBytes(Kind::kAllReduce) == (2u << 20) &&
             here->MeasuredThreshold(Kind::kAllReduce).has_value(),
         "this process reports the stage-1 model with its profiled size and threshold");
  if (p.index == 0 && here && here->Has(Kind::kAllReduce)) {
    plan::CacheKey key{plan::HostName(), "shm;tcp", static_cast<int>(p.devices.size())};
    key.processes = p.procs;
    plan::TuneRecord stored;
    std::string warning;
    const bool found = plan::LoadTuning(TuneCachePath(), key, &stored, &warning);
    Expect(found && stored.model.Has(Kind::kAllReduce) &&
               stored.model.Fits(Kind::kAllReduce)[1].beta == here->Fits(Kind::kAllReduce)[1].beta &&
               stored.model.ProfiledBytes(Kind::kAllReduce) == (2u << 20),
           "the leader stored the fits under (links, ranks, " + std::to_string(p.procs) + " processes): " + warning);
    key.processes = 1;
    Expect(!plan::LoadTuning(TuneCachePath(), key, &stored, &warning), "nothing stored for a group inside one process");
  }
  if (p.index == 0) {
    Expect(!LeaderPlans(p, plan::PlanMode::kProfile),
           "the calls after stage 1 are planned from its fits (no kProfile plan left)");
  }
  // Every rank of this process cut the same ranges at every call.
  std::map<uint64_t, std::set<std::vector<std::pair<uint64_t, uint64_t>>>> by_call;
  for (const auto& r : TakeSplitRecords()) by_call[r.call].insert(r.ranges);
  bool agree = by_call.size() == 5;
  for (const auto& [call, sets] : by_call) agree &= sets.size() == 1;
  Expect(agree, "every local rank cut the same ranges at each of the 5 calls");
  SetRecordSplits(false);
}

// The tuning cache across processes. Planted before the first call: an entry of this group's key
// (shm;tcp, its ranks, its processes) with all_reduce fits no profile would produce, and one of the
// same links and ranks inside one process with all_gather fits. The first large all_reduce is planned
// from the cached fits (the leader's process reads the cache; every process then reports them), and
// the first large all_gather profiles (the in-process entry is another path), its fits stored beside
// the cached all_reduce ones.
void MultiLinkStageOneCached(Proc& p) {
  Expect(ConfigureLinks("shm;tcp").ok(), "configure shm;tcp");
  SetAutotune(1 << 20);
  SetTuneMax(2 << 20);
  const int n = static_cast<int>(p.devices.size());
  const plan::AlphaBeta shm{2.5e-5, 1 / 3.125e9}, tcp{7.5e-5, 1 / 0.8e9}, decoy{1e-6, 1e-11};
  plan::CacheKey across{plan::HostName(), "shm;tcp", n}, inside{plan::HostName(), "shm;tcp", n};
  across.processes = p.procs;
  if (p.index == 0) {  // before the leader's first call, so before any plan
    plan::CostModel cached({"shm", "tcp"}), other({"shm", "tcp"});
    cached.Set(Kind::kAllReduce, 0, shm);
    cached.Set(Kind::kAllReduce, 1, tcp);
    cached.SetMeasuredThreshold(Kind::kAllReduce, 1 << 20);
    cached.SetProfiledBytes(Kind::kAllReduce, 2 << 20);
    other.Set(Kind::kAllGather, 0, decoy);
    other.Set(Kind::kAllGather, 1, decoy);
    other.SetProfiledBytes(Kind::kAllGather, 2 << 20);
    std::string warning;
    Expect(plan::StoreTuning(TuneCachePath(), {across, cached, 2 << 20}, &warning).ok() &&
               plan::StoreTuning(TuneCachePath(), {inside, other, 2 << 20}, &warning).ok(),
           "plant the cache entries");
  }
  const int64_t count = int64_t{1} << 19;  // 2 MiB f32 per rank
  CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 81});
  CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 82});
  auto same = [](const plan::AlphaBeta& a, const plan::AlphaBeta& b) { return a.alpha == b.alpha && a.beta == b.beta; };
  std::optional<plan::CostModel> m = xproc::XprocGroupModel(p.devices);
  Expect(m && m->Has(Kind::kAllReduce) && same(m->Fits(Kind::kAllReduce)[0], shm) &&
             same(m->Fits(Kind::kAllReduce)[1], tcp) && m->MeasuredThreshold(Kind::kAllReduce) == uint64_t{1} << 20 &&
             m->ProfiledBytes(Kind::kAllReduce) == (2u << 20),
         "process " + std::to_string(p.index) + " reports the cached all_reduce model");
  if (p.index == 0)
    Expect(!LeaderPlans(p, plan::PlanMode::kProfile), "all_reduce was planned from the cache, not profiled");
  CheckCase(p, {Kind::kAllGather, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 83});
  CheckCase(p, {Kind::kAllGather, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 84});
  m = xproc::XprocGroupModel(p.devices);
  Expect(m && m->Has(Kind::kAllGather) && !same(m->Fits(Kind::kAllGather)[0], decoy) &&
             m->ProfiledBytes(Kind::kAllGather) > 0 && same(m->Fits(Kind::kAllReduce)[0], shm),
         "process " + std::to_string(p.index) + ": all_gather profiled (the in-process entry is not this group's)");
  if (p.index == 0 && m && m->Has(Kind::kAllGather)) {
    plan::TuneRecord stored;
    std::string warning;
    Expect(plan::LoadTuning(TuneCachePath(), across, &stored, &warning) && stored.model.Has(Kind::kAllReduce) &&
               same(stored.model.Fits(Kind::kAllReduce)[0], shm) && stored.model.Has(Kind::kAllGather) &&
               same(stored.model.Fits(Kind::kAllGather)[1], m->Fits(Kind::kAllGather)[1]),
           "the profiled all_gather fits are stored beside the cached all_reduce ones: " + warning);
    Expect(plan::LoadTuning(TuneCachePath(), inside, &stored, &warning) &&
               same(stored.model.Fits(Kind::kAllGather)[0], decoy),
           "the in-process entry is left as it was");
  }
}

// Stage 1 when tcp fails inside it (a real stall from its first run on, in one process): every
// rank learns it in the same round, the leader installs nothing and turns stage 1 off for the group,
// and the call itself and the next ones are exact.
void MultiLinkStageOneFails(Proc& p) {
  Expect(ConfigureLinks("shm;tcp").ok(), "configure shm;tcp");
  SetAutotune(1 << 20);
  SetTuneMax(2 << 20);
  HealthOptions o = GetHealthOptions();
  o.link_timeout_s = 0.3;
  SetHealthOptions(o);
  if (p.index == 1)
    if (TcpChannel* ring = CrossProcessTcp(p.devices, "tcp")) ring->StallSendsForTest(p.ranks[0], 1);
  const int64_t count = int64_t{1} << 19;
  const auto t0 = Clock::now();
  CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 71});
  const double secs = Since(t0);
  Expect(secs < TimeoutSeconds(), "the failed profile ended at the link's deadlines, not the group's (" +
                                      std::to_string(secs) + " s)");
  if (p.index == 0) {
    std::printf("    stage 1 with a stalled tcp ring: the call returned after %.3f s\n", secs);
    Expect(!LeaderModel().Has(Kind::kAllReduce), "no fits installed");
  }
  CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 72});
  if (p.index == 0) {
    Expect(!LeaderPlans(p, plan::PlanMode::kProfile), "stage 1 is off for the group after it failed");
  }
  SetHealthOptions(HealthOptions{});
}

// --bench-multilink: all_reduce f32 at 16 and 64 MiB per process, the segment alone against shm+tcp
// after stage 2 converged (40 calls), median of the next 15; the leader prints the final split.
void MultiLinkBench(Proc& p) {
  const int rank = p.ranks[0];
  for (size_t bytes : {size_t{16} << 20, size_t{64} << 20}) {
    const Case c{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {static_cast<int64_t>(bytes / 4)}}}, 0, {}, false, 1};
    std::vector<std::vector<uint8_t>> in = {std::vector<uint8_t>(bytes, 1)}, out = {std::vector<uint8_t>(bytes)};
    auto median = [&](int warm, int timed) {
      std::vector<double> t;
      for (int i = 0; i < warm + timed; ++i) {
        const auto t0 = Clock::now();
        Status s = Call(p, rank, c, in, out);
        if (!s.ok()) std::printf("FAIL: bench: %s\n", s.message().c_str());
        if (i >= warm) t.push_back(Since(t0));
      }
      std::sort(t.begin(), t.end());
      return t[t.size() / 2];
    };
    Expect(ConfigureLinks("shm").ok(), "configure shm");
    const double alone = median(3, 15);
    Expect(ConfigureLinks("shm;tcp").ok(), "configure shm;tcp");
    const int converge = std::getenv("BENCH_CONVERGE") ? std::atoi(std::getenv("BENCH_CONVERGE")) : 40;
    const double split = median(converge, 15);
    if (p.index == 0) {
      std::string plan;
      for (const auto& snap : SnapshotPlans())
        if (snap.group == p.devices && snap.plan.bucket_bytes <= bytes && snap.plan.bucket_bytes * 2 > bytes) {
          plan = std::string(plan::Name(snap.plan.mode));
          for (size_t i = 0; i < snap.links.size(); ++i) {
            char b[48];
            std::snprintf(b, sizeof b, " %s=%.3f", snap.links[i].c_str(), snap.plan.shares[i]);
            plan += b;
          }
        }
      std::printf("| all_reduce | %d | %zu MiB | %.2f | %.2f | %s |\n", p.n(), bytes >> 20, alone * 1e3, split * 1e3,
                  plan.c_str());
      std::fflush(stdout);
    }
  }
}

// ---- the parent's side ------------------------------------------------------------------------

struct Child {
  pid_t pid = -1;
  int up = -1, down = -1;  // child -> parent, parent -> child
};

struct Scenario {
  std::string what;
  int procs = 2, per_proc = 1;
  size_t slot_bytes = 64 << 10;
  double timeout_s = 30;
  std::vector<int> dies;  // process indices expected to die (no report)
  bool same_token = false;
  std::function<void(Proc&)> body;
  bool tcp = false;  // also connect a cross-process tcp ring "tcp" (ports and token through the pipes)
  int rings = 1;     // with tcp: rings "tcp", then "tcp2", ...
};

std::string RingName(int i) { return i == 0 ? "tcp" : "tcp" + std::to_string(i + 1); }

struct Report {
  int32_t passed = 0, failed = 0;
  char token[512] = {};
};

[[noreturn]] void ChildMain(const Scenario& s, int index, Child self) {
  alarm(120);  // a hang ends this process (the parent sees the signal) instead of the test
  SetTimeoutSeconds(s.timeout_s);
  g_passed = g_failed = 0;
  Proc p;
  p.index = index;
  p.procs = s.procs;
  p.per_proc = s.per_proc;
  for (int r = 0; r < s.procs * s.per_proc; ++r) p.devices.push_back(kFirstDevice + r);
  std::vector<int64_t> local;
  for (int k = 0; k < s.per_proc; ++k) {
    p.ranks.push_back(index * s.per_proc + k);
    local.push_back(p.devices[p.ranks.back()]);
  }
  char name[kNameBytes] = {};
  if (index == 0) {
    std::string made;
    Status st = xproc::CreateProcessGroup(p.devices, local, s.slot_bytes, s.procs, &made);
    if (!st.ok()) std::printf("FAIL: create: %s\n", st.message().c_str());
    std::snprintf(name, sizeof name, "%s", made.c_str());
    if (!WriteFull(self.up, name, sizeof name)) _exit(3);
  } else {
    if (!ReadFull(self.down, name, sizeof name, 20000)) _exit(4);
    Status st = xproc::AttachProcessGroup(name, p.devices, local);
    if (!st.ok()) std::printf("FAIL: attach: %s\n", st.message().c_str());
    if (!WriteFull(self.up, "A", 1)) _exit(3);
  }
  p.name = name;
  for (int ring = 0; s.tcp && ring < s.rings; ++ring) {
    std::vector<uint16_t> ports;
    Status st = ListenCrossProcessTcp(p.devices, local, RingName(ring), &ports);
    if (!st.ok()) std::printf("FAIL: listen: %s\n", st.message().c_str());
    ports.resize(s.per_proc);
    if (!WriteFull(self.up, ports.data(), ports.size() * sizeof(uint16_t))) _exit(3);
    std::vector<uint16_t> all(p.n());
    uint8_t token[kTcpTokenBytes];
    if (!ReadFull(self.down, all.data(), all.size() * sizeof(uint16_t), 20000) ||
        !ReadFull(self.down, token, sizeof token, 20000))
      _exit(4);
    int refused = 0;
    st = ConnectCrossProcessTcp(p.devices, local, all, token, RingName(ring), &refused);
    Expect(st.ok(), "cross-process tcp ring connects: " + st.message());
  }
  char go;
  if (!ReadFull(self.down, &go, 1, 20000) || go != 'G') _exit(4);
  s.body(p);
  Report rep;
  rep.passed = g_passed;
  rep.failed = g_failed;
  std::snprintf(rep.token, sizeof rep.token, "%s", p.token.c_str());
  std::fflush(stdout);
  WriteFull(self.up, &rep, sizeof rep);
  _exit(g_failed ? 1 : 0);
}

std::vector<std::string> ShmEntries() {
  std::vector<std::string> names;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d))
      if (std::strncmp(e->d_name, "flexlink-", 9) == 0) names.push_back(e->d_name);
    closedir(d);
  }
  return names;
}

// Every scenario's processes get a tuning cache of their own (never the user's; and stage 1 of one
// scenario must not answer another's from the cache), removed afterwards.
std::string ScenarioCachePath() {
  static int scenarios = 0;
  return "/tmp/flexlink-xproc-test-" + std::to_string(getpid()) + "-" + std::to_string(++scenarios) + ".json";
}

void RunScenario(const Scenario& s) {
  if (!Selected(s.what)) return;
  const auto start = Clock::now();
  const std::string cache = ScenarioCachePath();
  SetTuneCachePath(cache);
  struct RemoveCache {
    std::string path;
    ~RemoveCache() { std::remove(path.c_str()); }
  } remove_cache{cache};
  std::fflush(stdout);
  std::vector<Child> kids(s.procs);
  for (int i = 0; i < s.procs; ++i) {
    int up[2], down[2];
    if (pipe(up) != 0 || pipe(down) != 0) {
      Expect(false, s.what + ": pipe");
      return;
    }
    const pid_t pid = fork();
    if (pid == 0) {
      for (int j = 0; j < i; ++j) {
        close(kids[j].up);
        close(kids[j].down);
      }
      close(up[0]);
      close(down[1]);
      ChildMain(s, i, Child{getpid(), up[1], down[0]});
    }
    close(up[1]);
    close(down[0]);
    kids[i] = Child{pid, up[0], down[1]};
  }
  char name[kNameBytes] = {};
  bool ok = ReadFull(kids[0].up, name, sizeof name, 20000) && name[0] == '/';
  Expect(ok, s.what + ": the creator sent the segment name");
  if (ok) {
    // The segment is private: mode 0600, a 32-hex random name.
    struct stat st;
    const std::string path = std::string("/dev/shm") + name;
    Expect(stat(path.c_str(), &st) == 0 && (st.st_mode & 0777) == 0600, s.what + ": segment mode 0600");
    Expect(xproc::Segment::ValidName(name) && std::strlen(name) == 10 + 32, s.what + ": name /flexlink-<32 hex>: " + name);
    for (int i = 1; i < s.procs; ++i) ok &= WriteFull(kids[i].down, name, sizeof name);
    for (int i = 1; i < s.procs; ++i) {
      char a;
      ok &= ReadFull(kids[i].up, &a, 1, 20000);
    }
    Expect(ok, s.what + ": every process attached");
    // As the Python glue does: unlink as soon as every process has mapped it.
    Expect(xproc::UnlinkProcessSegment(name).ok(), s.what + ": unlink");
    Expect(stat(path.c_str(), &st) != 0, s.what + ": nothing left in /dev/shm");
  }
  for (int ring = 0; ok && s.tcp && ring < s.rings; ++ring) {
    std::vector<uint16_t> ports(s.procs * s.per_proc);
    for (int i = 0; i < s.procs && ok; ++i)
      ok &= ReadFull(kids[i].up, ports.data() + i * s.per_proc, s.per_proc * sizeof(uint16_t), 20000);
    uint8_t token[kTcpTokenBytes];
    ok &= getrandom(token, sizeof token, 0) == static_cast<ssize_t>(sizeof token);
    for (int i = 0; i < s.procs && ok; ++i)
      ok &= WriteFull(kids[i].down, ports.data(), ports.size() * sizeof(uint16_t)) &&
            WriteFull(kids[i].down, token, sizeof token);
    Expect(ok, s.what + ": tcp ports and token passed");
  }
  for (auto& k : kids) WriteFull(k.down, ok ? "G" : "X", 1);
  std::string token;
  for (int i = 0; i < s.procs; ++i) {
    const bool dies = std::find(s.dies.begin(), s.dies.end(), i) != s.dies.end();
    Report rep;
    const bool got = ReadFull(kids[i].up, &rep, sizeof rep, 90000);
    if (dies) {
      Expect(!got, s.what + ": process " + std::to_string(i) + " died without a report");
      continue;
    }
    Expect(got, s.what + ": process " + std::to_string(i) + " reported");
    if (!got) continue;
    g_passed += rep.passed;
    g_failed += rep.failed;
    if (s.same_token) {
      if (i == 0) token = rep.token;
      Expect(!token.empty() && token == rep.token, s.what + ": the same error in every process: " + rep.token);
    }
  }
  for (int i = 0; i < s.procs; ++i) {
    int status = 0;
    // Every child exits within the read deadlines above or its own alarm; kill it if not.
    pid_t r = 0;
    for (int tries = 0; tries < 200 && (r = waitpid(kids[i].pid, &status, WNOHANG)) == 0; ++tries)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (r == 0) {
      kill(kids[i].pid, SIGKILL);
      waitpid(kids[i].pid, &status, 0);
    }
    const bool dies = std::find(s.dies.begin(), s.dies.end(), i) != s.dies.end();
    const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!dies) Expect(clean, s.what + ": process " + std::to_string(i) + " exit status " + std::to_string(status));
    close(kids[i].up);
    close(kids[i].down);
  }
  std::printf("  %-58s %6.2f s\n", s.what.c_str(), Since(start));
}

// Attach refuses what it must, in the parent itself (no threads are made, no group registered).
// The last process sleeps 5 ms before each call (3 ranks: chance is 1/3, so it must be last in
// most calls to be flagged; 5 ms is more than other processes are descheduled for, mostly): the leader's process (rank 0) records it as
// arriving last, flagged, ~2 ms late, from the arrival times in the rank blocks; the other
// processes record nothing for the group.
void Stragglers(Proc& p) {
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {256}}}, 0, {}, false, 5};
  const int calls = 32, n = p.n();
  std::atomic<int> good{0};
  for (int k = 0; k < calls; ++k) {
    if (p.index == p.procs - 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    OnRanks(p, [&](int r) {
      std::vector<std::vector<uint8_t>> in = {Input(c, 0, r)}, out = {std::vector<uint8_t>(in[0].size())};
      good += Call(p, r, c, in, out).ok();
    });
  }
  Expect(good == calls * static_cast<int>(p.ranks.size()), "straggler calls succeed");
  const StragglerGroup* g = nullptr;
  const auto groups = SnapshotStragglers();
  for (const auto& e : groups)
    if (e.devices == p.devices) g = &e;
  if (p.index != 0) {
    Expect(g == nullptr, "only the leader's process records the group's arrivals");
    return;
  }
  Expect(g && g->calls == static_cast<uint64_t>(calls), "the leader counted every call");
  if (!g) return;
  const StragglerRank& s = g->ranks[n - 1];
  std::printf("  cross-process straggler: rank %d last in %llu of %llu, p50 %.3f ms, max %.3f ms\n", n - 1,
              static_cast<unsigned long long>(s.last), static_cast<unsigned long long>(s.calls), s.p50_s * 1e3,
              s.max_s * 1e3);
  Expect(s.flagged && s.last >= calls / 2 && s.p50_s > 0.5e-3 && s.max_s < 1.0,
         "the sleeping process's rank is flagged, >= 0.5 ms late at the median");
  bool others = true;
  uint64_t sum = 0;
  for (const auto& r : g->ranks) {
    sum += r.last;
    others &= r.rank == n - 1 || !r.flagged;
  }
  Expect(others && sum == g->calls, "no other rank flagged; one last rank per call");
}

void AttachChecks() {
  std::unique_ptr<xproc::Segment> seg;
  Expect(xproc::AttachProcessGroup("/etc-passwd", std::vector<int64_t>{0, 1}, std::vector<int64_t>{0}).code() == StatusCode::kInvalidArgument, "attach: bad name");
  Expect(!xproc::AttachProcessGroup("/flexlink-00000000000000000000000000000000", std::vector<int64_t>{0, 1},
                                    std::vector<int64_t>{0}).ok(), "attach: no such segment");
  // A segment readable by others is refused.
  const std::string open_name = "/flexlink-0123456789abcdef0123456789abcdef";
  const int fd = shm_open(open_name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  Expect(fd >= 0 && fchmod(fd, 0644) == 0 && ftruncate(fd, 1 << 16) == 0, "make a 0644 segment");
  if (fd >= 0) close(fd);
  Status s = xproc::Segment::Attach(open_name, &seg);
  Expect(!s.ok() && s.message().find("mode 0644") != std::string::npos, "attach refuses mode 0644: " + s.message());
  shm_unlink(open_name.c_str());
  // A segment of the wrong group, or of another layout, is refused.
  std::string name;
  for (int processes : {1, 4, -1}) {
    const Status bad = xproc::CreateProcessGroup(std::vector<int64_t>{5, 6, 7}, std::vector<int64_t>{5}, 0, processes, &name);
    Expect(bad.code() == StatusCode::kInvalidArgument && bad.message().find("processes must be between 2 and") != std::string::npos,
           "create: " + std::to_string(processes) + " processes for 3 devices: " + bad.message());
  }
  Status made = xproc::CreateProcessGroup(std::vector<int64_t>{5, 6, 7}, std::vector<int64_t>{5}, 0, 2, &name);
  Expect(made.ok(), "create: " + made.message());
  Expect(xproc::CreateProcessGroup(std::vector<int64_t>{5, 6, 7}, std::vector<int64_t>{6}, 0, 0, &name).code() ==
             StatusCode::kInvalidArgument, "create: the same group twice in one process");
  // (Attaching in the creating process is refused as already registered; a fresh process would
  // see the device check below, exercised through the segment alone.)
  s = xproc::Segment::Attach(name, &seg);
  Expect(s.ok() && seg->size() > 4096, "the creator's segment attaches");
  Expect(xproc::CreateProcessGroup(std::vector<int64_t>{1, 1}, std::vector<int64_t>{1}, 0, 0, &name).code() ==
             StatusCode::kInvalidArgument, "create: a device twice");
  Expect(xproc::CreateProcessGroup(std::vector<int64_t>{1, 2}, std::vector<int64_t>{3}, 0, 0, &name).code() ==
             StatusCode::kInvalidArgument, "create: a local device outside the group");
  const auto groups = xproc::ProcessGroups();
  size_t default_slot = 0;
  (void)xproc::ChooseSlotBytes(3, 0, &default_slot);
  Expect(groups.size() == 1 && groups[0].slot_bytes == default_slot && default_slot >= (64 << 10) && groups[0].local_devices == std::vector<int64_t>{5},
         "groups(): the default slot");
  Expect(xproc::UnlinkProcessSegment(groups[0].name).ok(), "unlink the parent's group");
  Expect(!xproc::UnlinkProcessSegment(groups[0].name).ok(), "a second unlink fails");
}

// ---- benchmark --------------------------------------------------------------------------------

// fresh: every call gets a newly mapped output (as XLA hands out), faulted in by the call.
// --bench's smallest size and the segment's barrier spin (spin=US: ProcessGroup::SetSpin, which only
// the GPU engine sets on its own; the CPU engine's groups never spin).
size_t g_bench_from = 64 << 10;
int64_t g_bench_spin_us = 0;

void BenchBody(Proc& p, bool fresh) {
  const int rank = p.ranks[0], n = p.n();
  bool spin_set = false;
  for (Kind kind : {Kind::kAllReduce, Kind::kAllGather})
    for (size_t bytes = g_bench_from; bytes <= (64u << 20); bytes *= 4) {
      const int64_t count = static_cast<int64_t>(bytes / 4);
      Case c{kind, ReduceOp::kSum, {{DType::kF32, {count}}}, 0, {}, false, 1};
      std::vector<std::vector<uint8_t>> in = {std::vector<uint8_t>(bytes, 1)};
      std::vector<std::vector<uint8_t>> out = {std::vector<uint8_t>(kind == Kind::kAllGather ? bytes * n : bytes)};
      std::vector<double> t;
      const auto begin = Clock::now();
      for (int it = 0;; ++it) {
        // Ranks agree on the iteration count: everyone stops when rank 0 says so (its clock, or 200
        // timed calls), told through a 1-element all_reduce (max) outside the timed call.
        const size_t out_bytes = out[0].size();
        void* fresh_out = fresh ? mmap(nullptr, out_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                                : out[0].data();
        if (fresh_out == MAP_FAILED) return;
        if (!spin_set && it == 1) {  // the group exists from the first call on; nothing waits between calls
          spin_set = true;
          if (xproc::ProcessGroup* g = xproc::FindProcessGroup(p.devices))
            g->SetSpin(std::chrono::microseconds(g_bench_spin_us));
        }
        const auto t0 = Clock::now();
        Status s = CallOn(p, rank, c, {in[0].data()}, {fresh_out});
        const double secs = Since(t0);
        if (fresh) munmap(fresh_out, out_bytes);
        if (!s.ok()) {
          std::printf("FAIL: bench: %s\n", s.message().c_str());
          return;
        }
        if (it >= 3) t.push_back(secs);
        Case stop{Kind::kAllReduce, ReduceOp::kMax, {{DType::kS32, {1}}}, 0, {}, false, 1};
        int32_t mine = rank == 0 && (it == 3 + 200 || (it >= 3 + 5 && Since(begin) >= 1.5)), all = 0;
        std::vector<std::vector<uint8_t>> si = {std::vector<uint8_t>(4)}, so = {std::vector<uint8_t>(4)};
        std::memcpy(si[0].data(), &mine, 4);
        (void)Call(p, rank, stop, si, so);
        std::memcpy(&all, so[0].data(), 4);
        if (all) break;
      }
      std::sort(t.begin(), t.end());
      const double med = t[t.size() / 2];
      const double algbytes = static_cast<double>(kind == Kind::kAllGather ? bytes * n : bytes);
      if (rank == 0) {
        char line[160];
        std::snprintf(line, sizeof line, "| %-10s | %d | %8zu KiB | %s | %9.3f | %6.2f | %zu |\n",
                      std::string(Name(kind)).c_str(), n, bytes >> 10, fresh ? "fresh " : "reused", med * 1e3,
                      algbytes / med / 1e9, t.size());
        std::printf("%s", line);
        std::fflush(stdout);
      }
    }
}

}  // namespace

int main(int argc, char** argv) {
  alarm(900);  // backstop for the whole program
  const bool bench = argc > 1 && std::strcmp(argv[1], "--bench") == 0;
  const auto before = ShmEntries();
  if (bench) {
    // --bench [fresh|reused] [P...] [two_phase=BYTES] [direct=BYTES, 0: off] [direct_reduce=BYTES, 0: off] [spin=US] [from=BYTES]
    const bool fresh = argc > 2 && std::strcmp(argv[2], "fresh") == 0;
    std::vector<int> procs;
    for (int i = 3; i < argc; ++i) {
      if (std::strncmp(argv[i], "two_phase=", 10) == 0) SetXprocTwoPhaseBytes(std::strtoull(argv[i] + 10, nullptr, 10));
      else if (std::strncmp(argv[i], "direct=", 7) == 0) {
        const uint64_t b = std::strtoull(argv[i] + 7, nullptr, 10);
        SetXprocDirectBytes(b == 0 ? UINT64_MAX : b);
      } else if (std::strncmp(argv[i], "direct_reduce=", 14) == 0) {
        const uint64_t b = std::strtoull(argv[i] + 14, nullptr, 10);
        SetXprocDirectReduceBytes(b == 0 ? UINT64_MAX : b);
      }
      else if (std::strncmp(argv[i], "spin=", 5) == 0) g_bench_spin_us = std::atoll(argv[i] + 5);
      else if (std::strncmp(argv[i], "from=", 5) == 0) g_bench_from = std::strtoull(argv[i] + 5, nullptr, 10);
      else procs.push_back(std::atoi(argv[i]));
    }
    if (procs.empty()) procs = {2, 4};
    std::printf("| kind | processes | bytes per process | output | median ms | algbw GB/s | calls |\n"
                "|---|---|---|---|---|---|---|\n");
    for (int np : procs)
      RunScenario({"bench " + std::to_string(np) + " processes", np, 1, 0, 60, {}, false,
                   [fresh](Proc& p) { BenchBody(p, fresh); }});
    return Summary();
  }
  if (argc > 1 && std::strcmp(argv[1], "--bench-multilink") == 0) {
    if (std::getenv("BENCH_LOG")) SetDebugLevel(kDebugInfo);
    std::printf("| kind | processes | bytes per process | shm alone ms | shm+tcp ms | leader's plan |\n"
                "|---|---|---|---|---|---|\n");
    Scenario s{"bench shm+tcp, 2 processes", 2, 1, 0, 60, {}, false, MultiLinkBench};
    s.tcp = true;
    RunScenario(s);
    return Summary();
  }
  // Scenarios are selected by name (check.h: "-4 processes" leaves out the 4-process ones).
  SelectTests(argc, argv);
  const auto start = Clock::now();
  std::printf("xproc_test\n");
  RunScenario({"2 processes x 1 rank: every kind x dtype x op", 2, 1, 64 << 10, 30, {}, false,
               [](Proc& p) { Correctness(p, true); }});
  // With every all_reduce in one phase, then every one in two (by default from 1 MiB per rank).
  const uint64_t two_phase = XprocTwoPhaseBytes();
  SetXprocTwoPhaseBytes(UINT64_MAX);
  RunScenario({"4 processes x 1 rank: every kind x dtype x op", 4, 1, 64 << 10, 30, {}, false,
               [](Proc& p) { Correctness(p, true); }});
  SetXprocTwoPhaseBytes(0);
  RunScenario({"4 processes x 1 rank, two-phase all_reduce", 4, 1, 64 << 10, 30, {}, false,
               [](Proc& p) { Correctness(p, true); }});
  SetXprocTwoPhaseBytes(two_phase);
  RunScenario({"2 processes x 4 ranks on threads", 2, 4, 64 << 10, 30, {}, false,
               [](Proc& p) { Correctness(p, false); }});
  // Waits: arrivals publish their CPU; with the away-poll off, every wait that outlasts the yields
  // sleeps at once (both ways of waiting stay exercised: the poll also ends in a sleep).
  AwayPollSetting();
  SlotSetting();
  RunScenario({"waits: arrivals publish their CPU, 3 processes", 3, 1, 64 << 10, 30, {}, false, ArrivalCpus});
  {
    const int64_t was = SpinMicros();
    SetSpinMicros(0);
    RunScenario({"2 processes x 1 rank, no away-poll: every kind x dtype x op", 2, 1, 64 << 10, 30, {}, false,
                 [](Proc& p) { Correctness(p, true); }});
    SetSpinMicros(was);
  }
  // Every all_gather and all_reduce (after the group's first call, which agrees) reads the peers'
  // memory directly; with one kind off, only the other does; with both off, none does.
  const uint64_t direct = XprocDirectBytes(), direct_reduce = XprocDirectReduceBytes();
  SetXprocDirectBytes(1);
  SetXprocDirectReduceBytes(1);
  auto both = [](Proc& p, bool full) {
    Correctness(p, full);
    DirectAgreed(Kind::kAllGather, 1024);
    DirectAgreed(Kind::kAllReduce, 1024);
  };
  RunScenario({"2 processes x 1 rank, direct all_gather and all_reduce", 2, 1, 64 << 10, 30, {}, false,
               [&](Proc& p) { both(p, true); }});
  RunScenario({"4 processes x 1 rank, direct all_gather and all_reduce", 4, 1, 64 << 10, 30, {}, false,
               [&](Proc& p) { both(p, true); }});
  RunScenario({"2 processes x 3 ranks on threads, direct all_gather and all_reduce", 2, 3, 64 << 10, 30, {}, false,
               [&](Proc& p) { both(p, false); }});
  SetXprocDirectReduceBytes(UINT64_MAX);
  RunScenario({"2 processes x 1 rank, direct all_gather, all_reduce off", 2, 1, 64 << 10, 30, {}, false,
               [](Proc& p) {
                 CheckCase(p, {Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, {3, 7001}}}, 0, {}, false, 3});
                 DirectAgreed(Kind::kAllGather, 1024);
                 DirectAgreed(Kind::kAllReduce, UINT64_MAX, "FLEXLINK_XPROC_DIRECT_REDUCE_BYTES is off in rank 0");
               }});
  SetXprocDirectBytes(UINT64_MAX);
  RunScenario({"2 processes x 1 rank, direct all_gather and all_reduce off", 2, 1, 64 << 10, 30, {}, false,
               [](Proc& p) { CheckCase(p, {Kind::kAllGather, ReduceOp::kSum, {{DType::kF32, {3, 7001}}}, 1, {}, false, 3});
                             DirectAgreed(Kind::kAllGather, UINT64_MAX, "FLEXLINK_XPROC_DIRECT_BYTES and FLEXLINK_XPROC_DIRECT_REDUCE_BYTES are off");
                             DirectAgreed(Kind::kAllReduce, UINT64_MAX, "are off in rank "); }});
  SetXprocDirectBytes(direct);
  SetXprocDirectReduceBytes(direct_reduce);
  RunScenario({"mismatch: the same error everywhere, outputs untouched", 3, 1, 64 << 10, 30, {}, true, Mismatch});
  RunScenario({"mismatch, 2 processes x 2 ranks", 2, 2, 64 << 10, 30, {}, true, Mismatch});
  RunScenario({"a process _exits before the call", 3, 1, 64 << 10, 20, {2}, false,
               [](Proc& p) { PeerDies(p, 2, false); }});
  RunScenario({"a process is SIGKILLed inside the call", 4, 1, 64 << 10, 20, {3}, false,
               [](Proc& p) { PeerDies(p, 3, true); }});
  RunScenario({"a process never calls: deadline", 2, 1, 64 << 10, 1.5, {}, false, Deadline});
  RunScenario({"a process never calls: deadline, 2 x 2 ranks", 2, 2, 64 << 10, 1.5, {}, false, Deadline});
  auto multi = [](std::string what, int procs, int per_proc, double timeout, std::vector<int> dies, bool same,
                  std::function<void(Proc&)> body) {
    Scenario s{what, procs, per_proc, 64 << 10, timeout, dies, same, std::move(body)};
    s.tcp = true;
    RunScenario(s);
  };
  multi("shm+tcp, 2 processes: every kind, bitwise the segment's", 2, 1, 30, {}, false, MultiLinkCorrectness);
  multi("shm+tcp, 4 processes: every kind, bitwise the segment's", 4, 1, 30, {}, false, MultiLinkCorrectness);
  multi("shm+tcp, 2 processes x 2 ranks", 2, 2, 30, {}, false, MultiLinkCorrectness);
  multi("shm+tcp: pinned 0.7/0.3, links left out", 2, 1, 30, {}, false, MultiLinkPinned);
  multi("shm+tcp: plan agreement over 40 calls, 2 processes", 2, 1, 30, {}, true, MultiLinkAgreement);
  multi("shm+tcp: plan agreement, 4 processes", 4, 1, 30, {}, true, MultiLinkAgreement);
  multi("shm+tcp: plan agreement, 2 processes x 2 ranks", 2, 2, 30, {}, true, MultiLinkAgreement);
  multi("shm+tcp: a process SIGKILLed inside a split call", 3, 1, 20, {2}, false,
        [](Proc& p) { MultiLinkPeerDies(p, 2); });
  multi("shm+tcp: a real tcp stall fails over at the link's deadline", 2, 1, 30, {}, false, MultiLinkRealStall);
  multi("shm+tcp: a real tcp stall, 2 processes x 2 ranks", 2, 2, 30, {}, false, MultiLinkRealStall);
  multi("shm+tcp: the re-run fails too, no carrier", 2, 1, 30, {}, true, MultiLinkNoCarrier);
  {
    Scenario s{"shm+tcp+tcp2: failover in two rounds", 2, 1, 64 << 10, 30, {}, false, MultiLinkTwoRounds};
    s.tcp = true;
    s.rings = 2;
    RunScenario(s);
  }
  multi("shm+tcp: tcp slowed with fits installed: degraded, load moved", 2, 1, 30, {}, true, MultiLinkDegraded);
  multi("shm+tcp: stage 1 across processes, 2 processes", 2, 1, 30, {}, false, MultiLinkStageOne);
  multi("shm+tcp: stage 1 across processes, 2 processes x 2 ranks", 2, 2, 30, {}, false, MultiLinkStageOne);
  multi("shm+tcp: stage 1 with a stalled tcp ring installs nothing", 2, 1, 30, {}, false, MultiLinkStageOneFails);
  multi("shm+tcp: stage 1 from the tuning cache across processes", 2, 1, 30, {}, false, MultiLinkStageOneCached);
  multi("shm+tcp: stage 1 from the tuning cache across processes, 2 processes x 2 ranks", 2, 2, 30, {}, false,
        MultiLinkStageOneCached);
  RunScenario({"stragglers: the last process sleeps 5 ms before each call", 3, 1, 64 << 10, 30, {}, false, Stragglers});
  AttachChecks();
  const auto after = ShmEntries();
  Expect(after.size() <= before.size(), "no /dev/shm/flexlink-* left (" + std::to_string(after.size()) + " now, " +
                                            std::to_string(before.size()) + " before)");
  std::printf("total %.1f s\n", Since(start));
  return Summary();
}
