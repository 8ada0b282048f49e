"""`python -m jax_flexlink.diagnose [--json] [--run]`: FlexLink's diagnosis report (docs/diagnose.md).

A fresh process has run no collectives, so by default the report is the configuration (links,
timeouts, fault injection, the tuning cache and whether its entries match this machine); live
statistics come from calling jax_flexlink.diagnose() inside the job. `--run` first runs a short
self-check (psum and all_gather on the host devices, 8 of them unless XLA_FLAGS says otherwise, each
result checked; no stage-1 profiling, so nothing is written to the tuning cache) and reports on that.

This module is also `jax_flexlink.diagnose` once imported as a submodule, which shadows the function
of that name on the package; it is made callable so that `jax_flexlink.diagnose()` works either way.
"""
from __future__ import annotations

import argparse
import os
import sys
import types

PROG = "python -m jax_flexlink.diagnose"
SELF_CHECK_DEVICES = 8


def _host_devices_flag() -> None:
  # Must precede jax's backend start (it does not start before the first device query).
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={SELF_CHECK_DEVICES}".strip()


def self_check(calls: int = 8) -> list[str]:
  """psum and all_gather on the CPU devices, small and 1 MiB per device; returns problems found."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: PLC0415

  import jax_flexlink as flx  # noqa: PLC0415

  # No stage 1 here: it would profile for seconds and write the tuning cache. Without fits the
  # plans give every link an equal share, so every link carries bytes (fits already in the cache
  # for this host and link set are still loaded and used).
  flx.configure(autotune_min_bytes=0)
  devices = jax.devices("cpu")
  if len(devices) < 2:
    return [f"self-check needs at least 2 CPU devices, this process has {len(devices)} (XLA_FLAGS="
            f"{os.environ.get('XLA_FLAGS', '')!r})"]
  n = len(devices)
  mesh = Mesh(np.array(devices), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  psum = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  gather = jax.jit(jax.shard_map(lambda v: flx.all_gather(v, "x", tiled=True), mesh=mesh, in_specs=P("x"),
                                 out_specs=P("x")))
  problems = []
  for per_device in (1024, 256 * 1024):  # float32 elements: 4 KiB and 1 MiB per device
    x = np.arange(n * per_device, dtype=np.float32).reshape(n, per_device) % 97
    xs = jax.device_put(x.reshape(-1), sharding)
    want_sum = np.tile(x.sum(axis=0), n)
    want_gather = np.tile(x.reshape(-1), n)
    for _ in range(calls):
      got = np.asarray(psum(xs))
      if not np.array_equal(got, want_sum):
        problems.append(f"self-check: psum of {per_device * 4} bytes per device gave a wrong result")
        break
      got = np.asarray(gather(xs))
      if not np.array_equal(got, want_gather):
        problems.append(f"self-check: all_gather of {per_device * 4} bytes per device gave a wrong result")
        break
  return problems


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", action="store_true", help="the report as JSON")
  parser.add_argument("--run", action="store_true",
                      help="run a short self-check workload (psum, all_gather on the host devices) first")
  args = parser.parse_args(argv)
  if args.run:
    _host_devices_flag()
  from jax_flexlink._src import diagnose as impl  # noqa: PLC0415

  problems = []
  if args.run:
    try:
      problems = self_check()
    except Exception as e:  # noqa: BLE001 - the failure is the finding
      problems = [f"self-check failed: {type(e).__name__}: {e}"]
  report = impl.diagnose()
  report.findings[:0] = problems
  if args.run and not problems:
    report.notes.append("self-check: psum and all_gather results were exact")
  print(report.to_json() if args.json else str(report))
  return 1 if problems else 0


class _CallableModule(types.ModuleType):
  def __call__(self, *args, **kwargs):
    from jax_flexlink._src.diagnose import diagnose  # noqa: PLC0415
    return diagnose(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
  sys.exit(main())
