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

namespace {

size_t FirstRep(std::span<const uint64_t> sizes, size_t size) {
  return sizes[size] > kCoarseProfileBytes ? static_cast<size_t>(ProfileSession::kWarmup) : 0;
}

double Best(const std::vector<double>& table, size_t first) {
  double b = std::numeric_limits<double>::infinity();
  for (size_t r = ProfileSession::kWarmup; r < ProfileSession::reps(); ++r) b = std::min(b, table[first + r]);
  return b;
}

// Message sizes of the profiled calls.
std::vector<double> Messages(Kind kind, std::span<const uint64_t> sizes, int n) {
  std::vector<double> m;
  for (uint64_t size : sizes)
    m.push_back(static_cast<double>(MessageBytes(ProfileDesc(kind, size, n, nullptr, nullptr), n)));
  return m;
}

}  // namespace

void ProfileSession::Begin(Kind k, uint64_t top, const std::vector<std::string>& names) {
  kind = k;
  sizes = StageOneSizes(top);
  model = plan::CostModel(names);
  const size_t links = names.size();
  alone.assign(links * sizes.size() * reps(), 0.0);
  split.assign(sizes.size() * reps(), 0.0);
  paired.assign(sizes.size() * reps(), 0.0);
  steps = AloneSteps(links, sizes);
  times.assign(steps.size(), 0.0);
  phase = 0;
  started = std::chrono::steady_clock::now();
}

std::vector<ProfileStep> AloneSteps(size_t links, std::span<const uint64_t> sizes) {
  std::vector<ProfileStep> steps;
  for (size_t l = 0; l < links; ++l)
    for (size_t i = 0; i < sizes.size(); ++i)
      for (size_t r = FirstRep(sizes, i); r < ProfileSession::reps(); ++r) steps.push_back({i, r, l, {}, false});
  return steps;
}

std::vector<ProfileStep> SplitSteps(Kind kind, std::span<const plan::AlphaBeta> fits, std::span<const uint64_t> sizes,
                                    int n, double min_share) {
  const std::vector<double> message = Messages(kind, sizes, n);
  std::vector<ProfileStep> steps;
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<double> shares = plan::EqualFinishShares(fits, message[i]);
    plan::DropBelow(shares, min_share);
    if (plan::CountUsed(shares) < 2) continue;
    const size_t fastest = plan::FastestSingle(fits, message[i]);
    for (size_t r = FirstRep(sizes, i); r < ProfileSession::reps(); ++r) {
      steps.push_back({i, r, fastest, {}, true});
      steps.push_back({i, r, 0, shares, false});
    }
  }
  return steps;
}

bool ProfileSession::FitAlone(int n, double min_share) {
  for (size_t t = 0; t < steps.size(); ++t) {
    const ProfileStep& st = steps[t];
    alone[(st.link * sizes.size() + st.size) * reps() + st.rep] = times[t];
  }
  const std::vector<double> message = Messages(kind, sizes, n);
  for (size_t l = 0; l < model.links().size(); ++l) {
    std::vector<plan::Sample> samples;
    for (size_t i = 0; i < sizes.size(); ++i)
      samples.push_back({message[i], Best(alone, (l * sizes.size() + i) * reps())});
    model.Set(kind, l, plan::FitOrLine(samples));
  }
  std::vector<ProfileStep> next = SplitSteps(kind, model.Fits(kind), sizes, n, min_share);
  if (next.empty()) return false;
  phase = 1;
  steps = std::move(next);
  times.assign(steps.size(), 0.0);
  return true;
}

uint64_t ProfileSession::Finish(int n, const plan::BalancerOptions& options) {
  if (phase == 1)
    for (size_t t = 0; t < steps.size(); ++t) {
      const ProfileStep& st = steps[t];
      (st.paired ? paired : split)[st.size * reps() + st.rep] = times[t];
    }
  const size_t links = model.links().size();
  const std::vector<double> message = Messages(kind, sizes, n);
  std::vector<double> best_split(sizes.size()), best_paired(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    double best_alone = std::numeric_limits<double>::infinity();
    for (size_t l = 0; l < links; ++l) best_alone = std::min(best_alone, Best(alone, (l * sizes.size() + i) * reps()));
    best_split[i] = Best(split, i * reps());
    best_paired[i] = best_split[i] > 0 ? Best(paired, i * reps()) : best_alone;
  }
  const uint64_t threshold =
      plan::MeasuredSplitThreshold(message, best_paired, best_split, options.min_split_gain,
                                   plan::SplitThreshold(model.Fits(kind), options.split_overhead_s));
  model.SetMeasuredThreshold(kind, threshold);
  model.SetProfiledBytes(kind, sizes.back());
  return threshold;
}

bool GpuProfiler::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return session_ != nullptr;
}

bool GpuProfiler::LoadCachedFits(Kind kind, uint64_t needed_bytes) {
  plan::CostModel cached;
  if (!LoadCachedModel({plan::HostName(), ex_.links_->spec, ex_.group_.size()}, ex_.names_, kind, needed_bytes,
                       &cached) ||
      !ex_.balancer_.MergeModel(cached).ok())
    return false;
  LogInfo("stage 1 for " + std::string(Name(kind)) + " on GPU group " + FormatIds(ex_.group_.ids) + " from cache " +
          ProfileCachePath() + ": " + DescribeFits(ex_.names_, cached.Fits(kind)));
  return true;
}

ProfileAction GpuProfiler::Decide(Kind kind, uint64_t message_bytes, std::shared_ptr<const plan::Plan>* plan) {
  if ((*plan)->mode != plan::PlanMode::kProfile) return {};
  const int n = ex_.group_.size();
  std::lock_guard<std::mutex> lock(mu_);
  if (!session_) {
    if (TuneUseCache() && LoadCachedFits(kind, ProfileTopBytes(message_bytes))) {
      *plan = ex_.balancer_.PlanFor(kind, message_bytes);
      return {};
    }
    auto s = std::make_shared<ProfileSession>();
    s->Begin(kind, ProfileTopBytes(message_bytes), ex_.names_);
    s->enqueued.assign(n, -1);
    s->read.assign(n, 0);
    session_ = s;
    return {s, 0};
  }
  ProfileSession& s = *session_;
  if (s.kind != kind) return {};
  if (s.failed) {
    // As a group across processes does (gpu_xproc_profile.cc): stage 2 alone, from equal shares,
    // rather than the primary link for good, and said, since the user's calls change course.
    LogWarning("stage 1 for " + std::string(Name(kind)) + " on GPU group " + FormatIds(ex_.group_.ids) +
               " did not complete (phase " + std::to_string(s.phase + 1) + ": " +
               (s.why.empty() ? std::string("a rank's device could not run or time it") : s.why) +
               "), so stage 1 is off for the group (none of its calls, of any kind, profiles again) and stage 2 "
               "plans them from equal shares");
    session_.reset();
    ex_.balancer_.StopProfiling();
    ex_.balancer_.ForgetKind(kind);
    *plan = ex_.balancer_.PlanFor(kind, message_bytes);
    return {};
  }
  if (std::count(s.read.begin(), s.read.end(), 1) < n) return {};  // still on the device
  if (s.phase == 0 && s.FitAlone(n, ex_.balancer_.options().min_share)) {
    std::fill(s.read.begin(), s.read.end(), 0);
    return {session_, 1};
  }
  Finish(s);
  session_.reset();
  *plan = ex_.balancer_.PlanFor(kind, message_bytes);
  return {};
}

void GpuProfiler::Finish(ProfileSession& s) {
  const int n = ex_.group_.size();
  const uint64_t threshold = s.Finish(n, ex_.balancer_.options());
  Status merged = ex_.balancer_.MergeModel(s.model);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - s.started).count();
  LogInfo("stage 1 for " + std::string(Name(s.kind)) + " on GPU group " + FormatIds(ex_.group_.ids) + " (" +
          std::to_string(secs).substr(0, 5) + " s): " + DescribeFits(ex_.names_, s.model.Fits(s.kind)) + "; " +
          (threshold == plan::kNeverSplit ? std::string("never split") : "split from " + std::to_string(threshold) + " B"));
  if (!merged.ok()) return;
  StoreProfiledModel({plan::HostName(), ex_.links_->spec, n}, ex_.names_, s.kind, s.model, s.sizes.back());
}

Status PrepareProfile(DeviceApi& api, int device, ProfileRank& pr, size_t links, Kind kind,
                      std::span<const uint64_t> sizes, size_t steps, int n, Stream stream, ProfileScratch* scratch) {
  // Events: start and stop per step, then one per link of each split step.
  const size_t needed = 2 * steps + steps * links;
  while (pr.events.size() < needed) {
    Event e = nullptr;
    FLEXLINK_RETURN_IF_ERROR(api.CreateEvent(device, true, &e));
    pr.events.push_back(e);
  }
  const CallDesc largest = ProfileDesc(kind, sizes.back(), n, nullptr, nullptr);
  const size_t in_bytes = largest.in_count(largest.parts[0], n) * sizeof(float);
  const size_t out_bytes = largest.out_count(largest.parts[0], n) * sizeof(float);
  FLEXLINK_RETURN_IF_ERROR(api.Record(pr.fork, stream));
  FLEXLINK_RETURN_IF_ERROR(api.Wait(pr.stream, pr.fork));
  scratch->forked = true;
  Status s = api.MallocAsync(in_bytes, pr.stream, &scratch->in);
  if (s.ok()) s = api.MallocAsync(out_bytes, pr.stream, &scratch->out);
  // Zeros: sums and gathers of them are exact, whatever the split.
  if (s.ok()) s = api.Zero(scratch->in, in_bytes, pr.stream);
  if (s.ok()) s = api.Zero(scratch->out, out_bytes, pr.stream);
  if (!s.ok()) (void)ReleaseProfile(api, pr, *scratch, stream);
  return s;
}

Status ReleaseProfile(DeviceApi& api, ProfileRank& pr, ProfileScratch& scratch, Stream stream) {
  Status status;
  for (void** p : {&scratch.in, &scratch.out}) {
    if (*p) {
      Status freed = api.FreeAsync(*p, pr.stream);
      if (status.ok()) status = freed;
    }
    *p = nullptr;
  }
  if (!scratch.forked) return status;
  scratch.forked = false;
  Status joined = api.Record(pr.join, pr.stream);
  if (joined.ok()) joined = api.Wait(stream, pr.join);
  return status.ok() ? joined : status;
}

Status EnqueueProfileSteps(DeviceApi& api, ProfileRank& pr, ProfileScratch& scratch, std::span<const Stream> side,
                           const std::function<Status(size_t, const GpuWork&)>& enqueue, Kind kind,
                           std::span<const uint64_t> sizes, std::span<const ProfileStep> steps, int n, int rank,
                           Stream stream, std::string_view label) {
  const size_t links = side.size();
  // The profile's stream has work forked from XLA's (PrepareProfile): whatever fails below, the
  // scratch is freed and the stream joined back into XLA's (as every link's), so that XLA's stream
  // never runs ahead of NCCL operations this rank already enqueued.
  const std::string step_label = "stage 1 of " + std::string(label);
  bool unjoined = false;
  auto steps_on_stream = [&]() -> Status {
    std::vector<Piece> pieces;
    for (size_t t = 0; t < steps.size(); ++t) {
      const ProfileStep& st = steps[t];
      const CallDesc d = ProfileDesc(kind, sizes[st.size], n, scratch.in, scratch.out);
      Event start = pr.events[2 * t], stop = pr.events[2 * t + 1];
      FLEXLINK_RETURN_IF_ERROR(api.Record(start, pr.stream));
      if (st.shares.empty()) {
        d.AllPieces(&pieces);
        FLEXLINK_RETURN_IF_ERROR(enqueue(st.link, GpuWork{&d, rank, pieces, pr.stream, step_label}));
      } else {
        const auto ranges = plan::CutRanges(d.virtual_bytes(), 1, st.shares);
        for (size_t l = 0; l < links; ++l) {
          if (ranges[l].empty()) continue;
          Event end = pr.events[2 * steps.size() + t * links + l];
          d.PiecesOf(UnitRange{ranges[l].begin, ranges[l].end}, &pieces);
          FLEXLINK_RETURN_IF_ERROR(api.Wait(side[l], start));
          // The side stream is forked: joined back into the profile's stream also when its enqueue fails.
          Status s = enqueue(l, GpuWork{&d, rank, pieces, side[l], step_label});
          Status joined = api.Record(end, side[l]);
          if (joined.ok()) joined = api.Wait(pr.stream, end);
          // Not joined (a device error): the side stream may still use the scratch, so it is
          // left allocated rather than freed under it.
          if (!joined.ok()) unjoined = true;
          FLEXLINK_RETURN_IF_ERROR(s);
          FLEXLINK_RETURN_IF_ERROR(joined);
        }
      }
      FLEXLINK_RETURN_IF_ERROR(api.Record(stop, pr.stream));
    }
    return Status::Ok();
  };
  Status status = steps_on_stream();
  if (unjoined) scratch.in = scratch.out = nullptr;  // left allocated (above)
  // Nothing else would free the scratch: it is per call.
  Status released = ReleaseProfile(api, pr, scratch, stream);
  return status.ok() ? released : status;
}

Poll ReadProfileTimes(DeviceApi& api, const ProfileRank& pr, size_t steps, std::vector<double>* times) {
  if (steps == 0 || pr.events.size() < 2 * steps) return Poll::kError;
  std::string error;
  const Poll p = api.Query(pr.events[2 * steps - 1], &error);  // the phase's last stop
  if (p != Poll::kDone) return p;
  times->assign(steps, 0.0);
  for (size_t t = 0; t < steps; ++t)
    if (!api.ElapsedSeconds(pr.events[2 * t], pr.events[2 * t + 1], &(*times)[t]).ok()) return Poll::kError;
  return Poll::kDone;
}

Status GpuProfiler::Prepare(const ProfileAction& action, int rank, Stream stream, ProfileScratch* scratch) {
  const ProfileSession& s = *action.session;
  return PrepareProfile(ex_.api_, ex_.group_.devices[rank], ex_.ranks_[rank].profile, ex_.names_.size(), s.kind,
                        s.sizes, s.steps.size(), ex_.group_.size(), stream, scratch);
}

Status GpuProfiler::Enqueue(const ProfileAction& action, int rank, ProfileScratch& scratch, Stream stream,
                            std::string_view label) {
  ProfileSession& s = *action.session;
  GpuExecutor::Rank& k = ex_.ranks_[rank];
  Status st = EnqueueProfileSteps(
      ex_.api_, k.profile, scratch, k.side,
      [&](size_t link, const GpuWork& w) { return ex_.channels_[link]->Enqueue(w); }, s.kind, s.sizes, s.steps,
      ex_.group_.size(), rank, stream, label);
  std::lock_guard<std::mutex> lock(mu_);
  if (!st.ok()) {
    if (s.why.empty()) s.why = ex_.RankName(rank) + " could not enqueue it: " + st.message();
    s.failed = true;
    return Located(st, ErrorPrefix(label) + "stage 1 on group " + FormatIds(ex_.group_.ids) + ": ");
  }
  s.enqueued[rank] = action.phase;
  return Status::Ok();
}

void GpuProfiler::Abandon(const ProfileAction& action, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  ProfileSession& s = *action.session;
  if (s.why.empty()) s.why = why;
  s.failed = true;
}

void GpuProfiler::Poll(int rank) {
  std::shared_ptr<ProfileSession> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = session_;
    if (!s || s->enqueued[rank] != s->phase || s->read[rank]) return;
  }
  std::vector<double> times;
  const gpu::Poll p = ReadProfileTimes(ex_.api_, ex_.ranks_[rank].profile, s->steps.size(), &times);
  if (p == gpu::Poll::kPending) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (p != gpu::Poll::kDone) {
    if (s->why.empty()) s->why = ex_.RankName(rank) + " could not time it on its device";
    s->failed = true;
  }
  for (size_t t = 0; t < times.size(); ++t) s->times[t] = std::max(s->times[t], times[t]);
  s->read[rank] = 1;
}

bool ProfileEventsDrained(DeviceApi& api, const ProfileRank& pr) {
  for (Event e : pr.events)
    if (api.Query(e, nullptr) == Poll::kPending) return false;
  return true;
}

Status DestroyProfileEvents(DeviceApi& api, ProfileRank& pr) {
  Status first;
  for (Event e : pr.events) {
    Status s = api.DestroyEvent(e);
    if (!s.ok() && first.ok()) first = s;
  }
  pr.events.clear();
  return first;
}

}  // namespace flexlink::gpu
