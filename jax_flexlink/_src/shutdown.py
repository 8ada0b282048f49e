"""Ending FlexLink's GPU engine: `jax_flexlink.shutdown()`, and the same at the interpreter's exit.

Every FlexLink GPU group holds, for the process's life, its NCCL communicators, CUDA streams and
events, device staging buffers and pinned host memory. `shutdown()` releases them all
(GpuEngine::Shutdown in xla_ffi/cuda/gpu_engine.h; docs/cuda.md, "Shutdown"): later FlexLink calls
on GPU are refused, saying so, and only groups whose work has completed on their devices are
released (a group still running keeps everything and the report names it), all within a deadline.

At exit it runs by itself, before jax's own exit handlers (atexit runs handlers in reverse order,
and jax registers its own when it is imported, before this module): XLA's backends, their streams
and NCCL are still alive then. The CPU engine holds nothing outside the process (its shared-memory
segments are unlinked once mapped), so it is left as it is: its calls keep working.
"""
from __future__ import annotations

import atexit
import math
import numbers
import sys
import time

import jax
import numpy as np

from jax_flexlink._src import native

# The exit handler's deadline: how long a group's work may still take to complete on its devices,
# and, before that, how long it waits for the computations already dispatched.
EXIT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 1e6  # as configure(timeout_s=)


def shutdown(timeout_s: float = 10.0) -> dict:
  """Ends FlexLink's GPU engine in this process and releases what its groups hold.

  Within `timeout_s` seconds: waits for FlexLink calls inside the engine on the host to return,
  then for every group's work to complete on its devices, then releases each such group (its NCCL
  communicators finalized and destroyed; its streams, events, device and pinned memory freed).
  From the call on, every FlexLink collective on GPU fails with an error saying the engine was shut
  down; jax.lax's collectives are unaffected, and programs lowered afterwards for the GPU keep XLA's
  collectives under replacement (jax's caches are cleared, `jax.clear_caches()`, so that functions
  jitted before lower again). Call it once your program's FlexLink computations are done
  (`block_until_ready`). Calling it again retries the groups an earlier call kept.

  Returns {"engine": "cuda", "released": [group, ...], "kept": [group: why, ...],
  "errors": [group: error, ...], "again": bool}; in a build without the CUDA module (FLEXLINK_CUDA=ON)
  {"engine": None, ...} with the lists empty: there is nothing to release.
  """
  # As configure(timeout_s=): a bool or a string is a type error, not a number of seconds.
  if isinstance(timeout_s, (bool, np.bool_)) or not isinstance(timeout_s, numbers.Real):
    raise TypeError(f"shutdown: timeout_s must be a number of seconds, got {type(timeout_s).__name__} {timeout_s!r}")
  if not 0 <= timeout_s <= MAX_TIMEOUT_S or not math.isfinite(timeout_s):  # range first: 10**400 overflows a float
    raise ValueError(f"shutdown: timeout_s must be a finite number of seconds in [0, {MAX_TIMEOUT_S:g}], "
                     f"got {timeout_s!r}")
  cuda = native.cuda_module()
  if cuda is None:
    return {"engine": None, "released": [], "kept": [], "errors": [], "again": False}
  report = dict(cuda.shutdown(float(timeout_s)))
  report["engine"] = "cuda"
  # jax keeps lowerings by jaxpr: a function jitted again would reuse one with FlexLink's custom
  # calls, which the engine now refuses, instead of lowering to XLA's collectives (lowering.py).
  jax.clear_caches()
  return report


def _wait_for_gpu_work(timeout_s: float) -> bool:
  """Lets computations already dispatched finish first: their FlexLink calls would be refused once
  the engine is closed, and a group's ranks would then wait for each other to their deadline.
  Polled (`is_ready`), never blocked on, and given up after `timeout_s`: a computation that never
  completes (an XLA collective whose peer process died) must not hold the exit. Not on a thread:
  Python 3.12 refuses to start one in an exit handler. Whether everything completed."""
  deadline = time.monotonic() + timeout_s
  try:
    arrays = jax.live_arrays("gpu")
    while not all(a.is_ready() for a in arrays):
      if time.monotonic() >= deadline:
        return False
      time.sleep(0.005)
  except Exception:  # noqa: BLE001 - at exit, a failed computation has nothing left to report to
    pass
  return True


@atexit.register
def _at_exit() -> None:
  cuda = native.cuda_module()
  if cuda is None or not cuda.has_groups():
    return
  if not _wait_for_gpu_work(EXIT_TIMEOUT_S):
    # Releasing now could block the exit for good: cudaFree may synchronise a device whose work
    # never completes. The process's end frees everything anyway.
    print(f"flexlink: warning: at exit: GPU computations still running after {EXIT_TIMEOUT_S:g} s; FlexLink's "
          "GPU groups were not released (the process's exit frees them)", file=sys.stderr)
    return
  report = cuda.shutdown(EXIT_TIMEOUT_S)
  for line in list(report["kept"]) + list(report["errors"]):
    print(f"flexlink: warning: at exit: {line}", file=sys.stderr)
