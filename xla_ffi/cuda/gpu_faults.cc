#include "xla_ffi/cuda/gpu_faults.h"

#include <algorithm>
#include <utility>

#include "xla_ffi/core/call.h"

namespace flexlink::gpu {

Status FaultyGpuChannel::Admit(int rank, const FaultSet& faults, std::string_view label, Effect* effect) {
  const uint64_t call = counter_.Next(rank, faults);
  // Every fault of the link that fires here (a spec may slow a link and fail it later): an error
  // wins, since nothing of a refused range reaches the device.
  bool error = false;
  for (const Fault& f : faults.faults) {
    if (f.kind == Fault::Kind::kAbsent || f.link != link_name() || !f.FiresAt(call)) continue;
    switch (f.kind) {
      case Fault::Kind::kError: error = true; break;
      case Fault::Kind::kSlow: effect->slow = std::max(effect->slow, f.factor), effect->call = call; break;
      case Fault::Kind::kHang: effect->hang = true, effect->call = call; break;
      case Fault::Kind::kAbsent: break;
    }
  }
  if (!error) return Status::Ok();
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
      case Fault::Kind::kSlow:
      case Fault::Kind::kHang:
        continue;
      case Fault::Kind::kAbsent:
        why = "rank:absent is not supported by the GPU engine yet (its rendezvous deadline is tested "
              "without injection)";
        break;
    }
    return Status::InvalidArgument("flexlink: fault spec \"" + std::string(text) + "\": " + why +
                                   " (GPU links support NAME:error@at_call=N[,sticky=1], NAME:slow@factor=K[,from_call=N] and "
                                   "NAME:hang@at_call=N; docs/faults.md)");
  }
  SetParsedFaults(text, std::move(faults));
  return Status::Ok();
}

}  // namespace flexlink::gpu
