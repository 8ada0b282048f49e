"""One process of a job whose processes play several hosts (FLEXLINK_HOST_ID per process).

A collective over every device runs hierarchically: FlexLink inside each host — a group spanning
the host's processes, on their shared segment — and XLA's collective (gloo) across hosts. Checks
the results against lax and that the in-host legs really are cross-process FlexLink groups.
"""
from __future__ import annotations

import sys

import jax_flexlink.launch

jax_flexlink.launch.initialize()  # jax.distributed from the launcher's variables
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
import jax_flexlink as flx  # noqa: E402
from jax_flexlink._src import processes  # noqa: E402

DEVICES = jax.devices()
N = len(DEVICES)


def local(arr):
  return [np.asarray(s.data) for s in sorted(arr.addressable_shards, key=lambda s: s.device.id)]


def main():
  mesh = Mesh(np.array(DEVICES), ("x",))
  checks = 0
  for dtype in (np.float32, np.int32, jnp.bfloat16):
    host = (np.arange(N * N * 6) % 97 - 40).reshape(N * N, 6).astype(dtype)
    x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")), lambda i: host[i])
    kw = dict(mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    for name, f, g in [
        ("psum", lambda v: flx.psum(v, "x"), lambda v: jax.lax.psum(v, "x")),
        ("pmax", lambda v: flx.pmax(v, "x"), lambda v: jax.lax.pmax(v, "x")),
        ("all_gather", lambda v: flx.all_gather(v, "x", tiled=True),
         lambda v: jax.lax.all_gather(v, "x", tiled=True)),
        ("psum_scatter", lambda v: flx.psum_scatter(v, "x", tiled=True),
         lambda v: jax.lax.psum_scatter(v, "x", tiled=True)),
    ]:
      got = local(jax.jit(jax.shard_map(f, **kw))(x))
      want = local(jax.jit(jax.shard_map(g, **kw))(x))
      for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-2), (name, dtype)
      print(f"ok {name} {np.dtype(dtype).name}", flush=True)
      checks += 1
  groups = processes.groups()
  in_host = sorted({tuple(g["devices"]) for g in groups})
  print(f"ALL OK {checks} checks; in-host cross-process groups: {in_host}", flush=True)


if __name__ == "__main__":
  main()
  sys.exit(0)
