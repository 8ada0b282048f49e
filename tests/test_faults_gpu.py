"""GPU links' faults and health options from Python (docs/faults.md, "GPU links"). What the GPU
engine does with them (slow -> degraded, hang -> the group broken within the deadline) runs in
tests/cpp/gpu_sim_test.cc on the simulated device; here: that the settings reach the CUDA module.

The CUDA tests need a FLEXLINK_CUDA=ON build's module, not a GPU: FLEXLINK_CUDA_MODULE=<path of
_flexlink_cuda*.so> (.ci/run's CUDA step sets it), or one built in place; they load it in a fresh
interpreter before jax_flexlink, as an installed one would be, and skip without one. The CPU part
runs everywhere."""
import glob
import os
import sysconfig

import pytest
from helpers import run_python

import jax_flexlink as flx
from jax_flexlink._src import native


def _cuda_module_path():
  if os.environ.get("FLEXLINK_CUDA_MODULE"):
    return os.path.abspath(os.environ["FLEXLINK_CUDA_MODULE"])
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  name = "_flexlink_cuda" + sysconfig.get_config_var("EXT_SUFFIX")
  found = sorted(glob.glob(os.path.join(root, "build", "*", name)) + glob.glob(os.path.join(root, "jax_flexlink", name)))
  return found[0] if found else None


def _run_with_cuda_module(body):
  """Runs `body` (Python source; `cuda` is the module, `flx` jax_flexlink) with the CUDA module."""
  path = _cuda_module_path()
  if not path or not os.path.exists(path):
    pytest.skip("no FLEXLINK_CUDA=ON build here: set FLEXLINK_CUDA_MODULE to its _flexlink_cuda*.so "
                "(CI does) or build in place with `pip install -e . -C cmake.define.FLEXLINK_CUDA=ON`")
  preamble = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("jax_flexlink._flexlink_cuda", {path!r})
cuda = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cuda)
sys.modules["jax_flexlink._flexlink_cuda"] = cuda
import pytest
import jax_flexlink as flx
from jax_flexlink import _flexlink
from jax_flexlink._src import native
assert native.cuda_module() is cuda
"""
  result = run_python(preamble + body + "\nprint('ok')\n", env_extra={"FLEXLINK_LINK_TIMEOUT_S": "2.5"})
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


@pytest.fixture
def saved_options():
  before = [dict(m.health_options()) for m in native.modules()]
  yield
  for module, options in zip(native.modules(), before):
    for key, value in options.items():
      module.set_health_option(key, value)


def test_configure_link_timeout_reaches_the_engine(saved_options):
  """configure(link_timeout_s=) sets the engine's link deadline floor (every module of the build); a
  bad value changes nothing."""
  flx.configure(link_timeout_s=0.7)
  for module in native.modules():
    assert module.health_options()["link_timeout_s"] == pytest.approx(0.7), module.__name__
  with pytest.raises(ValueError):
    flx.configure(link_timeout_s=-1)
  assert native.health_options()["link_timeout_s"] == pytest.approx(0.7)


def test_health_options_reach_the_cuda_module():
  """FLEXLINK_LINK_TIMEOUT_S, configure(link_timeout_s=) and native.set_health_option set the GPU
  engine's options as the CPU engine's; a bad key or value changes neither."""
  _run_with_cuda_module("""
assert set(cuda.health_options()) == set(_flexlink.health_options())
assert cuda.health_options()["link_timeout_s"] == 2.5 == _flexlink.health_options()["link_timeout_s"]  # the env
flx.configure(link_timeout_s=0.7)
assert cuda.health_options()["link_timeout_s"] == pytest.approx(0.7)
native.set_health_option("probe_calls", 5)
native.set_health_option("degrade_fraction", 0.2)
native.set_health_option("link_timeout_factor", 4)
for module in (_flexlink, cuda):
  got = module.health_options()
  assert got["probe_calls"] == 5 and got["degrade_fraction"] == pytest.approx(0.2), module.__name__
  assert got["link_timeout_factor"] == 4 and got["link_timeout_s"] == pytest.approx(0.7), module.__name__
before = dict(cuda.health_options())
with pytest.raises(ValueError, match="unknown option 'bogus'"):
  native.set_health_option("bogus", 1)
with pytest.raises(ValueError, match="probe_seconds must be > 0"):
  native.set_health_option("probe_seconds", 0)
with pytest.raises(ValueError, match="link_timeout_s must be > 0"):
  cuda.set_health_option("link_timeout_s", -1)
assert dict(cuda.health_options()) == before and dict(_flexlink.health_options()) == before
""")


def test_gpu_links_take_slow_and_hang():
  """slow and hang specs on GPU links go to the CUDA module (their effects: gpu_sim_test), so does
  rank:absent, and a refused spec keeps the previous one."""
  _run_with_cuda_module("""
cuda.configure_links("nccl;pcie")
for spec in ("pcie:slow@factor=3,from_call=2", "nccl:hang@at_call=2", "nccl:slow@factor=2;pcie:hang@at_call=1"):
  flx.inject_faults(spec)
  assert flx.faults() == spec and cuda.faults() == spec and _flexlink.faults() == "", spec
cuda.inject_faults("rank:absent@rank=1,at_call=2")  # the GPU engine's rendezvous: gpu_sim_test
assert cuda.faults() == "rank:absent@rank=1,at_call=2"
with pytest.raises(ValueError, match="rank=x"):
  cuda.inject_faults("rank:absent@rank=x,at_call=2")
flx.inject_faults("nccl:slow@factor=2;pcie:hang@at_call=1")
with pytest.raises(ValueError, match="factor"):
  flx.inject_faults("pcie:slow@factor=0.5")
assert flx.faults() == "nccl:slow@factor=2;pcie:hang@at_call=1"
flx.inject_faults("")
assert cuda.faults() == ""
""")


def test_gpu_link_faults_go_to_the_cuda_module():
  """A spec naming GPU links goes to the CUDA module and clears the CPU module's, one naming no link
  (rank:absent alone) goes to both, a bad one is refused with the reason and keeps the previous,
  and the CUDA module reports health and failovers (their failover is gpu_sim_test's)."""
  _run_with_cuda_module("""
cuda.configure_links("nccl;pcie")
flx.inject_faults("shm:error@at_call=3")
flx.inject_faults("nccl:error@at_call=2,sticky=1")
assert flx.faults() == "nccl:error@at_call=2,sticky=1"
assert cuda.faults() == "nccl:error@at_call=2,sticky=1" and _flexlink.faults() == ""
for spec, why in (("nccl:error@at_call=2;shm:error@at_call=1", 'no link named "nccl"'),
                  ("nccl:error@at_call=x", "is not an integer")):
  with pytest.raises(ValueError, match=why):
    flx.inject_faults(spec)
assert flx.faults() == "nccl:error@at_call=2,sticky=1"
# A spec naming no link is both engines' (each has groups whose ranks can stay away).
flx.inject_faults("rank:absent@rank=1,at_call=2")
assert cuda.faults() == _flexlink.faults() == flx.faults() == "rank:absent@rank=1,at_call=2"
flx.inject_faults("nccl:error@at_call=2;rank:absent@rank=0,at_call=3")
assert cuda.faults() == "nccl:error@at_call=2;rank:absent@rank=0,at_call=3" and _flexlink.faults() == ""
full = cuda.stats()
assert full["health"] == [] and full["failovers"] == {"count": 0, "recent": []}
flx.inject_faults("shm:error@at_call=1")
assert cuda.faults() == "" and _flexlink.faults() == "shm:error@at_call=1"
flx.inject_faults("")
""")
