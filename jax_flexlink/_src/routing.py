"""Which lax collective binds go to FlexLink.

FlexLink's public functions *are* lax's functions run with routing on: lax's `psum`, `all_gather`, ...
validate their arguments, canonicalise groups, convert bool, constant-fold and pick the primitive
exactly as they always do, and the moment they bind a lax collective primitive, the bind is redirected
to the FlexLink primitive standing in for it. The same hook implements replacement mode (the config
option on), and FlexLink's own batching and transpose rules, which reuse lax's rules, run with routing
on so that the collectives those rules emit stay FlexLink collectives.

A bind is routed only when at least one of its named axes has devices behind it (a manual axis of
the enclosing shard_map/pmap mesh). Axes named by `jax.vmap(..., axis_name=...)` have none: lax's
batching rules compute those collectives locally, with no communication, and routing them would only
stand in lax's way.
"""
from __future__ import annotations

import contextlib
import threading

from jax_flexlink._src import compat
from jax_flexlink._src.config import replace_collectives_option

# How a FlexLink equation came to be; its `flexlink` parameter. "explicit": a jax_flexlink.* call,
# which must run on FlexLink or fail with an error; "replace": a jax.lax call in replacement mode,
# which falls back to lax's own lowering wherever FlexLink cannot run it.
EXPLICIT = "explicit"
REPLACE = "replace"

_state = threading.local()
_native_binds: dict = {}


def current_mode() -> str | None:
  """EXPLICIT inside an explicit scope, REPLACE with replacement mode on, else None."""
  mode = getattr(_state, "mode", None)
  if mode is not None:
    return mode
  return REPLACE if replace_collectives_option.value else None


@contextlib.contextmanager
def scope(mode: str | None):
  """Routes every lax collective bound in this block (on this thread) to FlexLink in `mode`
  (None: back to the config option's choice)."""
  previous = getattr(_state, "mode", None)
  _state.mode = mode
  try:
    yield
  finally:
    _state.mode = previous


def explicit_scope():
  return scope(EXPLICIT)


def native_bind(lax_prim):
  """`lax_prim`'s own bind, never routed."""
  return _native_binds.get(lax_prim, lax_prim.bind)


def device_axes(axis_names) -> tuple:
  """The names among `axis_names` that are manual axes of the enclosing mesh (devices behind them)."""
  manual = compat.manual_axes()
  return tuple(a for a in axis_names if not isinstance(a, int) and a in manual)


def install(lax_prim, flexlink_prim, axis_names_of) -> None:
  """Redirects `lax_prim.bind` to `flexlink_prim` while routing is on.

  `axis_names_of(params)`: the bind's axis names. What FlexLink cannot run (say, a float8 psum) is
  decided where the equation is lowered: an explicit call fails at trace time already, replacement
  mode lowers it as lax would and marks it with the reason (lowering.py).
  """
  if lax_prim in _native_binds:
    return
  native = lax_prim.bind
  _native_binds[lax_prim] = native

  def bind(*args, **params):
    mode = current_mode()
    if mode is not None and device_axes(axis_names_of(params)):
      out, = flexlink_prim.bind(*args, flexlink=mode, **params)  # one operand, one result
      return out
    return native(*args, **params)

  lax_prim.bind = bind


__all__ = ["EXPLICIT", "REPLACE", "current_mode", "scope", "explicit_scope", "native_bind",
           "device_axes", "install"]
