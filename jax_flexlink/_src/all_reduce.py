"""AllReduce: the FlexLink primitives behind psum, pmean, pmax and pmin."""
from __future__ import annotations

import numpy as np
from jax import lax

from jax_flexlink._src import collective
from jax_flexlink._src import compat
from jax_flexlink._src import native
from jax_flexlink._src.groups import device_groups


def _reduce_positional(ctx, x, aval, positional, reducer):
  aval_out = aval.update(shape=tuple(np.delete(np.array(aval.shape, dtype=np.int64), positional)))
  return compat.lower_pure(ctx, lambda v: reducer(v, tuple(positional)), x, aval, aval_out), aval_out


def _make(lax_prim, reduction: str, api_name: str, reducer) -> collective.Collective:
  def lower(ctx, operands, *, axes, axis_index_groups=None):
    named = tuple(a for a in axes if not isinstance(a, int))
    positional = [a for a in axes if isinstance(a, int)]
    avals_in = list(ctx.avals_in)
    operands = list(operands)
    if positional:
      for i, (x, aval) in enumerate(zip(operands, avals_in)):
        operands[i], avals_in[i] = _reduce_positional(ctx, x, aval, positional, reducer)
    if not named:
      return operands
    groups, sizes = device_groups(ctx.module_context.axis_context, named, axis_index_groups,
                                  api_name)
    return collective.emit_custom_call(
        ctx, native.ALL_REDUCE, operands, avals_in=avals_in,
        aliases=[i for i, x in enumerate(operands) if collective.in_place(x)],
        groups=groups, group_sizes=sizes, reduction=reduction,
        label=f"{api_name} over axes {named}")

  return collective.Collective(
      lax_prim=lax_prim, kind="all_reduce", api_name=api_name,
      axis_names=lambda params: tuple(params["axes"]), reduction=lambda params: reduction,
      lower=lower)


psum_p = collective.define(_make(compat.psum_p, "sum", "psum", lax.reduce_sum))
psum_invariant_p = collective.define(_make(compat.psum_invariant_p, "sum", "psum", lax.reduce_sum))
pmax_p = collective.define(_make(compat.pmax_p, "max", "pmax", lax.reduce_max))
pmin_p = collective.define(_make(compat.pmin_p, "min", "pmin", lax.reduce_min))
