"""One process of a job checking FlexLink's GPU groups across processes (started by
`python -m jax_flexlink.launch -n N ...`; tests/test_launch.py and benchmarks/gpu_check.sh run it).

Modes (argv[1]):
  --shared    every process on GPU 0 (`local_device_ids=[0]`): the job has N jax devices on one GPU,
              and a group of all of them runs on the pcie link across processes
              (xla_ffi/cuda/pcie_xproc.*: staging through the shared segment registered with
              cudaHostRegister, the devices ordered by stream memory operations on its flags). NCCL
              puts at most one rank of a communicator on a GPU, so neither nccl nor XLA's own
              collectives can run there. What a machine with one GPU can check.
  --reversed  rank i on GPU N-1-i (N GPUs or more), links nccl;pcie: every process runs its GPU under
              a CUDA ordinal that is not its jax id (rank 0's GPU N-1 is jax's device 0), so a wrong
              ordinal -> id map (docs/cuda.md, "Device ids") fails the job.
  --cpu       one host device per process, FlexLink's CPU links: the test suite's check of the
              expectations below.
Every result is checked against numpy (small integers in every dtype: exact in any order). Prints
one line per dtype, then `ALL OK <n> checks`; exits non-zero at the first wrong result.
XLA_PYTHON_CLIENT_PREALLOCATE defaults to false here: with --shared each process would otherwise
take 75 % of the one GPU's memory.
"""
from __future__ import annotations

import os
import sys

import jax_flexlink.launch

MODE = sys.argv[1] if len(sys.argv) > 1 else ""
if MODE not in ("--shared", "--reversed", "--cpu"):
  sys.exit(f"usage: gpu_processes.py --shared|--reversed|--cpu, got {sys.argv[1:]}")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if MODE == "--cpu":
  jax_flexlink.launch.initialize()
else:
  n, me = int(os.environ["FLEXLINK_NUM_PROCESSES"]), int(os.environ["FLEXLINK_PROCESS_ID"])
  jax_flexlink.launch.initialize(local_device_ids=[0 if MODE == "--shared" else n - 1 - me])
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_flexlink as flx  # noqa: E402

DEVICES = jax.devices() if MODE == "--cpu" else jax.devices("gpu")  # gpu whatever the default backend
N = len(DEVICES)
ROWS, COLS = 4 * N, 33  # ROWS divisible by N: psum_scatter and all_to_all split a block N ways


def say(*args):
  print(*args, flush=True)


def blocks(host):
  return [host[i * ROWS:(i + 1) * ROWS] for i in range(N)]


def expected(op, host, me):
  """Device `me`'s block of the result, from the inputs' blocks."""
  b = blocks(host)
  wide = [x.astype(np.float64) for x in b]
  if op == "psum":
    return sum(wide)
  if op == "pmax":
    return np.maximum.reduce(wide)
  if op == "pmin":
    return np.minimum.reduce(wide)
  if op == "all_gather":
    return np.concatenate(b)
  part = ROWS // N
  if op == "psum_scatter":
    return sum(wide)[me * part:(me + 1) * part]
  if op == "ppermute":  # ring: device j gets device j-1's block
    return b[(me - 1) % N]
  if op == "all_to_all":  # device j gets the j-th part of every block, in rank order
    return np.concatenate([x[me * part:(me + 1) * part] for x in b])
  raise ValueError(op)


BODIES = {
    "psum": lambda v: flx.psum(v, "x"),
    "pmax": lambda v: flx.pmax(v, "x"),
    "pmin": lambda v: flx.pmin(v, "x"),
    "all_gather": lambda v: flx.all_gather(v, "x", tiled=True),
    "psum_scatter": lambda v: flx.psum_scatter(v, "x", scatter_dimension=0, tiled=True),
    "ppermute": lambda v: flx.ppermute(v, "x", [(i, (i + 1) % N) for i in range(N)]),
    "all_to_all": lambda v: flx.all_to_all(v, "x", 0, 0, tiled=True),
}


def main() -> int:
  on_cpu = MODE == "--cpu"
  assert all(d.platform == ("cpu" if on_cpu else "gpu") for d in DEVICES) and N == jax.process_count(), DEVICES
  if not on_cpu:
    flx.configure(links="pcie" if MODE == "--shared" else "nccl;pcie", autotune_min_bytes=0)
  mesh = Mesh(np.array(DEVICES), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  me = jax.process_index()
  mine = [i for i, d in enumerate(DEVICES) if d.process_index == me]
  assert len(mine) == 1, mine
  rank = mine[0]
  checks = 0
  rng = np.random.default_rng(7)
  # Small integers in every dtype: sums are exact in any order, so results compare bitwise.
  for dtype in (np.float32, jnp.bfloat16, np.float16, np.int32, np.int8, np.uint8):
    low = 0 if dtype == np.uint8 else -8
    host = rng.integers(low, 9, size=(N * ROWS, COLS)).astype(dtype)
    x = jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    for op, body in BODIES.items():
      f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
      got, = [np.asarray(s.data) for s in f(x).addressable_shards]
      want = expected(op, host, rank)
      if got.shape != want.shape or not np.array_equal(got.astype(np.float64), want.astype(np.float64)):
        say(f"WRONG {op} {np.dtype(dtype).name}: got {got.dtype}{got.shape}, want {want.shape}")
        return 1
      checks += 1
    say(f"ok {np.dtype(dtype).name}: {', '.join(BODIES)}")
  # A large operand: several slot steps of the pcie staging (4 MiB slots), 16 MiB per device.
  big_rows = 4096
  host = rng.integers(-8, 9, size=(N * big_rows, 1024)).astype(np.float32)
  x = jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
  f = jax.jit(jax.shard_map(BODIES["psum"], mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  for _ in range(3):  # again: the same group, its staging reused
    got, = [np.asarray(s.data) for s in f(x).addressable_shards]
    want = host.reshape(N, big_rows, 1024).sum(0)
    if not np.array_equal(got, want):
      say("WRONG psum 16 MiB per device")
      return 1
    checks += 1
  say("ok psum 16 MiB per device, 3 calls")
  if not on_cpu:  # the CUDA module's map names this process's GPU by its CUDA ordinal
    from jax_flexlink._src import native  # noqa: PLC0415
    d = jax.local_devices(backend="gpu")[0]
    ids = native.cuda_module().device_ids()
    if not (d.local_hardware_id < len(ids) and ids[d.local_hardware_id] == d.id):
      say(f"WRONG device ids: jax device {d.id} is CUDA ordinal {d.local_hardware_id}, the map says {ids}")
      return 1
    say(f"jax device {d.id} on CUDA ordinal {d.local_hardware_id}, map {ids}")
  say(f"ALL OK {checks} checks; links: {flx.stats().get('links')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
