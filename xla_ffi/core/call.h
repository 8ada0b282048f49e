// The per-call descriptor: what one rank asks of one collective call, validated and reduced to the
// numbers the links need. The FFI handlers and engine_run both build it with DescribeCall, so a bad
// call gets the same message on both paths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"

namespace flexlink {

// A call's work is indexed by "units": the elements one rank contributes. all_reduce: the elements of
// x (= of y). all_gather: the elements of x; unit u = (o, i) with o < outer, i < inner lands in
// y[o, rank, i]. reduce_scatter: the elements of y; unit (o, i) of rank r is the reduction over ranks
// of x[o, r, i]. Links split a call by unit ranges, so every link sees the same layout rule.
struct CallDesc {
  Kind kind = Kind::kAllReduce;
  ReduceOp op = ReduceOp::kSum;  // ignored by all_gather
  DType dtype = DType::kF32;
  const void* in = nullptr;
  void* out = nullptr;
  size_t units = 0;  // per-rank unit count, see above
  size_t outer = 1;  // rows of the [outer, n, inner] layout (all_reduce: 1)
  size_t inner = 0;  // elements per rank block per row (all_reduce: units)

  size_t width() const { return ByteWidth(dtype); }
  // Elements of x / y for a group of n ranks.
  size_t in_count(int n) const { return kind == Kind::kReduceScatter ? units * n : units; }
  size_t out_count(int n) const { return kind == Kind::kAllGather ? units * n : units; }
  // Equal in everything every rank must agree on (not the buffers).
  bool SameCall(const CallDesc& o) const {
    return kind == o.kind && dtype == o.dtype && units == o.units && outer == o.outer &&
           inner == o.inner && (kind == Kind::kAllGather || op == o.op);
  }
  // e.g. "all_reduce(sum) float32[1024 per rank]"
  std::string Describe() const;
};

struct CallRequest {
  Kind kind = Kind::kAllReduce;
  std::string_view reduction;  // "sum" | "prod" | "max" | "min"; ignored by all_gather
  DType in_dtype = DType::kF32, out_dtype = DType::kF32;
  std::span<const int64_t> in_dims, out_dims;
  int64_t axis = 0;  // all_gather / reduce_scatter
  const void* in = nullptr;
  void* out = nullptr;
};

// Checks shapes, dtypes, axis and reduction against the contract of docs/interfaces.md for a group of
// `group_size` ranks; `label` prefixes the message.
Status DescribeCall(const CallRequest& req, int group_size, std::string_view label, CallDesc* desc);

// Finds `device` in the concatenated `groups` (sizes in `group_sizes`); on success `members` views
// its group inside `groups` and `rank` is its position there.
Status ResolveGroup(std::span<const int64_t> groups, std::span<const int64_t> group_sizes,
                    int64_t device, std::string_view label, std::span<const int64_t>* members,
                    int* rank);

// "[0, 1, 2, 3]"
std::string FormatIds(std::span<const int64_t> ids);
// "flexlink: <label>: " (label may be empty)
std::string ErrorPrefix(std::string_view label);

}  // namespace flexlink
