// Element-wise reduction kernels, one per (dtype, op). Every link that reduces calls these, so the
// arithmetic (and therefore every bit of the result) is the same whatever link or range split ran it.
#pragma once

#include <cstddef>

#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"

namespace flexlink {

// dst[i] = src[0][i] op src[1][i] op ... op src[n-1][i], evaluated left to right in rank order, for
// i in [0, count). float16/bfloat16 accumulate in float32 and round once (nearest-even); integers wrap;
// max/min propagate NaN; bool max = or, min = and. `dst` may alias any src (in-place collectives): each
// cache block is accumulated in a local buffer and stored only after all sources were read.
using ReduceKernel = void (*)(const void* const* srcs, int nsrc, void* dst, size_t count);

// nullptr when the combination is not supported (complex max/min).
ReduceKernel GetReduceKernel(DType dtype, ReduceOp op);

// OK, or an InvalidArgument naming the dtype and op.
Status CheckReduction(DType dtype, ReduceOp op);

}  // namespace flexlink
