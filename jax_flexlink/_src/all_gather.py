"""AllGather: the FlexLink primitives behind all_gather (varying and invariant results)."""
from __future__ import annotations

import numpy as np

from jax_flexlink._src import collective
from jax_flexlink._src import compat
from jax_flexlink._src import native
from jax_flexlink._src.groups import device_groups


def axis_names(params) -> tuple:
  name = params["axis_name"]
  return tuple(name) if isinstance(name, (tuple, list)) else (name,)


def _lower(ctx, operands, *, all_gather_dimension, axis_name, axis_size, tiled,
           axis_index_groups=None):
  del tiled  # untiled and tiled outputs share one memory layout: [outer, n, inner]
  names = axis_names({"axis_name": axis_name})
  groups, sizes = device_groups(ctx.module_context.axis_context, names, axis_index_groups,
                                "all_gather", group_size=axis_size)
  return collective.emit_custom_call(
      ctx, native.ALL_GATHER, operands, groups=groups, group_sizes=sizes,
      axis=np.int64(all_gather_dimension), label=f"all_gather over axes {names}")


def _make(lax_prim) -> collective.Collective:
  return collective.Collective(
      lax_prim=lax_prim, kind="all_gather", api_name="all_gather", axis_names=axis_names,
      reduction=lambda params: None, lower=_lower)


all_gather_p = collective.define(_make(compat.all_gather_p))
all_gather_invariant_p = collective.define(_make(compat.all_gather_invariant_p))
