// FFI boundary: decode the call frame, map types, hand over to the engine, map the status back.
// Operands (x_1, ..., x_k, token), results (y_1, ..., y_k, token), k >= 1, attributes as in
// docs/interfaces.md. The token carries no data; it only chains FlexLink calls so that every device
// runs them in program order.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// XLA's FFI headers are not -Wall -Wextra clean; keep our own warnings meaningful.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wattributes"
#pragma GCC diagnostic ignored "-Wreturn-type"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop

#include "xla_ffi/core/engine.h"
#include "xla_ffi/ffi/handlers.h"

namespace ffi = xla::ffi;

namespace flexlink {
namespace {

std::optional<DType> FromFfi(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return DType::kPred;
    case ffi::DataType::S8: return DType::kS8;
    case ffi::DataType::S16: return DType::kS16;
    case ffi::DataType::S32: return DType::kS32;
    case ffi::DataType::S64: return DType::kS64;
    case ffi::DataType::U8: return DType::kU8;
    case ffi::DataType::U16: return DType::kU16;
    case ffi::DataType::U32: return DType::kU32;
    case ffi::DataType::U64: return DType::kU64;
    case ffi::DataType::F16: return DType::kF16;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::F64: return DType::kF64;
    case ffi::DataType::C64: return DType::kC64;
    case ffi::DataType::C128: return DType::kC128;
    default: return std::nullopt;  // sub-byte ints, fp8, tokens
  }
}

ffi::Error ToFfi(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk: return ffi::Error::Success();
    case StatusCode::kInvalidArgument: return ffi::Error::InvalidArgument(s.message());
    case StatusCode::kDeadlineExceeded: return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, s.message());
    case StatusCode::kFailedPrecondition:
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, s.message());
    case StatusCode::kInternal: return ffi::Error::Internal(s.message());
  }
  return ffi::Error::Internal(s.message());
}

std::span<const int64_t> AsSpan(ffi::Span<const int64_t> s) { return {s.begin(), s.size()}; }

std::string Unsupported(std::string_view where, ffi::DataType t) {
  return std::string(where) + "unsupported element type (XLA type " + std::to_string(static_cast<int>(t)) +
         "); supported: bool, int8-64, uint8-64, float16, bfloat16, float32, float64, complex64, complex128";
}

// Operands (x_1, ..., x_k, token) and results (y_1, ..., y_k, token), k >= 1: decodes the k pairs into
// `operands` (thread_local storage, so a call allocates nothing once a device thread has seen its
// widest call) or says what is wrong with the call frame.
ffi::Error DecodeOperands(Kind kind, std::string_view label, const ffi::RemainingArgs& args,
                          const ffi::RemainingRets& rets, std::span<const OperandRequest>* operands) {
  const std::string where = ErrorPrefix(label) + std::string(Name(kind)) + ": ";
  const size_t nargs = args.size(), nrets = rets.size();
  if (nargs < 2 || nrets != nargs)
    return ffi::Error::InvalidArgument(
        where + "expected operands (x_1, ..., x_k, token) and results (y_1, ..., y_k, token) with k >= 1, got " +
        std::to_string(nargs) + " operands and " + std::to_string(nrets) + " results");
  const size_t k = nargs - 1;
  auto token = args.get<ffi::AnyBuffer>(k);
  auto token_out = rets.get<ffi::AnyBuffer>(k);
  if (!token || token->element_type() != ffi::DataType::TOKEN || !token_out ||
      (*token_out)->element_type() != ffi::DataType::TOKEN)
    return ffi::Error::InvalidArgument(where + "the last operand and the last result must be the ordering token");
  thread_local std::vector<OperandRequest> storage;
  storage.resize(k);
  for (size_t i = 0; i < k; ++i) {
    const std::string at = k > 1 ? where + "operand " + std::to_string(i) + ": " : where;
    auto x = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (!x || !y) return ffi::Error::InvalidArgument(at + "operand and result must be buffers");
    const auto in_type = FromFfi(x->element_type()), out_type = FromFfi((*y)->element_type());
    if (!in_type) return ffi::Error::InvalidArgument(Unsupported(at, x->element_type()));
    if (!out_type) return ffi::Error::InvalidArgument(Unsupported(at, (*y)->element_type()));
    OperandRequest& op = storage[i];
    op.in_dtype = *in_type;
    op.out_dtype = *out_type;
    op.in_dims = AsSpan(x->dimensions());
    op.out_dims = AsSpan((*y)->dimensions());
    op.in = x->untyped_data();
    op.out = (*y)->untyped_data();
  }
  *operands = storage;
  return ffi::Error::Success();
}

ffi::Error Run(Kind kind, int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
               ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes,
               std::string_view reduction, int64_t axis, std::string_view label,
               std::span<const int64_t> pairs = {}) {
  CollectiveArgs a;
  ffi::Error decoded = DecodeOperands(kind, label, args, rets, &a.request.operands);
  if (decoded.failure()) return decoded;
  a.groups = AsSpan(groups);
  a.group_sizes = AsSpan(group_sizes);
  a.device = device;
  a.run_id = run_id.run_id;
  a.label = label;
  a.request.kind = kind;
  a.request.reduction = reduction;
  a.request.axis = axis;
  a.request.pairs = pairs;
  return ToFfi(RunCollective(a));
}

ffi::Error AllReduceImpl(int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
                         ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes,
                         std::string_view reduction, std::string_view label) {
  return Run(Kind::kAllReduce, device, run_id, args, rets, groups, group_sizes, reduction, 0, label);
}

ffi::Error AllGatherImpl(int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
                         ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes,
                         int64_t axis, std::string_view label) {
  return Run(Kind::kAllGather, device, run_id, args, rets, groups, group_sizes, "", axis, label);
}

ffi::Error ReduceScatterImpl(int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
                             ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes,
                             std::string_view reduction, int64_t axis, std::string_view label) {
  return Run(Kind::kReduceScatter, device, run_id, args, rets, groups, group_sizes, reduction, axis, label);
}

ffi::Error PpermuteImpl(int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes,
                        ffi::Span<const int64_t> pairs, std::string_view label) {
  return Run(Kind::kPpermute, device, run_id, args, rets, groups, group_sizes, "", 0, label, AsSpan(pairs));
}

ffi::Error AllToAllImpl(int32_t device, ffi::RunId run_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes, int64_t axis,
                        std::string_view label) {
  return Run(Kind::kAllToAll, device, run_id, args, rets, groups, group_sizes, "", axis, label);
}

// The common prefix of every binding: context, (x_1..x_k, token) -> (y_1..y_k, token), group table.
auto Bind() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::RunId>()
      .RemainingArgs()
      .RemainingRets()
      .Attr<ffi::Span<const int64_t>>("groups")
      .Attr<ffi::Span<const int64_t>>("group_sizes");
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
