"""Lowering of a FlexLink equation: where FlexLink can run it, a custom call; where it cannot, lax's
own collective in replacement mode (so no program lax runs is broken by the switch) and a clear
error for an explicit call.

Where the region being lowered is only partially manual (a shard_map with `axis_names=` a subset of
the mesh, or a vmap of a shard_map whose batch is sharded over an Explicit mesh axis), XLA
partitions the values there over the remaining axes itself, and a custom call cannot sit in such a
region (shardy's export aborts the process). The call is wrapped, as lax's own `axis_index` is, in a
nested shard_map that makes the remaining axes manual too, with every operand replicated over them:
inside, the region is fully manual and the call is an ordinary FlexLink collective over the same
groups, joined to the token chain around it.
"""
from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jax_flexlink._src import collective
from jax_flexlink._src import compat
from jax_flexlink._src import hierarchical
from jax_flexlink._src import routing
from jax_flexlink._src.collective import NotLowerable

# Frontend attribute that marks a collective replacement mode left to XLA, with the reason; it
# survives into the compiled HLO, where jax_flexlink.collectives() reads it.
FALLBACK_ATTRIBUTE = "flexlink_fallback"


def rule(prim, spec: collective.Collective, platform: str | None):
  """The lowering rule of `prim` on `platform` (None: every platform without a FlexLink module)."""

  def lower(ctx, *operands, flexlink, **params):
    try:
      if platform is None:
        raise NotLowerable(
            f"this build of jax_flexlink runs collectives on CPU only, not on "
            f"{'/'.join(ctx.module_context.platforms)} (the CUDA module is built with "
            "`pip install -e . -C cmake.define.FLEXLINK_CUDA=ON`)")
      from jax_flexlink._src import native  # noqa: PLC0415 - as collective.py
      if platform == "cuda" and native.cuda_module().is_shut_down():
        # Its handlers would refuse every call: replaced collectives stay XLA's instead, and an
        # explicit one says why now rather than when the program runs.
        raise NotLowerable("FlexLink's GPU engine was shut down in this process (jax_flexlink.shutdown(), "
                           "docs/cuda.md), so it runs no more collectives on GPU")
      with collective.lowering_for(platform):
        return _lower(ctx, operands, prim, spec, flexlink, params)
    except NotLowerable as e:
      if flexlink == routing.EXPLICIT:
        raise NotImplementedError(f"jax_flexlink.{spec.api_name}: {e}") from None
      return _lower_natively(ctx, operands, spec, params, reason=str(e))

  return lower


def _lower(ctx, operands, prim, spec, flexlink, params):
  if compat.lowering_for_export(ctx):
    raise NotLowerable(
        "jax.export serializes the program to run elsewhere, and FlexLink's custom calls belong "
        "to this process (its devices and its engine); serialized programs keep XLA's collectives")
  axis_context = ctx.module_context.axis_context
  if compat.spmd_mesh(axis_context) is None:
    raise NotLowerable("FlexLink collectives lower only inside jax.shard_map or jax.pmap "
                       f"(got axis context {type(axis_context).__name__})")
  for aval in ctx.avals_in:
    problem = collective.unsupported_dtype(aval, spec.reduction(params))
    if problem:
      raise NotLowerable(problem)
  _, others = compat.lowering_manual_axes(axis_context)
  if others:
    return _lower_in_manual_region(ctx, operands, prim, flexlink, params, others)
  # Groups spanning hosts: FlexLink inside each host, XLA's collective across (None: they do not).
  outs = hierarchical.lower(ctx, operands, spec, params)
  if outs is not None:
    return outs
  return spec.lower(ctx, operands, **params)


def _lower_in_manual_region(ctx, operands, prim, flexlink, params, axes):
  ordering, = (e for e in ctx.tokens_in.effects() if isinstance(e, collective.FlexLinkOrdering))
  specs = (P(),) * len(operands)

  def nested(*xs):
    body = lambda *ys: tuple(prim.bind(*ys, flexlink=flexlink, **params))  # noqa: E731
    return compat.shard_map(body, in_specs=specs, out_specs=specs, axis_names=frozenset(axes),
                            check_vma=compat.check_vma_enabled())(*xs)

  with collective.ordering_effect_forced(ordering):
    return compat.lower_fun(nested, multiple_results=True)(ctx, *operands)


def _lower_natively(ctx, operands, spec, params, reason: str):
  native = routing.native_bind(spec.lax_prim)
  outs = []
  for x, aval_in, aval_out in zip(operands, ctx.avals_in, ctx.avals_out):
    out = compat.lower_pure(ctx, lambda v: native(v, **params), x, aval_in, aval_out)
    compat.set_frontend_attribute(out, FALLBACK_ATTRIBUTE, reason)
    outs.append(out)
  ctx.set_tokens_out(ctx.tokens_in)
  return outs
