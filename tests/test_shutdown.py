"""jax_flexlink.shutdown() (docs/cuda.md, "Shutdown"). What the GPU engine releases, and what it
keeps while a group's work still runs, is checked on the simulated device (tests/cpp/gpu_sim_test.cc
TestShutdown, TestShutdownWhileBusy; gpu_xproc_test's "shutdown" scenarios across processes);
here: the Python API in a build without the CUDA module, and with it (loaded in a fresh interpreter:
shutting the engine down is for good), on a machine without a GPU, where it has nothing to release."""
import math

import numpy as np
import pytest
from test_faults_gpu import _run_with_cuda_module

import jax_flexlink as flx
from jax_flexlink._src import native


@pytest.mark.skipif(native.cuda_module() is not None, reason="this build has the CUDA module (tested below)")
def test_shutdown_without_the_cuda_module_has_nothing_to_release():
  report = flx.shutdown()
  assert report == {"engine": None, "released": [], "kept": [], "errors": [], "again": False}


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, math.inf, 1e6 + 1, 10**30, 10**400])
def test_shutdown_timeout_must_be_finite_seconds(bad):
  with pytest.raises(ValueError, match=r"shutdown: timeout_s must be a finite number of seconds in \[0, 1e\+06\], got "):
    flx.shutdown(bad)


@pytest.mark.parametrize("bad", ["10", True, np.bool_(True), None, [1]])
def test_shutdown_timeout_must_be_a_number(bad):
  with pytest.raises(TypeError, match=r"shutdown: timeout_s must be a number of seconds, got "):
    flx.shutdown(bad)


def test_shutdown_with_the_cuda_module():
  _run_with_cuda_module("""
import io, contextlib
import numpy as np
import jax
from jax import lax
from jax.sharding import PartitionSpec as P
from jax_flexlink._src import shutdown as sd
assert not cuda.has_groups() and not cuda.is_shut_down()
# A function jitted and lowered for CUDA before the shutdown (FlexLink's custom call under
# replacement), lowered again after it: XLA's collective (jax's caches were cleared).
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
x = np.arange(64, dtype=np.float32)
before = jax.jit(jax.shard_map(lambda v: lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
with flx.replace_collectives():
  assert "flexlink_all_reduce" in before.trace(x).lower(lowering_platforms=("cuda",)).as_text()
first = flx.shutdown(np.float32(0.5))
assert first == {"engine": "cuda", "released": [], "kept": [], "errors": [], "again": False}, first
assert cuda.is_shut_down()
again = flx.shutdown(0)
assert again["again"] and again["released"] == again["kept"] == again["errors"] == [], again
# The exit handler does nothing for an engine that made no group (and says nothing).
err = io.StringIO()
with contextlib.redirect_stderr(err):
  sd._at_exit()
assert err.getvalue() == "", err.getvalue()
# Lowering for CUDA after it: an explicit FlexLink collective says why; under replacement jax.lax's
# collectives stay XLA's (and the coverage report says why).
with flx.replace_collectives():
  text = before.trace(x).lower(lowering_platforms=("cuda",)).as_text()
assert "stablehlo.all_reduce" in text and "flexlink_all_reduce" not in text, text
make = lambda mod: jax.jit(jax.shard_map(lambda v: mod.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
try:
  make(flx).trace(x).lower(lowering_platforms=("cuda",))
except NotImplementedError as e:
  assert "jax_flexlink.psum: FlexLink's GPU engine was shut down in this process" in str(e), e
else:
  raise AssertionError("an explicit psum lowered for CUDA after the shutdown")
with flx.replace_collectives():
  text = make(lax).trace(x).lower(lowering_platforms=("cuda",)).as_text()
assert "stablehlo.all_reduce" in text and "flexlink_all_reduce" not in text, text
# The CPU engine is not the GPU's: FlexLink still lowers and runs there.
text = make(flx).trace(x).lower(lowering_platforms=("cpu",)).as_text()
assert "flexlink_all_reduce" in text
np.testing.assert_array_equal(np.asarray(make(flx)(x)), np.asarray(make(lax)(x)))
""")


def test_new_gpu_links_release_the_earlier_groups_with_the_cuda_module():
  """configure(links=...) with GPU links calls the engine's release of the earlier links' groups
  (GpuEngine::ReleaseEarlierLinks; on the simulated device: gpu_sim_test TestReleaseEarlierLinks;
  on GPUs: test_gpu.py::test_new_links_release_the_earlier_groups). Here, with no GPU, there is no
  group to release: nothing is reported, nothing warned, the engine stays open, and the CPU links'
  configure does not call it."""
  _run_with_cuda_module("""
import warnings
from jax_flexlink._src import runtime
calls = []
real = runtime.release_earlier_gpu_groups
runtime.release_earlier_gpu_groups = lambda m: calls.append(m) or real(m)
with warnings.catch_warnings():
  warnings.simplefilter("error")
  flx.configure(links="nccl")
  flx.configure(links="nccl;pcie@slot_mib=1")
  flx.configure(links="shm")
assert calls == [cuda, cuda], calls
assert cuda.links_spec() == "nccl;pcie@slot_mib=1" and _flexlink.links_spec() == "shm"
report = cuda.release_earlier_links(0.5)
assert report == {"released": [], "kept": [], "errors": [], "again": False}, report
assert not cuda.has_groups() and not cuda.is_shut_down()
""")


def test_the_exit_wait_runs_inside_an_exit_handler():
  """The exit handler's wait for dispatched GPU work polls on the exit's own thread: Python 3.12
  refuses to start a thread in an exit handler (CI's jax 0.11.2 step runs this on 3.12)."""
  from helpers import run_python
  result = run_python("""
      import atexit
      from jax_flexlink._src import shutdown as sd
      atexit.register(lambda: print("waited", sd._wait_for_gpu_work(1.0), flush=True))
  """)
  assert result.returncode == 0 and "waited True" in result.stdout, result.stdout + result.stderr
  assert "Traceback" not in result.stderr, result.stderr
