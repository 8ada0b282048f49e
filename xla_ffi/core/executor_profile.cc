// Stage 1 inside the engine: the first large call of a kind on a group profiles its links (see
// executor.h). The model it produces is the same as jax_flexlink.tune()'s, plus one thing a model of
// links timed one at a time cannot know: whether splitting actually wins on this machine. Links can
// slow each other down (shm and tcp share this machine's two cores), so the split the fits predict
// is also timed, against the best link alone, and the smallest size from which it wins at every
// larger profiled size becomes the split threshold (docs/planning.md).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "xla_ffi/core/communicator.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/profile_calls.h"
#include "xla_ffi/core/rendezvous.h"
#include "xla_ffi/links/link.h"
#include "xla_ffi/plan/cost_model.h"
#include "xla_ffi/plan/ranges.h"
#include "xla_ffi/plan/shares.h"
#include "xla_ffi/plan/tuning_cache.h"

namespace flexlink {

uint64_t ProfileTopBytes(uint64_t message_bytes) {
  return plan::BucketOf(std::max<uint64_t>(
      2 * kMinProfileBytes, std::min(plan::BucketOf(message_bytes), TuneMaxBytes())));
}

bool Executor::LoadCachedFits(Kind kind, int n, uint64_t needed_bytes) {
  plan::CostModel cached;
  if (!LoadCachedModel({plan::HostName(), spec_, n}, link_names_, kind, needed_bytes, &cached)) return false;
  if (!balancer_->MergeModel(cached).ok()) return false;
  LogInfo("stage 1 for " + std::string(Name(kind)) + " on group " + FormatIds(comm_->devices()) +
      " from cache " + ProfileCachePath() + ": " + DescribeFits(link_names_, cached.Fits(kind)) + "; " +
      SplitThresholdText(balancer_->SplitThresholdBytes(kind)));
  return true;
}

Status Executor::RunProfile(CallContext& ctx, int rank, const CallDesc& call, CallState& state) {
  const int n = ctx.size();
  const size_t links = link_names_.size();
  Profile* p;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    if (!state.profiling) {
      auto prof = std::make_unique<Profile>();
      prof->kind = call.kind;
      prof->sizes = StageOneSizes(ProfileTopBytes(MessageBytes(call, n)));
      prof->run_id = std::numeric_limits<int64_t>::min() + static_cast<int64_t>(state.plan->epoch);
      prof->label = "stage 1 of " + ctx.label();
      prof->started = Clock::now();
      const size_t reps = prof->warmup + prof->iters;
      prof->alone.assign(links * prof->sizes.size() * reps, 0.0);
      prof->split.assign(prof->sizes.size() * reps, 0.0);
      prof->paired.assign(prof->sizes.size() * reps, 0.0);
      state.profiling = std::move(prof);
    }
    p = state.profiling.get();
  }
  const size_t num_sizes = p->sizes.size(), reps = p->warmup + p->iters;

  // This rank's scratch, sized for the largest profiled call.
  const CallDesc largest = ProfileDesc(p->kind, p->sizes.back(), n, nullptr, nullptr);
  ProfileBuffer in(largest.in_count(largest.parts[0], n) * sizeof(float)),
      out(largest.out_count(largest.parts[0], n) * sizeof(float));
  if (!in.ptr || !out.ptr)
    return Status::Internal("flexlink: stage 1: out of memory for the profiling buffers");

  auto seconds = std::make_shared<std::vector<double>>(links, 0.0);
  // One nested call: everything on `only` (< links), or `shares` split across the links.
  auto step = [&](size_t size_index, size_t only, const std::vector<double>* shares, double* slowest) {
    const CallDesc d = ProfileDesc(p->kind, p->sizes[size_index], n, in.ptr, out.ptr);
    const auto t0 = Clock::now();
    std::shared_ptr<CallContext> sub = comm_->Join(rank, p->run_id, p->label);
    Status s;
    if (shares == nullptr) {
      s = comm_->channel(only).RunAlone(*sub, rank, d);
    } else {
      s = sub->Arrive(rank, d, link_names_[0]);
      if (s.ok()) {
        std::vector<Status> status(links);
        RunRanges(*sub, rank, plan::CutRanges(d.virtual_bytes(), 1, *shares), seconds, &status);
        for (Status& one : status)
          if (!one.ok() && s.ok()) s = std::move(one);
      }
    }
    const double t = Since(t0);
    std::lock_guard<std::mutex> lock(state.mu);
    *slowest = std::max(*slowest, t);
    return s;
  };
  auto first_rep = [&](size_t size_index) -> size_t {
    return p->sizes[size_index] > kCoarseProfileBytes ? p->warmup : 0;
  };
  auto best = [&](const std::vector<double>& table, size_t first) {
    double b = std::numeric_limits<double>::infinity();
    for (int r = p->warmup; r < static_cast<int>(reps); ++r) b = std::min(b, table[first + r]);
    return b;
  };

  for (size_t l = 0; l < links; ++l)
    for (size_t i = 0; i < num_sizes; ++i)
      for (size_t r = first_rep(i); r < reps; ++r)
        FLEXLINK_RETURN_IF_ERROR(step(i, l, nullptr, &p->alone[(l * num_sizes + i) * reps + r]));
  FLEXLINK_RETURN_IF_ERROR(ctx.Barrier(rank, 0, "stage 1 fit", link_names_[0]));

  // Every rank fits the same numbers the same way, so all of them time the same splits.
  plan::CostModel model(link_names_);
  std::vector<double> message(num_sizes), best_alone(num_sizes, std::numeric_limits<double>::infinity());
  for (size_t i = 0; i < num_sizes; ++i)
    message[i] = static_cast<double>(MessageBytes(ProfileDesc(p->kind, p->sizes[i], n, nullptr, nullptr), n));
  for (size_t l = 0; l < links; ++l) {
    std::vector<plan::Sample> samples;
    for (size_t i = 0; i < num_sizes; ++i) {
      const double t = best(p->alone, (l * num_sizes + i) * reps);
      samples.push_back({message[i], t});
      best_alone[i] = std::min(best_alone[i], t);
    }
    model.Set(p->kind, l, plan::FitOrLine(samples));
  }
  // Each split repetition is paired with one of the fastest link alone just before it, and the two
  // are compared with each other: load that comes and goes while stage 1 runs then weighs on both.
  std::vector<std::vector<double>> splits(num_sizes);
  for (size_t i = 0; i < num_sizes; ++i) {
    splits[i] = plan::EqualFinishShares(model.Fits(p->kind), message[i]);
    plan::DropBelow(splits[i], balancer_->options().min_share);
    if (std::count_if(splits[i].begin(), splits[i].end(), [](double x) { return x > 0; }) < 2) continue;
    const size_t fastest = plan::FastestSingle(model.Fits(p->kind), message[i]);
    for (size_t r = first_rep(i); r < reps; ++r) {
      FLEXLINK_RETURN_IF_ERROR(step(i, fastest, nullptr, &p->paired[i * reps + r]));
      FLEXLINK_RETURN_IF_ERROR(step(i, 0, &splits[i], &p->split[i * reps + r]));
    }
  }
  FLEXLINK_RETURN_IF_ERROR(ctx.Barrier(rank, 0, "stage 1 split check", link_names_[0]));

  std::lock_guard<std::mutex> lock(state.mu);
  if (p->installed) return Status::Ok();
  p->installed = true;
  std::vector<double> split(num_sizes), paired(num_sizes);
  for (size_t i = 0; i < num_sizes; ++i) {
    split[i] = best(p->split, i * reps);
    paired[i] = split[i] > 0 ? best(p->paired, i * reps) : best_alone[i];
  }
  const uint64_t threshold = plan::MeasuredSplitThreshold(
      message, paired, split, balancer_->options().min_split_gain,
      plan::SplitThreshold(model.Fits(p->kind), balancer_->options().split_overhead_s));
  model.SetMeasuredThreshold(p->kind, threshold);
  model.SetProfiledBytes(p->kind, p->sizes.back());
  Status merged = balancer_->MergeModel(model);
  state.plan = balancer_->PlanFor(p->kind, MessageBytes(call, n));

  std::string timings;
  for (size_t i = 0; i < num_sizes; ++i) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "%s%.0f KiB %.3g/%.3g ms", i ? ", " : "", message[i] / 1024,
                  paired[i] * 1e3, std::isfinite(split[i]) && split[i] > 0 ? split[i] * 1e3 : 0.0);
    timings += buf;
  }
  LogInfo("stage 1 for " + std::string(Name(p->kind)) + " on group " + FormatIds(comm_->devices()) + " (" +
      std::to_string(Since(p->started)).substr(0, 5) + " s): " + DescribeFits(link_names_, model.Fits(p->kind)) +
      "; best alone/split: " + timings + "; " + SplitThresholdText(threshold) + "; plan " +
      balancer_->Describe(*state.plan));
  if (!merged.ok()) return merged;

  StoreProfiledModel({plan::HostName(), spec_, n}, link_names_, p->kind, model, p->sizes.back());
  return Status::Ok();
}

}  // namespace flexlink
