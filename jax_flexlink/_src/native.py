"""Loads the C++ extension and registers its FFI handlers with XLA, once per process."""
from __future__ import annotations

import os

import jax

try:
  from jax_flexlink import _flexlink  # the nanobind module built from xla_ffi/
except ImportError as e:  # the usual cause: Python found the source tree before the installed package
  raise ImportError(
      "jax_flexlink's compiled module _flexlink is missing next to the jax_flexlink package imported "
      f"from {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}. If that is the repository's source tree (Python puts "
      "the current directory first on its path, so running from the repository root after "
      "`pip install .` imports the sources, which have no compiled module), run from another "
      "directory or install in place with `pip install -e .`; otherwise rebuild with "
      f"`pip install .` ({e})") from e
from jax_flexlink._src.config import ENV

ALL_REDUCE = "flexlink_all_reduce"
ALL_GATHER = "flexlink_all_gather"
REDUCE_SCATTER = "flexlink_reduce_scatter"
PPERMUTE = "flexlink_ppermute"
ALL_TO_ALL = "flexlink_all_to_all"
TARGETS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, PPERMUTE, ALL_TO_ALL)

_registered = False


def tune_cache_path() -> str:
  return _flexlink.tune_cache_path(ENV.tune_cache, os.environ.get("HOME", ""))


def register_targets() -> None:
  global _registered
  if _registered:
    return
  targets = _flexlink.registrations()
  missing = set(TARGETS) - set(targets)
  if missing:
    raise ImportError(f"jax_flexlink's native module lacks FFI targets {sorted(missing)}; "
                      "rebuild it (pip install .)")
  for name, capsule in targets.items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  _flexlink.set_timeout(ENV.timeout_s)
  _flexlink.set_debug_level(ENV.debug_level)
  _flexlink.set_autotune_min_bytes(ENV.autotune_min_bytes)
  _flexlink.set_tune_max_bytes(ENV.tune_max_bytes)  # the engine profiles at least two sizes anyway
  _flexlink.set_tune_cache_path(tune_cache_path())
  try:
    _flexlink.configure_links(ENV.links)
  except ValueError as e:
    raise ValueError(f"FLEXLINK_LINKS: {e}") from None
  _registered = True
