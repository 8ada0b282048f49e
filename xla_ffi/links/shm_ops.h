// The shm link's sub-collectives on one part of a call, for one rank and one unit range of the part.
// The channel (shm.cc) decides the path and the barriers; these only move and reduce bytes.
//
// Sources are every rank's input of the part, or, on the staged path, every rank's staging region
// holding a copy of it; outputs of peers are given on the direct path only (on the staged path a
// peer may already have returned).
#pragma once

#include <cstddef>
#include <span>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/types.h"

namespace flexlink::shm {

struct PartView {
  const Part& part;  // this rank's descriptor: shapes (equal on every rank), its own in and out
  int n = 0, rank = 0;
  std::span<const char* const> sources;  // per rank: input or staging region
  std::span<char* const> outputs;        // per rank, direct path only (sources are the inputs then)

  char* out() const { return static_cast<char*>(part.out); }
  size_t width() const { return part.width(); }
};

// Whether a separate output (never read by this call) is written with non-temporal stores.
bool StreamSeparate(const void* in, const void* out, size_t out_bytes);

// all_reduce. Staged: this rank reduces `range` of every source into its own output. Direct: this
// rank reduces its slice of `range` (core of "reduce-scatter with direct broadcast") and stores the
// result into every rank's output in one pass.
void AllReduceStaged(const PartView& v, ReduceOp op, UnitRange range);
void AllReduceDirect(const PartView& v, ReduceOp op, UnitRange range);

// reduce_scatter: out[o, i] = reduce over ranks of source_k[o, rank, i], for units (o, i) in range.
void ReduceScatter(const PartView& v, ReduceOp op, UnitRange range);

// all_gather. Pull: this rank copies every rank's block into its own output (from the sources).
// Push: this rank copies its own block into every rank's output (direct path only).
void GatherPull(const PartView& v, UnitRange range, bool stream);
void GatherPush(const PartView& v, UnitRange range);
// Below this output size per rank the direct path pulls; above it, it pushes (see shm_gather.cc).
inline constexpr size_t kPullGatherBytes = size_t{4} << 20;

// ppermute: this rank's output units `range` from the source of rank `source` (-1: zeros).
void Permute(const PartView& v, int source, UnitRange range, bool stream);

// all_to_all: out[o, j, i] = source_j[o, rank, i] for units (o, i) in range and every j (pull).
void AllToAll(const PartView& v, UnitRange range, bool stream);

}  // namespace flexlink::shm
