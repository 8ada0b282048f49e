// The two choices failover makes the same way on every platform (core/executor.cc Recover, the CPU
// links; cuda/gpu_executor.cc Agree, the GPU links; docs/faults.md): which link carries a failed
// range, and the error when none can.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/call.h"

namespace flexlink {

// The link that carries a failed link's range: the one with the largest share of the call that is
// neither `bad` (failed in this call) nor `unhealthy(j)`; `shares.size()` when there is none. Every
// rank decides from the same shared state, so all choose the same carrier.
template <class Unhealthy>
size_t FailoverCarrier(const std::vector<char>& bad, const std::vector<double>& shares, Unhealthy unhealthy) {
  const size_t links = shares.size();
  size_t best = links;
  for (size_t j = 0; j < links; ++j) {
    if (bad[j] || unhealthy(j)) continue;
    if (best == links || shares[j] > shares[best]) best = j;
  }
  return best;
}

// "<kind> on group [..]: no link could carry the bytes of call N (links: name: what it reported; ...)".
template <class Unhealthy>
std::string NoCarrierMessage(std::string_view label, Kind kind, const std::string& group, uint64_t call,
                             const std::vector<std::string>& names, const std::vector<std::string>& errors,
                             Unhealthy unhealthy) {
  std::string report;
  for (size_t j = 0; j < names.size(); ++j)
    report += (j ? "; " : "") + names[j] + ": " +
              (!errors[j].empty() ? errors[j]
               : unhealthy(j)     ? std::string("unhealthy (excluded until its next probe)")
                                  : std::string("not tried"));
  return ErrorPrefix(label) + std::string(Name(kind)) + " on group " + group +
         ": no link could carry the bytes of call " + std::to_string(call) + " (links: " + report + ")";
}

}  // namespace flexlink
