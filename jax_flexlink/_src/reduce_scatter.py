"""ReduceScatter: the FlexLink primitive behind psum_scatter."""
from __future__ import annotations

import numpy as np

from jax_flexlink._src import collective
from jax_flexlink._src import compat
from jax_flexlink._src import native
from jax_flexlink._src.all_gather import axis_names
from jax_flexlink._src.groups import device_groups


def _lower(ctx, operands, *, scatter_dimension, axis_name, axis_index_groups, axis_size, tiled):
  del tiled  # both layouts are [outer, n, inner] on input, [outer, inner] on output
  ndim = ctx.avals_in[0].ndim
  if not 0 <= scatter_dimension < ndim:  # lax's lowering rejects it too (a negative i64 attribute)
    raise ValueError(f"psum_scatter: scatter_dimension={scatter_dimension} must be in [0, {ndim}) for an "
                     f"operand of rank {ndim}")
  names = axis_names({"axis_name": axis_name})
  groups, sizes = device_groups(ctx.module_context.axis_context, names, axis_index_groups,
                                "psum_scatter", group_size=axis_size)
  return collective.emit_custom_call(
      ctx, native.REDUCE_SCATTER, operands, groups=groups, group_sizes=sizes, reduction="sum",
      axis=np.int64(scatter_dimension), label=f"psum_scatter over axes {names}")


reduce_scatter_p = collective.define(collective.Collective(
    lax_prim=compat.reduce_scatter_p, kind="reduce_scatter", api_name="psum_scatter",
    axis_names=axis_names, reduction=lambda params: "sum", lower=_lower))
