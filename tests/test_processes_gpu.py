"""GPU groups across processes, the parts that run without a GPU (docs/multiprocess.md, "GPU groups
across processes"): the routing decision (CUDA path, or lax's collective with the reason), the
key-value exchange of the segment name and the NCCL unique ids between a leader and a follower
process (a stand-in store and module, threads for processes), its failures, the live deadline of
every exchange, and, with a FLEXLINK_CUDA=ON build, the CUDA module's functions for it.

The engine side (rendezvous, plan agreement, communicators across processes, a killed peer) is the
C++ gpu_xproc_test on the host simulation; nothing of it has run on a GPU.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

import jax_flexlink as flx
from jax_flexlink._src import hosts
from jax_flexlink._src import native
from jax_flexlink._src import processes
from jax_flexlink._src.collective import NotLowerable

from helpers import run_python
from test_dropin import _cuda_module_path


class Store:
  """jax.distributed's key-value client, the calls processes.py makes, for threads of one process."""

  def __init__(self):
    self.values = {}
    self.cv = threading.Condition()

  def key_value_set(self, key, value):
    with self.cv:
      assert key not in self.values, f"{key} set twice"
      self.values[key] = value
      self.cv.notify_all()

  key_value_set_bytes = key_value_set

  def blocking_key_value_get(self, key, timeout_ms):
    with self.cv:
      if not self.cv.wait_for(lambda: key in self.values, timeout_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self.values[key]

  blocking_key_value_get_bytes = blocking_key_value_get

  def key_value_increment(self, key, n):
    with self.cv:
      self.values[key] = self.values.get(key, 0) + n
      return self.values[key]


class Module:
  """The CUDA module's cross-process functions, recording what each process did."""

  ids = [bytes(range(128)), bytes(reversed(range(128)))]  # two nccl links

  def __init__(self, links=("nccl", "pcie")):
    self._links = list(links)
    self.calls = []

  def links(self):
    return self._links

  def gpu_xproc_links(self):
    return {"links": [l for l in self._links if l in ("nccl", "pcie")],
            "left_out": [(l, "cannot span processes") for l in self._links if l not in ("nccl", "pcie")]}

  def gpu_xproc_create(self, devices, local, processes):
    self.calls.append(("create", devices, local, processes))
    made = sum(c[0] == "create" for c in self.calls)  # a new segment per set-up
    return "/flexlink-" + ("ab" if made == 1 else f"{made:02x}") * 16, list(self.ids)

  def gpu_xproc_attach(self, name, ids, devices, local):
    self.calls.append(("attach", name, [bytes(i) for i in ids], devices, local))

  def gpu_xproc_unlink(self, name):
    self.calls.append(("unlink", name))


@pytest.fixture
def no_device_ids(monkeypatch):
  monkeypatch.setattr(processes, "_set_device_ids", lambda module: None)


def test_gpu_reason():
  assert "FLEXLINK_CUDA=ON" in processes.gpu_reason(None)
  assert "predates" in processes.gpu_reason(object())
  assert processes.gpu_reason(Module()) is None
  reason = processes.gpu_reason(Module(links=("rdma",)))
  assert "nccl and one pcie link can" in reason and "rdma: cannot span processes" in reason, reason


def test_route(monkeypatch):
  group = (0, 4)
  assert processes.route(group, ("cpu",)) == "cpu"
  monkeypatch.setattr(native, "cuda_module", lambda: None)
  with pytest.raises(NotLowerable, match=r"devices \[0, 4\] spans processes.*cannot run it on GPU.*FLEXLINK_CUDA=ON"):
    processes.route(group, ("cuda",))
  monkeypatch.setattr(native, "cuda_module", lambda: Module())
  assert processes.route(group, ("cuda",)) == "cuda"
  monkeypatch.setattr(native, "cuda_module", lambda: Module(links=("rdma",)))
  with pytest.raises(NotLowerable, match="nccl and one pcie link can"):
    processes.route(group, ("cuda",))
  with pytest.raises(NotLowerable, match="one platform at a time"):
    processes.route(group, ("cpu", "cuda"))


def _run_processes(store, modules, group, locals_, creator, order, round_=0):
  """Each process's exchange on its own thread, started in `order` (a follower may wait first)."""
  results, errors = {}, {}

  def body(p):
    try:
      results[p] = processes.exchange_gpu_ids(store, modules[p], group, p, locals_[p], creator, len(locals_),
                                              round_)
    except Exception as e:  # noqa: BLE001 - the test inspects it
      errors[p] = e

  threads = []
  for p in order:
    t = threading.Thread(target=body, args=(p,))
    t.start()
    threads.append(t)
    time.sleep(0.05)
  for t in threads:
    t.join(30)
  return results, errors


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_nccl_id_exchange(no_device_ids, order):
  """The leader's segment name and NCCL ids reach the follower unchanged, whoever lowers first;
  the name is unlinked exactly once, by whoever maps last."""
  store, modules = Store(), {0: Module(), 1: Module()}
  group, locals_ = (0, 1, 2, 3), {0: [0, 1], 1: [2, 3]}
  results, errors = _run_processes(store, modules, group, locals_, 0, order)
  assert not errors, errors
  name = "/flexlink-" + "ab" * 16
  assert results == {0: name, 1: name}
  assert modules[0].calls[0] == ("create", [0, 1, 2, 3], [0, 1], 2)
  attach = modules[1].calls[0]
  assert attach == ("attach", name, Module.ids, [0, 1, 2, 3], [2, 3]), attach
  unlinks = [c for m in modules.values() for c in m.calls if c[0] == "unlink"]
  assert unlinks == [("unlink", name)]
  key = processes._key("gpuxproc", group)
  assert store.values[f"{key}/mapped"] == 4 and store.values[f"{key}/nccl_ids"] == b"".join(Module.ids)
  processes._created_unlinked.pop(name, None)


def test_links_configured_later_set_the_group_up_again(no_device_ids, monkeypatch):
  """A GPU group is set up for the links current at lowering; after configure(links=...) the next
  lowering sets it up again (prepare's key holds the CUDA module's links), as a new round with keys
  of its own in the store, so the new segment and NCCL ids reach every process; the first round's
  group stays for programs lowered before."""
  store, modules = Store(), {0: Module(), 1: Module()}
  group, locals_ = (0, 1, 2, 3), {0: [0, 1], 1: [2, 3]}
  first, errors = _run_processes(store, modules, group, locals_, 0, (1, 0))
  assert not errors, errors
  second, errors = _run_processes(store, modules, group, locals_, 0, (1, 0), round_=1)
  assert not errors, errors
  assert first[0] == first[1] != second[0] == second[1], (first, second)
  key = processes._key("gpuxproc", group)
  assert store.values[f"{key}/name"] == first[0] and store.values[f"{key}/1/name"] == second[0]
  assert [c[1] for c in modules[1].calls if c[0] == "attach"] == [first[0], second[0]]
  for name in (first[0], second[0]):
    processes._created_unlinked.pop(name, None)
  # prepare()'s key: a GPU group's set-up depends on the CUDA module's links, a CPU group's does not.
  monkeypatch.setattr(native, "cuda_module", lambda: Module(links=("nccl",)))
  Module.links_spec = lambda self: ";".join(self._links)
  try:
    assert processes._links_key("cuda") == "nccl" and processes._links_key("cpu") == ""
  finally:
    del Module.links_spec


def test_missing_leader_is_named(no_device_ids, monkeypatch):
  """A follower whose leader never publishes fails at the deadline with a message naming the
  leader process, the group and the deadline; it attaches nothing."""
  monkeypatch.setattr(hosts, "kv_timeout_ms", lambda: 300)
  module = Module()
  start = time.monotonic()
  with pytest.raises(RuntimeError) as info:
    processes.exchange_gpu_ids(Store(), module, (0, 1), 1, [1], 0, 2)
  assert time.monotonic() - start < 5
  message = str(info.value)
  assert "process 0 did not publish the segment of the GPU group of devices [0, 1]" in message, message
  assert "within 0.3 s" in message and "FLEXLINK_TIMEOUT_S" in message, message
  assert module.calls == []


def test_bad_id_blob(no_device_ids):
  store = Store()
  key = processes._key("gpuxproc", (0, 1))
  store.key_value_set(f"{key}/name", "/flexlink-" + "cd" * 16)
  store.key_value_set(f"{key}/nccl_ids", b"x" * 100)
  module = Module()
  with pytest.raises(RuntimeError, match="100 bytes, not a multiple of 128"):
    processes.exchange_gpu_ids(store, module, (0, 1), 1, [1], 0, 2)
  assert module.calls == []


def test_exchanges_use_the_live_deadline():
  """Every exchange at lowering (host identities, segment names, tcp tokens, NCCL ids) is bounded
  by the deadline as configure(timeout_s=...) leaves it, not by FLEXLINK_TIMEOUT_S read at import."""
  from jax_flexlink._src import runtime
  before = runtime.timeout_s()
  try:
    flx.configure(timeout_s=3.5)
    assert hosts.kv_timeout_ms() == 3500
    with pytest.raises(RuntimeError, match=r"process 7 did not publish its host identity \(k\) within 0.05 s"):
      hosts.kv_get(Store(), "k", "process 7 did not publish its host identity", timeout_ms=50)
  finally:
    flx.configure(timeout_s=before)


def test_one_device_map():
  """processes.py and hosts.py share one device map."""
  assert processes.device_process is hosts.device_process
  import jax
  by_process = hosts.process_devices()
  assert by_process == {0: sorted(d.id for d in jax.devices())}
  with pytest.raises(NotLowerable, match="not one of this job's devices"):
    hosts.device_process(10 ** 6)


class Gpu:
  """A jax GPU device as processes.device_id_map reads it."""

  def __init__(self, id_, hw):
    self.id, self.local_hardware_id, self.platform = id_, hw, "gpu"


def test_device_id_map():
  """The CUDA ordinal -> jax id map comes from each device's local_hardware_id (XLA's DeviceOrdinal),
  not from the devices' order: a process shown GPUs 1 and 3 (jax_cuda_visible_devices, or
  jax.distributed.initialize(local_device_ids=...)) runs them as ordinals 1 and 3 while jax numbers
  them 0 and 1; in a multi-process job, process 1's single GPU 3 is, say, jax's device 11."""
  assert processes.device_id_map([Gpu(0, 0), Gpu(1, 1)]) == [0, 1]
  assert processes.device_id_map([Gpu(0, 1), Gpu(1, 3)]) == [-1, 0, -1, 1]
  assert processes.device_id_map([Gpu(11, 3)]) == [-1, -1, -1, 11]
  assert processes.device_id_map([Gpu(5, 1), Gpu(4, 0)]) == [4, 5]  # listed out of order
  assert processes.device_id_map([Gpu(8, None), Gpu(9, None)]) == [8, 9]  # no hardware id: local order
  assert processes.device_id_map([]) == []
  with pytest.raises(ValueError, match=r"GPU devices \[0, 1\] have CUDA ordinals \[2, 2\]"):
    processes.device_id_map([Gpu(0, 2), Gpu(1, 2)])


def test_device_ids_set_once(monkeypatch):
  """_set_device_ids hands the module the map from this process's GPU devices, once; with no GPU
  (lowering for another machine) it hands nothing and leaves the map to a later lowering."""
  class Ids:
    def __init__(self):
      self.got = []

    def set_device_ids(self, ids):
      self.got.append(list(ids))

  import jax
  monkeypatch.setattr(processes, "_ids_set", [])
  module = Ids()
  processes._set_device_ids(module)  # this machine has no GPU backend
  assert module.got == [] and processes._ids_set == []

  class Cpu:
    id, local_hardware_id, platform = 0, None, "cpu"

  # The GPU backend's devices even where cpu is the default backend (JAX_PLATFORMS=cpu,cuda).
  def local_devices(process_index=None, backend=None):
    return [Gpu(0, 1), Gpu(1, 3)] if backend == "gpu" else [Cpu()]
  monkeypatch.setattr(jax, "local_devices", local_devices)
  processes._set_device_ids(module)
  processes._set_device_ids(module)
  assert module.got == [[-1, 0, -1, 1]]


def _cuda_module_or_skip() -> str:
  """The FLEXLINK_CUDA=ON build's module file, or skip saying how to get one."""
  path = _cuda_module_path()
  if not path or not os.path.exists(path):
    pytest.skip("no FLEXLINK_CUDA=ON build here: set FLEXLINK_CUDA_MODULE to its _flexlink_cuda*.so")
  return path


def _load_module(path: str) -> str:
  """A fresh interpreter's lines (one, `;`-joined, for a dedented program) that load it as jax_flexlink's."""
  return ("import importlib.util, sys; "
          f"spec = importlib.util.spec_from_file_location('jax_flexlink._flexlink_cuda', {path!r}); "
          "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
          "sys.modules['jax_flexlink._flexlink_cuda'] = module")


def test_cuda_module_device_ids():
  """With a FLEXLINK_CUDA=ON build: the module's map (xla_ffi/cuda/device_ids.h) as Python sets it,
  set once, refusing another map or an id named twice."""
  path = _cuda_module_or_skip()
  result = run_python(f"""
      {_load_module(path)}
      assert module.device_ids() == []
      try:
          module.set_device_ids([3, 3])
      except ValueError as e:
          assert "twice" in str(e), e
      else:
          raise AssertionError("an id named twice was accepted")
      assert module.device_ids() == []
      module.set_device_ids([-1, 0, -1, 1, -1])
      assert module.device_ids() == [-1, 0, -1, 1], module.device_ids()
      module.set_device_ids([-1, 0, -1, 1])
      try:
          module.set_device_ids([0, 1])
      except ValueError as e:
          assert "already map to other global ids" in str(e), e
      else:
          raise AssertionError("a second map was accepted")
      assert module.device_ids() == [-1, 0, -1, 1]
      print("ok")
  """)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "ok" in result.stdout


def test_cuda_module_functions():
  """With a FLEXLINK_CUDA=ON build: the module reports which GPU links a group across processes
  uses (nccl and one pcie link; a second pcie is left out with the reason), refuses malformed ids, and a create on this GPU-less machine fails cleanly, leaving
  nothing in /dev/shm."""
  path = _cuda_module_or_skip()
  result = run_python(f"""
      import os
      {_load_module(path)}
      import jax_flexlink as flx
      from jax_flexlink._src import processes
      shm = lambda: sorted(n for n in os.listdir("/dev/shm") if n.startswith("flexlink-"))
      before = shm()
      flx.configure(links="nccl;pcie")
      links = module.gpu_xproc_links()
      assert links == {{"links": ["nccl", "pcie"], "left_out": []}}, links
      assert processes.gpu_reason(module) is None
      flx.configure(links="pcie:a;pcie:b")
      links = module.gpu_xproc_links()
      assert links["links"] == ["a"] and links["left_out"][0][0] == "b", links
      assert "second pcie" in links["left_out"][0][1], links
      assert processes.gpu_reason(module) is None
      try:
          module.gpu_xproc_attach("/flexlink-" + "ab" * 16, [b"x" * 5], [0, 1], [1])
      except ValueError as e:
          assert "128 bytes, got 5" in str(e), e
      else:
          raise AssertionError("a 5-byte id was accepted")
      try:
          module.gpu_xproc_create([0, 1], [0])
      except (ValueError, RuntimeError) as e:
          print("create refused:", e)
      else:
          raise AssertionError("created a GPU group on a machine without GPUs")
      assert shm() == before, (before, shm())
      print("ok")
  """)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "ok" in result.stdout
