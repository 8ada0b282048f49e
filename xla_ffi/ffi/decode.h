// Decoding shared by the CPU handlers (ffi/handlers.cc) and the CUDA handlers (cuda/handlers.cc):
// XLA element types to the engine's, engine statuses to ffi::Error, and the variadic operands
// (x_1, ..., x_k, token) -> (y_1, ..., y_k, token) of docs/interfaces.md. Both platforms take exactly
// the same call frame, so they give exactly the same messages for a bad one.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

// XLA's FFI headers are not -Wall -Wextra clean; keep our own warnings meaningful.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wattributes"
#pragma GCC diagnostic ignored "-Wreturn-type"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/engine.h"
#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"

namespace flexlink {

std::optional<DType> FromFfi(xla::ffi::DataType t);
xla::ffi::Error ToFfi(const Status& s);

inline std::span<const int64_t> AsSpan(xla::ffi::Span<const int64_t> s) { return {s.begin(), s.size()}; }

// Decodes the k operand/result pairs into `operands` (thread_local storage, so a call allocates
// nothing once a device thread has seen its widest call) or says what is wrong with the call frame.
xla::ffi::Error DecodeOperands(Kind kind, std::string_view label, const xla::ffi::RemainingArgs& args,
                               const xla::ffi::RemainingRets& rets, std::span<const OperandRequest>* operands);

// One rank's call from its frame: the operands (DecodeOperands) and the attributes every handler
// passes, into `out` for the platform's engine.
xla::ffi::Error DecodeCall(Kind kind, int32_t device, xla::ffi::RunId run_id, const xla::ffi::RemainingArgs& args,
                           const xla::ffi::RemainingRets& rets, xla::ffi::Span<const int64_t> groups,
                           xla::ffi::Span<const int64_t> group_sizes, std::string_view reduction, int64_t axis,
                           std::string_view label, std::span<const int64_t> pairs, CollectiveArgs* out);

}  // namespace flexlink
