"""Stage 1 of the balancer from Python: tune() runs the engine's stage 1 (core/executor_profile.cc)
now instead of on the first large call, and load_cached() installs cached fits at configure time.

Fits persist in the tuning cache (FLEXLINK_TUNE_CACHE, default ~/.cache/jax_flexlink/tune.json),
keyed by host, link set and group size, and are reloaded instead of re-profiling.
"""
from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_flexlink import _flexlink
from jax_flexlink._src import api, native
from jax_flexlink._src.config import ENV, check_bool, parse_profile_bytes

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# Calls per collective at most until its model appears. On CPU stage 1 completes inside the first;
# on GPU its phases run on the devices and the times are read by later calls (phase 1, phase 2, then
# the fits: three calls when each call is waited for), in one process or across processes, where the
# leader installs the fits and every other process learns them in the same call (xproc/slot_model.h),
# so every process leaves the loop at the same call.
MAX_TUNE_CALLS = 16


def cache_path() -> str:
  """The file the engine reads and writes (set at import from FLEXLINK_TUNE_CACHE)."""
  return _flexlink.tune_cache_file() or native.tune_cache_path()


def _log(msg: str) -> None:
  if ENV.debug_level >= 1:
    print(f"flexlink: {msg}", file=sys.stderr, flush=True)


def load_cached(ranks: int) -> dict | None:
  """Installs the cached fits for the current links and `ranks`, if there are any. A cache that
  cannot be trusted (corrupt, another machine's, another version's) is a warning, never an error:
  nothing of it is installed, and stage 1 runs as if there were no cache."""
  entry = _flexlink.install_cached(cache_path(), ranks)
  if entry["warning"]:
    warnings.warn(entry["warning"].removeprefix("flexlink: ").replace("ignoring", "jax_flexlink: ignoring", 1),
                  stacklevel=2)
  if entry["fits"] is None:
    return None
  _log(f"stage 1 from cache {cache_path()} ({entry['host']}, {ranks} ranks): {_describe(entry['fits'])}")
  return entry["fits"]


def _describe(fits: dict) -> str:
  names = _flexlink.links()
  parts = []
  for coll, per_link in fits.items():
    links = ", ".join(f"{n} a={a * 1e6:.1f}us bw={1 / b / 1e9 if b > 0 else float('inf'):.3g}GB/s"
                      for n, (a, b) in zip(names, per_link))
    parts.append(f"{coll}: {links}")
  return "; ".join(parts)


def _program(mesh, collective):
  body = {
      "all_reduce": lambda v: api.psum(v, "x"),
      "all_gather": lambda v: api.all_gather(v, "x", tiled=True),
      "reduce_scatter": lambda v: api.psum_scatter(v, "x", tiled=True),
  }[collective]
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))


def module_for(platform: str):
  """The native module whose engine runs the collectives of devices of `platform` (jax's
  Device.platform: "cpu", "gpu" or "cuda")."""
  if platform in ("gpu", "cuda"):
    module = native.cuda_module()
    if module is None:
      raise RuntimeError("tune(): the devices are GPUs, and this build of jax_flexlink has no CUDA module "
                         "(build it with `pip install -e . -C cmake.define.FLEXLINK_CUDA=ON`)")
    return module
  if platform != "cpu":
    raise ValueError(f"tune(): FlexLink runs on cpu and cuda devices, not {platform!r}")
  return _flexlink


def _run_until_fitted(module, run_once, ids, collective) -> int:
  """Runs the collective (waiting for each call) until the group's model has it, at most
  MAX_TUNE_CALLS times; the calls it took."""
  for calls in range(1, MAX_TUNE_CALLS + 1):
    run_once()
    model = module.group_fits(ids)
    if model is not None and collective in model["fits"]:
      return calls
  return MAX_TUNE_CALLS  # stage 1 failed (the engine warned why): the result lacks the collective


def _per_device_elements(collective, size, n, itemsize):
  """Elements each device contributes for a call of nccl-tests size `size` (the plans' bucket)."""
  if collective == "all_gather":
    return max(1, size // (n * itemsize))
  elems = max(1, size // itemsize)
  return -(-elems // n) * n if collective == "reduce_scatter" else elems


def _check_collectives(collectives) -> tuple:
  """tune(collectives=...): one name or a sequence of them, each one that stage 1 profiles."""
  if isinstance(collectives, str):
    collectives = (collectives,)
  try:
    names = tuple(collectives)
  except TypeError:
    raise TypeError(f"tune(): collectives must be a name or a sequence of names from {COLLECTIVES}, "
                    f"got {collectives!r}") from None
  for name in names:
    if name not in COLLECTIVES:
      raise ValueError(f"tune(): unknown collective {name!r}; stage 1 profiles {', '.join(COLLECTIVES)}")
  if not names:
    raise ValueError(f"tune(): collectives is empty; give some of {', '.join(COLLECTIVES)}")
  return names


def _check_devices(devices) -> list:
  """tune(devices=...): distinct jax devices (default all of them)."""
  if devices is None:
    return list(jax.devices())
  try:
    devices = list(devices)
  except TypeError:
    raise TypeError(f"tune(): devices must be a sequence of jax devices, got {devices!r}") from None
  for d in devices:
    if not isinstance(d, jax.Device):
      raise TypeError(f"tune(): devices must be jax devices (e.g. jax.devices()[:4]), got {d!r} of type "
                      f"{type(d).__name__}")
  if not devices:
    raise ValueError("tune(): devices is empty; give the devices of the group to tune (default: all)")
  if len({d.id for d in devices}) != len(devices):
    raise ValueError(f"tune(): devices {[d.id for d in devices]} name a device twice")
  return devices


def tune(*, collectives=COLLECTIVES, max_bytes: int | str = 16 << 20, devices=None,
         use_cache: bool = True) -> dict:
  """Stage 1 now, for the group of `devices` (default: all local devices, in order).

  The same stage 1 the engine runs on a group's first large call: every link profiled alone at
  powers of two from 64 KiB to `max_bytes`, α–β fits, the fitted split timed against the best link
  alone (which decides the size from which calls are split), stored in the tuning cache. With
  `use_cache`, a cached entry for this host, link set and group size is installed instead (one
  this machine and engine made: anything else in the cache is ignored with a warning).
  A group spanning processes (every process calls tune() with the same devices, as it would call the
  collective) runs stage 1 across processes (docs/xproc.md) and returns the same fits in every
  process; its tuning cache entry is its own (the key counts the processes), read and written by
  the leader's process (the one with the group's first device), whose fits reach the others with
  the calls.

  collectives: one or more of all_reduce, all_gather, reduce_scatter; devices: distinct jax devices;
  max_bytes: a byte count of at least 128K; use_cache: a bool. Anything else is a TypeError or
  ValueError before anything runs (docs/errors.md).

  Returns {"fits": {collective: [(alpha_s, beta_s_per_byte) per link, in link order]},
  "split_min_bytes": {collective: bytes}} (2**64 - 1: never split); {} with a single link.
  """
  collectives = _check_collectives(collectives)
  devices = _check_devices(devices)
  top = parse_profile_bytes(max_bytes, "max_bytes")
  use_cache = check_bool(use_cache, "use_cache")
  n = len(devices)
  platforms = {d.platform for d in devices}
  if len(platforms) != 1:
    raise ValueError(f"tune(): the devices are of several platforms ({sorted(platforms)}); a group is of one")
  module = module_for(platforms.pop())
  names = list(module.links())
  if len(names) < 2 or n < 2:
    return {}
  ids = [d.id for d in devices]
  mesh = Mesh(np.array(devices), ("x",))
  saved = (module.autotune_min_bytes(), module.tune_max_bytes(), module.tune_use_cache())
  try:
    module.set_autotune_min_bytes(1)  # this call is "large", whatever the configured size
    module.set_tune_max_bytes(top)
    module.set_tune_use_cache(bool(use_cache))
    for collective in collectives:
      module.forget_model(collective)
      elems = _per_device_elements(collective, top, n, 4)
      x = jax.device_put(jnp.zeros((n * elems,), jnp.float32), NamedSharding(mesh, P("x")))
      program = _program(mesh, collective)
      _run_until_fitted(module, lambda: program(x).block_until_ready(), ids, collective)
  finally:
    module.set_autotune_min_bytes(saved[0])
    module.set_tune_max_bytes(saved[1])
    module.set_tune_use_cache(saved[2])
  model = module.group_fits(ids)
  if model is None:  # cannot happen: the calls above made the group
    raise RuntimeError("flexlink: tune(): the group was not created")
  return {"fits": {c: model["fits"][c] for c in collectives if c in model["fits"]},
          "split_min_bytes": {c: model["split_min_bytes"][c] for c in collectives
                              if c in model["split_min_bytes"]}}
