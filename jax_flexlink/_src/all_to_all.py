"""AllToAll: the FlexLink primitive behind all_to_all (mixture-of-experts dispatch, pswapaxes).

The engine exchanges blocks along one axis: with the operand viewed as [outer, n, inner] about
`axis`, rank r's block j comes from rank j's block r. lax's all_to_all splits `split_axis` into n
chunks and stacks the chunks it receives along `concat_axis`; the lowering maps that onto the
engine's layout: split_axis's dimension n*s becomes (n, s), the n moves to just before concat_axis
(a transpose), the engine exchanges along it, and n merges with concat_axis's dimension (a reshape,
rank-major as lax stacks). When the two axes are one, that is the engine's exchange about it on the
operand as it is, with no reshape around the call.
"""
from __future__ import annotations

import numpy as np
from jax import lax

from jax_flexlink._src import collective
from jax_flexlink._src import compat
from jax_flexlink._src import native
from jax_flexlink._src.all_gather import axis_names
from jax_flexlink._src.groups import device_groups


def engine_layout(shape, split_axis: int, concat_axis: int, n: int):
  """(shape the engine exchanges, position of its n-axis, permutation from the split shape).

  The split shape is `shape` with split_axis's dimension written as (n, s); the permutation takes
  it to the engine's shape, where n sits right before concat_axis's dimension."""
  s = shape[split_axis] // n
  split = [*shape[:split_axis], n, s, *shape[split_axis + 1:]]
  # concat_axis's dimension in the split shape (the s half when the two axes coincide)
  concat = concat_axis + (concat_axis >= split_axis)
  order = [i for i in range(len(split)) if i != split_axis]
  axis = order.index(concat)
  order.insert(axis, split_axis)
  return [split[i] for i in order], axis, order, split


def _lower(ctx, operands, *, axis_name, split_axis, concat_axis, axis_index_groups, tiled):
  del tiled  # lax's all_to_all reshapes the untiled form before it binds
  names = axis_names({"axis_name": axis_name})
  groups, sizes = device_groups(ctx.module_context.axis_context, names, axis_index_groups,
                                "all_to_all")
  n = int(sizes[0])
  if np.any(sizes != n):
    raise ValueError("Replica groups must be equally sized")
  label = f"all_to_all over axes {names}"
  if split_axis == concat_axis:
    # Exactly the engine's exchange about that axis, on the operands as they are: no reshape around
    # the call, so the result can be the operand's buffer (XLA copies around an aliased bitcast of a
    # donated argument). In place under all_reduce's rule (collective.in_place).
    return collective.emit_custom_call(
        ctx, native.ALL_TO_ALL, operands, aliases=[i for i, x in enumerate(operands) if collective.in_place(x)],
        groups=groups, group_sizes=sizes, axis=np.int64(split_axis), label=label)
  prepared, prepared_avals, aliases, axis = [], [], [], 0
  for i, (x, aval) in enumerate(zip(operands, ctx.avals_in)):
    shape, axis, order, split = engine_layout(aval.shape, split_axis, concat_axis, n)
    prepared_aval = aval.update(shape=tuple(shape))
    prepared.append(compat.lower_pure(
        ctx, lambda v, split=split, order=order: lax.transpose(lax.reshape(v, split), order),
        x, aval, prepared_aval))
    prepared_avals.append(prepared_aval)
    # The transposed operand is a fresh intermediate: the result may as well be written there.
    aliases.append(i)
  exchanged = collective.emit_custom_call(
      ctx, native.ALL_TO_ALL, prepared, aliases=aliases, avals_in=prepared_avals, avals_out=prepared_avals,
      groups=groups, group_sizes=sizes, axis=np.int64(axis), label=label)
  outs = []
  for y, prepared_aval, aval_out in zip(exchanged, prepared_avals, ctx.avals_out):
    outs.append(compat.lower_pure(ctx, lambda v, shape=aval_out.shape: lax.reshape(v, shape), y,
                                  prepared_aval, aval_out))
  return outs


all_to_all_p = collective.define(collective.Collective(
    lax_prim=compat.all_to_all_p, kind="all_to_all", api_name="all_to_all", axis_names=axis_names,
    reduction=lambda params: None, lower=_lower))
