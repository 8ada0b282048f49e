"""What the three FlexLink collective primitives share: the ordering effect, rules borrowed from lax,
dtype checks and the emission of the custom call.

A FlexLink primitive stands in for one or more lax primitives and carries the lax primitive it replaces
as its `lax_prim` parameter, with that primitive's own parameters beside it. Typing (shape, varying
axes, named-axis effects, axis-name checks), batching and transposition are lax's rules for `lax_prim`;
FlexLink adds an ordered effect, so every device runs its FlexLink calls in program order, and its own
lowering to a custom call.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
from jax import lax

from jax_flexlink._src import compat
from jax_flexlink._src import routing


@dataclasses.dataclass(frozen=True, slots=True)
class FlexLinkOrdering(compat.NamedAxisEffect):
  """Threads a token through every FlexLink call inside a shard_map/pmap body.

  XLA:CPU runs independent custom calls in whatever order their operands become ready, which differs
  per device; blocking collectives entered in different orders on different devices deadlock. A
  token chain makes program order the execution order on every device.

  The effect is a named-axis effect of the outermost bound axis, so, like lax's own NamedAxisEffect,
  it ends at the shard_map/pmap that binds that axis: inside, JAX threads its token through loops and
  branches; outside, the jitted function has no effect at all, which keeps jit's C++ fast dispatch
  path (any JAX-level effect turns it off and costs ~100+ us per call). The body's chain starts from a
  token created by shard_map's lowering (see compat.wrap_shard_map_lowering).
  """

  def __repr__(self):
    return f"FlexLinkOrdering({self.name!r})"

  __str__ = __repr__


compat.register_ordered_effect_type(FlexLinkOrdering)


def _ordering_effect(axis_names) -> FlexLinkOrdering:
  outermost = compat.outermost_axis_name()
  return FlexLinkOrdering(outermost if outermost is not None else axis_names[0])


def _tokens_started_by_shard_map(ctx, jaxpr):
  present = ctx.tokens_in.effects()
  return [e for e in compat.ordered_effects.filter_in(jaxpr.effects)
          if isinstance(e, FlexLinkOrdering) and e not in present]


compat.wrap_shard_map_lowering(_tokens_started_by_shard_map)


# What the engine reduces and moves (xla_ffi/core): every dtype lax's collectives accept on CPU.
SUPPORTED_DTYPES = frozenset(np.dtype(d) for d in (
    "float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
    "uint16", "uint32", "uint64", "bool", "complex64", "complex128"))


def _dtype_of(x) -> np.dtype | None:
  dtype = getattr(getattr(x, "aval", None), "dtype", None)
  if dtype is None:
    dtype = getattr(x, "dtype", None)
  return None if dtype is None else np.dtype(dtype)


def runnable(x, *_, **__) -> bool:
  """Whether FlexLink can run this bind; replacement mode leaves the others to lax."""
  dtype = _dtype_of(x)
  return (dtype is not None and dtype in SUPPORTED_DTYPES
          and not compat.partially_automatic_axes())


def check_dtype(api_name: str, aval, reduction: str | None) -> None:
  """Trace-time dtype errors, in lax's words where lax has them."""
  dtype = np.dtype(aval.dtype)
  if dtype not in SUPPORTED_DTYPES:
    accepted = ", ".join(sorted(str(d) for d in SUPPORTED_DTYPES))
    raise TypeError(f"{api_name} does not accept dtype {dtype}. Accepted dtypes are: {accepted}.")
  if reduction == "sum" and dtype == np.bool_:
    # lax's psum converts bool first; psum_scatter's reducer is lax.add, which rejects bool.
    lax.add(np.bool_(True), np.bool_(True))
  if reduction in ("max", "min") and np.issubdtype(dtype, np.complexfloating):
    raise TypeError(f"{api_name} does not accept dtype {dtype}: complex numbers have no order, so "
                    f"{reduction} is not defined for them.")


def check_partially_automatic(api_name: str) -> None:
  auto = compat.partially_automatic_axes()
  if auto:
    raise NotImplementedError(
        f"{api_name}: FlexLink collectives need every mesh axis of size > 1 manual; this shard_map "
        f"leaves {auto} automatic (axis_names= a subset of the mesh). Use a fully manual "
        "shard_map, or jax.lax's collective here.")


def define_primitive(name: str, api_name: Callable[[compat.Primitive], str],
                     reduction: Callable[[compat.Primitive], str | None],
                     lowering: Callable, lax_prims) -> compat.Primitive:
  """Creates a FlexLink primitive standing in for `lax_prims`, with all its rules."""
  prim = compat.Primitive(name)

  def abstract_eval(aval, *, lax_prim, **params):
    check_dtype(api_name(lax_prim), aval, reduction(lax_prim))
    out_aval, effects = compat.abstract_eval_of(lax_prim, aval, **params)
    names = [e.name for e in effects if isinstance(e, compat.NamedAxisEffect)]
    if not names:
      # Only positional axes left (vmap reduced its own axis locally): no cross-device call.
      return out_aval, effects
    check_partially_automatic(api_name(lax_prim))
    return out_aval, {*effects, _ordering_effect(names)}

  def impl(*args, **params):
    # Reached only outside shard_map/pmap, where lax's abstract evaluation rejects the axis name.
    raise NotImplementedError(f"{name} runs only under jax.shard_map or jax.pmap")

  def transpose(ct, x, *, lax_prim, **params):
    # lax's rule emits the dual collective (psum_scatter for all_gather, ...) through lax's API;
    # routing sends it back to FlexLink.
    with routing.explicit_scope():
      return compat.primitive_transposes[lax_prim](ct, x, **params)

  def batch(axis_data, vals_in, dims_in, *, lax_prim, **params):
    with routing.explicit_scope():
      return compat.fancy_primitive_batchers[lax_prim](axis_data, vals_in, dims_in, **params)

  prim.def_effectful_abstract_eval(abstract_eval)
  prim.def_impl(impl)
  def jvp(primals, tangents, *, lax_prim, **params):
    # Linear for the collectives lax differentiates (psum, all_gather, psum_scatter); lax has no
    # rule for pmax/pmin, and neither has FlexLink: the same error, never a wrong derivative.
    if lax_prim not in compat.primitive_jvps:
      raise NotImplementedError(f"Differentiation rule for '{lax_prim}' not implemented")
    return compat.linear_jvp(prim, primals, tangents, lax_prim=lax_prim, **params)

  compat.primitive_jvps[prim] = jvp
  compat.primitive_transposes[prim] = transpose
  compat.fancy_primitive_batchers[prim] = batch
  # Not cacheable: the rule bakes in device ids from the enclosing mesh, which JAX's lowering cache
  # key does not include (two shard_maps over different meshes would share one lowering).
  compat.register_lowering(prim, lowering, platform="cpu", cacheable=False)
  for lax_prim in lax_prims:
    routing.install(lax_prim, prim, runnable)
  return prim


def emit_custom_call(ctx, target: str, x, *, aval_in=None, alias_input: bool = False, **attrs):
  """Emits `target(x, token) -> (y, token)` and threads the FlexLink ordering token.

  `aval_in`: x's aval when the rule has already transformed the primitive's operand.
  """
  ordering, = (e for e in ctx.tokens_in.effects() if isinstance(e, FlexLinkOrdering))
  token = ctx.tokens_in.get(ordering)
  call_ctx = ctx.replace(avals_in=[aval_in or ctx.avals_in[0], compat.abstract_token],
                         avals_out=[*ctx.avals_out, compat.abstract_token])
  op = compat.build_ffi_lowering_function(
      target, has_side_effect=True,
      operand_output_aliases={0: 0} if alias_input else None,
  )(call_ctx, x, token, **attrs)
  y, token_out = op.results
  ctx.set_tokens_out(ctx.tokens_in.update_tokens(compat.TokenSet({ordering: token_out})))
  return y
