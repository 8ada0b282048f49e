#include "xla_ffi/core/stats.h"

#include <map>
#include <mutex>

namespace flexlink {
namespace {

// A mutex is fine here: one update per call (not per rank), off the data path.
std::mutex g_mu;
std::map<std::string, LinkStatsSnapshot, std::less<>>& Table() {
  static auto* table = new std::map<std::string, LinkStatsSnapshot, std::less<>>();
  return *table;
}

LinkStatsSnapshot& Entry(std::string_view link) {
  auto& t = Table();
  auto it = t.find(link);
  if (it == t.end()) {
    it = t.emplace(std::string(link), LinkStatsSnapshot{}).first;
    it->second.name = std::string(link);
  }
  return it->second;
}

}  // namespace

void RecordLinkCall(std::string_view link, uint64_t bytes, double seconds) {
  std::lock_guard<std::mutex> lock(g_mu);
  LinkStatsSnapshot& e = Entry(link);
  e.bytes += bytes;
  e.calls += 1;
  e.seconds += seconds;
}

void MarkLinkHealth(std::string_view link, bool healthy) {
  std::lock_guard<std::mutex> lock(g_mu);
  Entry(link).healthy = healthy;
}

std::vector<LinkStatsSnapshot> SnapshotLinkStats() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<LinkStatsSnapshot> out;
  for (const auto& [name, e] : Table()) out.push_back(e);
  return out;
}

void ResetLinkStats() {
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto& [name, e] : Table()) e = LinkStatsSnapshot{name, 0, 0, 0.0, e.healthy};
}

}  // namespace flexlink
