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
  // Every kind of the grammar applies to GPU links (docs/faults.md, "GPU links"); names are checked
  // against the GPU link set's.
  std::vector<Fault> faults;
  FLEXLINK_RETURN_IF_ERROR(ParseFaults(text, links, &faults));
  SetParsedFaults(text, std::move(faults));
  return Status::Ok();
}

}  // namespace flexlink::gpu
