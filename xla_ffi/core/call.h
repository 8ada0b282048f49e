// The per-call descriptor: what one rank asks of one collective call, validated and reduced to the
// numbers the links need. The FFI handlers and engine_run both build it with DescribeCall, so a bad
// call gets the same message on both paths.
//
// A call has k >= 1 parts, one per operand (x_i -> y_i), which may differ in dtype and shape; it is
// one collective (one rendezvous, one plan, one set of link ranges), and its result is bitwise that
// of k separate calls. The parts are laid out one after another in a *virtual byte space*, each at a
// 64-byte-aligned offset: the executor cuts that space into one range per link at 64-byte multiples,
// so a range boundary never splits an element of any part (every element width divides 64), and each
// link runs the pieces — (part, unit range) — that its range covers, part by part.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"

namespace flexlink {

struct UnitRange {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
  bool empty() const { return end == begin; }
};

// One operand of a call. Its work is indexed by "units": the elements one rank contributes.
// all_reduce: the elements of x (= of y). all_gather: the elements of x; unit u = (o, i) with
// o < outer, i < inner lands in y[o, rank, i]. reduce_scatter: the elements of y; unit (o, i) of rank
// r is the reduction over ranks of x[o, r, i]. ppermute: the elements of x (= of y); unit u of rank d
// is x_s[u] of its source s (or 0). all_to_all: x and y are both [outer, n, inner]; unit (o, i) of
// rank r is the column y_r[o, j, i] = x_j[o, r, i] for every j (n elements, like reduce_scatter's
// units). Links split a part by unit ranges, so every link sees the same layout rule.
struct Part {
  DType dtype = DType::kF32;
  const void* in = nullptr;
  void* out = nullptr;
  size_t units = 0;  // per-rank unit count, see above
  size_t outer = 1;  // rows of the [outer, n, inner] layout (all_reduce: 1)
  size_t inner = 0;  // elements per rank block per row (all_reduce: units)
  uint64_t offset = 0;  // first byte in the call's virtual space (a multiple of 64; set by AddPart)

  size_t width() const { return ByteWidth(dtype); }
  // The part's extent in the virtual space: one element width per unit.
  uint64_t bytes() const { return static_cast<uint64_t>(units) * width(); }
};

// A part's units that one link runs for one call.
struct Piece {
  size_t part = 0;
  UnitRange units;
};

inline constexpr uint64_t kPartAlignBytes = 64;

struct CallDesc {
  Kind kind = Kind::kAllReduce;
  ReduceOp op = ReduceOp::kSum;  // used by the kinds that reduce (all_reduce, reduce_scatter)
  std::vector<Part> parts;
  // ppermute: per rank d, the rank whose input d receives (-1: none, d gets zeros); the same table on
  // every rank of the call (checked at the arrival). Empty for the other kinds.
  std::vector<int32_t> sources;
  // ppermute: the rank that receives rank r's input, -1 if none.
  int DestinationOf(int r) const;

  // Appends a part at the next 64-byte-aligned offset of the virtual space.
  void AddPart(Part p);
  // End of the last part: the size of the space the executor cuts (padding between parts included).
  uint64_t virtual_bytes() const { return parts.empty() ? 0 : parts.back().offset + parts.back().bytes(); }
  size_t total_units() const;

  // Elements of a part's x / y per unit, for a group of n ranks.
  size_t in_per_unit(int n) const {
    return kind == Kind::kReduceScatter || kind == Kind::kAllToAll ? static_cast<size_t>(n) : 1;
  }
  size_t out_per_unit(int n) const {
    return kind == Kind::kAllGather || kind == Kind::kAllToAll ? static_cast<size_t>(n) : 1;
  }
  size_t in_count(const Part& p, int n) const { return p.units * in_per_unit(n); }
  size_t out_count(const Part& p, int n) const { return p.units * out_per_unit(n); }
  // Input bytes of all parts together, and of the pieces of virtual bytes [range) (link statistics).
  uint64_t InputBytes(int n) const;
  uint64_t InputBytes(UnitRange virtual_range, int n) const;

  // The pieces of virtual bytes [begin, end): each part it overlaps, with the units whose first byte
  // falls inside (so adjacent ranges partition the units even if cut mid-element). Empty pieces are
  // left out. Reuses `out`'s storage.
  void PiecesOf(UnitRange virtual_range, std::vector<Piece>* out) const;
  // Every non-empty part, whole.
  void AllPieces(std::vector<Piece>* out) const { PiecesOf({0, virtual_bytes()}, out); }

  // Equal in everything every rank must agree on (not the buffers).
  bool SameCall(const CallDesc& o) const;
  // e.g. "all_reduce(sum) float32[1024 per rank]"; with several parts
  // "all_reduce(sum) of 3 operands per rank: float32[1024], bfloat16[7], int32[1]"; ppermute names
  // its pairs: "ppermute(0->1, 1->2) float32[1024 per rank]".
  std::string Describe() const;
};

// One operand as the caller sees it: x_i and y_i with their shapes.
struct OperandRequest {
  DType in_dtype = DType::kF32, out_dtype = DType::kF32;
  std::span<const int64_t> in_dims, out_dims;
  const void* in = nullptr;
  void* out = nullptr;
};

struct CallRequest {
  Kind kind = Kind::kAllReduce;
  std::string_view reduction;  // "sum" | "prod" | "max" | "min"; only for the kinds that reduce
  int64_t axis = 0;            // all_gather / reduce_scatter / all_to_all: the same for every operand
  std::span<const int64_t> pairs;            // ppermute: (source, destination) ranks, flattened
  std::span<const OperandRequest> operands;  // k >= 1
};

// Checks shapes, dtypes, axis and reduction against the contract of docs/interfaces.md for a group of
// `group_size` ranks; `label` prefixes the message.
Status DescribeCall(const CallRequest& req, int group_size, std::string_view label, CallDesc* desc);

// Finds `device` in the concatenated `groups` (sizes in `group_sizes`); on success `members` views
// its group inside `groups` and `rank` is its position there.
Status ResolveGroup(std::span<const int64_t> groups, std::span<const int64_t> group_sizes,
                    int64_t device, std::string_view label, std::span<const int64_t>* members,
                    int* rank);

// A group that names a device twice is refused (every engine: its ranks would be one device).
Status CheckDistinct(std::span<const int64_t> devices, std::string_view label);
// all_to_all exchanges blocks between every pair of ranks of a group; lax requires its groups to be
// of one size, and so do the engines (an uneven table is a front-end bug worth a clear message).
Status CheckEvenGroups(std::span<const int64_t> group_sizes, std::string_view label);

// "[0, 1, 2, 3]"
std::string FormatIds(std::span<const int64_t> ids);
// "flexlink: <label>: " (label may be empty)
std::string ErrorPrefix(std::string_view label);

}  // namespace flexlink
