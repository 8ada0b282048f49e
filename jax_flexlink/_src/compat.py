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
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.interpreters import pxla
from jax._src.lax import parallel as lax_parallel
from jax._src.sharding_impls import SPMDAxisContext

psum_p = lax_parallel.psum_p
psum_invariant_p = lax_parallel.psum_invariant_p
pmax_p = lax_parallel.pmax_p
pmin_p = lax_parallel.pmin_p
all_gather_p = lax_parallel.all_gather_p
all_gather_invariant_p = lax_parallel.all_gather_invariant_p
reduce_scatter_p = lax_parallel.reduce_scatter_p

Primitive = core.Primitive
Effect = effects.Effect
abstract_token = core.abstract_token
primitive_jvps = ad.primitive_jvps
linear_jvp = ad.linear_jvp
primitive_transposes = ad.primitive_transposes
is_undefined_primal = ad.is_undefined_primal
fancy_primitive_batchers = batching.fancy_primitive_batchers
register_lowering = mlir.register_lowering
lower_fun = mlir.lower_fun
TokenSet = mlir.TokenSet
build_ffi_lowering_function = jax_ffi.build_ffi_lowering_function


def register_ordered_effect_type(effect_type: type) -> None:
  """Declares an effect that orders FlexLink calls per device and is allowed wherever lax
  collectives are (shard_map over many devices, scan/cond/while, custom_vjp, checkpoint)."""
  effects.ordered_effects.add_type(effect_type)
  effects.shardable_ordered_effects.add_type(effect_type)
  effects.lowerable_effects.add_type(effect_type)
  effects.control_flow_allowed_effects.add_type(effect_type)
  effects.custom_derivatives_allowed_effects.add_type(effect_type)
  effects.remat_allowed_effects.add_type(effect_type)


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


def check_vma_enabled() -> bool:
  return bool(jax_config._check_vma.value)


__all__ = [n for n in dir() if not n.startswith("_")]
del pxla
