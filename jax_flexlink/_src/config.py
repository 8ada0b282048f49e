"""The one place FlexLink reads its configuration (`FLEXLINK_*` environment variables).

A value that cannot be used never stops the import: it is ignored with a warning that names the
variable, its value, what is accepted and the default used instead (docs/errors.md, "Bad input").
The same values passed to configure()/tune() are errors (TypeError, ValueError) instead."""
from __future__ import annotations

import dataclasses
import os
import re
import warnings

import numpy as np

from jax_flexlink._src import compat

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")

# A deadline must be one (the engine applies the same bound, xla_ffi/core/config.h).
MAX_TIMEOUT_S = 1e6


def ignored(name: str, raw: str, expected: str, default: str) -> None:
  """A FLEXLINK_* value that cannot be used: the import goes on with the default, and says so."""
  warnings.warn(f"jax_flexlink: ignoring {name}={raw!r}: expected {expected}; using the default {default}",
                stacklevel=3)


def _env_bool(name: str, default: bool) -> bool:
  raw = os.environ.get(name)
  if raw is None:
    return default
  value = raw.strip().lower()
  if value in _TRUE:
    return True
  if value in _FALSE:
    return False
  ignored(name, raw, f"one of {', '.join(_TRUE + _FALSE[:-1])}", str(default).lower())
  return default


_NUMBER = re.compile(r"[+]?([0-9]+([.][0-9]*)?|[.][0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def check_timeout(value, what: str) -> float:
  """A deadline in seconds: a finite real number in (0, MAX_TIMEOUT_S]; TypeError/ValueError naming `what`."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{what} must be a number of seconds, got {value!r} of type {type(value).__name__}")
  seconds = float(value)
  if not 0 < seconds <= MAX_TIMEOUT_S:  # also NaN
    raise ValueError(f"{what} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}")
  return seconds


def _env_timeout(name: str, default: float) -> float:
  raw = os.environ.get(name)
  if raw is None or not raw.strip():
    return default
  try:
    if not _NUMBER.fullmatch(raw.strip()):
      raise ValueError(raw)
    return check_timeout(float(raw), name)
  except ValueError:
    ignored(name, raw, f"a number of seconds in (0, {MAX_TIMEOUT_S:g}]", f"{default:g}")
    return default


_SUFFIXES = {"": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
             "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
_BYTES = re.compile(r"([0-9]+)[ \t]*([A-Za-z]*)", re.ASCII)
# Byte counts cross into the engine as unsigned 64-bit integers; the engine's own reader
# (ParseByteCount, xla_ffi/core/config.h) has the same grammar and bound.
MAX_BYTES = 1 << 63


def parse_bytes(text, what: str) -> int:
  """1048576, '1048576', '1M', '64KiB', '0' -> bytes (binary multiples, ASCII digits, at most 2**63).

  TypeError for what is not an integer or a string (a float or a bool is not a byte count), ValueError
  naming `what` for anything else."""
  if isinstance(text, (bool, np.bool_)) or not isinstance(text, (int, str, np.integer)):
    raise TypeError(f"{what} must be a byte count (an int, or a string such as '64K' or '1M'), got "
                    f"{text!r} of type {type(text).__name__}")
  if isinstance(text, (int, np.integer)):
    value = int(text)
  else:
    m = _BYTES.fullmatch(text.strip(" \t\r\n"))
    suffix = m.group(2).upper() if m else None
    value = int(m.group(1)) * _SUFFIXES[suffix] if m and suffix in _SUFFIXES else -1
  if not 0 <= value <= MAX_BYTES:
    raise ValueError(f"{what}={text!r}: expected a byte count such as 1048576, 64K or 1M "
                     f"(0 to 2**63)")
  return value


PROFILE_MIN_BYTES = 1 << 17


def parse_profile_bytes(text, what: str) -> int:
  """parse_bytes for a largest profiling size: stage 1 needs two sizes from 64 KiB, so >= 128K."""
  value = parse_bytes(text, what)
  if value < PROFILE_MIN_BYTES:
    raise ValueError(f"{what}={text!r}: must be at least 128K (two profile sizes)")
  return value


def _env_bytes(name: str, default: int, parse=parse_bytes, expected="a byte count such as 1048576, 64K or 1M") -> int:
  raw = os.environ.get(name)
  if raw is None or not raw.strip():
    return default
  try:
    return parse(raw, name)
  except ValueError:
    ignored(name, raw, expected, _format_bytes(default))
    return default


def _format_bytes(n: int) -> str:
  for shift, unit in ((30, "G"), (20, "M"), (10, "K")):
    if n and n % (1 << shift) == 0:
      return f"{n >> shift}{unit}"
  return str(n)


_DEBUG_LEVELS = {"": 0, "0": 0, "OFF": 0, "WARN": 0, "INFO": 1, "1": 1, "DEBUG": 1}


def _env_debug(name: str) -> int:
  raw = os.environ.get(name, "")
  level = _DEBUG_LEVELS.get(raw.strip().upper())
  if level is None:
    ignored(name, raw, "INFO (or empty, 0 or OFF for no logging)", "(no logging)")
    return 0
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
  faults: str
  link_timeout_s: float | None


def _env_hosts(name: str) -> int:
  raw = os.environ.get(name, "")
  if not raw.strip():
    return 1
  value = int(raw) if re.fullmatch(r"\s*[0-9]+\s*", raw, re.ASCII) else 0
  if value < 1:
    ignored(name, raw, "a number of hosts >= 1", "1")
    return 1
  return value


def from_environment() -> EnvConfig:
  return EnvConfig(
      # The native module _flexlink to load instead of the one next to the package (a path to a
      # _flexlink*.so, e.g. a sanitizer build's; docs/sanitizers.md); empty: the package's own.
      module=os.environ.get("FLEXLINK_MODULE", "").strip(),
      timeout_s=_env_timeout("FLEXLINK_TIMEOUT_S", 300.0),
      replace_collectives=_env_bool("FLEXLINK_REPLACE_COLLECTIVES", False),
      debug_level=_env_debug("FLEXLINK_DEBUG"),
      links=os.environ.get("FLEXLINK_LINKS", "").strip() or "shm",
      tune_cache=os.environ.get("FLEXLINK_TUNE_CACHE", "").strip(),
      # Stage 1 in the engine: on the first call of at least this size (0: only via tune()), ...
      autotune_min_bytes=_env_bytes("FLEXLINK_AUTOTUNE_MIN_BYTES", 1 << 20),
      # ... profiling sizes up to that call's, at most this.
      tune_max_bytes=_env_bytes("FLEXLINK_TUNE_MAX_BYTES", 16 << 20, parse_profile_bytes,
                                "a byte count of at least 128K such as 16M"),
      # Independent collectives of a shard_map body merge into one call up to this many operand
      # bytes (0: never merge).
      combine_bytes=_env_bytes("FLEXLINK_COMBINE_BYTES", 64 << 20),
      # This process's host identity (hosts.py); empty: hostname + boot id. Set it to make processes
      # of one machine count as different hosts.
      host_id=os.environ.get("FLEXLINK_HOST_ID", "").strip(),
      # Testbed: this process's devices play this many hosts (consecutive device ids each), so the
      # hierarchical path runs in one process. 1: every device of a process is on its host.
      emulated_hosts=_env_hosts("FLEXLINK_EMULATED_HOSTS"),
      # Fault injection for tests and drills (docs/faults.md); empty: none.
      faults=os.environ.get("FLEXLINK_FAULTS", "").strip(),
      # Floor of a link's own deadline for its range (docs/faults.md); None: the engine's 10 s.
      link_timeout_s=(_env_timeout("FLEXLINK_LINK_TIMEOUT_S", 10.0)
                      if os.environ.get("FLEXLINK_LINK_TIMEOUT_S", "").strip() else None),
  )


ENV = from_environment()

# `jax.config.update("jax_flexlink_replace_collectives", True)`, `--jax_flexlink_replace_collectives`
# (absl) and JAX_FLEXLINK_REPLACE_COLLECTIVES all set it; FLEXLINK_REPLACE_COLLECTIVES gives its default.
def check_bool(value, what: str) -> bool:
  """True/False (numpy's too); TypeError naming `what` otherwise ('no' must not mean True)."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{what} must be True or False, got {value!r} of type {type(value).__name__}")
  return bool(value)


replace_collectives_option = compat.bool_config_state(
    "jax_flexlink_replace_collectives",
    ENV.replace_collectives,
    help=("Lower jax.lax.psum/pmean/pmax/pmin/all_gather/psum_scatter inside shard_map and pmap "
          "to FlexLink's custom calls instead of XLA's native collectives."),
    validator=lambda value: check_bool(value, "jax_flexlink_replace_collectives"),
)


# Counts configure(links=...) calls that changed an engine's links (0 before any). Every FlexLink
# call carries its engine's link-set version from its lowering and runs on that set (CPU:
# xla_ffi/core/link_set.h; GPU: GpuEngine::GetGroup, and the group across processes set up for it),
# and since this option is part of the jit cache key, jitted and pmapped programs are lowered again
# (and so run on the new links) at their next call. Not for setting by hand.
links_generation_option = compat.int_config_state(
    "jax_flexlink_links_generation",
    0,
    help=("How many times jax_flexlink.configure(links=...) changed the links FlexLink's "
          "collectives are lowered for; set by it, not by hand."),
)
