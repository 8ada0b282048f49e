// FFI boundary on CUDA: decode the call frame exactly as on CPU (ffi/decode.h), take XLA's stream,
// hand over to the GPU engine, which enqueues the call's work on that stream and returns. Nothing
// here or below waits for the device (docs/cuda.md, "Stream ordering").
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/cuda/runtime/handlers.h"
#include "xla_ffi/cuda/runtime/process.h"
#include "xla_ffi/ffi/decode.h"

namespace ffi = xla::ffi;

namespace flexlink::gpu {
namespace {

std::string FormatMap(const std::vector<int64_t>& ids) {
  std::string out;
  for (size_t o = 0; o < ids.size(); ++o) {
    if (ids[o] < 0) continue;
    out += (out.empty() ? "" : ", ") + std::to_string(o) + " -> " + std::to_string(ids[o]);
  }
  return out.empty() ? "none" : out;
}

ffi::Error Run(Kind kind, cudaStream_t stream, int32_t device, ffi::RunId run_id, ffi::RemainingArgs args,
               ffi::RemainingRets rets, ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes,
               int64_t links_version, std::string_view reduction, int64_t axis, std::string_view label,
               std::span<const int64_t> pairs = {}) {
  CollectiveArgs a;
  // Groups hold global device ids; XLA gives the CUDA ordinal (device_ids.h).
  const int64_t global = ProcessDeviceIds().GlobalIdOf(device);
  if (global < 0)
    return ffi::Error::InvalidArgument(
        ErrorPrefix(label) + "XLA ran this call on CUDA device " + std::to_string(device) +
        ", which is none of this process's jax devices as FlexLink was told at lowering (ordinal -> id: " +
        FormatMap(ProcessDeviceIds().Map()) + ")");
  const int32_t id = static_cast<int32_t>(global);
  ffi::Error decoded = DecodeCall(kind, id, run_id, args, rets, groups, group_sizes, reduction, axis, label, pairs, &a);
  if (decoded.failure()) return decoded;
  a.links_version = links_version > 0 ? static_cast<uint64_t>(links_version) : 0;
  return ToFfi(ProcessEngine().Run(a, stream));
}

ffi::Error AllReduceImpl(cudaStream_t stream, int32_t device, ffi::RunId run_id, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                         ffi::Span<const int64_t> group_sizes, int64_t links_version, std::string_view reduction,
                         std::string_view label) {
  return Run(Kind::kAllReduce, stream, device, run_id, args, rets, groups, group_sizes, links_version, reduction, 0,
             label);
}

ffi::Error AllGatherImpl(cudaStream_t stream, int32_t device, ffi::RunId run_id, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                         ffi::Span<const int64_t> group_sizes, int64_t links_version, int64_t axis, std::string_view label) {
  return Run(Kind::kAllGather, stream, device, run_id, args, rets, groups, group_sizes, links_version, "", axis, label);
}

ffi::Error ReduceScatterImpl(cudaStream_t stream, int32_t device, ffi::RunId run_id, ffi::RemainingArgs args,
                             ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                             ffi::Span<const int64_t> group_sizes, int64_t links_version, std::string_view reduction,
                             int64_t axis, std::string_view label) {
  return Run(Kind::kReduceScatter, stream, device, run_id, args, rets, groups, group_sizes, links_version, reduction,
             axis, label);
}

ffi::Error PpermuteImpl(cudaStream_t stream, int32_t device, ffi::RunId run_id, ffi::RemainingArgs args,
                        ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                        ffi::Span<const int64_t> group_sizes, int64_t links_version, ffi::Span<const int64_t> pairs,
                        std::string_view label) {
  return Run(Kind::kPpermute, stream, device, run_id, args, rets, groups, group_sizes, links_version, "", 0, label,
             AsSpan(pairs));
}

ffi::Error AllToAllImpl(cudaStream_t stream, int32_t device, ffi::RunId run_id, ffi::RemainingArgs args,
                        ffi::RemainingRets rets, ffi::Span<const int64_t> groups,
                        ffi::Span<const int64_t> group_sizes, int64_t links_version, int64_t axis,
                        std::string_view label) {
  return Run(Kind::kAllToAll, stream, device, run_id, args, rets, groups, group_sizes, links_version, "", axis, label);
}

auto Bind() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::RunId>()
      .RemainingArgs()
      .RemainingRets()
      .Attr<ffi::Span<const int64_t>>("groups")
      .Attr<ffi::Span<const int64_t>>("group_sizes")
      // The CUDA engine's link set at lowering (collective.py): picks the GPU group across processes
      // set up then, so every process runs a program on the same group whenever its calls execute.
      .Attr<int64_t>("links_version");
}

}  // namespace
}  // namespace flexlink::gpu

// Traits: none, deliberately not ffi::Traits::kCmdBufferCompatible. Every call runs host logic that
// must run per call (the rendezvous of the group's device threads, the balancer's plan, the pcie
// link's host-side ordering, polling timing events); inside a CUDA graph the handler would run once
// at capture and its enqueued work would be replayed with a stale plan and stale host state. XLA
// therefore keeps these custom calls out of command buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexlinkCudaAllReduce, flexlink::gpu::AllReduceImpl,
                              flexlink::gpu::Bind().Attr<std::string_view>("reduction").Attr<std::string_view>("label"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexlinkCudaAllGather, flexlink::gpu::AllGatherImpl,
                              flexlink::gpu::Bind().Attr<int64_t>("axis").Attr<std::string_view>("label"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexlinkCudaReduceScatter, flexlink::gpu::ReduceScatterImpl,
                              flexlink::gpu::Bind()
                                  .Attr<std::string_view>("reduction")
                                  .Attr<int64_t>("axis")
                                  .Attr<std::string_view>("label"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexlinkCudaPpermute, flexlink::gpu::PpermuteImpl,
                              flexlink::gpu::Bind().Attr<ffi::Span<const int64_t>>("pairs").Attr<std::string_view>("label"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexlinkCudaAllToAll, flexlink::gpu::AllToAllImpl,
                              flexlink::gpu::Bind().Attr<int64_t>("axis").Attr<std::string_view>("label"));
