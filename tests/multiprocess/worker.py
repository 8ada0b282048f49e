"""One process of a multi-process FlexLink check (started by `python -m jax_flexlink.launch`, or by
the test itself where it must outlive a dead peer).

Every collective over a mesh of all processes' devices, FlexLink against jax.lax (gloo), on groups
inside one process and across processes. Prints one line per check and exits non-zero on the first
mismatch. Modes (argv[1]): `collectives` (the checks), `kill` (process 1 dies at a collective, the
others must fail naming it), `plan` (repeated calls: every rank's result identical, stats agree),
`stage1` (FLEXLINK_LINKS="shm;tcp": stage 1 across processes, in the engine and by tune()),
`multilink` (run with FLEXLINK_LINKS="shm;tcp": every kind against lax while cross-process calls are
split across the segment and the tcp ring, then converging calls; prints this process's split records
of the cross-process group, its xproc_groups() entry and, on process 0, the group's plans),
`reconfigure` (links changed between calls again and again: results right, threads flat).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax_flexlink.launch

jax_flexlink.launch.initialize()  # jax.distributed from the launcher's (or the test's) variables
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
import jax_flexlink as flx  # noqa: E402

ME = jax.process_index()
NPROC = jax.process_count()
DEVICES = jax.devices()
N = len(DEVICES)
K = len(jax.local_devices())


def say(*args):
  print(*args, flush=True)


def global_array(mesh, spec, host):
  return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])


def local_values(arr):
  """This process's shards, in device order, as numpy."""
  return [np.asarray(s.data) for s in sorted(arr.addressable_shards, key=lambda s: s.device.id)]


def data(shape, dtype, seed):
  rng = np.random.default_rng(seed)
  if np.issubdtype(dtype, np.integer):
    return rng.integers(-100, 100, size=shape).astype(dtype)
  if dtype == np.bool_:
    return rng.integers(0, 2, size=shape).astype(bool)
  return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def compare(name, mesh, spec_in, spec_out, body_flx, body_lax, host):
  x = global_array(mesh, spec_in, host)
  kw = dict(mesh=mesh, in_specs=spec_in, out_specs=spec_out, check_vma=False)
  got = local_values(jax.jit(jax.shard_map(body_flx, **kw))(x))
  want = local_values(jax.jit(jax.shard_map(body_lax, **kw))(x))
  for g, w in zip(got, want):
    if g.shape != w.shape or g.dtype != w.dtype:
      raise AssertionError(f"{name}: got {g.dtype}{g.shape}, lax gives {w.dtype}{w.shape}")
    exact = np.issubdtype(w.dtype, np.integer) or w.dtype == np.bool_
    ok = np.array_equal(g, w) if exact else np.allclose(
        g.astype(np.float64), w.astype(np.float64), rtol=2e-2 if w.dtype.itemsize == 2 else 1e-5,
        atol=1e-2 if w.dtype.itemsize == 2 else 1e-5)
    if not ok:
      raise AssertionError(f"{name}: FlexLink's result differs from lax's")
  say(f"ok {name}")


def collectives():
  meshes = {"x": Mesh(np.array(DEVICES), ("x",))}
  if K > 1:  # 'p' crosses processes, 'd' stays inside one; and the transposed layout
    grid = np.array(DEVICES).reshape(NPROC, K)
    meshes["pd"] = Mesh(grid, ("p", "d"))
    meshes["dp"] = Mesh(grid.T, ("d", "p"))
  checks = 0
  for mesh_name, mesh in meshes.items():
    # Every dtype over the whole job; on the 2-D meshes (groups inside one process, across
    # processes, and both), one float and one integer type: the in-process groups are the main
    # suite's, and the kernels are the same whatever crosses processes.
    for axes in ([mesh.axis_names] if mesh_name == "x" else [("p",), ("d",), mesh.axis_names]):
      size = int(np.prod([mesh.shape[a] for a in axes]))
      rows = N * size
      spec = P(mesh.axis_names)  # every device its own rows
      dtypes = (np.float32, jnp.bfloat16, np.int32, np.int8) if mesh_name == "x" else (np.float32, np.int32)
      for dtype in dtypes:
        host = data((rows, 24), dtype, seed=checks)
        tag = f"{mesh_name}/{','.join(axes)}/{np.dtype(dtype).name}"
        for op in ("psum", "pmax", "pmin"):
          f = getattr(flx, op)
          lx = getattr(jax.lax, op)
          compare(f"{op} {tag}", mesh, spec, spec, lambda v: f(v, axes), lambda v: lx(v, axes), host)
          checks += 1
        compare(f"pmean {tag}", mesh, spec, spec, lambda v: flx.pmean(v.astype(jnp.float32), axes),
                lambda v: jax.lax.pmean(v.astype(jnp.float32), axes), host)
        for tiled in (False, True):
          for axis in (0, 1):
            compare(f"all_gather axis={axis} tiled={tiled} {tag}", mesh, spec, spec,
                    lambda v: flx.all_gather(v, axes, axis=axis, tiled=tiled),
                    lambda v: jax.lax.all_gather(v, axes, axis=axis, tiled=tiled), host)
          compare(f"psum_scatter tiled={tiled} {tag}", mesh, spec, spec,
                  lambda v: flx.psum_scatter(v, axes, scatter_dimension=0, tiled=tiled),
                  lambda v: jax.lax.psum_scatter(v, axes, scatter_dimension=0, tiled=tiled), host)
          checks += 3
        perm = [(i, (i + 1) % size) for i in range(size)]
        compare(f"ppermute ring {tag}", mesh, spec, spec, lambda v: flx.ppermute(v, axes, perm),
                lambda v: jax.lax.ppermute(v, axes, perm), host)
        partial = [(0, size - 1)]
        compare(f"ppermute 0->{size - 1} {tag}", mesh, spec, spec,
                lambda v: flx.ppermute(v, axes, partial), lambda v: jax.lax.ppermute(v, axes, partial),
                host)
        compare(f"all_to_all {tag}", mesh, spec, spec,
                lambda v: flx.all_to_all(v, axes, 0, 0, tiled=True),
                lambda v: jax.lax.all_to_all(v, axes, 0, 0, tiled=True), host)
        checks += 5
  # A pytree of mixed dtypes is one call; a large operand runs in several slot steps.
  mesh = meshes["x"]
  tree = {"a": data((N * 3, 1000), np.float32, 1), "b": data((N * 5,), np.int32, 2),
          "c": data((N * 2, 7), jnp.bfloat16, 3)}
  xs = {k: global_array(mesh, P("x"), v) for k, v in tree.items()}
  kw = dict(mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
  got = jax.jit(jax.shard_map(lambda t: flx.psum(t, "x"), **kw))(xs)
  want = jax.jit(jax.shard_map(lambda t: jax.lax.psum(t, "x"), **kw))(xs)
  for k in tree:
    for g, w in zip(local_values(got[k]), local_values(want[k])):
      assert np.allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=2e-2), k
  say("ok pytree psum")
  big = data((N * 1024, 2048), np.float32, 4)  # 8 MiB per device: several steps of a 4 MiB slot
  compare("psum 8 MiB per device", mesh, P("x"), P("x"), lambda v: flx.psum(v, "x"),
          lambda v: jax.lax.psum(v, "x"), big)
  compare("all_gather 8 MiB per device", mesh, P("x"), P("x"), lambda v: flx.all_gather(v, "x", tiled=True),
          lambda v: jax.lax.all_gather(v, "x", tiled=True), big[: N * 128])
  # 1 MiB per device: read straight from the peers (direct all_gather), also into strided rows.
  compare("all_gather axis=1 1 MiB per device", mesh, P("x"), P("x"),
          lambda v: flx.all_gather(v, "x", axis=1, tiled=True),
          lambda v: jax.lax.all_gather(v, "x", axis=1, tiled=True), big[: N * 128])
  checks += 4
  groups = flx._src.processes.groups() if hasattr(flx, "_src") else []
  whole = [g for g in groups if list(g["devices"]) == [d.id for d in DEVICES]]
  say("DIRECT " + json.dumps([[g.get("direct_all_gather_from_bytes"), g.get("direct_all_gather_refusal"),
                               g.get("direct_all_reduce_from_bytes"), g.get("direct_all_reduce_refusal")]
                              for g in whole]))
  say(f"ALL OK {checks} checks; cross-process groups set up here: {len(groups)}")


def _expect_failure(f, x, missing: str):
  """Runs the call that must fail, reports its error and how long it took, and exits (3: failed as
  it should, 4: it completed without `missing`)."""
  start = time.monotonic()
  try:
    f(x).block_until_ready()
  except Exception as e:  # noqa: BLE001 - the error is what these modes check
    say(f"FAILED after {time.monotonic() - start:.2f} s: {e}")
    sys.stdout.flush()
    os._exit(3)
  say(f"UNEXPECTED: the collective completed without {missing}")
  os._exit(4)


def kill():
  mesh = Mesh(np.array(DEVICES), ("x",))
  f = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  x = global_array(mesh, P("x"), np.ones((N, 1024), np.float32))
  f(x).block_until_ready()  # the group works, and its segment is already unlinked
  say("warm")
  if ME == NPROC - 1:
    os.kill(os.getpid(), signal.SIGKILL)
  _expect_failure(f, x, "the killed process")


def absent():
  """FLEXLINK_FAULTS="rank:absent@rank=R,at_call=2": rank R's process stays away from the second call;
  every process reports the error it got."""
  mesh = Mesh(np.array(DEVICES), ("x",))
  f = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  x = global_array(mesh, P("x"), np.ones((N, 1024), np.float32))
  f(x).block_until_ready()
  say("warm")
  _expect_failure(f, x, "the absent rank")


def plan():
  mesh = Mesh(np.array(DEVICES), ("x",))
  f = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  x = global_array(mesh, P("x"), data((N * 256, 1024), np.float32, 7))
  first = local_values(f(x))
  for _ in range(20):
    again = local_values(f(x))
    assert all(np.array_equal(a, b) for a, b in zip(first, again)), "results changed between calls"
  say(f"ALL OK plan: 21 identical calls; checksum {float(np.sum(first[0], dtype=np.float64)):.6f}")


def multilink():
  from jax_flexlink import _flexlink  # noqa: PLC0415 - the split records and groups
  _flexlink.set_record_splits(True)
  mesh = Mesh(np.array(DEVICES), ("x",))
  spec = P("x")
  checks = 0
  for dtype in (np.float32, jnp.bfloat16, np.int32):
    host = data((N * 64, 130), dtype, seed=10 + checks)
    tag = np.dtype(dtype).name
    for op in ("psum", "pmax"):
      f, lx = getattr(flx, op), getattr(jax.lax, op)
      compare(f"{op} {tag}", mesh, spec, spec, lambda v: f(v, "x"), lambda v: lx(v, "x"), host)
    compare(f"all_gather {tag}", mesh, spec, spec, lambda v: flx.all_gather(v, "x", tiled=True),
            lambda v: jax.lax.all_gather(v, "x", tiled=True), host)
    compare(f"psum_scatter {tag}", mesh, spec, spec,
            lambda v: flx.psum_scatter(v, "x", scatter_dimension=0, tiled=True),
            lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True), host)
    perm = [(i, (i + 1) % N) for i in range(N)]
    compare(f"ppermute {tag}", mesh, spec, spec, lambda v: flx.ppermute(v, "x", perm),
            lambda v: jax.lax.ppermute(v, "x", perm), host)
    compare(f"all_to_all {tag}", mesh, spec, spec, lambda v: flx.all_to_all(v, "x", 0, 0, tiled=True),
            lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True), host)
    checks += 6
  # Converging calls: stage 2 moves the split; every rank must cut the same ranges at every call.
  f = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=mesh, in_specs=spec, out_specs=spec))
  x = global_array(mesh, spec, data((N * 256, 1024), np.float32, 7))
  for _ in range(30):
    f(x).block_until_ready()
  group = "[" + ", ".join(str(d.id) for d in DEVICES) + "]"
  records = [r for r in _flexlink.take_split_records() if r["group"] == group]
  splits = {}
  for r in records:
    splits.setdefault(str(r["call"]), {})[str(r["rank"])] = [list(p) for p in r["ranges"]]
  say("SPLITS " + json.dumps(splits))
  ids = [d.id for d in DEVICES]
  mine = [g for g in _flexlink.xproc_groups() if list(g["devices"]) == ids]
  say("GROUPS " + json.dumps([{k: g[k] for k in ("links", "left_out", "refused_connections", "calls")}
                              for g in mine]))
  if ME == 0:
    plans = [p for p in flx.stats()["plans"] if list(p.get("group", [])) == ids]
    say(f"PLANS {len(plans)} " + json.dumps(plans, default=str)[:2000])
  say(f"ALL OK multilink {checks} checks")


def reconfigure():
  """Links changed again and again between calls (shm;tcp, then shm), a call of the earlier links
  left queued at each change: every result right, and this process's part of the cross-process
  group's earlier link sets released each time (their tcp workers' threads), so the threads stay
  flat. Prints the threads after the second round and at the end, and the last release's counts."""
  from jax_flexlink import _flexlink  # noqa: PLC0415
  mesh = Mesh(np.array(DEVICES), ("x",))
  spec = P("x")
  f = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=mesh, in_specs=spec, out_specs=spec))
  x = global_array(mesh, spec, data((N * 64, 1024), np.int32, 5))
  want = np.asarray(jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=spec,
                                          out_specs=spec))(x).addressable_shards[0].data)
  threads = lambda: len(os.listdir("/proc/self/task"))
  early = None
  for i in range(10):
    for links in ("shm;tcp", "shm"):
      flx.configure(links=links)
      queued = f(x)  # left queued across the next change
      flx.configure(links="shm" if links == "shm;tcp" else "shm;tcp")
      got = np.asarray(queued.addressable_shards[0].data)
      assert np.array_equal(got, want), (i, links)
      flx.configure(links=links)
      got = np.asarray(f(x).addressable_shards[0].data)
      assert np.array_equal(got, want), (i, links)
    if i == 1:
      early = threads()
  say(f"THREADS {early} {threads()}")
  say("RELEASE " + json.dumps(_flexlink.release_earlier_groups()))
  say("ALL OK reconfigure")


def stage1():
  """FLEXLINK_LINKS="shm;tcp": stage 1 across processes. The first large psum profiles both links in
  every process inside the call; then jax_flexlink.tune() of all_gather does it on purpose. Prints
  this process's view of the group's fits (every process computed the same), the results' check and,
  on process 0, the leader's plans."""
  from jax_flexlink import _flexlink  # noqa: PLC0415
  mesh = Mesh(np.array(DEVICES), ("x",))
  host = data((N * 256, 1024), np.int32, 5)  # 1 MiB per device: the autotune size
  x = global_array(mesh, P("x"), host)
  f = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  want = host.reshape(N, 256, 1024).sum(0, dtype=np.int32)
  for _ in range(3):
    for shard in local_values(f(x)):
      assert np.array_equal(shard, want)
  ids = [d.id for d in DEVICES]
  say("FITS " + json.dumps(_flexlink.group_fits(ids), sort_keys=True))
  tuned = flx.tune(collectives="all_gather", devices=DEVICES, max_bytes="1M", use_cache=False)
  say("TUNED " + json.dumps(tuned, sort_keys=True))
  g = jax.jit(jax.shard_map(lambda v: flx.all_gather(v, "x", tiled=True), mesh=mesh, in_specs=P("x"),
                            out_specs=P("x")))
  for shard in local_values(g(x)):  # every device's block is the whole gathered array
    assert np.array_equal(shard, host), "all_gather after tune()"
  if ME == 0:
    plans = [p for p in flx.stats()["plans"] if list(p.get("group", [])) == ids]
    say("PLANS " + json.dumps(plans, default=str)[:3000])
  say("ALL OK stage1 3 checks")


def linkfault():
  """FLEXLINK_LINKS="shm;tcp" and FLEXLINK_FAULTS naming one of them: the cross-process calls, split
  50/50, fail over to the other link and stay exact; prints this process's failover count and the
  group's health."""
  from jax_flexlink import _flexlink  # noqa: PLC0415
  mesh = Mesh(np.array(DEVICES), ("x",))
  host = data((N * 256, 1024), np.int32, 3)
  x = global_array(mesh, P("x"), host)
  f = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  want = host.reshape(N, 256, 1024).sum(0, dtype=np.int32)
  _flexlink.set_shares("all_reduce", 1 << 20, [0.5, 0.5], True)
  for call in range(5):
    got = local_values(f(x))
    assert all(np.array_equal(g, want) for g in got), f"call {call + 1}: not the exact sum"
  s = flx.stats()
  group = "[" + ", ".join(str(d.id) for d in DEVICES) + "]"
  health = {h["link"]: h["state"] for h in s["health"] if h["group"] == group}
  say("FAILOVERS " + json.dumps({"count": s["failovers"]["count"], "health": health,
                                 "to": [r["to"] for r in s["failovers"]["recent"]]}))
  say("ALL OK linkfault: 5 exact calls")


def nocarrier():
  """FLEXLINK_LINKS="shm;tcp", FLEXLINK_FAULTS failing tcp's range and then its re-run on shm: the
  second call fails in every process with 'no link could carry', naming each link's report; the
  third (faults spent) is exact again: the group stays usable."""
  from jax_flexlink import _flexlink  # noqa: PLC0415
  mesh = Mesh(np.array(DEVICES), ("x",))
  host = data((N * 256, 1024), np.int32, 5)
  x = global_array(mesh, P("x"), host)
  f = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  want = host.reshape(N, 256, 1024).sum(0, dtype=np.int32)
  _flexlink.set_shares("all_reduce", 1 << 20, [0.5, 0.5], True)
  assert all(np.array_equal(g, want) for g in local_values(f(x))), "call 1: not the exact sum"
  try:
    f(x).block_until_ready()
    say("UNEXPECTED: call 2 completed with no link left")
    os._exit(4)
  except Exception as e:  # noqa: BLE001 - the error is what this mode checks
    say(f"NOCARRIER {e}")
  assert all(np.array_equal(g, want) for g in local_values(f(x))), "call 3: not the exact sum"
  say("ALL OK nocarrier: the failed call named every link, the next one exact")


if __name__ == "__main__":
  {"collectives": collectives, "kill": kill, "absent": absent, "linkfault": linkfault, "nocarrier": nocarrier, "plan": plan, "multilink": multilink, "stage1": stage1,
   "reconfigure": reconfigure}[sys.argv[1]]()
