// FFI boundary: decode the call frame, map types, hand over to the engine, map the status back.
// Operands (x_1, ..., x_k, token), results (y_1, ..., y_k, token), k >= 1, attributes as in
// docs/interfaces.md. The token carries no data; it only chains FlexLink calls so that every device
// runs them in program order.
#include <cstdint>
#include <span>
#include <string_view>

#include "xla_ffi/core/engine.h"
#include "xla_ffi/ffi/decode.h"
#include "xla_ffi/ffi/handlers.h"

namespace ffi = xla::ffi;

namespace flexlink {
namespace {

ffi::Error Run(Kind kind, int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
               ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes, int64_t links_version,
               std::string_view reduction, int64_t axis, std::string_view label,
               std::span<const int64_t> pairs = {}) {
  CollectiveArgs a;
  ffi::Error decoded = DecodeCall(kind, device, run_id, args, rets, groups, group_sizes, reduction, axis, label, pairs, &a);
  if (decoded.failure()) return decoded;
  a.links_version = links_version > 0 ? static_cast<uint64_t>(links_version) : 0;
  return ToFfi(RunCollective(a));
}

ffi::Error AllReduceImpl(int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
                         ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes, int64_t links_version,
                         std::string_view reduction, std::string_view label) {
  return Run(Kind::kAllReduce, device, run_id, args, rets, groups, group_sizes, links_version, reduction, 0, label);
}

ffi::Error AllGatherImpl(int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
                         ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes, int64_t links_version,
                         int64_t axis, std::string_view label) {
  return Run(Kind::kAllGather, device, run_id, args, rets, groups, group_sizes, links_version, "", axis, label);
}

ffi::Error ReduceScatterImpl(int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
                             ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes, int64_t links_version,
                             std::string_view reduction, int64_t axis, std::string_view label) {
  return Run(Kind::kReduceScatter, device, run_id, args, rets, groups, group_sizes, links_version, reduction, axis,
             label);
}

ffi::Error PpermuteImpl(int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes, int64_t links_version,
                        ffi::Span<const int64_t> pairs, std::string_view label) {
  return Run(Kind::kPpermute, device, run_id, args, rets, groups, group_sizes, links_version, "", 0, label,
             AsSpan(pairs));
}

ffi::Error AllToAllImpl(int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes, int64_t links_version,
                        int64_t axis, std::string_view label) {
  return Run(Kind::kAllToAll, device, run_id, args, rets, groups, group_sizes, links_version, "", axis, label);
}

// The common prefix of every binding: context, (x_1..x_k, token) -> (y_1..y_k, token), group table,
// and the link set the program was lowered with (core/link_set.h: every rank of a call runs on it).
auto Bind() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::RunId>()
      .RemainingArgs()
      .RemainingRets()
      .Attr<ffi::Span<const int64_t>>("groups")
      .Attr<ffi::Span<const int64_t>>("group_sizes")
      .Attr<int64_t>("links_version");
}

}  // namespace
}  // namespace flexlink

// Not kCmdBufferCompatible: a call blocks on other devices, which command-buffer capture must not do.
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexlinkAllReduce, flexlink::AllReduceImpl,
                              flexlink::Bind()
                                  .Attr<std::string_view>("reduction")
                                  .Attr<std::string_view>("label"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexlinkAllGather, flexlink::AllGatherImpl,
                              flexlink::Bind().Attr<int64_t>("axis").Attr<std::string_view>("label"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexlinkReduceScatter, flexlink::ReduceScatterImpl,
                              flexlink::Bind()
                                  .Attr<std::string_view>("reduction")
                                  .Attr<int64_t>("axis")
                                  .Attr<std::string_view>("label"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexlinkPpermute, flexlink::PpermuteImpl,
                              flexlink::Bind()
                                  .Attr<ffi::Span<const int64_t>>("pairs")
                                  .Attr<std::string_view>("label"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexlinkAllToAll, flexlink::AllToAllImpl,
                              flexlink::Bind().Attr<int64_t>("axis").Attr<std::string_view>("label"));
