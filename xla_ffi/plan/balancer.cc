#include "xla_ffi/plan/balancer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "xla_ffi/plan/shares.h"

namespace flexlink::plan {
namespace {

std::string FormatBytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (u < 4 && b >= 1024 && b % 1024 == 0) {
    b /= 1024;
    ++u;
  }
  return std::to_string(b) + " " + units[u];
}

}  // namespace

std::string_view Name(PlanMode mode) {
  switch (mode) {
    case PlanMode::kSingle: return "single";
    case PlanMode::kConverging: return "converging";
    case PlanMode::kSettled: return "settled";
    case PlanMode::kTrial: return "trial";
    case PlanMode::kFallback: return "fallback";
    case PlanMode::kPinned: return "pinned";
    case PlanMode::kProfile: return "profile";
  }
  return "?";
}

Balancer::Balancer(std::vector<std::string> links, BalancerOptions options)
    : links_(std::move(links)), options_(options), model_(links_), seed_(links_),
      profile_from_bytes_(options.profile_from_bytes), profile_max_bytes_(options.profile_max_bytes) {}

void Balancer::SetProfileMaxBytes(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  profile_max_bytes_ = bytes;
}

void Balancer::SetProfileFromBytes(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  profile_from_bytes_ = bytes;
}

void Balancer::StopProfiling() {
  std::lock_guard<std::mutex> lock(mu_);
  profile_from_bytes_ = 0;
  std::erase_if(entries_, [](const auto& kv) { return kv.second.plan->mode == PlanMode::kProfile; });
}

Status Balancer::SetModel(CostModel model) {
  std::lock_guard<std::mutex> lock(mu_);
  if (model.links() != links_) {
    return Status::InvalidArgument("flexlink: balancer: the cost model is for a different link set");
  }
  model_ = std::move(model);
  UpdateThresholds();
  DropPlans(std::nullopt);
  return Status::Ok();
}

void Balancer::DropPlans(std::optional<size_t> kind) {
  std::erase_if(entries_, [&](const auto& kv) {
    return (!kind || kv.first.first == *kind) && kv.second.plan->mode != PlanMode::kPinned;
  });
}

Status Balancer::MergeModel(const CostModel& model) {
  std::lock_guard<std::mutex> lock(mu_);
  if (model.links() != links_) {
    return Status::InvalidArgument("flexlink: balancer: the cost model is for a different link set");
  }
  for (size_t k = 0; k < kNumKinds; ++k) {
    const Kind kind = static_cast<Kind>(k);
    if (!model.Has(kind)) continue;
    model_.CopyKind(model, kind);
    DropPlans(k);
  }
  UpdateThresholds();
  return Status::Ok();
}

Status Balancer::SetSeed(CostModel seed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (seed.links() != links_) {
    return Status::InvalidArgument("flexlink: balancer: the seed model is for a different link set");
  }
  seed_ = std::move(seed);
  for (size_t k = 0; k < kNumKinds; ++k)
    if (!model_.Has(static_cast<Kind>(k))) DropPlans(k);  // plans made without the seed
  return Status::Ok();
}

void Balancer::ForgetKind(Kind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  model_.ClearKind(kind);
  DropPlans(KindIndex(kind));
  UpdateThresholds();
}

CostModel Balancer::Model() const {
  std::lock_guard<std::mutex> lock(mu_);
  return model_;
}

bool Balancer::FitsFor(Kind kind, std::vector<AlphaBeta>* out, std::optional<uint64_t>* measured,
                       uint64_t* profiled) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!model_.Has(kind)) return false;
  const auto fits = model_.Fits(kind);
  out->assign(fits.begin(), fits.end());
  if (measured) *measured = model_.MeasuredThreshold(kind);
  if (profiled) *profiled = model_.ProfiledBytes(kind);
  return true;
}

void Balancer::UpdateThresholds() {
  for (size_t k = 0; k < kNumKinds; ++k) {
    const Kind kind = static_cast<Kind>(k);
    thresholds_[k] = !model_.Has(kind) ? 0
                     : model_.MeasuredThreshold(kind)
                         ? *model_.MeasuredThreshold(kind)
                         : SplitThreshold(model_.Fits(kind), options_.split_overhead_s);
  }
}

uint64_t Balancer::SplitThresholdBytes(Kind kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  return thresholds_[KindIndex(kind)];
}

double Balancer::ModelSingleRate(Kind kind, uint64_t bytes, size_t* link) const {
  if (!model_.Has(kind) || bytes == 0) return 0;
  *link = FastestSingle(model_.Fits(kind), static_cast<double>(bytes));
  return bytes / model_.Fits(kind)[*link].Predict(static_cast<double>(bytes));
}

void Balancer::Install(Entry& e, PlanMode mode, std::vector<double> shares) {
  auto plan = std::make_shared<Plan>();
  plan->kind = e.plan ? e.plan->kind : Kind::kAllReduce;
  plan->bucket_bytes = e.plan ? e.plan->bucket_bytes : 0;
  plan->epoch = next_epoch_++;
  plan->mode = mode;
  plan->shares = std::move(shares);
  e.plan = std::move(plan);
  e.recent.clear();  // times of the previous plan say nothing about this one
  e.single_recent.clear();
  e.settled_calls = 0;
}

Balancer::Entry& Balancer::EntryFor(Kind kind, uint64_t bytes) {
  uint64_t bucket = BucketOf(bytes);
  auto [it, inserted] = entries_.try_emplace(Key{KindIndex(kind), bucket});
  Entry& e = it->second;
  if (!inserted) return e;
  auto seed = std::make_shared<Plan>();  // carries kind and bucket into Install
  seed->kind = kind;
  seed->bucket_bytes = bucket;
  e.plan = seed;
  e.retry_calls = options_.retry_calls;
  size_t n = links_.size();
  if (n == 1) {
    Install(e, PlanMode::kSingle, OneHot(1, 0));
  } else if (model_.Has(kind) && profile_from_bytes_ > 0 && model_.ProfiledBytes(kind) > 0 &&
             model_.ProfiledBytes(kind) < BucketOf(profile_max_bytes_) &&
             bucket / options_.reprofile_factor >= model_.ProfiledBytes(kind)) {
    // Far beyond what stage 1 measured (links can behave differently at larger sizes, and a "never
    // split" seen at small sizes may not hold): profile again, up to this size.
    Install(e, PlanMode::kProfile, OneHot(n, 0));
  } else if (model_.Has(kind)) {
    InstallFromFits(e, model_.Fits(kind), thresholds_[KindIndex(kind)], bytes);
  } else if (profile_from_bytes_ > 0) {
    // No stage 1 for this kind yet. A large call runs it (the engine profiles, merges the fits and
    // asks again); until then small calls take the primary link alone: a split started blind costs
    // its small calls more than it could gain (and on shared cores may lose outright).
    if (bytes >= profile_from_bytes_) {
      Install(e, PlanMode::kProfile, OneHot(n, 0));
    } else if (seed_.Has(kind)) {
      InstallFromFits(e, seed_.Fits(kind), SplitThreshold(seed_.Fits(kind), options_.split_overhead_s), bytes);
    } else {
      e.single_link = 0;
      Install(e, PlanMode::kSingle, OneHot(n, 0));
    }
  } else if (seed_.Has(kind)) {
    InstallFromFits(e, seed_.Fits(kind), SplitThreshold(seed_.Fits(kind), options_.split_overhead_s), bytes);
  } else {
    // Stage 2 alone: start from equal shares; stage 2 finds the split and the guard the single-link
    // fallback (by a trial, since there is no model to predict it).
    Install(e, PlanMode::kConverging, std::vector<double>(n, 1.0 / n));
  }
  e.split = e.seed = e.plan->shares;
  e.link_rate.assign(n, 0.0);
  return e;
}

void Balancer::InstallFromFits(Entry& e, std::span<const AlphaBeta> fits, uint64_t threshold, uint64_t bytes) {
  if (bytes < threshold) {
    e.single_link = FastestSingle(fits, static_cast<double>(bytes));
    Install(e, PlanMode::kSingle, OneHot(links_.size(), e.single_link));
  } else {
    std::vector<double> shares = EqualFinishShares(fits, static_cast<double>(bytes));
    DropBelow(shares, options_.min_share);
    Install(e, PlanMode::kConverging, std::move(shares));
  }
}

std::shared_ptr<const Plan> Balancer::PlanFor(Kind kind, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  return EntryFor(kind, bytes).plan;
}

Balancer::Outcome Balancer::Report(const Plan& plan, uint64_t bytes, std::span<const double> link_seconds,
                                   double call_seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  Outcome out;
  auto it = entries_.find(Key{KindIndex(plan.kind), plan.bucket_bytes});
  if (it == entries_.end() || it->second.plan->epoch != plan.epoch) {
    out.stale = true;
    return out;
  }
  Entry& e = it->second;
  if (call_seconds <= 0) {
    for (size_t i = 0; i < link_seconds.size() && i < plan.shares.size(); ++i) {
      if (plan.shares[i] > 0) call_seconds = std::max(call_seconds, link_seconds[i]);
    }
  }
  if (!(call_seconds > 0) || bytes == 0) return out;  // nothing measured
  double rate = static_cast<double>(bytes) / call_seconds;
  uint64_t before = e.plan->epoch;
  switch (plan.mode) {
    case PlanMode::kPinned:
    case PlanMode::kProfile: break;
    case PlanMode::kSingle:  // below the threshold: remember the rate, nothing to balance
      e.single_rate = e.single_rate > 0 ? 0.9 * e.single_rate + 0.1 * rate : rate;
      break;
    case PlanMode::kTrial:
    case PlanMode::kFallback: OnSingleCall(e, bytes, rate, &out); break;
    case PlanMode::kConverging:
    case PlanMode::kSettled: OnSplitCall(e, bytes, link_seconds, rate, &out); break;
  }
  out.changed = e.plan->epoch != before;
  if (out.changed) {
    if (!out.reason.empty()) out.reason += ": ";
    out.reason += Describe(*e.plan);
  }
  return out;
}

Status Balancer::SetShares(Kind kind, uint64_t bucket_bytes, std::vector<double> shares, bool pinned) {
  if (shares.size() != links_.size()) {
    return Status::InvalidArgument("flexlink: plan for " + std::string(flexlink::Name(kind)) + " needs " +
                                   std::to_string(links_.size()) + " shares (one per link), got " +
                                   std::to_string(shares.size()));
  }
  FLEXLINK_RETURN_IF_ERROR(NormaliseShares(shares));
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = EntryFor(kind, bucket_bytes);
  if (pinned) {
    Install(e, PlanMode::kPinned, std::move(shares));
  } else {
    // A new starting point: stage 2 starts over, including what it measured of single links alone
    // (a rate measured before may be of other conditions; kept, it could send the new split back
    // to a link that has since slowed down).
    e.seed = shares;
    e.single_rate = e.single_sum = 0;
    e.single_calls = 0;
    e.single_fresh = false;
    e.link_rate.assign(links_.size(), 0.0);
    e.retry_calls = options_.retry_calls;
    Reconverge(e, std::move(shares));
  }
  return Status::Ok();
}

void Balancer::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.clear();
}

std::vector<std::shared_ptr<const Plan>> Balancer::Plans() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<const Plan>> plans;
  for (const auto& [key, e] : entries_) plans.push_back(e.plan);
  return plans;
}

std::string Balancer::Describe(const Plan& plan) const {
  std::string s = std::string(flexlink::Name(plan.kind)) + " " + FormatBytes(plan.bucket_bytes) + " [" +
                  std::string(Name(plan.mode)) + "]";
  for (size_t i = 0; i < plan.shares.size() && i < links_.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "=%.3f", plan.shares[i]);
    s += " " + links_[i] + buf;
  }
  return s;
}

}  // namespace flexlink::plan
