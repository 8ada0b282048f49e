"""Stage 1 of the balancer: profile each link alone, fit latency and bandwidth, seed the split.

Each link is timed alone (its share pinned to 100%) on real collective calls at power-of-two sizes;
a least-squares α–β fit per (collective, link) gives predicted times, from which the balancer takes
the split that makes the links finish together, and the size below which one link beats any split.
Fits persist in the tuning cache (FLEXLINK_TUNE_CACHE, default ~/.cache/jax_flexlink/tune.json),
keyed by host, link set and group size, and are reloaded instead of re-profiling.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_flexlink import _flexlink
from jax_flexlink._src import api, native
from jax_flexlink._src.config import ENV

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def cache_path() -> str:
  return native.tune_cache_path()


def _log(msg: str) -> None:
  if ENV.debug_level >= 1:
    print(f"flexlink: {msg}", file=sys.stderr, flush=True)


def load_cached(ranks: int) -> dict | None:
  """Installs the cached fits for the current links and `ranks`, if there are any."""
  entry = _flexlink.install_cached(cache_path(), ranks)
  if entry["warning"]:
    _log(f"tuning cache {cache_path()}: {entry['warning']}")
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


def _per_device_elements(collective, size, n, itemsize):
  """Elements each device contributes for a call of nccl-tests size `size` (the plans' bucket)."""
  if collective == "all_gather":
    return max(1, size // (n * itemsize))
  elems = max(1, size // itemsize)
  return -(-elems // n) * n if collective == "reduce_scatter" else elems


def tune(*, collectives=COLLECTIVES, min_bytes: int = 1 << 16, max_bytes: int = 1 << 24,
         iters: int = 3, devices=None, use_cache: bool = True, store: bool = True) -> dict:
  """Stage 1: profiles every configured link alone and installs the fitted split.

  Returns {collective: [(alpha_s, beta_s_per_byte) per link, in link order]}. With `use_cache`, a
  cached entry for this host, link set and group size is installed instead of profiling.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if use_cache:
    cached = load_cached(n)
    if cached is not None and set(collectives) <= set(cached):
      return cached
  names = list(_flexlink.links())
  mesh = Mesh(np.array(devices), ("x",))
  sizes = [1 << k for k in range(max(int(min_bytes).bit_length() - 1, 0),
                                 int(max_bytes).bit_length())]
  fits = {}
  try:
    for collective in collectives:
      f = _program(mesh, collective)
      samples = [[] for _ in names]
      for size in sizes:
        elems = _per_device_elements(collective, size, n, 4)
        x = jax.device_put(jnp.ones((n * elems,), jnp.float32), NamedSharding(mesh, P("x")))
        message = elems * 4 * (n if collective == "all_gather" else 1)
        bucket = 1 << (message.bit_length() - 1)
        for i, name in enumerate(names):
          _flexlink.set_shares(collective, bucket, [float(j == i) for j in range(len(names))], True)
          f(x).block_until_ready()  # compile, warm the link
          before = _flexlink.stats()["links"][name]
          for _ in range(iters):
            f(x).block_until_ready()
          after = _flexlink.stats()["links"][name]
          calls = after["calls"] - before["calls"]
          if calls:
            samples[i].append((float(message), (after["seconds"] - before["seconds"]) / calls))
      fits[collective] = [_flexlink.fit_alpha_beta(s) for s in samples]
  finally:
    _flexlink.clear_plans()  # the pins go; stage 2 starts from the model below
  _flexlink.install_model(fits)
  _log(f"stage 1 profiled {n} ranks, {sizes[0]}..{sizes[-1]} B: {_describe(fits)}")
  for collective in fits:
    _log(f"{collective}: split from {_flexlink.split_threshold_bytes(collective)} B per call")
  if store:
    warning = _flexlink.store_tuning(cache_path(), n, fits, sizes[-1])
    if warning:
      _log(f"tuning cache {cache_path()}: {warning}")
  return fits
