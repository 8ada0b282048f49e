// FFI boundary: decode the call frame, map types, hand over to the engine, map the status back.
// Operands (x, token), results (y, token), attributes as in docs/interfaces.md. The token carries no
// data; it only chains FlexLink calls so that every device runs them in program order.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

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

ffi::Error Run(Kind kind, int32_t device, ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer y,
               ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes,
               std::string_view reduction, int64_t axis, std::string_view label) {
  const auto in_type = FromFfi(x.element_type()), out_type = FromFfi(y.element_type());
  if (!in_type || !out_type)
    return ffi::Error::InvalidArgument(
        ErrorPrefix(label) + std::string(Name(kind)) + ": unsupported element type (XLA type " +
        std::to_string(static_cast<int>(x.element_type())) +
        "); supported: bool, int8-64, uint8-64, float16, bfloat16, float32, float64, complex64, "
        "complex128");
  CollectiveArgs args;
  args.groups = AsSpan(groups);
  args.group_sizes = AsSpan(group_sizes);
  args.device = device;
  args.run_id = run_id.run_id;
  args.label = label;
  args.request.kind = kind;
  args.request.reduction = reduction;
  args.request.in_dtype = *in_type;
  args.request.out_dtype = *out_type;
  args.request.in_dims = AsSpan(x.dimensions());
  args.request.out_dims = AsSpan(y.dimensions());
  args.request.axis = axis;
  args.request.in = x.untyped_data();
  args.request.out = y.untyped_data();
  return ToFfi(RunCollective(args));
}

ffi::Error AllReduceImpl(int32_t device, ffi::RunId run_id, ffi::AnyBuffer x, ffi::Token,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                         ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes,
                         std::string_view reduction, std::string_view label) {
  return Run(Kind::kAllReduce, device, run_id, x, *y, groups, group_sizes, reduction, 0, label);
}

ffi::Error AllGatherImpl(int32_t device, ffi::RunId run_id, ffi::AnyBuffer x, ffi::Token,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                         ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes,
                         int64_t axis, std::string_view label) {
  return Run(Kind::kAllGather, device, run_id, x, *y, groups, group_sizes, "", axis, label);
}

ffi::Error ReduceScatterImpl(int32_t device, ffi::RunId run_id, ffi::AnyBuffer x, ffi::Token,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>,
                             ffi::Span<const int64_t> groups, ffi::Span<const int64_t> group_sizes,
                             std::string_view reduction, int64_t axis, std::string_view label) {
  return Run(Kind::kReduceScatter, device, run_id, x, *y, groups, group_sizes, reduction, axis, label);
}

// The common prefix of every binding: context, (x, token) -> (y, token), group table.
auto Bind() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::RunId>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Token>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::Token>()
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
