#include "xla_ffi/cuda/gpu_xproc_profile.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/profile_calls.h"
#include "xla_ffi/xproc/process_group.h"

namespace flexlink::gpu {
namespace {

uint64_t Tag(uint32_t id, int phase) { return (uint64_t{id} << 2) | static_cast<uint64_t>(phase); }

}  // namespace

GpuXprocProfiler::GpuXprocProfiler(xproc::ProcessGroup* segment, plan::Balancer* balancer, const GroupInfo* group,
                                   std::vector<std::string> names, std::string cache_spec, DeviceApi* api)
    : seg_(*segment), balancer_(*balancer), group_(*group), names_(std::move(names)),
      cache_spec_(std::move(cache_spec)), api_(*api), ranks_(group->size()) {}

plan::CacheKey GpuXprocProfiler::CacheKey() const {
  plan::CacheKey key{plan::HostName(), cache_spec_, group_.size()};
  key.processes = seg_.processes();
  return key;
}

bool GpuXprocProfiler::LoadCached(Kind kind, uint64_t message_bytes) {
  // A group whose creator was not told how many processes it spans neither reads nor writes it.
  if (!TuneUseCache() || seg_.processes() == 0) return false;
  plan::CostModel cached, one(names_);
  if (!LoadCachedModel(CacheKey(), names_, kind, ProfileTopBytes(message_bytes), &cached)) return false;
  // This kind alone: the other processes learn a kind's model from its calls' slots, so each kind
  // is installed at its own first large call and every process reports the same kinds.
  one.CopyKind(cached, kind);
  if (!balancer_.MergeModel(one).ok()) return false;
  LogInfo("stage 1 for " + std::string(Name(kind)) + " on GPU group " + FormatIds(group_.ids) + " across " +
          std::to_string(seg_.processes()) + " processes from cache " + ProfileCachePath() + ": " +
          DescribeFits(names_, cached.Fits(kind)) + "; " + SplitThresholdText(balancer_.SplitThresholdBytes(kind)));
  return true;
}

Status GpuXprocProfiler::SetupRank(int rank, int device, DeviceLedger& ledger) {
  ProfileRank& p = ranks_[rank].profile;
  FLEXLINK_RETURN_IF_ERROR(ledger.CreateStream(device, &p.stream));
  FLEXLINK_RETURN_IF_ERROR(ledger.CreateEvent(device, false, &p.fork));
  return ledger.CreateEvent(device, false, &p.join);
}

bool GpuXprocProfiler::EventsDrained() {
  for (const RankState& k : ranks_)
    if (!ProfileEventsDrained(api_, k.profile)) return false;
  return true;
}

Status GpuXprocProfiler::DestroyEvents() {
  Status first;
  for (RankState& k : ranks_) {
    Status s = DestroyProfileEvents(api_, k.profile);
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

void GpuXprocProfiler::Ask(int phase, xproc::PlanSlot* slot) const {
  slot->profile_phase = static_cast<uint32_t>(phase);
  slot->profile_id = id_;
  slot->profile_top = session_->sizes.back();
  slot->profile_min_share = balancer_.options().min_share;
  if (phase != 2) return;  // the caller writes the leader's own fits (if any) into the slot
  slot->has_fits = 1;
  const auto fits = session_->model.Fits(session_->kind);
  for (size_t i = 0; i < xproc::kMaxXprocLinks; ++i) {
    slot->alpha[i] = i < fits.size() ? fits[i].alpha : 0;
    slot->beta[i] = i < fits.size() ? fits[i].beta : 0;
  }
}

GpuXprocProfiler::Gathered GpuXprocProfiler::Gather(std::vector<double>* times, std::string* why) const {
  const uint64_t want = Tag(id_, session_->phase + 1);
  const size_t steps = session_->steps.size();
  times->assign(steps, 0.0);
  for (int r = 0; r < group_.size(); ++r) {
    xproc::ProfileTimes& t = seg_.profile_times(r);
    if (__atomic_load_n(&t.tag, __ATOMIC_ACQUIRE) != want) return Gathered::kPending;
    // Another process wrote it: checked, not trusted.
    if (!t.ok || t.steps != steps) {
      *why = seg_.DescribeRank(r) + (t.ok ? " timed " + std::to_string(t.steps) + " steps, not " + std::to_string(steps)
                                          : std::string(" could not time it on its device"));
      return Gathered::kFailed;
    }
    for (size_t s = 0; s < steps; ++s) {
      const double v = t.seconds[s];
      if (!(v > 0) || !std::isfinite(v)) {
        *why = seg_.DescribeRank(r) + " reported a time of " + std::to_string(v) + " s";
        return Gathered::kFailed;
      }
      (*times)[s] = std::max((*times)[s], v);
    }
  }
  return Gathered::kDone;
}

void GpuXprocProfiler::Fail(Kind kind, const std::string& why) {
  session_.reset();
  balancer_.StopProfiling();
  balancer_.ForgetKind(kind);  // its kProfile plans with it
  LogWarning("stage 1 for " + std::string(Name(kind)) + " on GPU group " + FormatIds(group_.ids) +
             " across processes did not complete (" + why +
             "), so stage 1 is off for the group (none of its calls, of any kind, profiles again) and stage 2 "
             "plans them from equal shares");
}

void GpuXprocProfiler::Decide(Kind kind, uint64_t message_bytes, std::shared_ptr<const plan::Plan>* plan,
                              xproc::PlanSlot* slot) {
  slot->profile_phase = 0;
  if ((*plan)->mode != plan::PlanMode::kProfile) return;
  const int n = group_.size();
  if (!session_) {
    if (LoadCached(kind, message_bytes)) {
      *plan = balancer_.PlanFor(kind, message_bytes);
      return;
    }
    auto s = std::make_unique<ProfileSession>();
    s->Begin(kind, ProfileTopBytes(message_bytes), names_);
    if (s->steps.size() > xproc::kMaxProfileSteps) {
      Fail(kind, std::to_string(s->steps.size()) + " timed steps, more than the segment's " +
                     std::to_string(xproc::kMaxProfileSteps));
      *plan = balancer_.PlanFor(kind, message_bytes);
      return;
    }
    session_ = std::move(s);
    ++id_;
    Ask(1, slot);
    return;
  }
  if (session_->kind != kind) return;  // one profile at a time; this call runs on the primary link
  std::string why;
  switch (Gather(&session_->times, &why)) {
    case Gathered::kPending:
      return;
    case Gathered::kFailed:
      Fail(kind, "phase " + std::to_string(session_->phase + 1) + ": " + why);
      *plan = balancer_.PlanFor(kind, message_bytes);
      return;
    case Gathered::kDone:
      break;
  }
  if (session_->phase == 0 && session_->FitAlone(n, balancer_.options().min_share)) {
    Ask(2, slot);
    return;
  }
  const uint64_t threshold = session_->Finish(n, balancer_.options());
  const Status merged = balancer_.MergeModel(session_->model);
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.3g s",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - session_->started).count());
  LogInfo("stage 1 for " + std::string(Name(kind)) + " on GPU group " + FormatIds(group_.ids) + " across processes (" +
          secs + ", " + std::to_string(session_->sizes.size()) + " sizes): " +
          DescribeFits(names_, session_->model.Fits(kind)) + "; " + SplitThresholdText(threshold) +
          (merged.ok() ? std::string() : "; not installed: " + merged.message()));
  if (merged.ok() && seg_.processes() > 0)
    StoreProfiledModel(CacheKey(), names_, kind, session_->model, session_->sizes.back());
  session_.reset();
  *plan = balancer_.PlanFor(kind, message_bytes);
}

Status GpuXprocProfiler::Prepare(int rank, Kind kind, const xproc::PlanSlot& slot, Stream stream,
                                 std::string_view label) {
  const int phase = static_cast<int>(slot.profile_phase);
  const size_t links = names_.size();
  RankState& k = ranks_[rank];
  k.sizes = StageOneSizes(slot.profile_top);
  if (phase == 1) {
    k.prepared = AloneSteps(links, k.sizes);
  } else {
    std::vector<plan::AlphaBeta> fits(links);
    for (size_t i = 0; i < links && i < xproc::kMaxXprocLinks; ++i) fits[i] = plan::AlphaBeta{slot.alpha[i], slot.beta[i]};
    k.prepared = SplitSteps(kind, fits, k.sizes, group_.size(), slot.profile_min_share);
  }
  const std::string where = ErrorPrefix(label) + "stage 1 on GPU group " + FormatIds(group_.ids) + " across processes: ";
  if (k.prepared.empty() || k.prepared.size() > xproc::kMaxProfileSteps)
    return Status::Internal(where + "phase " + std::to_string(phase) + " has " + std::to_string(k.prepared.size()) +
                            " steps (the leader's slot is inconsistent)");
  Status s = PrepareProfile(api_, group_.devices[rank], k.profile, links, kind, k.sizes, k.prepared.size(),
                            group_.size(), stream, &k.scratch);
  if (!s.ok()) return Located(s, where);
  k.prepared_tag = Tag(slot.profile_id, phase);
  return Status::Ok();
}

Status GpuXprocProfiler::Enqueue(int rank, Kind kind, std::span<const Stream> side,
                                 const std::function<Status(size_t, const GpuWork&)>& enqueue, Stream stream,
                                 std::string_view label) {
  RankState& k = ranks_[rank];
  const uint64_t tag = k.prepared_tag;
  k.prepared_tag = 0;
  Status s = EnqueueProfileSteps(api_, k.profile, k.scratch, side, enqueue, kind, k.sizes, k.prepared, group_.size(),
                                 rank, stream, label);
  if (!s.ok())
    return Located(s, ErrorPrefix(label) + "stage 1 on GPU group " + FormatIds(group_.ids) + " across processes: ");
  k.tag = tag;
  k.steps = k.prepared.size();
  return Status::Ok();
}

void GpuXprocProfiler::Release(int rank, Stream stream) {
  RankState& k = ranks_[rank];
  k.prepared_tag = 0;
  (void)ReleaseProfile(api_, k.profile, k.scratch, stream);
}

void GpuXprocProfiler::Abandon(Kind kind, const std::string& why) {
  if (session_ && session_->kind == kind) Fail(kind, "phase " + std::to_string(session_->phase + 1) + ": " + why);
}

void GpuXprocProfiler::Publish(int rank) {
  RankState& k = ranks_[rank];
  if (k.tag == 0) return;
  std::vector<double> times;
  const Poll p = ReadProfileTimes(api_, k.profile, k.steps, &times);
  if (p == Poll::kPending) return;
  xproc::ProfileTimes& out = seg_.profile_times(rank);
  out.ok = p == Poll::kDone;
  out.steps = static_cast<uint32_t>(k.steps);
  for (size_t s = 0; s < times.size() && s < xproc::kMaxProfileSteps; ++s) out.seconds[s] = times[s];
  __atomic_store_n(&out.tag, k.tag, __ATOMIC_RELEASE);
  k.tag = 0;
}

}  // namespace flexlink::gpu
