"""The GPU engine's stage 1 starts from the machine's nominal link speeds (jax_flexlink/_src/gpu_seed.py):
on recorded machines, the fits handed to the CUDA module are topology.nominal_fits for every group
size, and where there is nothing to seed the sentence says why. The module is a recording stand-in
here; test_dropin's CUDA-module test feeds the real one, and gpu_sim_test checks that a seeded
group splits its first small call."""
import dataclasses

import pytest

import topology_fakes as tf
from jax_flexlink import topology as T
from jax_flexlink._src import gpu_seed


class RecordingModule:
    def __init__(self, links):
        self._links = links
        self.seeds = {}

    def links(self):
        return list(self._links)

    def seed_model(self, ranks, fits):
        self.seeds[ranks] = fits


def _topo(tmp_path, name):
    machine = tf.MACHINES[name]()
    return T.discover(nvml=tf.FakeNvml(machine), sysfs=tf.build_sysfs(str(tmp_path / "sys"), machine))


@pytest.mark.parametrize("name", ["8xH100", "8xH800", "2xA100-bridged", "2xL40S"])
def test_every_group_size_gets_the_nominal_fits(tmp_path, name):
    topo = _topo(tmp_path, name)
    module = RecordingModule(["nccl", "pcie"])
    said = gpu_seed.seed_from_topology(module, topo)
    n = len(topo.gpus)
    assert sorted(module.seeds) == list(range(2, n + 1)), module.seeds
    for ranks, fits in module.seeds.items():
        assert fits == T.nominal_fits(topo, ["nccl", "pcie"], gpus=range(ranks)), ranks
        assert set(fits) == set(T.COLLECTIVES)
        (a_nccl, b_nccl), (a_pcie, b_pcie) = fits["all_reduce"]
        assert b_nccl <= b_pcie and a_nccl > 0 and a_pcie > 0  # nccl: NVLink's or the same PCIe
    nominal = T.describe_nominal(topo)
    assert said == (f"nominal seed for links nccl;pcie (nccl {nominal['nccl']['gbps']:g} GB/s, pcie "
                    f"{nominal['pcie']['gbps']:g} GB/s), groups of 2..{n} GPUs")


def test_nothing_to_seed_says_why(tmp_path):
    topo = _topo(tmp_path, "8xH100")
    one = RecordingModule(["nccl"])
    assert gpu_seed.seed_from_topology(one, topo) == "no nominal seed: one GPU link (nccl), nothing to split"
    assert one.seeds == {}
    no_gpu = T.discover(nvml=tf.FakeNvml(None, init_error=tf.NVML_ERROR_LIBRARY_NOT_FOUND),
                        sysfs=str(tmp_path / "empty"))
    module = RecordingModule(["nccl", "pcie"])
    said = gpu_seed.seed_from_topology(module, no_gpu)
    assert module.seeds == {} and said.startswith("no nominal seed for links nccl;pcie: ") and no_gpu.nvml.error in said
    unknown = RecordingModule(["nccl", "pcie:staged"])  # a named link: its kind is what counts
    gpu_seed.seed_from_topology(unknown, topo)
    assert sorted(unknown.seeds) == list(range(2, 9))
    foreign = RecordingModule(["nccl", "nvme"])
    said = gpu_seed.seed_from_topology(foreign, topo)
    assert foreign.seeds == {} and "no nominal speed for link 'nvme'" in said, said


def test_logged_at_info(tmp_path, monkeypatch, capsys):
    topo = _topo(tmp_path, "2xA100-bridged")
    monkeypatch.setattr(gpu_seed, "ENV", dataclasses.replace(gpu_seed.ENV, debug_level=1))
    said = gpu_seed.seed_from_topology(RecordingModule(["nccl", "pcie"]), topo)
    assert f"[flexlink] {said}\n" in capsys.readouterr().err
