#include "xla_ffi/core/profile_calls.h"

#include <algorithm>
#include <cstdio>

#include "xla_ffi/core/config.h"
#include "xla_ffi/plan/tuning_cache.h"

namespace flexlink {

std::vector<uint64_t> StageOneSizes(uint64_t top) {
  std::vector<uint64_t> sizes;
  for (uint64_t s = kMinProfileBytes; s <= top; s *= s < kCoarseProfileBytes ? 2 : 4) sizes.push_back(s);
  if (sizes.empty() || sizes.back() != top) sizes.push_back(top);
  return sizes;
}

std::string ProfileCachePath() {
  std::string path = TuneCachePath();
  return path.empty() ? plan::DefaultCachePath() : path;
}

bool LoadCachedModel(const plan::CacheKey& key, const std::vector<std::string>& names, Kind kind,
                     uint64_t needed_bytes, plan::CostModel* out) {
  plan::TuneRecord rec;
  std::string warning;
  const bool found = plan::LoadTuning(ProfileCachePath(), key, &rec, &warning);
  plan::ReportCacheProblem(warning);
  if (!found || rec.model.links() != names || !rec.model.Has(kind)) return false;
  if (rec.model.ProfiledBytes(kind) < needed_bytes) return false;  // profiled at smaller sizes only
  *out = std::move(rec.model);
  return true;
}

void StoreProfiledModel(const plan::CacheKey& key, const std::vector<std::string>& names, Kind kind,
                        const plan::CostModel& model, uint64_t max_bytes) {
  const std::string path = ProfileCachePath();
  plan::TuneRecord rec;
  std::string warning;
  plan::CostModel stored = model;
  if (plan::LoadTuning(path, key, &rec, &warning) && rec.model.links() == names) {
    for (size_t k = 0; k < plan::kNumKinds; ++k) {
      const Kind other = static_cast<Kind>(k);
      if (other != kind && rec.model.Has(other)) stored.CopyKind(rec.model, other);
    }
    max_bytes = std::max(max_bytes, rec.max_bytes);
  }
  Status saved = plan::StoreTuning(path, plan::TuneRecord{key, stored, max_bytes}, &warning);
  plan::ReportCacheProblem(saved.ok() ? warning : saved.message());
}

CallDesc ProfileDesc(Kind kind, uint64_t message, int n, void* in, void* out) {
  CallDesc d;
  d.kind = kind;
  d.op = ReduceOp::kSum;
  Part p;
  p.dtype = DType::kF32;
  p.in = in;
  p.out = out;
  const size_t elems = message / sizeof(float);
  p.units = kind == Kind::kAllReduce || kind == Kind::kPpermute ? elems : std::max<size_t>(1, elems / n);
  p.outer = 1;
  p.inner = p.units;
  d.AddPart(p);
  if (kind == Kind::kPpermute) {
    for (int r = 0; r < n; ++r) d.sources.push_back((r + n - 1) % n);
  }
  return d;
}

std::string SplitThresholdText(uint64_t t) {
  return t == plan::kNeverSplit ? std::string("never split (one link alone is faster)")
                                : "split from " + std::to_string(t) + " B per call";
}

std::string DescribeFits(const std::vector<std::string>& names, std::span<const plan::AlphaBeta> fits) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "%s%s a=%.1fus bw=%.3gGB/s", i ? ", " : "", names[i].c_str(),
                  fits[i].alpha * 1e6, fits[i].bytes_per_second() * 1e-9);
    s += buf;
  }
  return s;
}

}  // namespace flexlink
