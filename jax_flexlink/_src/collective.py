"""What every FlexLink collective primitive shares: the ordering effect, rules borrowed from lax,
dtype checks, lowering (with its fallback to lax) and the emission of the custom call.

A FlexLink primitive stands in for exactly one lax primitive and has its name (`psum`,
`all_gather`, ...), so that what looks at primitives by name — `jax.checkpoint` policies such as
`lambda prim, *_, **__: str(prim) != "all_gather"`, jaxpr printouts — sees what it would see with lax.
It takes that primitive's parameters plus `flexlink` ("explicit" or "replace", routing.py), and any
number of operands: lax binds one per pytree leaf, and FlexLink merges independent calls of one
shard_map body into one (combine.py), so that a pytree costs one rendezvous, not one per leaf.
Typing (shapes, varying axes, named-axis effects, axis-name checks), batching and transposition are
lax's rules applied operand by operand; FlexLink adds an ordered effect, so every device runs its
FlexLink calls in program order, and its own lowering to a custom call.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
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

_forced = threading.local()


@contextlib.contextmanager
def _forcing(name: str, value):
  """`_forced.<name>` is `value` in this block (this thread's)."""
  previous = getattr(_forced, name, None)
  setattr(_forced, name, value)
  try:
    yield
  finally:
    setattr(_forced, name, previous)


def ordering_effect_forced(effect: FlexLinkOrdering):
  """Collectives traced in this block take `effect` (lowering a nested region: its calls must join
  the chain of the region around it, whatever the axis environment is there)."""
  return _forcing("effect", effect)


def lowering_for(platform: str):
  """The platform whose lowering rule runs in this block (jax calls every platform's rule with the
  same context when it lowers for several): the CUDA module's calls carry one attribute more."""
  return _forcing("platform", platform)


def _links_attributes(platform: str | None) -> dict:
  """`links_version`: the running engine's link set when the program was lowered. CPU: every rank
  of the call runs on that set (xla_ffi/core/link_set.h), so a configure(links=...) while calls are
  still queued (jax dispatches asynchronously) cannot give a call's ranks different links. Jit and
  pmap lower again for new links of either engine (the JAX option jax_flexlink_links_generation,
  which configure sets, is part of their cache keys). CUDA: likewise every rank of an in-process
  group runs on the GPU link set of the lowering (GpuEngine::GetGroup), and it picks the GPU group
  across processes set up for it (xla_ffi/cuda/gpu_xproc.h: links configured later get a group of
  their own at the next lowering, and a program lowered before keeps its group in every process,
  whenever its calls execute)."""
  from jax_flexlink._src import native  # noqa: PLC0415
  module = native.cuda_module() if platform == "cuda" else native.cpu_module()
  return {"links_version": np.int64(module.links_version() if module is not None else 0)}


def _ordering_effect(axis_names) -> FlexLinkOrdering:
  forced = getattr(_forced, "effect", None)
  if forced is not None:
    return forced
  outermost = compat.outermost_axis_name()
  return FlexLinkOrdering(outermost if outermost is not None else axis_names[0])


def tokens_started_by_shard_map(ctx, jaxpr):
  """The FlexLink token chains a shard_map body starts (see compat.wrap_shard_map_lowering)."""
  present = ctx.tokens_in.effects()
  return [e for e in compat.ordered_effects.filter_in(jaxpr.effects)
          if isinstance(e, FlexLinkOrdering) and e not in present]


# What the engine reduces and moves (xla_ffi/core): every dtype lax's collectives accept on CPU.
SUPPORTED_DTYPES = frozenset(np.dtype(d) for d in (
    "float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
    "uint16", "uint32", "uint64", "bool", "complex64", "complex128"))


def check_dtype(api_name: str, aval, reduction: str | None) -> None:
  """Trace-time dtype errors of the explicit API, in lax's words where lax has them."""
  dtype = np.dtype(aval.dtype)
  if dtype not in SUPPORTED_DTYPES:
    accepted = ", ".join(sorted(str(d) for d in SUPPORTED_DTYPES))
    raise TypeError(f"{api_name} does not accept dtype {dtype}. Accepted dtypes are: {accepted}.")
  if reduction == "sum" and dtype == np.bool_:
    # lax's psum converts bool first; psum_scatter's reducer is lax.add, which rejects bool (with
    # these words; calling lax.add here would need a trace, which jax 0.11 has none of here).
    raise TypeError("add does not accept dtype bool at position 0. Accepted dtypes at position 0 "
                    "are subtypes of integer, floating, complexfloating.")
  if reduction in ("max", "min") and np.issubdtype(dtype, np.complexfloating):
    raise TypeError(f"{api_name} does not accept dtype {dtype}: complex numbers have no order, so "
                    f"{reduction} is not defined for them.")


def unsupported_dtype(aval, reduction: str | None) -> str | None:
  """Why the engine cannot run this operand (replacement mode leaves it to lax), or None."""
  dtype = np.dtype(aval.dtype)
  if dtype not in SUPPORTED_DTYPES:
    return f"FlexLink's engine does not move {dtype}"
  if reduction in ("max", "min") and np.issubdtype(dtype, np.complexfloating):
    return f"FlexLink does not {reduction}-reduce {dtype}"
  return None


class NotLowerable(Exception):
  """FlexLink cannot run this equation where it is being lowered (the message says why): in
  replacement mode it runs as lax's collective instead, an explicit call fails with the reason."""


@dataclasses.dataclass(frozen=True)
class Collective:
  """How one lax collective primitive maps onto the engine.

  `lower(ctx, operands, **params)` emits the custom call(s) for a fully manual region and returns
  the results; it raises NotLowerable where FlexLink cannot run the call.
  """
  lax_prim: compat.Primitive
  kind: str                                # the engine's collective: all_reduce, all_gather, ...
  api_name: str                            # lax's function, for messages: psum, all_gather, ...
  axis_names: Callable[[dict], tuple]      # the bind's axis names, from its parameters
  reduction: Callable[[dict], str | None]  # what the engine reduces with (None: moves only)
  lower: Callable


def define(spec: Collective) -> compat.Primitive:
  """The FlexLink primitive standing in for `spec.lax_prim`, with all its rules, routed from lax."""
  lax_prim = spec.lax_prim
  prim = compat.Primitive(lax_prim.name)
  prim.multiple_results = True
  prim.flexlink = spec

  def abstract_eval(*avals, flexlink, **params):
    outs, effects = [], set()
    for aval in avals:
      if flexlink == routing.EXPLICIT:  # replacement: lax's typing alone (dtypes: lowering.py)
        check_dtype(spec.api_name, aval, spec.reduction(params))
      out, eff = compat.abstract_eval_of(lax_prim, aval, **params)
      outs.append(out)
      effects |= set(eff)
    names = tuple(a for a in spec.axis_names(params) if not isinstance(a, int))
    if names:
      effects.add(_ordering_effect(names))
    return outs, effects

  def impl(*args, flexlink, **params):
    # Reached when vmap has computed every named axis locally: what remains is lax's to do.
    return [routing.native_bind(lax_prim)(x, **params) for x in args]

  def batch(axis_data, vals_in, dims_in, *, flexlink, **params):
    rule = compat.fancy_primitive_batchers[lax_prim]
    outs, dims = [], []
    with routing.scope(flexlink):  # what lax's rule binds stays FlexLink's, in the same mode
      for v, d in zip(vals_in, dims_in):
        out, dim = rule(axis_data, [v], [d], **params)
        outs.append(out)
        dims.append(dim)
    return outs, dims

  def jvp(primals, tangents, *, flexlink, **params):
    # Linear for the collectives lax differentiates; lax has no rule for pmax/pmin, and neither has
    # FlexLink: the same error, never a wrong derivative.
    if lax_prim not in compat.primitive_jvps:
      raise NotImplementedError(f"Differentiation rule for '{lax_prim}' not implemented")
    outs = prim.bind(*primals, flexlink=flexlink, **params)
    # Zero tangents stay symbolic zeros, as with lax's per-leaf binds (no bytes moved for them).
    live = [i for i, t in enumerate(tangents) if type(t) is not compat.Zero]
    tangents_out = [compat.zero_tangent_like(o) for o in outs]
    if live:
      for i, t in zip(live, prim.bind(*(tangents[i] for i in live), flexlink=flexlink, **params)):
        tangents_out[i] = t
    return outs, tangents_out

  def transpose(cts, *args, flexlink, **params):
    # lax's rule emits the dual collective (psum_scatter for all_gather, ...) through lax's API;
    # routing sends it back to FlexLink.
    rule = compat.primitive_transposes[lax_prim]
    out = []
    with routing.scope(flexlink):
      for ct, x in zip(cts, args):
        out.extend(rule(ct, x, **params))
    return out

  prim.def_effectful_abstract_eval(abstract_eval)
  prim.def_impl(impl)
  compat.primitive_jvps[prim] = jvp
  compat.primitive_transposes[prim] = transpose
  compat.fancy_primitive_batchers[prim] = batch
  # Not cacheable: the rule bakes in device ids from the enclosing mesh, which JAX's lowering cache
  # key does not include (two shard_maps over different meshes would share one lowering).
  from jax_flexlink._src import lowering  # noqa: PLC0415 - lowering imports this module
  compat.register_lowering(prim, lowering.rule(prim, spec, platform="cpu"), platform="cpu",
                           cacheable=False)
  from jax_flexlink._src import native  # noqa: PLC0415 - native loads the extension modules
  if native.cuda_module() is not None:  # the CUDA module's handlers take the same custom calls
    compat.register_lowering(prim, lowering.rule(prim, spec, platform="cuda"), platform="cuda",
                             cacheable=False)
  # Any other platform (and cuda in a build without the CUDA module): lax's lowering, or the
  # reason for an explicit call.
  compat.register_lowering(prim, lowering.rule(prim, spec, platform=None), cacheable=False)
  routing.install(lax_prim, prim, spec.axis_names)
  return prim


def in_place(x) -> bool:
  """Whether a collective's result should alias its operand (all_reduce, ppermute, all_to_all).

  XLA:CPU pays heavily for first-touching the pages of a fresh output buffer, and where the jitted
  function's output is a donated argument it copies a fresh result into it afterwards; writing the
  result into the operand's buffer avoids both when XLA may reuse that buffer: a donated argument or
  an intermediate value. For an argument that is not donated, XLA would first copy it into a fresh
  buffer, paying the page faults *and* a copy, so the result goes to a fresh buffer instead.
  """
  return compat.operand_origin(x) != "parameter"


def emit_custom_call(ctx, target: str, operands, *, aliases=(), avals_in=None, avals_out=None,
                     **attrs):
  """Emits `target(x_1, ..., x_k, token) -> (y_1, ..., y_k, token)` and threads the FlexLink
  ordering token.

  `aliases`: indices i whose result y_i may reuse x_i's buffer. `avals_in` / `avals_out`: the
  operands' and results' avals when the rule transforms them around the call.
  """
  from jax_flexlink._src import processes  # noqa: PLC0415 - processes imports this module
  from jax_flexlink._src import runtime  # noqa: PLC0415 - runtime imports the primitives' modules
  runtime.ensure_cached_model()
  if "groups" in attrs:  # groups spanning processes get their shared segment first
    processes.prepare(attrs["groups"], attrs["group_sizes"], ctx.module_context.platforms)
  attrs = {**attrs, **_links_attributes(getattr(_forced, "platform", None))}
  ordering, = (e for e in ctx.tokens_in.effects() if isinstance(e, FlexLinkOrdering))
  token = ctx.tokens_in.get(ordering)
  call_ctx = ctx.replace(avals_in=[*(avals_in or ctx.avals_in), compat.abstract_token],
                         avals_out=[*(avals_out or ctx.avals_out), compat.abstract_token])
  op = compat.build_ffi_lowering_function(
      target, has_side_effect=True, operand_output_aliases={i: i for i in aliases} or None,
  )(call_ctx, *operands, token, **attrs)
  *ys, token_out = op.results
  ctx.set_tokens_out(ctx.tokens_in.update_tokens(compat.TokenSet({ordering: token_out})))
  return ys
