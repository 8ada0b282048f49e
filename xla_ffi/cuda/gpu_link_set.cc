#include "xla_ffi/cuda/gpu_link_set.h"

#include "xla_ffi/cuda/nccl_link.h"
#include "xla_ffi/cuda/pcie_link.h"
#include "xla_ffi/plan/link_spec.h"

namespace flexlink::gpu {

std::vector<std::string> GpuLinkSet::names() const {
  std::vector<std::string> out;
  for (const auto& link : links) out.emplace_back(link->name());
  return out;
}

Status MakeGpuLinkSet(std::string_view text, uint64_t version, DeviceApi* api, CommApi* comm,
                      std::shared_ptr<const GpuLinkSet>* out) {
  std::vector<plan::LinkSpec> specs;
  FLEXLINK_RETURN_IF_ERROR(plan::ParseLinkSpecs(text, {"nccl", "pcie", "rdma"}, &specs));
  auto set = std::make_shared<GpuLinkSet>();
  set->version = version;
  set->spec = plan::FormatLinkSpecs(specs);
  for (const plan::LinkSpec& spec : specs) {
    std::unique_ptr<GpuLink> link;
    Status s;
    if (spec.kind == "nccl") {
      s = NcclLink::FromSpec(spec, api, comm, &link);
    } else if (spec.kind == "pcie") {
      s = PcieLink::FromSpec(spec, api, &link);
    } else {
      s = Status::InvalidArgument(
          "the rdma link (NIC loopback through the switch) is not implemented yet; its design is in "
          "docs/cuda.md, \"The rdma link\"; use nccl and pcie");
    }
    if (!s.ok()) return Status::InvalidArgument("flexlink: links \"" + std::string(text) + "\": " + s.message());
    set->links.push_back(std::move(link));
  }
  *out = std::move(set);
  return Status::Ok();
}

std::string LinkWhere(std::string_view label, Kind kind, std::span<const int64_t> ids, std::string_view link) {
  return ErrorPrefix(label) + std::string(Name(kind)) + " on group " + FormatIds(ids) + " (link " +
         std::string(link) + "): ";
}

}  // namespace flexlink::gpu
