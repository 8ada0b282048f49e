#include "xla_ffi/cuda/gpu_faults.h"

#include <utility>

#include "xla_ffi/core/call.h"

namespace flexlink::gpu {

Status FaultyGpuChannel::Admit(int rank, const FaultSet& faults, std::string_view label) {
  const uint64_t call = counter_.Next(rank, faults);
  const Fault* f = faults.ForLink(link_name(), call);
  if (!f) return Status::Ok();
  // SetGpuFaults admits only errors; anything else here is a fault set made by another path.
  return Status::Unavailable(ErrorPrefix(label) + "link " + std::string(link_name()) + ": injected error at its call " +
                             std::to_string(call) + " (FLEXLINK_FAULTS \"" + faults.text + "\")");
}

Status SetGpuFaults(std::string_view text, const std::vector<std::string>& links) {
  std::vector<Fault> faults;
  FLEXLINK_RETURN_IF_ERROR(ParseFaults(text, links, &faults));
  for (const Fault& f : faults) {
    std::string why;
    switch (f.kind) {
      case Fault::Kind::kError:
        continue;
      case Fault::Kind::kSlow:
        why = "slow is not supported on GPU links: a GPU call returns once its work is enqueued, so the "
              "engine has no host-side time of the link's range to stretch, and a device-side delay "
              "would need a kernel of its own per link";
        break;
      case Fault::Kind::kHang:
        why = "hang is not supported on GPU links: the host never waits for the device on the call "
              "path, so a range that never completes on the device cannot be detected, failed over or "
              "re-run in the call it belongs to (its outputs are already promised to XLA's stream)";
        break;
      case Fault::Kind::kAbsent:
        why = "rank:absent is not supported by the GPU engine yet (its rendezvous deadline is tested "
              "without injection)";
        break;
    }
    return Status::InvalidArgument("flexlink: fault spec \"" + std::string(text) + "\": " + why +
                                   " (GPU links support NAME:error@at_call=N[,sticky=1]; docs/faults.md)");
  }
  SetParsedFaults(text, std::move(faults));
  return Status::Ok();
}

}  // namespace flexlink::gpu
