// The engine's values as Python sees them, for both native modules (_flexlink: ffi/module.cc,
// ffi/control.cc; _flexlink_cuda: cuda/runtime/module.cc), so that jax_flexlink reads the two
// platforms' statistics, plans, split records and fits in one shape, and both raise the same errors.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

#include "xla_ffi/core/engine.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"
#include "xla_ffi/plan/balancer.h"
#include "xla_ffi/plan/cost_model.h"

namespace flexlink::py {

namespace nb = nanobind;

// A failed status as Python's ValueError.
inline void Check(const Status& s) {
  if (!s.ok()) throw nb::value_error(s.message().c_str());
}

inline Kind KindOf(const std::string& name) {
  auto k = ParseKind(name);
  if (!k)
    throw nb::value_error(("unknown collective '" + name +
                           "' (all_reduce, all_gather, reduce_scatter, ppermute, all_to_all)").c_str());
  return *k;
}

// {'links': {name: {bytes, calls, seconds, healthy}}}
inline nb::object RateOrNone(double bps) { return bps > 0 ? nb::object(nb::float_(bps)) : nb::none(); }

// {'links': {name: {bytes, calls, seconds, healthy, state}}, 'health': [...], 'failovers': {...}}
// (the schema in docs/faults.md). A link's "healthy"/"state": the worst over the groups it ran in.
inline nb::dict LinkStats() {
  const std::vector<LinkHealthSnapshot> health = SnapshotHealth();
  auto worst = [&](const std::string& link) {
    LinkState w = LinkState::kHealthy;
    for (const auto& h : health)
      if (h.link == link && static_cast<int>(h.state) > static_cast<int>(w)) w = h.state;
    return w;
  };
  nb::dict links;
  for (const LinkStatsSnapshot& s : SnapshotLinkStats()) {
    nb::dict e;
    const LinkState state = worst(s.name);
    e["bytes"] = s.bytes;
    e["calls"] = s.calls;
    e["seconds"] = s.seconds;
    e["healthy"] = s.healthy && state != LinkState::kUnhealthy;
    e["state"] = std::string(Name(state));
    links[s.name.c_str()] = e;
  }
  nb::list hl;
  for (const auto& h : health) {
    nb::dict d;
    d["group"] = h.group;
    d["link"] = h.link;
    d["state"] = std::string(Name(h.state));
    d["since"] = h.since;
    d["since_call"] = h.since_call;
    d["reason"] = h.reason;
    d["expected_bytes_per_s"] = RateOrNone(h.expected_bps);
    d["observed_bytes_per_s"] = RateOrNone(h.observed_bps);
    d["errors"] = h.errors;
    d["failovers"] = h.failovers;
    d["probes"] = h.probes;
    hl.append(d);
  }
  nb::list recent;
  for (const auto& f : RecentFailovers()) {
    nb::dict d;
    d["group"] = f.group;
    d["collective"] = f.collective;
    d["call"] = f.call;
    d["link"] = f.link;
    d["to"] = f.to;
    d["reason"] = f.reason;
    d["bytes"] = f.bytes;
    d["seconds"] = f.seconds;
    d["time"] = f.time;
    recent.append(d);
  }
  nb::dict failovers;
  failovers["count"] = FailoverCount();
  failovers["recent"] = recent;
  nb::dict out;
  out["links"] = links;
  out["health"] = hl;
  out["failovers"] = failovers;
  return out;
}

// {collective, bucket_bytes, shares: {link: share}, mode, epoch, group}
inline nb::dict PlanDict(const PlanSnapshot& p) {
  nb::dict shares;
  for (size_t i = 0; i < p.links.size() && i < p.plan.shares.size(); ++i) shares[p.links[i].c_str()] = p.plan.shares[i];
  nb::dict d;
  d["collective"] = std::string(Name(p.plan.kind));
  d["bucket_bytes"] = p.plan.bucket_bytes;
  d["shares"] = shares;
  d["mode"] = std::string(plan::Name(p.plan.mode));
  d["epoch"] = p.plan.epoch;
  d["group"] = p.group;
  return d;
}

// [{group, run_id, call, rank, ranges}]
inline nb::list SplitRecordList(const std::vector<SplitRecord>& records) {
  nb::list out;
  for (const SplitRecord& r : records) {
    nb::dict d;
    d["group"] = r.group;
    d["run_id"] = r.run_id;
    d["call"] = r.call;
    d["rank"] = r.rank;
    d["ranges"] = r.ranges;
    out.append(d);
  }
  return out;
}

// {collective: [(alpha_s, beta_s_per_byte) per link]} for the kinds the model has.
inline nb::dict FitsOf(const plan::CostModel& model) {
  nb::dict out;
  for (Kind kind : kAllKinds) {
    if (!model.Has(kind)) continue;
    std::vector<std::pair<double, double>> fits;
    for (const auto& f : model.Fits(kind)) fits.emplace_back(f.alpha, f.beta);
    out[std::string(Name(kind)).c_str()] = fits;
  }
  return out;
}

// A group's stage-1 model: {fits, split_min_bytes, profiled_bytes}.
inline nb::dict GroupModelDict(const plan::CostModel& model) {
  nb::dict thresholds, profiled;
  for (Kind kind : kAllKinds) {
    if (!model.Has(kind)) continue;
    if (auto t = model.MeasuredThreshold(kind)) thresholds[std::string(Name(kind)).c_str()] = nb::int_(*t);
    profiled[std::string(Name(kind)).c_str()] = nb::int_(model.ProfiledBytes(kind));
  }
  nb::dict result;
  result["fits"] = FitsOf(model);
  result["split_min_bytes"] = thresholds;
  result["profiled_bytes"] = profiled;
  return result;
}

}  // namespace flexlink::py
