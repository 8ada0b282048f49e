"""Every use of JAX internals (`jax._src`) lives here, so a JAX upgrade touches one file.

FlexLink's primitives reuse lax's own typing, batching and transpose rules for the collectives they
stand in for; that is what makes them drop-ins (same varying-axes typing, same errors, same vmap and
autodiff semantics). Those rules are not public API, hence this module.
"""
from __future__ import annotations

from jax._src import config as jax_config
from jax._src import core
from jax._src import effects
from jax._src import ffi as jax_ffi
from jax._src import mesh as mesh_lib
from jax._src import shard_map as jax_shard_map
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.lax import parallel as lax_parallel
from jax._src.lib.mlir import ir
from jax._src.sharding_impls import SPMDAxisContext

psum_p = lax_parallel.psum_p
psum_invariant_p = lax_parallel.psum_invariant_p
pmax_p = lax_parallel.pmax_p
pmin_p = lax_parallel.pmin_p
all_gather_p = lax_parallel.all_gather_p
all_gather_invariant_p = lax_parallel.all_gather_invariant_p
reduce_scatter_p = lax_parallel.reduce_scatter_p

Primitive = core.Primitive
NamedAxisEffect = core.NamedAxisEffect
ordered_effects = effects.ordered_effects
abstract_token = core.abstract_token
primitive_jvps = ad.primitive_jvps
linear_jvp = ad.linear_jvp
primitive_transposes = ad.primitive_transposes
fancy_primitive_batchers = batching.fancy_primitive_batchers
register_lowering = mlir.register_lowering
lower_fun = mlir.lower_fun
TokenSet = mlir.TokenSet
build_ffi_lowering_function = jax_ffi.build_ffi_lowering_function


def register_ordered_effect_type(effect_type: type) -> None:
  """Declares an effect whose calls JAX orders with a token, allowed wherever lax collectives are
  (scan/cond/while thread the token as a carry; custom_vjp; checkpoint)."""
  effects.ordered_effects.add_type(effect_type)
  effects.shardable_ordered_effects.add_type(effect_type)
  effects.lowerable_effects.add_type(effect_type)
  effects.control_flow_allowed_effects.add_type(effect_type)
  effects.custom_derivatives_allowed_effects.add_type(effect_type)
  effects.remat_allowed_effects.add_type(effect_type)


def bound_axis_sizes() -> dict:
  """Named axes in scope (shard_map, pmap, vmap with axis_name) and their sizes."""
  return dict(core.get_axis_env().axis_sizes)


def partially_automatic_axes() -> tuple:
  """Mesh axes of size > 1 left automatic by the enclosing shard_map (`axis_names=` a subset)."""
  mesh = mesh_lib.get_abstract_mesh()
  if mesh.empty or not mesh._any_axis_manual:
    return ()
  return tuple(a for a in mesh.auto_axes if mesh.shape[a] > 1)


def outermost_axis_name():
  """The first-bound named axis in scope (that of the outermost shard_map/pmap), or None."""
  names = tuple(core.get_axis_env().axis_sizes)
  return names[0] if names else None


def wrap_shard_map_lowering(make_tokens_for) -> None:
  """Lets shard_map's lowering start token chains for effects that stop at its boundary.

  `make_tokens_for(ctx, jaxpr)` lists the ordered effects of the body for which the body needs a
  fresh token; they get one, created just outside the manual computation, and their final tokens
  are dropped on the way out (the enclosing jit never sees them).
  """
  prim = jax_shard_map.shard_map_p
  entry = mlir._lowerings[prim]
  if getattr(entry.rule, "_flexlink_wrapped", False):
    return
  native_rule = entry.rule

  def rule(ctx, *in_nodes, jaxpr, **params):
    fresh = make_tokens_for(ctx, jaxpr)
    if not fresh:
      return native_rule(ctx, *in_nodes, jaxpr=jaxpr, **params)
    inner = ctx.replace(tokens_in=mlir.TokenSet(
        {**dict(ctx.tokens_in.items()), **dict(mlir.TokenSet.create(fresh).items())}))
    out = native_rule(inner, *in_nodes, jaxpr=jaxpr, **params)
    if inner.tokens_out is not None:
      ctx.set_tokens_out(mlir.TokenSet(
          {e: t for e, t in inner.tokens_out.items() if e not in fresh}))
    return out

  rule._flexlink_wrapped = True
  # Not cacheable, so the body is lowered inline in its caller: FlexLink's rules can then see
  # whether an operand is a donated argument of the jitted function (see donated_argument).
  mlir.register_lowering(prim, rule, inline=entry.inline, cacheable=False)


_DONATION_ATTRS = ("tf.aliasing_output", "jax.buffer_donor")


def operand_origin(value) -> str:
  """Where a collective's operand comes from, as far as its reuse in place is concerned.

  "donated" / "parameter": a donated / not donated argument of the jitted function (through the
  shard_map boundary); "intermediate": anything else (an op's result, a loop carry, an argument of
  a nested function whose caller is not known here).
  """
  def block_arg(v):
    return ir.BlockArgument(v) if isinstance(v, ir.BlockArgument) else None

  arg = block_arg(value)
  if arg is not None and arg.owner.owner.operation.name == "sdy.manual_computation":
    arg = block_arg(arg.owner.owner.operation.operands[arg.arg_number])
  if arg is None:
    return "intermediate"
  func = arg.owner.owner.operation
  if func.name != "func.func" or ir.StringAttr(func.attributes["sym_name"]).value != "main":
    return "intermediate"
  attrs = func.attributes["arg_attrs"] if "arg_attrs" in func.attributes else None
  if attrs is None:
    return "parameter"
  arg_attrs = ir.DictAttr(ir.ArrayAttr(attrs)[arg.arg_number])
  return "donated" if any(a in arg_attrs for a in _DONATION_ATTRS) else "parameter"


def bool_config_state(name: str, default: bool, help: str):
  """A JAX config option: `jax.config.update`, the `JAX_*` env var and absl flags all work, and the
  value is part of the jit cache key, so toggling it retraces instead of reusing native code."""
  return jax_config.bool_state(name, default, help, include_in_jit_key=True,
                               include_in_trace_context=True)


def replica_groups(axis_context, axis_names, axis_index_groups):
  """lax's groups: lists of partition indices into `mesh.devices.flat`, in lax's rank order."""
  return lax_parallel._replica_groups(axis_context, axis_names, axis_index_groups)


def spmd_mesh(axis_context):
  """The mesh of a shard_map/pmap body being lowered, or None outside one."""
  if isinstance(axis_context, SPMDAxisContext):
    return axis_context.mesh
  return None


def abstract_eval_of(prim: Primitive, aval, **params):
  """(out_aval, effects) from lax's own abstract evaluation rule for `prim`."""
  return prim.abstract_eval(aval, **params)
