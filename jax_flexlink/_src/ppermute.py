"""Collective permutation: the FlexLink primitive behind ppermute (and lax's pshuffle, pbroadcast-free
ring shifts of collective matmuls and pipelines)."""
from __future__ import annotations

import numpy as np

from jax_flexlink._src import collective
from jax_flexlink._src import compat
from jax_flexlink._src import native
from jax_flexlink._src.groups import partition_groups, to_device_ids


def axis_names(params) -> tuple:
  name = params["axis_name"]
  return tuple(name) if isinstance(name, (tuple, list)) else (name,)


def _pairs(perm, group_size: int) -> np.ndarray:
  """lax's (source, destination) pairs as flat ranks within a group, checked as lax checks them."""
  pairs = [(int(s) % group_size, int(d) % group_size) for s, d in perm]
  sources, destinations = [s for s, _ in pairs], [d for _, d in pairs]
  if len(set(sources)) != len(sources) or len(set(destinations)) != len(destinations):
    raise ValueError(f"ppermute sources and destinations must be unique, got {perm}.")
  return np.array(pairs, dtype=np.int64).reshape(-1)


def _lower(ctx, operands, *, axis_name, perm):
  names = axis_names({"axis_name": axis_name})
  axis_context = ctx.module_context.axis_context
  # lax numbers a group's members by sorted partition index (_pcollectives_lowering_common).
  partitions = [sorted(g) for g in partition_groups(axis_context, names, None, "ppermute")]
  groups, sizes = to_device_ids(axis_context, partitions)
  # In place under all_reduce's rule (collective.in_place); the engine keeps every rank from
  # overwriting what its destination has not read yet (docs/engine.md, "In place").
  return collective.emit_custom_call(
      ctx, native.PPERMUTE, operands, aliases=[i for i, x in enumerate(operands) if collective.in_place(x)],
      groups=groups, group_sizes=sizes,
      pairs=_pairs(perm, int(sizes[0])), label=f"ppermute over axes {names}")


ppermute_p = collective.define(collective.Collective(
    lax_prim=compat.ppermute_p, kind="ppermute", api_name="ppermute", axis_names=axis_names,
    reduction=lambda params: None, lower=_lower))
