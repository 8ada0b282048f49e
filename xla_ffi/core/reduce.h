// Element-wise reduction kernels, one per (dtype, op). Every link that reduces calls these, so the
// arithmetic (and therefore every bit of the result) is the same whatever link or range split ran it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"

namespace flexlink {

// dst[i] = src[0][i] op src[1][i] op ... op src[n-1][i], evaluated left to right in rank order, for
// i in [0, count). float16/bfloat16 accumulate in float32 and round once (nearest-even); integers wrap;
// max/min propagate NaN; bool max = or, min = and. `dst` may alias any src (in-place collectives): each
// 64-byte tile is reduced in registers and stored only after all sources of the tile were read.
using ReduceKernel = void (*)(const void* const* srcs, int nsrc, void* dst, size_t count);

// The same reduction stored to each of dsts[0, ndst) (all_reduce: one rank's slice into every rank's
// output) in one pass over the sources. stream[d] (nullptr: none): non-temporal stores (x86) into
// dsts[d] where a tile is a whole cache line of it — for outputs that are separate buffers, whose lines
// were never read; a destination that is also a source was just read and takes plain stores.
using ReduceToKernel = void (*)(const void* const* srcs, int nsrc, void* const* dsts, int ndst, size_t count,
                                const uint8_t* stream);

// nullptr when the combination is not supported (complex max/min).
ReduceKernel GetReduceKernel(DType dtype, ReduceOp op);
ReduceToKernel GetReduceToKernel(DType dtype, ReduceOp op);

// OK, or an InvalidArgument naming the dtype and op.
Status CheckReduction(DType dtype, ReduceOp op);

}  // namespace flexlink
