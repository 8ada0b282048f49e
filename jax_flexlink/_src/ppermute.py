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


def _lower(ctx, operands, *, axis_name, perm):
  names = axis_names({"axis_name": axis_name})
  axis_context = ctx.module_context.axis_context
  partitions = partition_groups(axis_context, names, None, "ppermute")
  # lax's own (source, destination) partitions: its checks, its errors, and its numbering of a
  # group's members, which changed between jax versions (sorted partition ids in 0.10; lax's rank
  # order in 0.11, with an error where the two differ).
  full = np.asarray(compat.ppermute_partition_pairs(ctx, names, perm), dtype=np.int64)
  full = full.reshape(len(partitions), len(perm), 2)
  pairs = []
  for group, group_pairs in zip(partitions, full):
    rank = {int(p): r for r, p in enumerate(group)}
    pairs.append([(rank[int(s)], rank[int(d)]) for s, d in group_pairs])
  if any(p != pairs[0] for p in pairs):
    raise collective.NotLowerable("ppermute's pairs differ between its groups")
  groups, sizes = to_device_ids(axis_context, partitions)
  # In place under all_reduce's rule (collective.in_place); the engine keeps every rank from
  # overwriting what its destination has not read yet (docs/engine.md, "In place").
  return collective.emit_custom_call(
      ctx, native.PPERMUTE, operands, aliases=[i for i, x in enumerate(operands) if collective.in_place(x)],
      groups=groups, group_sizes=sizes,
      pairs=np.array(pairs[0], dtype=np.int64).reshape(-1), label=f"ppermute over axes {names}")


ppermute_p = collective.define(collective.Collective(
    lax_prim=compat.ppermute_p, kind="ppermute", api_name="ppermute", axis_names=axis_names,
    reduction=lambda params: None, lower=_lower))
