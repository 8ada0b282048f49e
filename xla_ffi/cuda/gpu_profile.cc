// Stage 1 on the device (see gpu_profile.h). The arithmetic is the CPU engine's
// (core/executor_profile.cc): the same sizes, repetitions, fits, split check, measured threshold
// and tuning cache entries; only the timing differs (CUDA events on the profile stream, read later,
// a step's time being the slowest rank's elapsed time between its start and stop events).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/profile_calls.h"
#include "xla_ffi/cuda/gpu_executor.h"
#include "xla_ffi/plan/cost_model.h"
#include "xla_ffi/plan/shares.h"
#include "xla_ffi/plan/tuning_cache.h"

namespace flexlink::gpu {

struct ProfileStep {
  size_t size = 0;              // index into sizes
  size_t rep = 0;
  size_t link = 0;              // alone: the link
  std::vector<double> shares;   // split steps: the fitted split
  bool paired = false;          // phase 1: the fastest link alone, paired with the split after it
};

struct ProfileSession {
  Kind kind = Kind::kAllReduce;
  std::vector<uint64_t> sizes;  // message sizes (nccl-tests bytes), ascending
  int warmup = 1, iters = 2;
  int phase = 0;
  std::vector<ProfileStep> steps;    // of the current phase
  std::vector<double> times;         // per step: the slowest rank's seconds
  std::vector<int> enqueued;         // per rank: the phase it enqueued (-1: none yet)
  std::vector<char> read;            // per rank: read its events of the current phase
  std::vector<double> alone;         // [link][size][rep]
  std::vector<double> split, paired; // [size][rep]
  plan::CostModel model;
  std::chrono::steady_clock::time_point started;
  bool failed = false;
  size_t reps() const { return static_cast<size_t>(warmup + iters); }
};

namespace {

size_t FirstRep(const ProfileSession& s, size_t size) {
  return s.sizes[size] > kCoarseProfileBytes ? static_cast<size_t>(s.warmup) : 0;
}

double Best(const ProfileSession& s, const std::vector<double>& table, size_t first) {
  double b = std::numeric_limits<double>::infinity();
  for (size_t r = s.warmup; r < s.reps(); ++r) b = std::min(b, table[first + r]);
  return b;
}

// Message sizes of the profiled calls.
std::vector<double> Messages(const ProfileSession& s, int n) {
  std::vector<double> m;
  for (uint64_t size : s.sizes)
    m.push_back(static_cast<double>(MessageBytes(ProfileDesc(s.kind, size, n, nullptr, nullptr), n)));
  return m;
}

}  // namespace

bool GpuProfiler::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return session_ != nullptr;
}

bool GpuProfiler::LoadCachedFits(Kind kind, uint64_t needed_bytes) {
  const std::string path = ProfileCachePath();
  plan::TuneRecord rec;
  std::string warning;
  const bool found = plan::LoadTuning(path, {plan::HostName(), ex_.links_->spec, ex_.group_.size()}, &rec, &warning);
  plan::ReportCacheProblem(warning);  // a bad cache is never silent, whatever FLEXLINK_DEBUG says
  if (!found || rec.model.links() != ex_.names_ || !rec.model.Has(kind)) return false;
  if (rec.model.ProfiledBytes(kind) < needed_bytes) return false;
  if (!ex_.balancer_.MergeModel(rec.model).ok()) return false;
  LogInfo("stage 1 for " + std::string(Name(kind)) + " on GPU group " + FormatIds(ex_.group_.ids) + " from cache " +
          path + ": " + DescribeFits(ex_.names_, rec.model.Fits(kind)));
  return true;
}

ProfileAction GpuProfiler::Decide(Kind kind, uint64_t message_bytes, std::shared_ptr<const plan::Plan>* plan) {
  if ((*plan)->mode != plan::PlanMode::kProfile) return {};
  const int n = ex_.group_.size();
  const size_t links = ex_.names_.size();
  std::lock_guard<std::mutex> lock(mu_);
  if (!session_) {
    if (failed_[static_cast<size_t>(kind)]) return {};
    if (TuneUseCache() && LoadCachedFits(kind, ProfileTopBytes(message_bytes))) {
      *plan = ex_.balancer_.PlanFor(kind, message_bytes);
      return {};
    }
    auto s = std::make_shared<ProfileSession>();
    s->kind = kind;
    const uint64_t top = ProfileTopBytes(message_bytes);
    for (uint64_t size = kMinProfileBytes; size <= top; size *= size < kCoarseProfileBytes ? 2 : 4)
      s->sizes.push_back(size);
    if (s->sizes.back() != top) s->sizes.push_back(top);
    s->model = plan::CostModel(ex_.names_);
    s->alone.assign(links * s->sizes.size() * s->reps(), 0.0);
    s->split.assign(s->sizes.size() * s->reps(), 0.0);
    s->paired.assign(s->sizes.size() * s->reps(), 0.0);
    for (size_t l = 0; l < links; ++l)
      for (size_t i = 0; i < s->sizes.size(); ++i)
        for (size_t r = FirstRep(*s, i); r < s->reps(); ++r) s->steps.push_back({i, r, l, {}, false});
    s->times.assign(s->steps.size(), 0.0);
    s->enqueued.assign(n, -1);
    s->read.assign(n, 0);
    s->started = std::chrono::steady_clock::now();
    session_ = s;
    return {s, 0};
  }
  ProfileSession& s = *session_;
  if (s.kind != kind) return {};
  if (s.failed) {
    failed_[static_cast<size_t>(kind)] = true;
    LogInfo("stage 1 for " + std::string(Name(kind)) + " on GPU group " + FormatIds(ex_.group_.ids) +
            " failed; its calls stay on " + ex_.names_[0]);
    session_.reset();
    return {};
  }
  if (std::count(s.read.begin(), s.read.end(), 1) < n) return {};  // still on the device
  if (s.phase == 0) {
    // Fit every link from the alone phase, then plan the split check.
    for (size_t t = 0; t < s.steps.size(); ++t) {
      const ProfileStep& st = s.steps[t];
      s.alone[(st.link * s.sizes.size() + st.size) * s.reps() + st.rep] = s.times[t];
    }
    const std::vector<double> message = Messages(s, n);
    for (size_t l = 0; l < links; ++l) {
      std::vector<plan::Sample> samples;
      for (size_t i = 0; i < s.sizes.size(); ++i)
        samples.push_back({message[i], Best(s, s.alone, (l * s.sizes.size() + i) * s.reps())});
      plan::AlphaBeta fit;
      if (!plan::FitAlphaBeta(samples, &fit).ok()) fit = plan::AlphaBeta{0, samples.back().seconds / samples.back().bytes};
      s.model.Set(kind, l, fit);
    }
    std::vector<ProfileStep> steps;
    for (size_t i = 0; i < s.sizes.size(); ++i) {
      std::vector<double> shares = plan::EqualFinishShares(s.model.Fits(kind), message[i]);
      plan::DropBelow(shares, ex_.balancer_.options().min_share);
      if (plan::CountUsed(shares) < 2) continue;
      const size_t fastest = plan::FastestSingle(s.model.Fits(kind), message[i]);
      for (size_t r = FirstRep(s, i); r < s.reps(); ++r) {
        steps.push_back({i, r, fastest, {}, true});
        steps.push_back({i, r, 0, shares, false});
      }
    }
    if (!steps.empty()) {
      s.phase = 1;
      s.steps = std::move(steps);
      s.times.assign(s.steps.size(), 0.0);
      std::fill(s.read.begin(), s.read.end(), 0);
      return {session_, 1};
    }
  } else {
    for (size_t t = 0; t < s.steps.size(); ++t) {
      const ProfileStep& st = s.steps[t];
      (st.paired ? s.paired : s.split)[st.size * s.reps() + st.rep] = s.times[t];
    }
  }
  Finish(s);
  session_.reset();
  *plan = ex_.balancer_.PlanFor(kind, message_bytes);
  return {};
}

void GpuProfiler::Finish(ProfileSession& s) {
  const int n = ex_.group_.size();
  const size_t links = ex_.names_.size();
  const std::vector<double> message = Messages(s, n);
  std::vector<double> split(s.sizes.size()), paired(s.sizes.size());
  for (size_t i = 0; i < s.sizes.size(); ++i) {
    double best_alone = std::numeric_limits<double>::infinity();
    for (size_t l = 0; l < links; ++l)
      best_alone = std::min(best_alone, Best(s, s.alone, (l * s.sizes.size() + i) * s.reps()));
    split[i] = Best(s, s.split, i * s.reps());
    paired[i] = split[i] > 0 ? Best(s, s.paired, i * s.reps()) : best_alone;
  }
  const auto& opts = ex_.balancer_.options();
  const uint64_t threshold = plan::MeasuredSplitThreshold(
      message, paired, split, opts.min_split_gain, plan::SplitThreshold(s.model.Fits(s.kind), opts.split_overhead_s));
  s.model.SetMeasuredThreshold(s.kind, threshold);
  s.model.SetProfiledBytes(s.kind, s.sizes.back());
  Status merged = ex_.balancer_.MergeModel(s.model);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - s.started).count();
  LogInfo("stage 1 for " + std::string(Name(s.kind)) + " on GPU group " + FormatIds(ex_.group_.ids) + " (" +
          std::to_string(secs).substr(0, 5) + " s): " + DescribeFits(ex_.names_, s.model.Fits(s.kind)) + "; " +
          (threshold == plan::kNeverSplit ? std::string("never split") : "split from " + std::to_string(threshold) + " B"));
  if (!merged.ok()) return;
  // Persist, keeping what the cache holds for the other kinds of this key.
  const std::string path = ProfileCachePath();
  plan::TuneRecord rec;
  std::string warning;
  const plan::CacheKey key{plan::HostName(), ex_.links_->spec, n};
  plan::CostModel stored = s.model;
  uint64_t max_bytes = s.sizes.back();
  if (plan::LoadTuning(path, key, &rec, &warning) && rec.model.links() == ex_.names_) {
    for (Kind other : kAllKinds)
      if (other != s.kind && rec.model.Has(other)) stored.CopyKind(rec.model, other);
    max_bytes = std::max(max_bytes, rec.max_bytes);
  }
  Status saved = plan::StoreTuning(path, plan::TuneRecord{key, stored, max_bytes}, &warning);
  plan::ReportCacheProblem(saved.ok() ? warning : saved.message());
}

Status GpuProfiler::Enqueue(const ProfileAction& action, int rank, Stream stream, std::string_view label) {
  ProfileSession& s = *action.session;
  GpuExecutor::Rank& k = ex_.ranks_[rank];
  DeviceApi& api = ex_.api_;
  const int n = ex_.group_.size();
  const int dev = ex_.group_.devices[rank];
  const size_t links = ex_.names_.size();
  const std::vector<ProfileStep>& steps = s.steps;  // fixed for this phase (Decide made it)
  // Events: start and stop per step, then one per link of each split step.
  const size_t needed = 2 * steps.size() + steps.size() * links;
  const std::string where = ErrorPrefix(label) + "stage 1 on group " + FormatIds(ex_.group_.ids) + ": ";
  auto check = [&](Status st) {
    if (st.ok()) return st;
    std::lock_guard<std::mutex> lock(mu_);
    s.failed = true;
    return st.message().rfind("flexlink:", 0) == 0 ? st : Status(st.code(), where + st.message());
  };
  while (k.profile_events.size() < needed) {
    Event e = nullptr;
    FLEXLINK_RETURN_IF_ERROR(check(api.CreateEvent(dev, true, &e)));
    k.profile_events.push_back(e);
  }
  const CallDesc largest = ProfileDesc(s.kind, s.sizes.back(), n, nullptr, nullptr);
  const size_t in_bytes = largest.in_count(largest.parts[0], n) * sizeof(float);
  const size_t out_bytes = largest.out_count(largest.parts[0], n) * sizeof(float);
  void *in = nullptr, *out = nullptr;
  FLEXLINK_RETURN_IF_ERROR(check(api.Record(k.profile_fork, stream)));
  FLEXLINK_RETURN_IF_ERROR(check(api.Wait(k.profile, k.profile_fork)));
  FLEXLINK_RETURN_IF_ERROR(check(api.MallocAsync(in_bytes, k.profile, &in)));
  FLEXLINK_RETURN_IF_ERROR(check(api.MallocAsync(out_bytes, k.profile, &out)));
  // Zeros: sums and gathers of them are exact, whatever the split.
  FLEXLINK_RETURN_IF_ERROR(check(api.Zero(in, in_bytes, k.profile)));
  FLEXLINK_RETURN_IF_ERROR(check(api.Zero(out, out_bytes, k.profile)));
  const std::string step_label = "stage 1 of " + std::string(label);
  std::vector<Piece> pieces;
  for (size_t t = 0; t < steps.size(); ++t) {
    const ProfileStep& st = steps[t];
    const CallDesc d = ProfileDesc(s.kind, s.sizes[st.size], n, in, out);
    Event start = k.profile_events[2 * t], stop = k.profile_events[2 * t + 1];
    FLEXLINK_RETURN_IF_ERROR(check(api.Record(start, k.profile)));
    if (st.shares.empty()) {
      d.AllPieces(&pieces);
      FLEXLINK_RETURN_IF_ERROR(check(ex_.channels_[st.link]->Enqueue(GpuWork{&d, rank, pieces, k.profile, step_label})));
    } else {
      const auto ranges = plan::CutRanges(d.virtual_bytes(), 1, st.shares);
      for (size_t l = 0; l < links; ++l) {
        if (ranges[l].empty()) continue;
        Event end = k.profile_events[2 * steps.size() + t * links + l];
        d.PiecesOf(UnitRange{ranges[l].begin, ranges[l].end}, &pieces);
        FLEXLINK_RETURN_IF_ERROR(check(api.Wait(k.side[l], start)));
        FLEXLINK_RETURN_IF_ERROR(check(ex_.channels_[l]->Enqueue(GpuWork{&d, rank, pieces, k.side[l], step_label})));
        FLEXLINK_RETURN_IF_ERROR(check(api.Record(end, k.side[l])));
        FLEXLINK_RETURN_IF_ERROR(check(api.Wait(k.profile, end)));
      }
    }
    FLEXLINK_RETURN_IF_ERROR(check(api.Record(stop, k.profile)));
  }
  FLEXLINK_RETURN_IF_ERROR(check(api.FreeAsync(in, k.profile)));
  FLEXLINK_RETURN_IF_ERROR(check(api.FreeAsync(out, k.profile)));
  FLEXLINK_RETURN_IF_ERROR(check(api.Record(k.profile_join, k.profile)));
  FLEXLINK_RETURN_IF_ERROR(check(api.Wait(stream, k.profile_join)));
  std::lock_guard<std::mutex> lock(mu_);
  s.enqueued[rank] = action.phase;
  return Status::Ok();
}

void GpuProfiler::Poll(int rank) {
  std::shared_ptr<ProfileSession> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = session_;
    if (!s || s->enqueued[rank] != s->phase || s->read[rank]) return;
  }
  GpuExecutor::Rank& k = ex_.ranks_[rank];
  DeviceApi& api = ex_.api_;
  std::string error;
  const size_t steps = s->steps.size();
  const gpu::Poll p = api.Query(k.profile_events[2 * steps - 1], &error);  // the phase's last stop
  if (p == gpu::Poll::kPending) return;
  std::vector<double> times(steps, 0.0);
  bool ok = p == gpu::Poll::kDone;
  for (size_t t = 0; ok && t < steps; ++t)
    ok = api.ElapsedSeconds(k.profile_events[2 * t], k.profile_events[2 * t + 1], &times[t]).ok();
  std::lock_guard<std::mutex> lock(mu_);
  if (!ok) s->failed = true;
  for (size_t t = 0; t < steps; ++t) s->times[t] = std::max(s->times[t], times[t]);
  s->read[rank] = 1;
}

}  // namespace flexlink::gpu
