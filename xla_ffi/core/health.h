// Link health per group (docs/faults.md): healthy, degraded (sustained low bandwidth against the
// stage-1 fit; stage 2 moves load away by itself) or unhealthy (an error or a missed deadline: its
// ranges fail over, plans exclude it, and it is probed with a small range before re-admission).
// Plus the process's failover log. What stats()["health"] and stats()["failovers"] report.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/status.h"

namespace flexlink {

enum class LinkState { kHealthy, kDegraded, kUnhealthy };
std::string_view Name(LinkState state);

struct HealthOptions {
  // Degraded: observed bandwidth below degrade_fraction x the stage-1 fit's at the same size for
  // degrade_calls consecutive measured calls. This VM's A/A noise is a few percent per call, but two
  // links running concurrently on 2 cores each run well below their alone fit, so the threshold is
  // far below that (docs/faults.md has the measurements).
  double degrade_fraction = 0.3;
  double recover_fraction = 0.6;  // degraded -> healthy after degrade_calls calls above this
  int degrade_calls = 8;
  uint64_t min_bytes = 256 << 10;  // a range smaller than this is no evidence (α and noise dominate)
  // An unhealthy link is probed probe_calls group calls (or probe_seconds) after it failed, then
  // after twice that each time the probe fails, up to 1024 calls.
  int probe_calls = 16;
  double probe_seconds = 30;
  uint64_t probe_bytes = 256 << 10;  // most bytes a probe carries (at most 1/16 of the call)
  // A link's deadline for its range: min(T / 2, max(factor x predicted, floor)), T the global timeout
  // (the executor predicts from stage 1's fit, else from a pessimistic rate). FLEXLINK_LINK_TIMEOUT_S
  // sets the floor.
  double link_timeout_factor = 8;
  double link_timeout_s = 10;
};
HealthOptions GetHealthOptions();
void SetHealthOptions(const HealthOptions& options);
// set_health_option / health_options of both native modules (each holds its own options): one
// option by name; an unknown name or a bad value is InvalidArgument (Python's ValueError) and
// changes nothing.
Status SetHealthOption(std::string_view key, double value);
std::map<std::string, double> HealthOptionValues();
// The rule above for one range.
double LinkBudgetSeconds(double predicted_s);

struct LinkHealthSnapshot {
  std::string group, link;
  LinkState state = LinkState::kHealthy;
  double since = 0;        // unix seconds of the last state change (or of the first call)
  uint64_t since_call = 0;
  std::string reason;
  double expected_bps = -1, observed_bps = -1;  // < 0: unknown
  uint64_t errors = 0, failovers = 0, probes = 0;
};

class GroupHealth {
 public:
  GroupHealth(std::string group, std::vector<std::string> links);
  const std::string& group() const { return group_; }
  const std::vector<std::string>& links() const { return links_; }

  // The group's call number (from 1); one per executor call.
  uint64_t NextCall();
  // The shares a call uses: the plan's with unhealthy links removed and the rest renormalised (all
  // unhealthy: the plan's own); an unhealthy link due for a probe gets a small share (*probe: its
  // index, else -1). *masked: the result differs from `shares` (stage 2 does not learn from it).
  std::vector<double> Effective(const std::vector<double>& shares, uint64_t call, uint64_t virtual_bytes,
                                bool* masked, int* probe);
  bool Unhealthy(size_t link);
  // An error or a missed deadline; `what` starts the reason ("error at call N: ...").
  void Failed(size_t link, uint64_t call, const std::string& reason, std::string_view what = "error");
  void FailedOver(size_t link);
  void Probed(size_t link, uint64_t call, bool ok, const std::string& reason);
  // A successful range of `bytes` (nccl-tests bytes of the range): the fit's rate (<= 0: unknown) and
  // the observed one.
  void Observed(size_t link, uint64_t call, uint64_t bytes, double expected_bps, double observed_bps);
  void Reset();
  void Snapshot(std::vector<LinkHealthSnapshot>* out);

 private:
  struct Entry {
    LinkHealthSnapshot s;
    bool ran = false;
    int low = 0, high = 0;  // consecutive calls below degrade / above recover
    double low_observed = 0, low_expected = 0, high_observed = 0;  // sums over those calls
    uint64_t next_probe_call = 0, probe_interval = 0;
    double next_probe_time = 0;
  };
  void Change(Entry& e, LinkState state, uint64_t call, std::string reason);
  const std::string group_;
  const std::vector<std::string> links_;
  std::mutex mu_;
  std::vector<Entry> entries_;
  uint64_t calls_ = 0;
};

// Every group's health registers here with its link set's version; reconfiguring the links drops
// the older sets' (their groups run only calls of programs lowered before, which stats leave out).
void RegisterGroupHealth(std::shared_ptr<GroupHealth> health, uint64_t link_set_version);
void DropHealthBefore(uint64_t link_set_version);
std::vector<LinkHealthSnapshot> SnapshotHealth();

struct FailoverRecord {
  std::string group, collective, link, to, reason;
  uint64_t call = 0, bytes = 0;
  double seconds = 0, time = 0;
};
void RecordFailover(FailoverRecord record);
uint64_t FailoverCount();
std::vector<FailoverRecord> RecentFailovers();  // newest last, at most 64
// reset_stats(): every group's health back to healthy with zero counts, the failover log emptied.
void ResetHealth();

double UnixNow();

}  // namespace flexlink
