"""ReduceScatter: the FlexLink primitive behind psum_scatter."""
from __future__ import annotations

import numpy as np

from jax_flexlink._src import collective
from jax_flexlink._src import compat
from jax_flexlink._src import native
from jax_flexlink._src.groups import device_groups


def _lowering(ctx, x, *, lax_prim, scatter_dimension, axis_name, axis_index_groups, axis_size,
              tiled):
  del lax_prim, tiled  # both layouts are [outer, n, inner] on input, [outer, inner] on output
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  groups, sizes = device_groups(ctx.module_context.axis_context, names, axis_index_groups,
                                "psum_scatter", group_size=axis_size)
  return [collective.emit_custom_call(
      ctx, native.REDUCE_SCATTER, x, groups=groups, group_sizes=sizes, reduction="sum",
      axis=np.int64(scatter_dimension), label=f"psum_scatter over axes {names}")]


reduce_scatter_p = collective.define_primitive(
    "flexlink_reduce_scatter", lambda p: "psum_scatter", lambda p: "sum", _lowering, (compat.reduce_scatter_p,))
