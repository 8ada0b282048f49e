// Stage 2 of the balancer: learning from each call's measured link times (see balancer.h and
// docs/planning.md). The plan bookkeeping (creation, epochs, locking) is in balancer.cc; everything
// here runs under the balancer's mutex, called from Report.
#include <algorithm>
#include <cmath>

#include "xla_ffi/plan/balancer.h"
#include "xla_ffi/plan/shares.h"

namespace flexlink::plan {

Balancer::Assessment Balancer::Assess(const Entry& e, uint64_t bytes, std::span<const double> link_seconds) const {
  const std::vector<double>& shares = e.plan->shares;
  size_t n = shares.size();
  bool has_model = model_.Has(e.plan->kind);
  // Lines through the measured points: link i took t_i for share_i·bytes; with intercept α'_i (the
  // model's α, at most max_alpha_fraction of t_i) its slope is (t_i − α'_i)/(share_i·bytes). The
  // equal-finish split of these lines over the measured links' mass is the target. Links without a
  // time (no range, not measured) keep their share.
  Assessment a;
  a.target = shares;
  a.dev.assign(n, 0.0);
  a.rate.assign(n, 0.0);
  std::vector<size_t> measured;
  std::vector<AlphaBeta> lines;
  double mass = 0, t_min = 0, t_max = 0, best = -1;
  for (size_t i = 0; i < n; ++i) {
    double t = i < link_seconds.size() ? link_seconds[i] : 0;
    if (!(shares[i] > 0) || !(t > 0)) continue;
    double alpha = has_model ? std::min(model_.Fits(e.plan->kind)[i].alpha, options_.max_alpha_fraction * t) : 0;
    measured.push_back(i);
    lines.push_back({alpha, (t - alpha) / (shares[i] * bytes)});
    mass += shares[i];
    t_min = t_min > 0 ? std::min(t_min, t) : t;
    t_max = std::max(t_max, t);
    if (shares[i] / t > best) best = shares[i] / t, a.fastest = i;
    a.rate[i] = shares[i] * bytes / t;
  }
  if (measured.empty()) return a;
  a.valid = true;
  a.spread = t_max / t_min - 1;
  std::vector<double> part = EqualFinishShares(lines, mass * bytes);
  a.worst = measured[0];
  for (size_t k = 0; k < measured.size(); ++k) {
    size_t i = measured[k];
    a.target[i] = mass * part[k];
    a.dev[i] = a.target[i] - shares[i];
    if (std::abs(a.dev[i]) > a.max_dev) a.max_dev = std::abs(a.dev[i]), a.worst = i;
  }
  return a;
}

void Balancer::OnSplitCall(Entry& e, uint64_t bytes, std::span<const double> link_seconds, double rate,
                           Outcome* out) {
  const std::vector<double>& shares = e.plan->shares;
  size_t n = shares.size();
  size_t window = static_cast<size_t>(std::max({options_.settle_calls, options_.change_calls, 1}));
  e.window.push_back(rate);
  if (e.window.size() > window) e.window.erase(e.window.begin());

  if (e.plan->mode == PlanMode::kConverging) {
    Assessment a = Assess(e, bytes, link_seconds);
    if (!a.valid) return;
    e.fastest_link = a.fastest;
    for (size_t i = 0; i < n; ++i) {
      if (a.rate[i] > 0) e.link_rate[i] = a.rate[i];
    }
    // A target on the other side of the previous one means the step overshot (the model's α is
    // larger than the link's): halve the far step. Near balance the sign flips with noise; the damped
    // step handles that.
    if (!e.last_dev.empty() && a.max_dev > options_.settle_tolerance && a.dev[a.worst] * e.last_dev[a.worst] < 0) {
      e.step = std::max(0.125, e.step / 2);
    }
    e.last_dev = a.dev;
    double d = a.spread > options_.far_spread ? e.step : std::min(e.step, options_.damping);
    std::vector<double> next(n);
    // A share shrinks at most 4x per call: one bad step (an α larger than the link's) cannot drop a
    // useful link for good; a really slow link still reaches the floor in a few calls.
    for (size_t i = 0; i < n; ++i) next[i] = std::max(shares[i] + d * a.dev[i], shares[i] / 4);
    Normalise(next);
    DropBelow(next, options_.min_share);
    ++e.converge_calls;
    bool balanced = a.max_dev < options_.settle_tolerance && a.spread < options_.settle_spread;
    e.settle_count = balanced ? e.settle_count + 1 : 0;
    e.split = next;
    if (e.settle_count >= options_.settle_calls || e.converge_calls >= options_.max_converge_calls) {
      // Settling only by the call limit means the links are noisier than the tolerances: widen the
      // change-detection tolerances of this plan, or noise alone would keep re-opening it.
      bool balanced_now = e.settle_count >= options_.settle_calls;
      e.slack = balanced_now ? 1.0 : std::min(8.0, 2 * e.slack);
      out->reason = balanced_now ? "balanced" : "settled after max calls";
      Decide(e, bytes, out);
    } else if (next != shares) {
      Install(e, PlanMode::kConverging, next);
    }
    return;
  }
  // Settled: shares stay frozen (no epoch churn from noise). The balance is judged on link times
  // averaged over the last change_calls calls (the plan did not change, so they average noise out);
  // lost twice in a row means a link's speed changed.
  e.recent.emplace_back(link_seconds.begin(), link_seconds.end());
  e.recent.back().resize(n, 0.0);
  if (e.recent.size() > static_cast<size_t>(options_.change_calls)) e.recent.erase(e.recent.begin());
  if (e.recent.size() == static_cast<size_t>(options_.change_calls)) {
    std::vector<double> mean(n, 0.0);
    for (size_t i = 0; i < n; ++i) {  // a link unmeasured in any of the calls stays unmeasured (0)
      bool all = true;
      for (const auto& t : e.recent) all = all && t[i] > 0, mean[i] += t[i];
      mean[i] = all ? mean[i] / e.recent.size() : 0;
    }
    Assessment a = Assess(e, bytes, mean);
    bool lost = a.valid && (a.max_dev > options_.change_tolerance * e.slack ||
                            a.spread > options_.change_spread * e.slack);
    e.change_count = lost ? e.change_count + 1 : 0;
    if (e.change_count >= 2) {
      out->reason = "link speed changed";
      e.single_fresh = false;  // the single link may have changed too
      Assessment now = Assess(e, bytes, link_seconds);  // start from this call's target
      std::vector<double> next = now.valid ? now.target : shares;
      DropBelow(next, options_.min_share);
      Reconverge(e, std::move(next));
      return;
    }
  }
  size_t link = 0;
  double single = e.single_rate > 0 ? e.single_rate : ModelSingleRate(e.plan->kind, bytes, &link);
  if (single > 0 && e.window.size() >= window && Mean(e.window) < single * (1 - options_.fallback_margin)) {
    StartTrial(e, bytes, out, "split slower than the best single link");
    return;
  }
  // A dropped link is invisible to the measurements; give it a small share again now and then (with
  // the same doubling interval as fallback retries) in case it got faster.
  std::vector<double> reopened = Reopen(e);
  if (++e.settled_calls >= e.retry_calls && reopened != shares) {
    e.retry_calls = std::min(2 * e.retry_calls, options_.max_retry_calls);
    out->reason = "re-probing dropped links";
    Reconverge(e, std::move(reopened));
  }
}

void Balancer::Reconverge(Entry& e, std::vector<double> shares) {
  e.converge_calls = e.settle_count = e.change_count = 0;
  e.step = 1.0;
  e.last_dev.clear();
  e.window.clear();
  e.split = shares;
  Install(e, PlanMode::kConverging, std::move(shares));
}

std::vector<double> Balancer::Reopen(const Entry& e) const {
  std::vector<double> s = CountUsed(e.split) >= 2 ? e.split : e.seed;
  // A probe is sized to finish with the others if the link still has its last measured speed, so
  // probing a link that is still slow costs about nothing, and one that got faster shows it.
  double call = e.window.empty() ? 0 : 1.0 / Mean(e.window);  // seconds per byte of recent calls
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] > 0 || e.seed[i] <= 0) continue;
    double fit = e.link_rate[i] > 0 && call > 0 ? call * e.link_rate[i] : options_.probe_share;
    s[i] = std::clamp(fit, 1e-4, options_.probe_share);
  }
  Normalise(s);
  return s;
}

void Balancer::Decide(Entry& e, uint64_t bytes, Outcome* out) {
  e.converge_calls = e.settle_count = e.change_count = 0;
  if (CountUsed(e.split) < 2) {  // the split collapsed onto one link: that link alone, retried later
    e.single_link = static_cast<size_t>(std::max_element(e.split.begin(), e.split.end()) - e.split.begin());
    e.single_calls = 0;
    e.single_sum = 0;
    Install(e, PlanMode::kFallback, OneHot(links_.size(), e.single_link));
    return;
  }
  double split_rate = Mean(e.window);
  size_t model_link = e.fastest_link;
  double model_rate = ModelSingleRate(e.plan->kind, bytes, &model_link);
  double single = e.single_rate > 0 ? e.single_rate : model_rate;
  if (single > 0 && split_rate >= single * (1 + options_.min_split_gain)) {
    e.retry_calls = options_.retry_calls;
    Install(e, PlanMode::kSettled, e.split);
  } else if (single > 0 && e.single_fresh) {
    out->reason += out->reason.empty() ? "" : "; ";
    out->reason += "split does not beat " + links_[e.single_link] + " alone: fallback";
    e.single_calls = 0;
    e.single_sum = 0;
    Install(e, PlanMode::kFallback, OneHot(links_.size(), e.single_link));
  } else {
    e.single_link = model_rate > 0 ? model_link : e.fastest_link;
    StartTrial(e, bytes, out, single > 0 ? "split may not beat a single link" : "measuring a single link");
  }
}

void Balancer::StartTrial(Entry& e, uint64_t /*bytes*/, Outcome* out, std::string_view why) {
  if (!out->reason.empty()) out->reason += "; ";
  out->reason += std::string(why) + ": trial of " + links_[e.single_link] + " alone";
  e.single_calls = 0;
  e.single_sum = 0;
  Install(e, PlanMode::kTrial, OneHot(links_.size(), e.single_link));
}

void Balancer::OnSingleCall(Entry& e, uint64_t bytes, double rate, Outcome* out) {
  // A fallback link that slows down (a degraded link) would otherwise carry every byte until the
  // next retry, up to max_retry_calls later: when its last change_calls calls, averaged, run below
  // fallback_slowdown x its rate over the phase before them, the split is retried at once.
  if (e.plan->mode == PlanMode::kFallback) {
    const size_t window = static_cast<size_t>(std::max(options_.change_calls, 1));
    e.single_recent.push_back(rate);
    if (e.single_recent.size() > window) e.single_recent.erase(e.single_recent.begin());
    const int before = e.single_calls - static_cast<int>(e.single_recent.size()) + 1;
    if (e.single_recent.size() == window && before >= static_cast<int>(window)) {
      const double recent = Mean(e.single_recent);
      double sum_before = e.single_sum;
      for (size_t k = 0; k + 1 < e.single_recent.size(); ++k) sum_before -= e.single_recent[k];
      const double earlier = sum_before / before;
      if (recent < earlier * options_.fallback_slowdown) {
        out->reason = links_[e.single_link] + " alone slowed down: retrying the split";
        e.single_rate = e.single_sum = 0;
        e.single_calls = 0;
        e.single_fresh = false;
        e.single_recent.clear();
        Reconverge(e, Reopen(e));
        return;
      }
    }
  }
  ++e.single_calls;
  e.single_sum += rate;
  e.single_rate = e.single_sum / e.single_calls;
  e.single_fresh = true;
  if (e.plan->mode == PlanMode::kTrial && e.single_calls >= options_.trial_calls) {
    out->reason = "trial done";
    Decide(e, bytes, out);
  } else if (e.plan->mode == PlanMode::kFallback && e.single_calls >= e.retry_calls) {
    // Retry the split from where it was; if it loses again the next fallback lasts twice as long.
    e.retry_calls = std::min(2 * e.retry_calls, options_.max_retry_calls);
    out->reason = "retrying the split";
    Reconverge(e, Reopen(e));
  }
}

}  // namespace flexlink::plan
