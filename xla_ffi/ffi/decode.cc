#include "xla_ffi/ffi/decode.h"

#include <string>
#include <vector>

namespace ffi = xla::ffi;

namespace flexlink {
namespace {

std::string Unsupported(std::string_view where, ffi::DataType t) {
  return std::string(where) + "unsupported element type (XLA type " + std::to_string(static_cast<int>(t)) +
         "); supported: bool, int8-64, uint8-64, float16, bfloat16, float32, float64, complex64, complex128";
}

}  // namespace

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
    case StatusCode::kUnavailable: return ffi::Error(ffi::ErrorCode::kUnavailable, s.message());
  }
  return ffi::Error::Internal(s.message());
}

ffi::Error DecodeOperands(Kind kind, std::string_view label, const ffi::RemainingArgs& args,
                          const ffi::RemainingRets& rets, std::span<const OperandRequest>* operands) {
  // Error texts are made for an error only: every call of every device passes here.
  auto where = [&] { return ErrorPrefix(label) + std::string(Name(kind)) + ": "; };
  const size_t nargs = args.size(), nrets = rets.size();
  if (nargs < 2 || nrets != nargs)
    return ffi::Error::InvalidArgument(
        where() + "expected operands (x_1, ..., x_k, token) and results (y_1, ..., y_k, token) with k >= 1, got " +
        std::to_string(nargs) + " operands and " + std::to_string(nrets) + " results");
  const size_t k = nargs - 1;
  auto token = args.get<ffi::AnyBuffer>(k);
  auto token_out = rets.get<ffi::AnyBuffer>(k);
  if (!token || token->element_type() != ffi::DataType::TOKEN || !token_out ||
      (*token_out)->element_type() != ffi::DataType::TOKEN)
    return ffi::Error::InvalidArgument(where() + "the last operand and the last result must be the ordering token");
  thread_local std::vector<OperandRequest> storage;
  storage.resize(k);
  for (size_t i = 0; i < k; ++i) {
    auto at = [&] { return k > 1 ? where() + "operand " + std::to_string(i) + ": " : where(); };
    auto x = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (!x || !y) return ffi::Error::InvalidArgument(at() + "operand and result must be buffers");
    const auto in_type = FromFfi(x->element_type()), out_type = FromFfi((*y)->element_type());
    if (!in_type) return ffi::Error::InvalidArgument(Unsupported(at(), x->element_type()));
    if (!out_type) return ffi::Error::InvalidArgument(Unsupported(at(), (*y)->element_type()));
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

ffi::Error DecodeCall(Kind kind, int32_t device, ffi::RunId run_id, const ffi::RemainingArgs& args,
                      const ffi::RemainingRets& rets, ffi::Span<const int64_t> groups,
                      ffi::Span<const int64_t> group_sizes, std::string_view reduction, int64_t axis,
                      std::string_view label, std::span<const int64_t> pairs, CollectiveArgs* out) {
  ffi::Error decoded = DecodeOperands(kind, label, args, rets, &out->request.operands);
  if (decoded.failure()) return decoded;
  out->groups = AsSpan(groups);
  out->group_sizes = AsSpan(group_sizes);
  out->device = device;
  out->run_id = run_id.run_id;
  out->label = label;
  out->request.kind = kind;
  out->request.reduction = reduction;
  out->request.axis = axis;
  out->request.pairs = pairs;
  return ffi::Error::Success();
}

}  // namespace flexlink
