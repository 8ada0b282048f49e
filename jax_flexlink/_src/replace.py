"""Replacement mode: plain jax.lax collectives lowered through FlexLink, with no code change."""
from __future__ import annotations

import jax

from jax_flexlink._src.config import check_bool, replace_collectives_option


class replace_collectives:  # noqa: N801 - reads as a function at call sites, like jax's own config managers
  """Turns replacement mode on (or off with `enabled=False`).

  As a plain call it sets the process-wide default::

      jax_flexlink.replace_collectives()        # on from here on
      jax_flexlink.replace_collectives(False)   # off again

  As a context manager it restores the previous setting on exit::

      with jax_flexlink.replace_collectives():
        jax.jit(f)(x)

  It is the JAX config option `jax_flexlink_replace_collectives` (part of the jit cache key, so a
  function traced in one mode is retraced in the other, never silently reused).
  """

  def __init__(self, enabled: bool = True):
    enabled = check_bool(enabled, "replace_collectives(enabled)")
    self._previous = bool(replace_collectives_option.value)
    jax.config.update(replace_collectives_option.name, enabled)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    jax.config.update(replace_collectives_option.name, self._previous)
    return False


def replacing_collectives() -> bool:
  """Whether replacement mode is on in this thread."""
  return bool(replace_collectives_option.value)
