"""The fault × link table of docs/faults.md: for each fault kind injected into each link, the outcome
(exact after failover, or the error) and the faulted call's time against a clean call's.

  python benchmarks/fault_table.py [--mib 4] [--repeats 5]

8 host devices, an f32 psum of `--mib` MiB per device, links "shm;tcp" (shm and tcp rows) and
"shm;emulated:pcie@gbps=2" (emulated row), shares pinned 50/50 so every call splits. A clean call's
time is the median of `--repeats` calls; a faulted call is the one call the fault hits (each fault
fires at the link's 2nd call after injection; `sticky` and `slow` keep firing, the next call's time
is shown too). Not a test: it asserts exactness only.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("FLEXLINK_AUTOTUNE_MIN_BYTES", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_flexlink as flx  # noqa: E402
from jax_flexlink import _flexlink  # noqa: E402

LINKS = {"shm": ("shm", "shm;tcp"), "tcp": ("tcp", "shm;tcp"), "emulated": ("pcie", "shm;emulated:pcie@gbps=2")}
FAULTS = {"error": "{l}:error@at_call=2", "sticky error": "{l}:error@at_call=2,sticky=1",
          "hang": "{l}:hang@at_call=2", "slow x4": "{l}:slow@factor=4,from_call=2"}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=float, default=4)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--link-timeout", type=float, default=0.5)
  args = ap.parse_args()
  n = len(jax.devices())
  mesh = Mesh(np.array(jax.devices()), ("x",))
  count = int(args.mib * (1 << 20)) // 4
  x = jax.device_put(np.random.default_rng(0).standard_normal(n * count).astype(np.float32),
                     NamedSharding(mesh, P("x")))
  fns = {m: jax.jit(jax.shard_map(lambda v, m=m: m.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                                  out_specs=P("x"), check_vma=False)) for m in (lax, flx)}
  want = np.asarray(fns[lax](x))
  f = fns[flx]
  flx.configure(timeout_s=10, link_timeout_s=args.link_timeout)
  bucket = 1 << (count * 4).bit_length() - 1

  def call():
    t = time.perf_counter()
    got = np.asarray(f(x))
    dt = time.perf_counter() - t
    # Failover re-runs a range on another link: the same reduction order per element within a link,
    # but links may order differently, so compare to lax within float tolerance, and exactly to the
    # clean FlexLink result.
    return got, dt

  print(f"| fault | link | outcome | clean call (ms) | faulted call (ms) | next call (ms) |")
  print("| --- | --- | --- | --- | --- | --- |")
  for fault, spec in FAULTS.items():
    for which, (link, links) in LINKS.items():
      flx.inject_faults("")
      flx.configure(links=links)
      _flexlink.set_shares("all_reduce", bucket, [0.5, 0.5], True)
      flx.reset_stats()
      clean_out, _ = call()
      clean = statistics.median(call()[1] for _ in range(args.repeats))
      flx.inject_faults(spec.format(l=link))
      call()  # the link's first call after injection
      outcome = "exact after failover"
      try:
        got, faulted = call()
        _, following = call()
        if not np.array_equal(got, clean_out):
          outcome = "WRONG"
        s = flx.stats()
        h = [h for h in s["health"] if h["link"] == link][0]
        outcome += f" ({s['failovers']['count']} failover(s), {h['state']})"
        if fault.startswith("slow"):
          outcome = f"exact, no failover ({h['state']})"
      except Exception as e:  # noqa: BLE001 - the outcome is the point
        faulted = following = float("nan")
        outcome = "error: " + str(e)[:120]
      np.testing.assert_allclose(clean_out, want, rtol=1e-4, atol=1e-3)
      print(f"| {fault} | {which} | {outcome} | {clean * 1e3:.1f} | {faulted * 1e3:.1f} | {following * 1e3:.1f} |")
  flx.inject_faults("")


if __name__ == "__main__":
  main()
