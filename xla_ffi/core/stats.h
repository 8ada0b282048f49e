// Per-link counters, process-wide and keyed by link name (what stats() reports). Updated once per
// call by rank 0 of the call, so "bytes" is the per-rank message size summed over calls, the
// convention of nccl-tests' "size" column.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace flexlink {

struct LinkStatsSnapshot {
  std::string name;
  uint64_t bytes = 0;
  uint64_t calls = 0;
  double seconds = 0;
  bool healthy = true;
};

void RecordLinkCall(std::string_view link, uint64_t bytes, double seconds);
void MarkLinkHealth(std::string_view link, bool healthy);
std::vector<LinkStatsSnapshot> SnapshotLinkStats();
void ResetLinkStats();  // zeroes counters; links stay listed

}  // namespace flexlink
