"""tune() on the engine of the devices' platform (jax_flexlink/_src/tune.py).

On CPU, stage 1 completes inside the first call (test_multipath.py runs it for real). On GPU its
phases run on the devices and later calls read their times, so tune() repeats each collective until
the group's model has it; in a group across processes, every process must leave that loop at the
same call (gpu_xproc_test's stage-1 scenario checks the engine side of that). No GPU here: the
CUDA module is a stand-in that installs the fits at a chosen call, and the program is a counter.
"""
import jax
import pytest

from jax_flexlink._src import native, tune


class Module:
  """The CUDA module's tune controls: fits for a collective appear at its `fit_at`-th call."""

  def __init__(self, fit_at, links=("nccl", "pcie")):
    self.fit_at, self._links = fit_at, links
    self.settings = {"autotune_min_bytes": 1 << 20, "tune_max_bytes": 16 << 20, "tune_use_cache": True}
    self.log, self.calls, self.fits = [], 0, {}

  def links(self):
    return list(self._links)

  def autotune_min_bytes(self):
    return self.settings["autotune_min_bytes"]

  def tune_max_bytes(self):
    return self.settings["tune_max_bytes"]

  def tune_use_cache(self):
    return self.settings["tune_use_cache"]

  def set_autotune_min_bytes(self, v):
    self.settings["autotune_min_bytes"] = v

  def set_tune_max_bytes(self, v):
    self.settings["tune_max_bytes"] = v

  def set_tune_use_cache(self, v):
    self.settings["tune_use_cache"] = v

  def forget_model(self, collective):
    self.log.append(("forget", collective))
    self.fits.pop(collective, None)
    self.calls = 0

  def call(self, collective):
    self.calls += 1
    self.log.append(("call", collective, dict(self.settings)))
    if self.fit_at and self.calls >= self.fit_at:
      self.fits[collective] = [(1e-5, 1e-10), (2e-5, 3e-10)]

  def group_fits(self, ids):
    return {"fits": dict(self.fits), "split_min_bytes": {c: 1 << 20 for c in self.fits}, "profiled_bytes": {}}


@pytest.fixture
def gpu(monkeypatch):
  def install(fit_at, links=("nccl", "pcie")):
    module = Module(fit_at, links)
    monkeypatch.setattr(tune, "module_for", lambda platform: module)
    monkeypatch.setattr(tune, "_program", lambda mesh, collective: lambda x: _Ready(module, collective))
    return module
  return install


class _Ready:
  def __init__(self, module, collective):
    module.call(collective)

  def block_until_ready(self):
    return self


def test_repeats_each_collective_until_the_engine_has_its_fits(gpu):
  module = gpu(fit_at=4)  # as gpu_xproc_test measures: phase 1, phase 2, then the fits
  out = tune.tune(collectives=("all_reduce", "all_gather"), max_bytes="1M", devices=jax.devices()[:2],
                  use_cache=False)
  assert out["fits"] == {c: [(1e-5, 1e-10), (2e-5, 3e-10)] for c in ("all_reduce", "all_gather")}
  calls = [e for e in module.log if e[0] == "call"]
  assert [e[1] for e in calls] == ["all_reduce"] * 4 + ["all_gather"] * 4
  assert module.log[0] == ("forget", "all_reduce") and module.log[5] == ("forget", "all_gather")
  # Every call ran with stage 1 forced on, at the asked size, with the asked cache use...
  assert all(e[2] == {"autotune_min_bytes": 1, "tune_max_bytes": 1 << 20, "tune_use_cache": False} for e in calls)
  # ...and the module's own settings are back afterwards.
  assert module.settings == {"autotune_min_bytes": 1 << 20, "tune_max_bytes": 16 << 20, "tune_use_cache": True}


def test_a_stage_1_that_never_completes_stops_after_max_calls(gpu):
  module = gpu(fit_at=0)
  out = tune.tune(collectives="all_reduce", max_bytes="1M", devices=jax.devices()[:2])
  assert out == {"fits": {}, "split_min_bytes": {}}
  assert sum(e[0] == "call" for e in module.log) == tune.MAX_TUNE_CALLS
  assert module.settings["autotune_min_bytes"] == 1 << 20


def test_one_gpu_link_has_nothing_to_balance(gpu):
  module = gpu(fit_at=1, links=("nccl",))
  assert tune.tune(devices=jax.devices()[:2]) == {}
  assert module.log == []


def test_the_platforms_module(monkeypatch):
  from jax_flexlink import _flexlink
  assert tune.module_for("cpu") is _flexlink
  monkeypatch.setattr(native, "cuda_module", lambda: None)
  for platform in ("gpu", "cuda"):
    with pytest.raises(RuntimeError, match=r"the devices are GPUs.*no CUDA module.*FLEXLINK_CUDA=ON"):
      tune.module_for(platform)
  marker = object()
  monkeypatch.setattr(native, "cuda_module", lambda: marker)
  assert tune.module_for("gpu") is marker
  with pytest.raises(ValueError, match="runs on cpu and cuda devices, not 'tpu'"):
    tune.module_for("tpu")
