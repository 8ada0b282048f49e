#include "xla_ffi/core/health.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <numeric>

#include "xla_ffi/core/config.h"

namespace flexlink {
namespace {

std::mutex g_mu;  // options, registry, failover log
HealthOptions g_options;
std::vector<std::pair<uint64_t, std::shared_ptr<GroupHealth>>>& Registered() {
  static auto* v = new std::vector<std::pair<uint64_t, std::shared_ptr<GroupHealth>>>();
  return *v;
}
std::vector<std::shared_ptr<GroupHealth>> Groups() {
  std::vector<std::shared_ptr<GroupHealth>> out;
  for (const auto& [version, g] : Registered()) out.push_back(g);
  return out;
}
std::deque<FailoverRecord>& Log() {
  static auto* v = new std::deque<FailoverRecord>();
  return *v;
}
uint64_t g_failovers = 0;
constexpr size_t kRecentFailovers = 64;

std::string Rate(double bps) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g GB/s", bps / 1e9);
  return buf;
}

}  // namespace

std::string_view Name(LinkState state) {
  switch (state) {
    case LinkState::kHealthy: return "healthy";
    case LinkState::kDegraded: return "degraded";
    case LinkState::kUnhealthy: return "unhealthy";
  }
  return "?";
}

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

HealthOptions GetHealthOptions() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_options;
}

void SetHealthOptions(const HealthOptions& options) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_options = options;
}

Status SetHealthOption(std::string_view key, double value) {
  HealthOptions o = GetHealthOptions();
  const std::string k(key);
  if (k != "min_bytes" && !(value > 0))
    return Status::InvalidArgument("set_health_option: " + k + " must be > 0");
  if (k == "degrade_fraction") o.degrade_fraction = value;
  else if (k == "recover_fraction") o.recover_fraction = value;
  else if (k == "degrade_calls") o.degrade_calls = static_cast<int>(value);
  else if (k == "min_bytes") o.min_bytes = static_cast<uint64_t>(std::max(0.0, value));
  else if (k == "probe_calls") o.probe_calls = static_cast<int>(value);
  else if (k == "probe_seconds") o.probe_seconds = value;
  else if (k == "probe_bytes") o.probe_bytes = static_cast<uint64_t>(value);
  else if (k == "link_timeout_factor") o.link_timeout_factor = value;
  else if (k == "link_timeout_s") o.link_timeout_s = value;
  else
    return Status::InvalidArgument("set_health_option: unknown option '" + k +
                                   "' (degrade_fraction, recover_fraction, degrade_calls, min_bytes, probe_calls, "
                                   "probe_seconds, probe_bytes, link_timeout_factor, link_timeout_s)");
  SetHealthOptions(o);
  return Status::Ok();
}

std::map<std::string, double> HealthOptionValues() {
  const HealthOptions o = GetHealthOptions();
  return {{"degrade_fraction", o.degrade_fraction}, {"recover_fraction", o.recover_fraction},
          {"degrade_calls", o.degrade_calls}, {"min_bytes", static_cast<double>(o.min_bytes)},
          {"probe_calls", o.probe_calls}, {"probe_seconds", o.probe_seconds},
          {"probe_bytes", static_cast<double>(o.probe_bytes)}, {"link_timeout_factor", o.link_timeout_factor},
          {"link_timeout_s", o.link_timeout_s}};
}

double LinkBudgetSeconds(double predicted_s) {
  const HealthOptions o = GetHealthOptions();
  const double half = TimeoutSeconds() / 2;
  const double budget = predicted_s > 0 ? std::max(o.link_timeout_factor * predicted_s, o.link_timeout_s)
                                        : o.link_timeout_s;
  return std::min(half, budget);
}

GroupHealth::GroupHealth(std::string group, std::vector<std::string> links)
    : group_(std::move(group)), links_(std::move(links)), entries_(links_.size()) {
  for (size_t i = 0; i < links_.size(); ++i) {
    entries_[i].s.group = group_;
    entries_[i].s.link = links_[i];
    entries_[i].s.since = UnixNow();
  }
}

uint64_t GroupHealth::NextCall() {
  std::lock_guard<std::mutex> lock(mu_);
  return ++calls_;
}

void GroupHealth::Change(Entry& e, LinkState state, uint64_t call, std::string reason) {
  if (e.s.state != state) {
    e.s.since = UnixNow();
    e.s.since_call = call;
    LogInfo("group " + group_ + ": link " + e.s.link + " " + std::string(Name(e.s.state)) + " -> " +
            std::string(Name(state)) + ": " + reason);
  }
  e.s.state = state;
  e.s.reason = std::move(reason);
  e.low = e.high = 0;
  e.low_observed = e.low_expected = e.high_observed = 0;
}

std::vector<double> GroupHealth::Effective(const std::vector<double>& shares, uint64_t call,
                                           uint64_t virtual_bytes, bool* masked, int* probe) {
  *masked = false;
  *probe = -1;
  std::lock_guard<std::mutex> lock(mu_);
  bool any_unhealthy = false, any_healthy = false;
  for (const Entry& e : entries_) (e.s.state == LinkState::kUnhealthy ? any_unhealthy : any_healthy) = true;
  if (!any_unhealthy || !any_healthy) return shares;
  std::vector<double> out = shares;
  double sum = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (entries_[i].s.state == LinkState::kUnhealthy) out[i] = 0;
    sum += out[i];
  }
  if (sum <= 0) {
    // The plan used only unhealthy links: the first healthy one carries the call.
    for (size_t i = 0; i < out.size(); ++i)
      if (entries_[i].s.state != LinkState::kUnhealthy) {
        out[i] = 1;
        break;
      }
    sum = 1;
  }
  for (double& s : out) s /= sum;
  const HealthOptions o = GetHealthOptions();
  const double now = UnixNow();
  for (size_t i = 0; i < out.size() && virtual_bytes > 0; ++i) {
    Entry& e = entries_[i];
    if (e.s.state != LinkState::kUnhealthy || (call < e.next_probe_call && now < e.next_probe_time)) continue;
    const double share = std::min(1.0 / 16, static_cast<double>(o.probe_bytes) / virtual_bytes);
    if (share * virtual_bytes < 2 * 64) break;  // too small a call to carry a probe: a later one will
    for (double& s : out) s *= 1 - share;
    out[i] = share;
    *probe = static_cast<int>(i);
    break;  // one probe per call
  }
  *masked = out != shares;
  return out;
}

bool GroupHealth::Unhealthy(size_t link) {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_[link].s.state == LinkState::kUnhealthy;
}

void GroupHealth::Failed(size_t link, uint64_t call, const std::string& reason, std::string_view what) {
  const HealthOptions o = GetHealthOptions();
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = entries_[link];
  e.ran = true;
  ++e.s.errors;
  if (e.s.state != LinkState::kUnhealthy) e.probe_interval = o.probe_calls;
  Change(e, LinkState::kUnhealthy, call, std::string(what) + " at call " + std::to_string(call) + ": " + reason);
  e.next_probe_call = call + e.probe_interval;
  e.next_probe_time = UnixNow() + o.probe_seconds;
}

void GroupHealth::FailedOver(size_t link) {
  std::lock_guard<std::mutex> lock(mu_);
  ++entries_[link].s.failovers;
}

void GroupHealth::Probed(size_t link, uint64_t call, bool ok, const std::string& reason) {
  const HealthOptions o = GetHealthOptions();
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = entries_[link];
  ++e.s.probes;
  if (ok) {
    Change(e, LinkState::kHealthy, call, "re-admitted: the probe at call " + std::to_string(call) + " succeeded");
    return;
  }
  ++e.s.errors;
  e.probe_interval = std::min<uint64_t>(std::max<uint64_t>(1, e.probe_interval) * 2, 1024);
  e.next_probe_call = call + e.probe_interval;
  e.next_probe_time = UnixNow() + o.probe_seconds;
  e.s.reason = "the probe at call " + std::to_string(call) + " failed: " + reason;
}

void GroupHealth::Observed(size_t link, uint64_t call, uint64_t bytes, double expected_bps,
                           double observed_bps) {
  const HealthOptions o = GetHealthOptions();
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = entries_[link];
  e.ran = true;
  if (bytes < o.min_bytes || !(observed_bps > 0)) return;
  e.s.observed_bps = observed_bps;
  e.s.expected_bps = expected_bps > 0 ? expected_bps : -1;
  if (!(expected_bps > 0) || e.s.state == LinkState::kUnhealthy) return;
  const double ratio = observed_bps / expected_bps;
  if (e.s.state == LinkState::kHealthy) {
    if (ratio < o.degrade_fraction) {
      ++e.low, e.low_observed += observed_bps, e.low_expected += expected_bps;
    } else {
      e.low = 0, e.low_observed = e.low_expected = 0;
    }
    if (e.low >= o.degrade_calls) {
      const double obs = e.low_observed / e.low, exp = e.low_expected / e.low;
      char pct[16];
      std::snprintf(pct, sizeof pct, "%.0f%%", 100 * obs / exp);
      Change(e, LinkState::kDegraded, call,
             "observed " + Rate(obs) + " over the last " + std::to_string(o.degrade_calls) + " calls, " +
                 pct + " of the profiled " + Rate(exp));
    }
  } else {  // degraded
    if (ratio >= o.recover_fraction) {
      ++e.high, e.high_observed += observed_bps;
    } else {
      e.high = 0, e.high_observed = 0;
    }
    if (e.high >= o.degrade_calls)
      Change(e, LinkState::kHealthy, call,
             "recovered: observed " + Rate(e.high_observed / e.high) + " over the last " +
                 std::to_string(o.degrade_calls) + " calls, the profiled rate is " + Rate(expected_bps));
  }
}

void GroupHealth::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < entries_.size(); ++i) {
    entries_[i] = Entry{};
    entries_[i].s.group = group_;
    entries_[i].s.link = links_[i];
    entries_[i].s.since = UnixNow();
    entries_[i].s.since_call = calls_;
  }
}

void GroupHealth::Snapshot(std::vector<LinkHealthSnapshot>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Entry& e : entries_)
    if (e.ran) out->push_back(e.s);
}

void RegisterGroupHealth(std::shared_ptr<GroupHealth> health, uint64_t link_set_version) {
  std::lock_guard<std::mutex> lock(g_mu);
  Registered().emplace_back(link_set_version, std::move(health));
}

void DropHealthBefore(uint64_t link_set_version) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& v = Registered();
  v.erase(std::remove_if(v.begin(), v.end(), [&](const auto& e) { return e.first < link_set_version; }), v.end());
}

std::vector<LinkHealthSnapshot> SnapshotHealth() {
  std::vector<std::shared_ptr<GroupHealth>> groups;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    groups = Groups();
  }
  std::vector<LinkHealthSnapshot> out;
  for (const auto& g : groups) g->Snapshot(&out);
  return out;
}

void RecordFailover(FailoverRecord record) {
  std::lock_guard<std::mutex> lock(g_mu);
  ++g_failovers;
  Log().push_back(std::move(record));
  while (Log().size() > kRecentFailovers) Log().pop_front();
}

uint64_t FailoverCount() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_failovers;
}

std::vector<FailoverRecord> RecentFailovers() {
  std::lock_guard<std::mutex> lock(g_mu);
  return {Log().begin(), Log().end()};
}

void ResetHealth() {
  std::vector<std::shared_ptr<GroupHealth>> groups;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    groups = Groups();
    g_failovers = 0;
    Log().clear();
  }
  for (const auto& g : groups) g->Reset();
}

}  // namespace flexlink
