"""The one place FlexLink reads its configuration (`FLEXLINK_*` environment variables)."""
from __future__ import annotations

import dataclasses
import os

from jax_flexlink._src import compat

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _env_bool(name: str, default: bool) -> bool:
  raw = os.environ.get(name)
  if raw is None:
    return default
  value = raw.strip().lower()
  if value in _TRUE:
    return True
  if value in _FALSE:
    return False
  raise ValueError(f"{name}={raw!r}: expected one of {_TRUE + _FALSE[:-1]}")


def _env_float(name: str, default: float) -> float:
  raw = os.environ.get(name)
  if raw is None or not raw.strip():
    return default
  try:
    value = float(raw)
  except ValueError:
    raise ValueError(f"{name}={raw!r}: expected a number of seconds") from None
  if not value > 0:
    raise ValueError(f"{name}={raw!r}: must be positive")
  return value


_SUFFIXES = {"": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
             "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_bytes(text: str, what: str) -> int:
  """'1048576', '1M', '64KiB', '0' -> bytes (binary multiples); ValueError naming `what` otherwise."""
  raw = str(text).strip()
  digits = raw.rstrip("KkMmGgIiBb ")
  suffix = raw[len(digits):].strip().upper()
  try:
    value = int(digits)
  except ValueError:
    value = -1
  if value < 0 or suffix not in _SUFFIXES:
    raise ValueError(f"{what}={text!r}: expected a byte count such as 1048576, 64K or 1M")
  return value * _SUFFIXES[suffix]


def parse_profile_bytes(text, what: str) -> int:
  """parse_bytes for a largest profiling size: stage 1 needs two sizes from 64 KiB, so >= 128K."""
  value = parse_bytes(text, what)
  if value < 1 << 17:
    raise ValueError(f"{what}={text!r}: must be at least 128K (two profile sizes)")
  return value


def _env_bytes(name: str, default: int) -> int:
  raw = os.environ.get(name)
  if raw is None or not raw.strip():
    return default
  return parse_bytes(raw, name)


_DEBUG_LEVELS = {"": 0, "0": 0, "OFF": 0, "WARN": 0, "INFO": 1, "1": 1, "DEBUG": 1}


def _env_debug(name: str) -> int:
  raw = os.environ.get(name, "")
  level = _DEBUG_LEVELS.get(raw.strip().upper())
  if level is None:
    raise ValueError(f"{name}={raw!r}: expected INFO (or empty to turn logging off)")
  return level


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  module: str
  timeout_s: float
  replace_collectives: bool
  debug_level: int
  links: str
  tune_cache: str
  autotune_min_bytes: int
  tune_max_bytes: int
  combine_bytes: int
  host_id: str
  emulated_hosts: int


def _env_hosts(name: str) -> int:
  raw = os.environ.get(name, "").strip()
  if not raw:
    return 1
  try:
    value = int(raw)
  except ValueError:
    value = 0
  if value < 1:
    raise ValueError(f"{name}={raw!r}: expected a number of hosts >= 1")
  return value


def from_environment() -> EnvConfig:
  return EnvConfig(
      # The native module _flexlink to load instead of the one next to the package (a path to a
      # _flexlink*.so, e.g. a sanitizer build's; docs/sanitizers.md); empty: the package's own.
      module=os.environ.get("FLEXLINK_MODULE", "").strip(),
      timeout_s=_env_float("FLEXLINK_TIMEOUT_S", 300.0),
      replace_collectives=_env_bool("FLEXLINK_REPLACE_COLLECTIVES", False),
      debug_level=_env_debug("FLEXLINK_DEBUG"),
      links=os.environ.get("FLEXLINK_LINKS", "").strip() or "shm",
      tune_cache=os.environ.get("FLEXLINK_TUNE_CACHE", "").strip(),
      # Stage 1 in the engine: on the first call of at least this size (0: only via tune()), ...
      autotune_min_bytes=_env_bytes("FLEXLINK_AUTOTUNE_MIN_BYTES", 1 << 20),
      # ... profiling sizes up to that call's, at most this.
      tune_max_bytes=_env_bytes("FLEXLINK_TUNE_MAX_BYTES", 16 << 20),
      # Independent collectives of a shard_map body merge into one call up to this many operand
      # bytes (0: never merge).
      combine_bytes=_env_bytes("FLEXLINK_COMBINE_BYTES", 64 << 20),
      # This process's host identity (hosts.py); empty: hostname + boot id. Set it to make processes
      # of one machine count as different hosts.
      host_id=os.environ.get("FLEXLINK_HOST_ID", "").strip(),
      # Testbed: this process's devices play this many hosts (consecutive device ids each), so the
      # hierarchical path runs in one process. 1: every device of a process is on its host.
      emulated_hosts=_env_hosts("FLEXLINK_EMULATED_HOSTS"),
  )


ENV = from_environment()

# `jax.config.update("jax_flexlink_replace_collectives", True)`, `--jax_flexlink_replace_collectives`
# (absl) and JAX_FLEXLINK_REPLACE_COLLECTIVES all set it; FLEXLINK_REPLACE_COLLECTIVES gives its default.
replace_collectives_option = compat.bool_config_state(
    "jax_flexlink_replace_collectives",
    ENV.replace_collectives,
    help=("Lower jax.lax.psum/pmean/pmax/pmin/all_gather/psum_scatter inside shard_map and pmap "
          "to FlexLink's custom calls instead of XLA's native collectives."),
)
