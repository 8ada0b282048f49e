// Fuzz run of the engine: thousands of random valid calls through flexlink::RunCollective (threads
// stand in for devices, as in engine_test), each compared with the independent reference of
// reference.h — bitwise for every dtype (the engine reduces floats in rank order, as the reference
// does; any NaN equals any NaN) — and checked for writes outside its outputs, changed inputs, and the
// forced split actually cut (split records against plan::CutRanges).
//
// A case draws: the kind (all five), the reduction (sum, prod, max, min; complex only sum/prod), k
// operands (a pytree's leaves) of random dtypes (all 15) and shapes (0-d, zero-size, one element, odd,
// up to ~10^5 elements), the group layout (several groups at once, device ids not 0..n-1, uneven
// where the kind allows), ppermute pairs (partial, identity, none), in-place operands (all, none or
// some ranks), forced link shares (0, 1, equal, random, tiny), and the shm staging/streaming
// thresholds and output-page options. The link set is one of the run's link sets (shm, tcp,
// emulated over shm or tcp, 1-4 links), drawn from the seed.
//
// fuzz_test [--seed S] [--cases N] [--case K] [--verbose]
//   default: a random seed (printed first), 3000 cases. --seed S --cases N repeats a run; --case K
//   runs case K of that run alone (the same link set and layouts; engine state from earlier cases,
//   e.g. call counters, is not reproduced, which no result depends on). Every failure prints the
//   case and the command that runs it alone. Exit status non-zero on any failure.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/engine.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/link_set.h"
#include "xla_ffi/plan/cost_model.h"
#include "xla_ffi/plan/ranges.h"
#include "tests/cpp/check.h"
#include "tests/cpp/reference.h"

using namespace flexlink;
using namespace flexlink::testing;

namespace {

constexpr int kLinkSets = 6;        // link sets per run; case k runs on link set k % kLinkSets
constexpr int kFamiliesPerSet = 5;       // device sets per link set (groups are never freed: bounded)
constexpr int kPartitionsPerFamily = 3;  // groupings of each device set
constexpr size_t kCanaryBytes = 64;  // checked after every output and in-place buffer
constexpr uint8_t kCanary = 0xA5;
constexpr size_t kMaxCaseElements = 1 << 19;  // inputs and outputs of all ranks together

// ---- Random draws, all from one 64-bit generator per case (or per link set).

struct Rng {
  std::mt19937_64 g;
  explicit Rng(uint64_t seed) : g(seed) {}
  int64_t Int(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
  double Real(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(g); }
  bool Chance(double p) { return Real(0, 1) < p; }
  template <class T>
  const T& Pick(const std::vector<T>& v) { return v[static_cast<size_t>(Int(0, static_cast<int64_t>(v.size()) - 1))]; }
};

uint64_t Mix(uint64_t a, uint64_t b) {  // splitmix64 of a combination: independent streams per (seed, index)
  uint64_t z = a * 0x9E3779B97F4A7C15ull + b + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

const std::vector<DType> kDTypes = {DType::kPred, DType::kS8,  DType::kS16, DType::kS32, DType::kS64,
                                    DType::kU8,   DType::kU16, DType::kU32, DType::kU64, DType::kF16,
                                    DType::kBF16, DType::kF32, DType::kF64, DType::kC64, DType::kC128};
bool IsComplex(DType t) { return t == DType::kC64 || t == DType::kC128; }

// XLA:CPU runs device programs on tsl thread-pool workers, which flush denormals to zero
// (FTZ/DAZ), while Python calls the control surface (set_shares) on a thread that does not. The
// fuzz's device threads do the same, so a value set on the main thread and read on a device thread
// is read as XLA would.
void FlushDenormalsLikeXla() {
#if defined(__SSE2__)
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ | DAZ
#endif
}

// ---- The run's link sets and group layouts.

// 1-4 links of kinds shm, tcp, emulated over shm, emulated over tcp (fast enough not to dominate);
// set 0 is always plain shm (the one-link paths).
std::vector<std::string> MakeLinkSets(uint64_t seed) {
  std::vector<std::string> sets = {"shm"};
  Rng r(Mix(seed, 0x11));
  while (sets.size() < kLinkSets) {
    const int64_t links = r.Int(1, 4);
    std::string spec;
    int count[4] = {0, 0, 0, 0};
    for (int64_t i = 0; i < links; ++i) {
      const int kind = static_cast<int>(r.Int(0, 3));
      const int k = count[kind]++;
      const std::string suffix = std::to_string(k + 1);
      std::string one;
      if (kind == 0) one = k == 0 ? "shm" : "shm:s" + suffix;
      if (kind == 1) one = k == 0 ? "tcp" : "tcp:t" + suffix;
      if (kind >= 2) {
        one = "emulated:" + std::string(kind == 2 ? "e" : "et") + suffix + "@gbps=" + std::to_string(r.Int(20, 200)) +
              ",latency_us=" + std::to_string(r.Int(0, 5)) + (kind == 3 ? ",base=tcp" : "");
      }
      spec += (spec.empty() ? "" : ";") + one;
    }
    sets.push_back(spec);
  }
  return sets;
}

using Layout = std::vector<std::vector<int64_t>>;  // groups of global device ids, rank order

bool Even(const Layout& l) {
  return std::all_of(l.begin(), l.end(), [&](const auto& g) { return g.size() == l[0].size(); });
}

// `devices` cut into groups in a fresh order: even (one size dividing the count) or uneven.
Layout Partition(Rng& r, std::vector<int64_t> devices, bool even) {
  std::shuffle(devices.begin(), devices.end(), r.g);
  const int64_t n = static_cast<int64_t>(devices.size());
  Layout layout;
  if (even) {
    std::vector<int64_t> sizes;
    for (int64_t s = 1; s <= n; ++s)
      if (n % s == 0) sizes.push_back(s);
    const int64_t size = r.Chance(0.4) ? n : r.Pick(sizes);
    for (int64_t i = 0; i < n; i += size) layout.emplace_back(devices.begin() + i, devices.begin() + i + size);
  } else {
    for (int64_t i = 0; i < n;) {
      const int64_t size = std::min(n - i, r.Int(1, n));
      layout.emplace_back(devices.begin() + i, devices.begin() + i + size);
      i += size;
    }
  }
  return layout;
}

// A set of devices (ids spread out, not 0..n-1) and several ways to group them, as the axes of a
// mesh do: the calls of one case may each use another (a device's calls on different groups
// interleave). Partition 0 is even (all_to_all needs even groups).
struct Family {
  std::vector<int64_t> devices;
  std::vector<Layout> partitions;
};

std::vector<Family> MakeFamilies(uint64_t seed, int link_set) {
  Rng r(Mix(seed, 0x22 + static_cast<uint64_t>(link_set)));
  std::vector<Family> families;
  for (int i = 0; i < kFamiliesPerSet; ++i) {
    Family f;
    const int64_t n = r.Chance(0.4) ? 8 : r.Chance(0.1) ? r.Int(9, 12) : r.Int(1, 8);
    const int64_t base = r.Pick(std::vector<int64_t>{0, 3, 100, 2048});
    std::vector<int64_t> pool(2 * n);
    std::iota(pool.begin(), pool.end(), base);
    std::shuffle(pool.begin(), pool.end(), r.g);
    f.devices.assign(pool.begin(), pool.begin() + n);
    for (int p = 0; p < kPartitionsPerFamily; ++p) f.partitions.push_back(Partition(r, f.devices, p == 0 || r.Chance(0.5)));
    families.push_back(std::move(f));
  }
  return families;
}

// ---- One case: a sequence of calls by the same devices, under one run id.

struct Operand {
  DType dtype = DType::kF32;
  std::vector<int64_t> dims;   // per-rank input dims
  std::set<int64_t> in_place;  // devices whose result is written over their input
};

struct Call {
  Kind kind = Kind::kAllReduce;
  ReduceOp op = ReduceOp::kSum;
  Layout groups;
  int64_t axis = 0;
  std::vector<Operand> operands;
  std::vector<std::pair<int64_t, int64_t>> pairs;  // ppermute
};

struct Case {
  int64_t index = 0;
  int link_set = 0;
  std::vector<int64_t> devices;
  std::vector<Call> calls;
  std::vector<double> shares;  // per link, normalised; set on every call's plan bucket
  bool pinned = true;          // else a starting point that stage 2 moves between calls
  size_t staging_bytes = 0, streaming_bytes = 0;
  bool huge_pages = true, populate = false;
  uint32_t data_seed = 0;
};

std::string DimsText(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? "," : "") + std::to_string(dims[i]);
  return s + "]";
}

std::string Describe(const Call& c) {
  std::string d = std::string(Name(c.kind));
  if (Reduces(c.kind)) d += "(" + std::string(Name(c.op)) + ")";
  if (c.kind != Kind::kAllReduce && c.kind != Kind::kPpermute) d += " axis " + std::to_string(c.axis);
  d += " of " + std::to_string(c.operands.size()) + " operand(s):";
  for (const Operand& o : c.operands) {
    d += " " + std::string(Name(o.dtype)) + DimsText(o.dims);
    if (!o.in_place.empty()) {
      d += "{in place on";
      for (int64_t dev : o.in_place) d += " " + std::to_string(dev);
      d += "}";
    }
  }
  d += "; groups";
  for (const auto& g : c.groups) d += " " + DimsText(g);
  if (c.kind == Kind::kPpermute) {
    d += "; pairs";
    for (const auto& [s, t] : c.pairs) d += " " + std::to_string(s) + "->" + std::to_string(t);
    if (c.pairs.empty()) d += " none";
  }
  return d;
}

std::string Describe(const Case& c, const std::string& links) {
  std::string d = "case " + std::to_string(c.index) + ":";
  for (size_t i = 0; i < c.calls.size(); ++i) d += (i ? " | call " : " call ") + std::to_string(i) + ": " + Describe(c.calls[i]);
  d += " || links \"" + links + "\" " + (c.pinned ? "pinned" : "starting") + " shares";
  for (double s : c.shares) {
    char buf[32];
    std::snprintf(buf, sizeof buf, " %.6g", s);
    d += buf;
  }
  d += "; shm staging " + std::to_string(c.staging_bytes) + " B, streaming from " + std::to_string(c.streaming_bytes) +
       " B, huge pages " + (c.huge_pages ? "on" : "off") + ", populate " + (c.populate ? "on" : "off");
  return d;
}

// An element count from a class: zero, one, small odd, medium, large.
int64_t DrawCount(Rng& r) {
  const double u = r.Real(0, 1);
  if (u < 0.05) return 0;
  if (u < 0.15) return 1;
  if (u < 0.50) return r.Int(2, 64);
  if (u < 0.85) return r.Int(65, 4096);
  if (u < 0.98) return r.Int(4097, 40000);
  return r.Int(40001, 120000);
}

// Dims of rank 0-3 with about `count` elements (0-d only for one element).
std::vector<int64_t> DrawDims(Rng& r, int64_t count) {
  if (count == 1 && r.Chance(0.5)) return {};
  const int64_t rank = r.Int(1, 3);
  std::vector<int64_t> dims;
  int64_t rest = count;
  for (int64_t i = 0; i + 1 < rank; ++i) {
    const int64_t d = count == 0 && r.Chance(0.3) ? 0 : r.Int(1, 7);
    dims.push_back(d);
    rest = d ? rest / d : rest;
  }
  dims.push_back(rest);
  std::shuffle(dims.begin(), dims.end(), r.g);
  return dims;
}

std::vector<double> DrawShares(Rng& r, size_t links) {
  std::vector<double> s(links, 0.0);
  const int64_t pattern = r.Int(0, 7);
  const size_t pick = static_cast<size_t>(r.Int(0, static_cast<int64_t>(links) - 1));
  switch (pattern) {
    case 0: s[pick] = 1; break;                           // one link, any of them
    case 1: s.assign(links, 1.0); break;                  // equal
    case 2: for (double& x : s) x = r.Real(0, 1); break;  // random
    case 3: for (double& x : s) x = r.Chance(0.5) ? 0.0 : r.Real(0, 1); break;  // some links idle
    case 4:                                               // a tiny share (less than one 64-byte block)
      for (double& x : s) x = r.Real(0.1, 1);
      s[pick] = std::pow(10.0, r.Real(-7, -2));
      break;
    case 5:                                               // everything but slivers on one link
      for (double& x : s) x = std::pow(10.0, r.Real(-6, -2));
      s[pick] = 1;
      break;
    case 7:                                               // denormal shares (and zeros), alone or beside normal ones
      for (double& x : s) x = r.Chance(0.3) ? 0.0 : std::pow(10.0, -r.Real(308.5, 320));
      if (r.Chance(0.3)) s[pick] = r.Real(0.1, 1);
      break;
    default: s[0] = 1; break;                             // the primary alone
  }
  if (std::accumulate(s.begin(), s.end(), 0.0) <= 0) s[pick] = 1;
  const double sum = std::accumulate(s.begin(), s.end(), 0.0);
  for (double& x : s) x /= sum;  // as set_shares normalises them (on this, the control thread)
  return s;
}

size_t Prod(const std::vector<int64_t>& d) {
  size_t p = 1;
  for (int64_t x : d) p *= static_cast<size_t>(x);
  return p;
}

std::vector<int64_t> OutDims(const Call& c, const Operand& o, int64_t n) {
  if (c.kind == Kind::kAllGather) return {static_cast<int64_t>(Prod(o.dims)) * n};
  std::vector<int64_t> out = o.dims;
  if (c.kind == Kind::kReduceScatter) out[c.axis] /= n;
  return out;
}

// Elements of all inputs and outputs of every rank.
size_t CallElements(const Call& c) {
  size_t total = 0;
  for (const auto& g : c.groups)
    for (const Operand& o : c.operands)
      total += g.size() * (Prod(o.dims) + Prod(OutDims(c, o, static_cast<int64_t>(g.size()))));
  return total;
}

Call MakeCall(Rng& r, const Family& family, size_t max_elements) {
  Call c;
  c.kind = kAllKinds[r.Int(0, kNumKinds - 1)];
  c.op = static_cast<ReduceOp>(r.Int(0, 3));
  std::vector<Layout> usable;
  for (const Layout& l : family.partitions)
    if (Even(l) || c.kind != Kind::kAllToAll) usable.push_back(l);
  c.groups = r.Pick(usable);
  int64_t lcm = 1, nmin = INT64_MAX;
  for (const auto& g : c.groups) {
    lcm = std::lcm(lcm, static_cast<int64_t>(g.size()));
    nmin = std::min(nmin, static_cast<int64_t>(g.size()));
  }
  const double u = r.Real(0, 1);
  const int64_t k = u < 0.55 ? 1 : u < 0.9 ? r.Int(2, 4) : r.Int(5, 13);
  // Shapes first without the kind's constraint, then the constrained axis fixed.
  const int64_t rank = r.Int(0, 3);
  const bool needs_axis = c.kind == Kind::kReduceScatter || c.kind == Kind::kAllToAll;
  for (int64_t i = 0; i < k; ++i) {
    Operand o;
    do {
      o.dtype = r.Pick(kDTypes);
    } while (Reduces(c.kind) && IsComplex(o.dtype) && (c.op == ReduceOp::kMax || c.op == ReduceOp::kMin));
    const int64_t count = DrawCount(r);
    o.dims = DrawDims(r, count);
    if (needs_axis) {  // every operand needs dims[axis] divisible by the group sizes
      while (static_cast<int64_t>(o.dims.size()) < std::max<int64_t>(rank, 1)) o.dims.push_back(r.Int(1, 3));
      if (i == 0) c.axis = r.Int(0, static_cast<int64_t>(o.dims.size()) - 1);
      while (static_cast<int64_t>(o.dims.size()) <= c.axis) o.dims.push_back(r.Int(1, 3));
      const int64_t others = static_cast<int64_t>(Prod(o.dims) / std::max<size_t>(o.dims[c.axis], 1));
      const int64_t blocks = std::max<int64_t>(count / std::max<int64_t>(others * lcm, 1), 0);
      o.dims[c.axis] = lcm * (count == 0 ? 0 : std::max<int64_t>(blocks, 1));
    }
    c.operands.push_back(o);
  }
  if (c.kind == Kind::kAllGather) {
    size_t min_rank = SIZE_MAX;
    for (const Operand& o : c.operands) min_rank = std::min(min_rank, o.dims.size());
    c.axis = r.Int(0, static_cast<int64_t>(min_rank));  // axis == rank: one block per row
  }
  // Keep a case's memory and time bounded: halve the largest operand until it fits.
  while (CallElements(c) > max_elements) {
    auto it = std::max_element(c.operands.begin(), c.operands.end(),
                               [](const Operand& a, const Operand& b) { return Prod(a.dims) < Prod(b.dims); });
    bool halved = false;
    for (size_t d = 0; d < it->dims.size() && !halved; ++d) {
      if (needs_axis && static_cast<int64_t>(d) == c.axis) continue;
      if (it->dims[d] > 1) it->dims[d] /= 2, halved = true;
    }
    if (!halved && needs_axis && it->dims[c.axis] > lcm) it->dims[c.axis] = lcm, halved = true;
    if (!halved) break;
  }
  if (c.kind == Kind::kPpermute) {
    // The same pairs in every group, ranks below the smallest group's size; sources and
    // destinations unique; partial and empty sets included.
    std::vector<int64_t> src(nmin), dst(nmin);
    std::iota(src.begin(), src.end(), 0);
    std::iota(dst.begin(), dst.end(), 0);
    std::shuffle(src.begin(), src.end(), r.g);
    std::shuffle(dst.begin(), dst.end(), r.g);
    const int64_t count = r.Chance(0.5) ? nmin : r.Int(0, nmin);
    for (int64_t i = 0; i < count; ++i) c.pairs.push_back({src[i], dst[i]});
  }
  if (c.kind == Kind::kAllReduce || c.kind == Kind::kPpermute || c.kind == Kind::kAllToAll) {
    for (Operand& o : c.operands) {
      const double p = r.Real(0, 1);
      for (const auto& g : c.groups)
        for (int64_t dev : g)
          if (p > 0.8 || (p > 0.6 && r.Chance(0.5))) o.in_place.insert(dev);
    }
  }
  return c;
}

Case MakeCase(uint64_t seed, int64_t index, const std::vector<Family>& families, size_t links) {
  Rng r(Mix(seed, 0x1000 + static_cast<uint64_t>(index)));
  Case c;
  c.index = index;
  c.link_set = static_cast<int>(index % kLinkSets);
  const Family& family = r.Pick(families);
  c.devices = family.devices;
  const double u = r.Real(0, 1);
  const int64_t calls = u < 0.6 ? 1 : u < 0.85 ? 2 : 3;
  for (int64_t i = 0; i < calls; ++i) c.calls.push_back(MakeCall(r, family, kMaxCaseElements / calls));
  c.shares = DrawShares(r, links);
  c.pinned = r.Chance(0.8);
  c.staging_bytes = r.Pick(std::vector<size_t>{0, 1024, 16 << 10, 16 << 10, 1 << 20});
  c.streaming_bytes = r.Pick(std::vector<size_t>{256 << 10, 256 << 10, 4096});
  c.huge_pages = r.Chance(0.8);
  c.populate = r.Chance(0.2);
  c.data_seed = static_cast<uint32_t>(r.g());
  return c;
}

// ---- Running and checking one case.

// A 64-byte-aligned buffer with a canary tail.
struct Buffer {
  std::vector<uint8_t> mem;
  size_t bytes = 0;
  uint8_t* data() { return mem.data() + Offset(); }
  size_t Offset() const { return (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64) % 64; }
  void Assign(const std::vector<uint8_t>& v) {
    bytes = v.size();
    mem.assign(bytes + kCanaryBytes + 64, 0);
    std::memset(data() + bytes, kCanary, kCanaryBytes);
    if (bytes) std::memcpy(data(), v.data(), bytes);
  }
  bool CanaryIntact() {
    const uint8_t* p = data() + bytes;
    return std::all_of(p, p + kCanaryBytes, [](uint8_t b) { return b == kCanary; });
  }
  std::vector<uint8_t> Contents() { return std::vector<uint8_t>(data(), data() + bytes); }
};

struct Outcome {
  bool ok = true;
  std::string why;
  void Fail(const std::string& w) {
    if (ok) why = w;
    ok = false;
  }
};

// One call's buffers: [device][operand].
struct CallBuffers {
  std::map<int64_t, std::vector<std::vector<uint8_t>>> original;
  std::map<int64_t, std::vector<Buffer>> in, out;
};

const std::vector<int64_t>& GroupOf(const Call& c, int64_t dev, int* rank) {
  for (const auto& g : c.groups)
    for (size_t r = 0; r < g.size(); ++r)
      if (g[r] == dev) {
        *rank = static_cast<int>(r);
        return g;
      }
  static const std::vector<int64_t> none;
  return none;
}

std::vector<OperandRequest> Requests(const Call& c, CallBuffers& b, int64_t dev, int64_t n,
                                     std::vector<std::vector<int64_t>>* out_dims) {
  const size_t k = c.operands.size();
  std::vector<OperandRequest> reqs(k);
  out_dims->assign(k, {});
  for (size_t i = 0; i < k; ++i) {
    const Operand& o = c.operands[i];
    (*out_dims)[i] = OutDims(c, o, n);
    reqs[i].in_dtype = reqs[i].out_dtype = o.dtype;
    reqs[i].in_dims = o.dims;
    reqs[i].out_dims = (*out_dims)[i];
    reqs[i].in = b.in[dev][i].data();
    reqs[i].out = o.in_place.count(dev) ? b.in[dev][i].data() : b.out[dev][i].data();
  }
  return reqs;
}

using RangeList = std::vector<std::pair<uint64_t, uint64_t>>;

std::string RangesText(const RangeList& ranges) {
  std::string s;
  for (const auto& [b, e] : ranges) s += " [" + std::to_string(b) + "," + std::to_string(e) + ")";
  return s;
}

void CheckCall(const Call& c, size_t ci, CallBuffers& b, const std::map<int64_t, std::vector<Status>>& status,
               Outcome* result) {
  const size_t k = c.operands.size();
  for (const auto& g : c.groups)
    for (size_t r = 0; r < g.size() && result->ok; ++r) {
      const int64_t dev = g[r];
      const std::string who = "call " + std::to_string(ci) + " device " + std::to_string(dev) + " (rank " +
                              std::to_string(r) + ")";
      if (!status.at(dev)[ci].ok()) {
        result->Fail(who + " failed: " + status.at(dev)[ci].message());
        return;
      }
      for (size_t i = 0; i < k && result->ok; ++i) {
        const Operand& o = c.operands[i];
        std::vector<const uint8_t*> srcs;
        for (int64_t peer : g) srcs.push_back(b.original[peer][i].data());
        const auto want = RefCollective(c.kind, c.op, o.dtype, o.dims, c.axis, c.pairs, srcs, static_cast<int>(r));
        const bool inplace = o.in_place.count(dev) > 0;
        Buffer& got = inplace ? b.in[dev][i] : b.out[dev][i];
        const std::string where = who + " operand " + std::to_string(i) + (inplace ? " (in place)" : "");
        const size_t wrong = CountWrong(o.dtype, got.Contents(), want);
        if (wrong)
          result->Fail(where + ": " + (wrong == SIZE_MAX ? std::string("wrong size") : std::to_string(wrong) + " wrong elements"));
        else if (!got.CanaryIntact())
          result->Fail(where + ": wrote past the end of its output");
        else if (!inplace && b.in[dev][i].Contents() != b.original[dev][i])
          result->Fail(where + ": changed its input");
        else if (!inplace && !b.in[dev][i].CanaryIntact())
          result->Fail(where + ": wrote past the end of its input");
      }
    }
}

Outcome RunCase(const Case& c) {
  SetShmStagingBytes(c.staging_bytes);
  SetShmStreamingSeparateBytes(c.streaming_bytes);
  SetHugePageOutputs(c.huge_pages);
  SetPopulateOutputs(c.populate);
  Outcome result;
  std::vector<CallBuffers> bufs(c.calls.size());
  std::vector<std::vector<int64_t>> flat(c.calls.size()), sizes(c.calls.size()), flat_pairs(c.calls.size());
  for (size_t ci = 0; ci < c.calls.size(); ++ci) {
    const Call& call = c.calls[ci];
    for (const auto& g : call.groups) {
      flat[ci].insert(flat[ci].end(), g.begin(), g.end());
      sizes[ci].push_back(static_cast<int64_t>(g.size()));
    }
    for (const auto& [s, d] : call.pairs) flat_pairs[ci].insert(flat_pairs[ci].end(), {s, d});
    // Inputs: random values seeded by case, call, operand and device.
    const bool with_nan = call.op == ReduceOp::kMax || call.op == ReduceOp::kMin;
    for (const auto& g : call.groups)
      for (int64_t dev : g)
        for (size_t i = 0; i < call.operands.size(); ++i) {
          const Operand& o = call.operands[i];
          bufs[ci].original[dev].push_back(RandomData(
              o.dtype, Prod(o.dims), c.data_seed + static_cast<uint32_t>(104729 * ci + 131 * i + 7919 * dev), with_nan));
          bufs[ci].in[dev].emplace_back().Assign(bufs[ci].original[dev][i]);
          const size_t out_bytes = Prod(OutDims(call, o, static_cast<int64_t>(g.size()))) * ByteWidth(o.dtype);
          bufs[ci].out[dev].emplace_back().Assign(std::vector<uint8_t>(out_bytes, 0xAB));
        }
  }

  // Pin the shares on the plan bucket of every call on every group (groups of other sizes have other
  // message sizes), and work out the ranges the executor must cut there: one record per rank.
  const size_t links = c.shares.size();
  std::multiset<std::pair<std::string, RangeList>> expected;
  for (size_t ci = 0; ci < c.calls.size(); ++ci) {
    const Call& call = c.calls[ci];
    for (const auto& g : call.groups) {
      const int n = static_cast<int>(g.size());
      std::vector<std::vector<int64_t>> out_dims;
      const std::vector<OperandRequest> reqs = Requests(call, bufs[ci], g[0], n, &out_dims);
      CallRequest req;
      req.kind = call.kind;
      req.reduction = Name(call.op);
      req.axis = call.axis;
      req.pairs = flat_pairs[ci];
      req.operands = reqs;
      CallDesc desc;
      Status s = DescribeCall(req, n, "fuzz", &desc);
      if (!s.ok()) {
        result.Fail("call " + std::to_string(ci) + " is invalid (a bug of the fuzzer): " + s.message());
        return result;
      }
      s = SetShares(call.kind, plan::BucketOf(MessageBytes(desc, n)), c.shares, c.pinned);
      if (!s.ok()) {
        result.Fail("set_shares: " + s.message());
        return result;
      }
      if (links > 1 && n > 1 && desc.total_units() > 0) {
        RangeList ranges;
        std::thread([&] {  // cut as a device thread does (denormal shares read as 0 there)
          FlushDenormalsLikeXla();
          for (const auto& range : plan::CutRanges(desc.virtual_bytes(), 1, c.shares)) ranges.emplace_back(range.begin, range.end);
        }).join();
        for (int r = 0; r < n; ++r) expected.insert({FormatIds(g), ranges});
      }
    }
  }

  (void)TakeSplitRecords();
  std::map<int64_t, std::vector<Status>> status;
  for (int64_t dev : c.devices) status[dev].assign(c.calls.size(), Status());
  std::vector<std::thread> threads;
  const int64_t run = NextRunId();
  for (int64_t dev : c.devices)
    threads.emplace_back([&, dev] {
      FlushDenormalsLikeXla();
      // This device's calls one after another, as a program runs them: a fast rank starts its next
      // call while its peers still finish the last one.
      for (size_t ci = 0; ci < c.calls.size(); ++ci) {
        const Call& call = c.calls[ci];
        int rank = 0;
        const int64_t n = static_cast<int64_t>(GroupOf(call, dev, &rank).size());
        std::vector<std::vector<int64_t>> out_dims;
        const std::vector<OperandRequest> reqs = Requests(call, bufs[ci], dev, n, &out_dims);
        CollectiveArgs a;
        a.groups = flat[ci];
        a.group_sizes = sizes[ci];
        a.device = dev;
        a.run_id = run;
        a.label = "fuzz_test";
        a.request.kind = call.kind;
        a.request.reduction = Name(call.op);
        a.request.axis = call.axis;
        a.request.pairs = flat_pairs[ci];
        a.request.operands = reqs;
        status[dev][ci] = RunCollective(a);
        if (!status[dev][ci].ok()) break;  // a program stops at its first failing call
      }
    });
  for (auto& t : threads) t.join();

  for (size_t ci = 0; ci < c.calls.size() && result.ok; ++ci) CheckCall(c.calls[ci], ci, bufs[ci], status, &result);
  // One split per call: every rank of a call cut the same ranges. Pinned, they are the forced
  // shares' ranges; else stage 2 may move them from call to call (the same for all ranks).
  if (result.ok && links > 1) {
    std::multiset<std::pair<std::string, RangeList>> seen;
    std::map<std::pair<std::string, uint64_t>, RangeList> per_call;
    for (const SplitRecord& rec : TakeSplitRecords()) {
      seen.insert({rec.group, rec.ranges});
      auto [it, fresh] = per_call.emplace(std::make_pair(rec.group, rec.call), rec.ranges);
      if (!fresh && it->second != rec.ranges && result.ok)
        result.Fail("group " + rec.group + " call " + std::to_string(rec.call) + ": rank " + std::to_string(rec.rank) +
                    " cut" + RangesText(rec.ranges) + ", another rank" + RangesText(it->second));
    }
    if (result.ok && seen.size() != expected.size())
      result.Fail("split records: " + std::to_string(seen.size()) + ", one per rank of each multi-link call: " +
                  std::to_string(expected.size()));
    if (result.ok && c.pinned && seen != expected) {
      std::string text;
      for (const auto& [g, ranges] : seen)
        if (expected.count({g, ranges}) != seen.count({g, ranges})) text += " group " + g + " cut" + RangesText(ranges) + ";";
      for (const auto& [g, ranges] : expected)
        if (expected.count({g, ranges}) != seen.count({g, ranges})) text += " group " + g + " should cut" + RangesText(ranges) + ";";
      result.Fail("the split records differ from the forced shares' ranges:" + text);
    }
  }
  return result;
}

struct Options {
  uint64_t seed = 0;
  bool seed_given = false;
  int64_t cases = 3000;
  int64_t only = -1;
  bool verbose = false;
};

bool ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "fuzz_test: %s needs a value\n", name);
        return nullptr;
      }
      return argv[++i];
    };
    char* end = nullptr;
    if (a == "--seed") {
      const char* v = value("--seed");
      if (!v) return false;
      o->seed = std::strtoull(v, &end, 0);
      o->seed_given = true;
    } else if (a == "--cases") {
      const char* v = value("--cases");
      if (!v) return false;
      o->cases = std::strtoll(v, &end, 0);
    } else if (a == "--case") {
      const char* v = value("--case");
      if (!v) return false;
      o->only = std::strtoll(v, &end, 0);
    } else if (a == "--verbose") {
      o->verbose = true;
      continue;
    } else {
      std::fprintf(stderr, "usage: fuzz_test [--seed S] [--cases N] [--case K] [--verbose]\n");
      return false;
    }
    if (!end || *end != '\0') {
      std::fprintf(stderr, "fuzz_test: %s: not a number: %s\n", a.c_str(), argv[i]);
      return false;
    }
  }
  if (o->cases < 0 || (o->only >= 0 && o->only >= o->cases)) {
    std::fprintf(stderr, "fuzz_test: --case K needs 0 <= K < --cases N\n");
    return false;
  }
  if (!o->seed_given) o->seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Options opt;
  if (!ParseArgs(argc, argv, &opt)) return 2;
  std::printf("fuzz_test --seed %llu --cases %lld%s\n", static_cast<unsigned long long>(opt.seed),
              static_cast<long long>(opt.cases), opt.seed_given ? "" : "   (random seed; pass it to repeat this run)");
  SetTimeoutSeconds(30);  // a hang fails its case within the deadline instead of stalling the run
  SetAutotune(0);         // no stage 1: the pinned shares decide every split
  SetRecordSplits(true);
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::string> sets = MakeLinkSets(opt.seed);
  int failures = 0;
  int64_t ran = 0, calls = 0;
  std::map<std::string, int64_t> per_kind;
  for (int s = 0; s < kLinkSets && failures < 10; ++s) {
    if (opt.only >= 0 && opt.only % kLinkSets != s) continue;
    Status st = ConfigureLinks(sets[s]);
    Expect(st.ok(), "configure links \"" + sets[s] + "\": " + st.message());
    if (!st.ok()) continue;
    const size_t links = CurrentLinkSet()->links.size();
    const std::vector<Family> families = MakeFamilies(opt.seed, s);
    const auto ts = std::chrono::steady_clock::now();
    int64_t here = 0;
    for (int64_t i = s; i < opt.cases && failures < 10; i += kLinkSets) {
      if (opt.only >= 0 && i != opt.only) continue;
      const Case c = MakeCase(opt.seed, i, families, links);
      const auto tc = std::chrono::steady_clock::now();
      const Outcome out = RunCase(c);
      if (opt.verbose)
        std::printf("%.1f ms %s\n", 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - tc).count(),
                    Describe(c, sets[s]).c_str());
      Expect(out.ok, Describe(c, sets[s]) + ": " + out.why);
      if (!out.ok) {
        ++failures;
        std::printf("  reproduce: fuzz_test --seed %llu --cases %lld --case %lld\n",
                    static_cast<unsigned long long>(opt.seed), static_cast<long long>(opt.cases),
                    static_cast<long long>(i));
      }
      for (const Call& call : c.calls) ++per_kind[std::string(Name(call.kind))];
      calls += static_cast<int64_t>(c.calls.size());
      ++ran, ++here;
    }
    std::printf("links \"%s\": %lld cases, %.1f s\n", sets[s].c_str(), static_cast<long long>(here),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - ts).count());
  }
  SetRecordSplits(false);
  std::string kinds;
  for (const auto& [name, count] : per_kind) kinds += " " + name + " " + std::to_string(count);
  std::printf("fuzz: seed %llu, %lld cases, %lld calls (%s ) in %.1f s%s\n", static_cast<unsigned long long>(opt.seed),
              static_cast<long long>(ran), static_cast<long long>(calls), kinds.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              failures >= 10 ? "; stopped after 10 failures" : "");
  return Summary();
}
