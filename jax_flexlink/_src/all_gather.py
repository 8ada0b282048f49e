"""AllGather: the FlexLink primitive behind all_gather (varying and invariant results)."""
from __future__ import annotations

import numpy as np

from jax_flexlink._src import collective
from jax_flexlink._src import compat
from jax_flexlink._src import native
from jax_flexlink._src.groups import device_groups

_LAX = (compat.all_gather_p, compat.all_gather_invariant_p)


def _lowering(ctx, x, *, lax_prim, all_gather_dimension, axis_name, axis_size, tiled,
              axis_index_groups=None):
  del lax_prim, tiled  # untiled and tiled outputs share one memory layout: [outer, n, inner]
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  groups, sizes = device_groups(ctx.module_context.axis_context, names, axis_index_groups,
                                "all_gather", group_size=axis_size)
  return [collective.emit_custom_call(
      ctx, native.ALL_GATHER, x, groups=groups, group_sizes=sizes,
      axis=np.int64(all_gather_dimension), label=f"all_gather over axes {names}")]


all_gather_p = collective.define_primitive(
    "flexlink_all_gather", lambda p: "all_gather", lambda p: None, _lowering, _LAX)
