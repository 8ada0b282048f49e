"""Which lax collective binds go to FlexLink.

FlexLink's public functions *are* lax's functions run with routing on: lax's `psum`, `all_gather`, ...
validate their arguments, canonicalise groups, convert bool, constant-fold and pick the primitive
exactly as they always do, and the moment they bind a lax collective primitive, the bind is redirected
to the matching FlexLink primitive. The same hook implements replacement mode (the config option on),
and FlexLink's own batching and transpose rules, which reuse lax's rules, run with routing on so that
the collectives those rules emit stay FlexLink collectives.
"""
from __future__ import annotations

import contextlib
import threading

from jax_flexlink._src.config import replace_collectives_option

_state = threading.local()


def explicit_scope_active() -> bool:
  return getattr(_state, "explicit", False)


@contextlib.contextmanager
def explicit_scope():
  """Route every lax collective bound in this block (on this thread) to FlexLink."""
  previous = explicit_scope_active()
  _state.explicit = True
  try:
    yield
  finally:
    _state.explicit = previous


def routing_active() -> bool:
  return explicit_scope_active() or bool(replace_collectives_option.value)


def install(lax_prim, flexlink_prim, supports) -> None:
  """Redirects `lax_prim.bind` to `flexlink_prim` while routing is active.

  `supports(*args, **params)` says whether FlexLink can run this bind; in replacement mode an
  unsupported one (say, a float8 psum) keeps its native lowering, while an explicit FlexLink call
  goes on to FlexLink's abstract evaluation, which raises the trace-time error.
  """
  if getattr(lax_prim, "_flexlink_routed", False):
    return
  native_bind = lax_prim.bind

  def bind(*args, **params):
    if routing_active() and (explicit_scope_active() or supports(*args, **params)):
      return flexlink_prim.bind(*args, lax_prim=lax_prim, **params)
    return native_bind(*args, **params)

  lax_prim.bind = bind
  lax_prim._flexlink_routed = True


__all__ = ["explicit_scope", "explicit_scope_active", "routing_active", "install"]
