"""Every use of JAX internals (`jax._src`) lives here, so a JAX upgrade touches one file.

FlexLink's primitives reuse lax's own typing, batching and transpose rules for the collectives they
stand in for; that is what makes them drop-ins (same varying-axes typing, same errors, same vmap and
autodiff semantics). Those rules are not public API, hence this module.
"""
from __future__ import annotations

import contextlib
import threading

from jax._src import ad_util
from jax._src import config as jax_config
from jax._src import core
from jax._src import distributed as jax_distributed
from jax._src import effects
from jax._src import ffi as jax_ffi
from jax._src import mesh as mesh_lib
from jax._src import shard_map as jax_shard_map
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.lax import parallel as lax_parallel
from jax._src.lib.mlir import ir
import numpy as np
from jax._src.sharding_impls import ShardingContext, SPMDAxisContext

psum_p = lax_parallel.psum_p
psum_invariant_p = lax_parallel.psum_invariant_p
pmax_p = lax_parallel.pmax_p
pmin_p = lax_parallel.pmin_p
all_gather_p = lax_parallel.all_gather_p
all_gather_invariant_p = lax_parallel.all_gather_invariant_p
reduce_scatter_p = lax_parallel.reduce_scatter_p
ppermute_p = lax_parallel.ppermute_p
all_to_all_p = lax_parallel.all_to_all_p

Primitive = core.Primitive
NamedAxisEffect = core.NamedAxisEffect
ordered_effects = effects.ordered_effects
abstract_token = core.abstract_token
primitive_jvps = ad.primitive_jvps
Zero = ad.Zero
zero_tangent_like = ad_util.p2tz
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


def manual_axes() -> frozenset:
  """Axes of the enclosing shard_map/pmap mesh that are manual here (devices behind each name)."""
  mesh = mesh_lib.get_abstract_mesh()
  if mesh.empty:
    return frozenset()
  return frozenset(mesh.manual_axes)


def check_vma_enabled() -> bool:
  return bool(jax_config._check_vma.value)


def lowering_manual_axes(axis_context) -> tuple[frozenset, tuple]:
  """(manual axes, axes of size > 1 that are not manual) of the computation being lowered.

  Non-empty second element: a partially manual region (shard_map with `axis_names=` a subset, or a
  vmap of a shard_map whose vmapped axis is sharded over an Explicit mesh axis): XLA partitions
  what it holds over those axes automatically, and a FlexLink custom call cannot sit there directly.
  """
  mesh = axis_context.mesh
  manual = frozenset(axis_context.manual_axes)
  others = tuple(a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1)
  return manual, others


# The device assignment of the computation being lowered (partition i runs on device [i]), taken from
# the top-level lowering context as shard_map's lowering enters its body: inside, the axis context's
# mesh may be abstract (a shard_map under jax.set_mesh or nested in another), without devices.
_lowering_devices = threading.local()


@contextlib.contextmanager
def _entered_devices(axis_context):
  stack = _lowering_devices.__dict__.setdefault("stack", [])
  devices = None
  if isinstance(axis_context, ShardingContext):
    devices = axis_context.device_assignment
  elif isinstance(axis_context, SPMDAxisContext) and isinstance(axis_context.mesh, mesh_lib.Mesh):
    devices = tuple(np.asarray(axis_context.mesh.devices).flat)
  stack.append(devices if devices is not None else (stack[-1] if stack else None))
  try:
    yield
  finally:
    stack.pop()


def partition_devices(axis_context):
  """The devices of the partitions of the computation being lowered, in partition order, or None
  where they are not known (an abstract mesh with no enclosing device assignment, e.g. jax.export)."""
  mesh = axis_context.mesh
  if isinstance(mesh, mesh_lib.Mesh):
    return tuple(np.asarray(mesh.devices).flat)
  stack = getattr(_lowering_devices, "stack", None)
  return stack[-1] if stack else None


def outermost_axis_name():
  """The first-bound named axis in scope (that of the outermost shard_map/pmap), or None."""
  names = tuple(core.get_axis_env().axis_sizes)
  return names[0] if names else None


def wrap_shard_map_lowering(make_tokens_for, rewrite_body=lambda jaxpr: jaxpr) -> None:
  """Lets shard_map's lowering start token chains for effects that stop at its boundary.

  `make_tokens_for(ctx, jaxpr)` lists the ordered effects of the body whose chains start in the
  body; they get a token created inside the manual computation, and their final tokens are dropped
  at its end (the enclosing jit never sees them). Inside, not passed in: a token operand of a
  partially manual computation (axis_names= a subset of the mesh) aborts shardy's export.
  `rewrite_body(jaxpr)` may replace the body before it is lowered (FlexLink merges collectives
  there). While the body is lowered, `partition_devices` knows the computation's devices.
  """
  prim = jax_shard_map.shard_map_p
  entry = mlir._lowerings[prim]
  if getattr(entry.rule, "_flexlink_wrapped", False):
    return
  native_rule = entry.rule

  def rule(ctx, *in_nodes, jaxpr, **params):
    jaxpr = rewrite_body(jaxpr)
    started = make_tokens_for(ctx, jaxpr)
    if started:
      jaxpr = _in_token_region(jaxpr, started)
    with _entered_devices(ctx.module_context.axis_context):
      return native_rule(ctx, *in_nodes, jaxpr=jaxpr, **params)

  rule._flexlink_wrapped = True
  # Not cacheable, so the body is lowered inline in its caller: FlexLink's rules can then see
  # whether an operand is a donated argument of the jitted function (see donated_argument).
  mlir.register_lowering(prim, rule, inline=entry.inline, cacheable=False)


# One equation holding a whole shard_map body, whose lowering creates the tokens of the chains that
# start in the body and lowers the body with them.
_token_region_p = core.Primitive("flexlink_token_region")
_token_region_p.multiple_results = True
_token_region_p.def_effectful_abstract_eval(
    lambda *avals, jaxpr, started: ([v.aval for v in jaxpr.outvars],
                                    set(jaxpr.effects) - set(started)))


def _token_region_lowering(ctx, *args, jaxpr, started):
  tokens = mlir.TokenSet({**dict(ctx.tokens_in.items()),
                          **dict(mlir.TokenSet.create(list(started)).items())})
  outs, tokens_out = mlir.jaxpr_subcomp(
      ctx.module_context, jaxpr, ctx.name_stack, tokens, (), *args,
      dim_var_values=ctx.dim_var_values, const_lowering=ctx.const_lowering, outer_traceback=None)
  ctx.set_tokens_out(mlir.TokenSet({e: t for e, t in tokens_out.items() if e not in started}))
  return outs


mlir.register_lowering(_token_region_p, _token_region_lowering, cacheable=False)


def _in_token_region(jaxpr, started):
  invars = [core.Var(v.aval) for v in jaxpr.invars]
  outvars = [core.Var(v.aval) for v in jaxpr.outvars]
  effects = set(jaxpr.effects) - set(started)
  eqn = core.new_jaxpr_eqn(invars, outvars, _token_region_p,
                           {"jaxpr": jaxpr, "started": tuple(started)}, effects)
  return core.Jaxpr((), invars, outvars, [eqn], effects, jaxpr.debug_info)


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


def bool_config_state(name: str, default: bool, help: str, validator=None):
  """A JAX config option: `jax.config.update`, the `JAX_*` env var and absl flags all work, and the
  value is part of the jit cache key, so toggling it retraces instead of reusing native code.
  `validator(value)` raises on a value that is not a bool (jax's own bool options take any value and
  keep its truth, so "no" would mean True)."""
  return jax_config.bool_state(name, default, help, include_in_jit_key=True,
                               include_in_trace_context=True, validator=validator)


def int_config_state(name: str, default: int, help: str):
  """A JAX config option holding an int, part of the jit cache key and of the trace context (so
  jit's, pmap's and the lowering caches all miss when it changes)."""
  return jax_config.int_state(name, default, help, include_in_jit_key=True,
                              include_in_trace_context=True)


def replica_groups(axis_context, axis_names, axis_index_groups):
  """lax's groups: lists of partition indices into `mesh.devices.flat`, in lax's rank order."""
  return lax_parallel._replica_groups(axis_context, axis_names, axis_index_groups)


def ppermute_partition_pairs(ctx, axis_names, perm):
  """lax's (source, destination) partition pairs of a ppermute, group after group, checked as lax
  checks them (its errors)."""
  pairs, _ = lax_parallel._pcollectives_lowering_common(ctx, axis_name=tuple(axis_names),
                                                        perm=perm, op_name="ppermute")
  return pairs


def spmd_mesh(axis_context):
  """The mesh of a shard_map/pmap body being lowered, or None outside one."""
  if isinstance(axis_context, SPMDAxisContext):
    return axis_context.mesh
  return None


def abstract_eval_of(prim: Primitive, aval, **params):
  """(out_aval, effects) from lax's own abstract evaluation rule for `prim`."""
  return prim.abstract_eval(aval, **params)


def lower_pure(ctx, fn, x, aval_in, aval_out):
  """Lowers `fn(x)` (jax operations without effects) in the rule context `ctx`; one result."""
  sub = ctx.replace(primitive=None, avals_in=[aval_in], avals_out=[aval_out],
                    tokens_in=mlir.TokenSet(), tokens_out=None)
  out, = mlir.lower_fun(fn, multiple_results=False)(sub, x)
  return out


def shard_map(f, **kwargs):
  import jax  # noqa: PLC0415 - jax's public shard_map; compat is imported while jax initialises too
  return jax.shard_map(f, **kwargs)


def set_frontend_attribute(value, name: str, text: str) -> None:
  """Sets an XLA frontend attribute on the op that defines `value` (XLA keeps these in the HLO)."""
  op = value.owner
  op = getattr(op, "operation", op)
  attrs = {}
  if "mhlo.frontend_attributes" in op.attributes:
    existing = ir.DictAttr(op.attributes["mhlo.frontend_attributes"])
    attrs = {existing[i].name: existing[i].attr for i in range(len(existing))}
  attrs[name] = ir.StringAttr.get(text)
  op.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(attrs)


def vars_of(atoms):
  """The variables among a jaxpr equation's operands or results (not literals, not dropped)."""
  return [a for a in atoms if isinstance(a, core.Var) and not isinstance(a, core.DropVar)]


def new_eqn(invars, outvars, prim, params, effects, source_info, ctx):
  return core.new_jaxpr_eqn(invars, outvars, prim, params, effects, source_info, ctx)


def lowering_for_export(ctx) -> bool:
  """Whether the module being lowered is for jax.export (serialized, run elsewhere)."""
  return bool(getattr(ctx.module_context.lowering_parameters, "for_export", False))


def backends_initialized() -> bool:
  """Whether jax has created its backends (XLA reads the host device count only before that)."""
  from jax._src import xla_bridge
  return bool(xla_bridge.backends_are_initialized())


def distributed_client():
  """The key-value store client of `jax.distributed.initialize`, or None in a single-process job.

  Methods used (same in jax 0.10 and 0.11): key_value_set(_bytes), blocking_key_value_get(_bytes),
  key_value_try_get, wait_at_barrier, key_value_delete.
  """
  return jax_distributed.global_state.client


def _xla_collective_args():
  # As lax's own lowerings inside shard_map/pmap: partition ids as groups, a channel, global ids
  # (otherwise XLA reads the groups as replicas, and an SPMD program has one replica).
  from jax._src.lib.mlir.dialects import hlo  # noqa: PLC0415
  return dict(channel_handle=hlo.ChannelHandle.get(mlir.COLLECTIVE_CHANNEL_ID,
                                                   mlir.DEVICE_TO_DEVICE_TYPE),
              use_global_device_ids=ir.BoolAttr.get(True))


def _groups_attr(groups):
  return ir.DenseIntElementsAttr.get(np.ascontiguousarray(np.array(groups, dtype=np.int64)))


def _reducer_region(op, x, reduction: str):
  from jax._src.lib.mlir.dialects import hlo  # noqa: PLC0415
  scalar = ir.RankedTensorType.get([], ir.RankedTensorType(x.type).element_type)
  block = op.regions[0].blocks.append(scalar, scalar)
  with ir.InsertionPoint(block):
    a, b = block.arguments
    fn = {"sum": hlo.add, "max": hlo.maximum, "min": hlo.minimum}[reduction]
    hlo.return_([fn(a, b)])


def xla_all_reduce(x, groups, reduction: str):
  """XLA's all-reduce of `x` over `groups` (lists of partition ids, all of one size)."""
  from jax._src.lib.mlir.dialects import hlo  # noqa: PLC0415
  op = hlo.AllReduceOp([x.type], [x], replica_groups=_groups_attr(groups), **_xla_collective_args())
  _reducer_region(op, x, reduction)
  return op.result


def xla_all_gather(ctx, x, aval_out, groups, dimension: int):
  from jax._src.lib.mlir.dialects import hlo  # noqa: PLC0415
  return hlo.AllGatherOp([mlir.aval_to_ir_type(ctx.module_context, aval_out)], [x],
                         all_gather_dim=mlir.i64_attr(dimension),
                         replica_groups=_groups_attr(groups), **_xla_collective_args()).result


def xla_reduce_scatter(ctx, x, aval_out, groups, dimension: int, reduction: str):
  from jax._src.lib.mlir.dialects import hlo  # noqa: PLC0415
  op = hlo.ReduceScatterOp(mlir.aval_to_ir_type(ctx.module_context, aval_out), x,
                           scatter_dimension=mlir.i64_attr(dimension),
                           replica_groups=_groups_attr(groups), **_xla_collective_args())
  _reducer_region(op, x, reduction)
  return op.result
