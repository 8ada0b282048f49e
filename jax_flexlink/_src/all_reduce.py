"""AllReduce: the FlexLink primitive behind psum, pmean, pmax and pmin."""
from __future__ import annotations

import numpy as np
from jax import lax

from jax_flexlink._src import collective
from jax_flexlink._src import compat
from jax_flexlink._src import native
from jax_flexlink._src.groups import device_groups

# lax primitive -> (reduction the engine applies, the lax API name used in messages, positional reducer)
_LAX = {
    compat.psum_p: ("sum", "psum", lax.reduce_sum),
    compat.psum_invariant_p: ("sum", "psum", lax.reduce_sum),
    compat.pmax_p: ("max", "pmax", lax.reduce_max),
    compat.pmin_p: ("min", "pmin", lax.reduce_min),
}



def _reduce_in_place(x) -> bool:
  """Whether the output should alias the input.

  XLA:CPU pays heavily for first-touching the pages of a fresh output buffer; reducing into the
  input's buffer avoids that when XLA may reuse it: a donated argument or an intermediate value. For
  an argument that is not donated, XLA would first copy it into a fresh buffer, paying the page
  faults *and* a copy, so the result goes to a fresh buffer instead.
  """
  return compat.operand_origin(x) != "parameter"


def _reduce_positional(ctx, x, positional, reducer):
  aval, = ctx.avals_in
  aval_out = aval.update(shape=tuple(np.delete(np.array(aval.shape, dtype=np.int64), positional)))
  lowered = compat.lower_fun(lambda v: reducer(v, tuple(positional)), multiple_results=False)
  out, = lowered(ctx.replace(primitive=None, avals_in=[aval], avals_out=[aval_out]), x)
  return out, aval_out


def _lowering(ctx, x, *, lax_prim, axes, axis_index_groups=None):
  reduction, api_name, reducer = _LAX[lax_prim]
  named = tuple(a for a in axes if not isinstance(a, int))
  positional = [a for a in axes if isinstance(a, int)]
  aval_in = ctx.avals_in[0]
  if positional:
    x, aval_in = _reduce_positional(ctx, x, positional, reducer)
  if not named:
    return [x]
  groups, sizes = device_groups(ctx.module_context.axis_context, named, axis_index_groups,
                                api_name)
  return [collective.emit_custom_call(
      ctx, native.ALL_REDUCE, x, aval_in=aval_in, alias_input=_reduce_in_place(x),
      groups=groups, group_sizes=sizes, reduction=reduction, label=f"{api_name} over axes {named}")]


all_reduce_p = collective.define_primitive(
    "flexlink_all_reduce", lambda p: _LAX[p][1], lambda p: _LAX[p][0], _lowering, tuple(_LAX))
