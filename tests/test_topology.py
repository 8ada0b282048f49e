"""jax_flexlink.topology on recorded machines (tests/topology_fakes.py): a stand-in for pynvml and a
fake /sys tree, every field of the result checked, the JSON round trip, nominal speeds and fits,
bad inputs, and the command without a GPU (this machine has none)."""
import dataclasses
import inspect
import io
import json
import os
import subprocess
import sys

import pytest

import topology_fakes as tf
from jax_flexlink import topology as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PCIE5_X16 = 63.016   # 3.9385 GB/s per lane x 16
PCIE4_X16 = 31.507   # 1.9692 x 16


def _discover(tmp_path, name, **nvml_kw):
    machine = tf.MACHINES[name]()
    root = tf.build_sysfs(str(tmp_path / "sys"), machine)
    return T.discover(nvml=tf.FakeNvml(machine, **nvml_kw), sysfs=root), machine, root


def _pcie(gen, width, cur_gen, cur_width):
    return T.Pcie(gen=gen, width=width, current_gen=cur_gen, current_width=cur_width)


# --------------------------------------------------------------------------------------------------
# The four machines, field by field


def test_h100_every_field(tmp_path):
    topo, _, root = _discover(tmp_path, "8xH100")
    assert topo.sysfs == root and topo.host
    assert topo.nvml == T.NvmlInfo(available=True, error=None, driver_version="580.65.06",
                                   cuda_driver_version=13000, nvml_version="13.580.65.06")
    assert topo.numa_nodes == 2 and topo.notes == ()
    paths = {0: ("0000:17:01.0", "0000:18:00.0", "0000:18:08.0"), 1: ("0000:17:01.0", "0000:18:00.0", "0000:18:09.0"),
             2: ("0000:39:01.0", "0000:3a:00.0", "0000:3a:08.0"), 3: ("0000:39:01.0", "0000:3a:00.0", "0000:3a:09.0"),
             4: ("0000:99:01.0", "0000:9a:00.0", "0000:9a:08.0"), 5: ("0000:99:01.0", "0000:9a:00.0", "0000:9a:09.0"),
             6: ("0000:b9:01.0", "0000:ba:00.0", "0000:ba:08.0"), 7: ("0000:b9:01.0", "0000:ba:00.0", "0000:ba:09.0")}
    expected = [T.Gpu(index=i, name="NVIDIA H100 80GB HBM3", pci_bus_id=bdf, uuid=f"GPU-h100-{i}",
                      memory_bytes=85520809984, numa_node=0 if i < 4 else 1,
                      local_cpus="0-55,112-167" if i < 4 else "56-111,168-223", architecture="hopper",
                      pcie=_pcie(5, 16, 5, 16),
                      nvlink=T.GpuNvlink(links=18, generation=4, nvml_version=4, to_gpu=0, to_switch=18, to_other=0,
                                         switches=tuple(tf.H100_SWITCHES)),
                      pci_path=paths[i])
                for i, bdf in enumerate(tf.H100_GPU_BDF)]
    assert list(topo.gpus) == expected
    assert [g.pcie.gbps for g in topo.gpus] == [PCIE5_X16] * 8
    assert [g.nvlink.gbps for g in topo.gpus] == [450.0] * 8
    assert len(topo.nvlink_pairs) == 28
    for p in topo.nvlink_pairs:
        assert p.links == 18 and p.generation == 4 and p.via == "nvswitch" and p.gbps == 450.0
    assert {p.gpus for p in topo.nvlink_pairs} == {(a, b) for a in range(8) for b in range(a + 1, 8)}
    # /sys: the eight GPUs (not the NVSwitches, NVIDIA bridges of class 0x0680)
    assert [(g.pci_bus_id, g.device_id, g.numa_node, g.pcie, g.pci_path) for g in topo.pci_gpus] == [
        (bdf, "0x2330", 0 if i < 4 else 1, _pcie(5, 16, 5, 16), paths[i]) for i, bdf in enumerate(tf.H100_GPU_BDF)]
    assert topo.pci_links == {b: _pcie(5, 16, 5, 16) for path in paths.values() for b in path}
    nic_bdf = ["0000:29:00.0", "0000:2a:00.0", "0000:4b:00.0", "0000:4c:00.0",
               "0000:ab:00.0", "0000:ac:00.0", "0000:cb:00.0", "0000:cc:00.0"]
    nic_path = {i: (paths[i][0], paths[i][1], f"{paths[i][1][:8]}{0x10 + i % 2:02x}.0") for i in range(8)}
    assert list(topo.nics) == [
        T.Nic(name=f"mlx5_{i}", kind="rdma", rate_gbit=400.0, state="ACTIVE", link_layer="InfiniBand", ports=1,
              pci_bus_id=nic_bdf[i], numa_node=0 if i < 4 else 1, netdevs=(f"ibp{i}",), pci_path=nic_path[i])
        for i in range(8)] + [
        T.Nic(name="eno1", kind="ethernet", rate_gbit=None, state="down", link_layer=None, ports=1,
              pci_bus_id=None, numa_node=None, netdevs=("eno1",), pci_path=())]
    assert all(n.active for n in topo.nics[:8]) and not topo.nics[8].active


def test_h800_every_field(tmp_path):
    topo, _, _ = _discover(tmp_path, "8xH800")
    assert topo.nvml.available and topo.numa_nodes == 2 and topo.notes == ()
    for i, (g, bdf) in enumerate(zip(topo.gpus, tf.H800_GPU_BDF)):
        bus = int(bdf[5:7], 16)
        assert g == T.Gpu(index=i, name="NVIDIA H800", pci_bus_id=bdf, uuid=f"GPU-h800-{i}", memory_bytes=85520809984,
                          numa_node=0 if i < 4 else 1, local_cpus="0-55,112-167" if i < 4 else "56-111,168-223",
                          architecture="hopper", pcie=_pcie(5, 16, 5, 16),
                          nvlink=T.GpuNvlink(links=8, generation=4, nvml_version=6, to_gpu=0, to_switch=8,
                                             to_other=0, switches=tuple(tf.H100_SWITCHES)),
                          pci_path=(f"0000:{bus - 3:02x}:01.0", f"0000:{bus - 2:02x}:00.0", f"0000:{bus - 1:02x}:00.0"))
        assert g.nvlink.gbps == 200.0 and g.pcie.gbps == PCIE5_X16
    assert len(topo.nvlink_pairs) == 28
    assert all((p.links, p.generation, p.via, p.gbps) == (8, 4, "nvswitch", 200.0) for p in topo.nvlink_pairs)
    assert [g.pci_bus_id for g in topo.pci_gpus] == tf.H800_GPU_BDF
    assert all(g.device_id == "0x2324" for g in topo.pci_gpus)
    rdma = [n for n in topo.nics if n.kind == "rdma"]
    assert [n.name for n in rdma] == [f"mlx5_{i}" for i in range(8)]
    assert all(n.link_layer == "Ethernet" and n.ports == 1 for n in rdma)
    assert [n.state for n in rdma] == ["ACTIVE"] * 3 + ["DOWN"] + ["ACTIVE"] * 4
    assert [n.rate_gbit for n in rdma] == [400.0] * 3 + [None] + [400.0] * 4  # a down port has no rate
    assert [n.netdevs for n in rdma] == [(f"ens{i}np0",) for i in range(8)]
    assert topo.nics[-1] == T.Nic(name="eno1", kind="ethernet", rate_gbit=25.0, state="up", link_layer=None,
                                  ports=1, pci_bus_id="0000:e1:00.0", numa_node=1, netdevs=("eno1",),
                                  pci_path=("0000:e0:01.0",))


def test_pcie_only_pair_every_field(tmp_path):
    topo, _, _ = _discover(tmp_path, "2xL40S")
    assert list(topo.gpus) == [
        T.Gpu(index=0, name="NVIDIA L40S", pci_bus_id="0000:01:00.0", uuid="GPU-l40s-0", memory_bytes=48305799168,
              numa_node=0, local_cpus="0-31", architecture="ada", pcie=_pcie(4, 16, 1, 16), nvlink=T.GpuNvlink(),
              pci_path=("0000:00:01.0",)),
        T.Gpu(index=1, name="NVIDIA L40S", pci_bus_id="0000:81:00.0", uuid="GPU-l40s-1", memory_bytes=48305799168,
              numa_node=1, local_cpus="32-63", architecture="ada", pcie=_pcie(4, 16, 1, 8), nvlink=T.GpuNvlink(),
              pci_path=("0000:80:01.0",))]
    assert topo.nvlink_pairs == () and topo.pair(0, 1) is None
    assert [g.nvlink.gbps for g in topo.gpus] == [None, None]
    assert [g.pcie.gbps for g in topo.gpus] == [PCIE4_X16] * 2
    assert [(g.pci_bus_id, g.pcie) for g in topo.pci_gpus] == [("0000:01:00.0", _pcie(4, 16, 1, 16)),
                                                               ("0000:81:00.0", _pcie(4, 16, 1, 8))]
    assert list(topo.nics) == [T.Nic(name="enp65s0f0", kind="ethernet", rate_gbit=10.0, state="up", ports=1,
                                     pci_bus_id="0000:41:00.0", numa_node=0, netdevs=("enp65s0f0",),
                                     pci_path=("0000:40:01.0",))]
    assert topo.notes == ()  # NVLink "Not Supported" is an absent feature, not a failure


def test_direct_nvlink_bridges(tmp_path):
    topo, _, _ = _discover(tmp_path, "2xA100-bridged")
    assert [(g.architecture, g.nvlink) for g in topo.gpus] == [
        ("ampere", T.GpuNvlink(links=12, generation=3, nvml_version=4, to_gpu=12))] * 2
    assert topo.nvlink_pairs == (T.NvlinkPair(gpus=(0, 1), links=12, generation=3, via="direct"),)
    assert topo.pair(1, 0).gbps == 300.0 and topo.nics == ()


def test_nvlink_generation_from_nvml_code_when_the_architecture_is_unknown(tmp_path):
    machine = tf.h800()
    for g in machine.gpus:
        g.arch = 0xFFFFFFFF  # NVML_DEVICE_ARCH_UNKNOWN
        for link in g.links[:8]:
            link.version = 7  # NVML_NVLINK_VERSION_5_0
    topo = T.discover(nvml=tf.FakeNvml(machine), sysfs=tf.build_sysfs(str(tmp_path), machine))
    assert {(g.architecture, g.nvlink.generation, g.nvlink.gbps) for g in topo.gpus} == {(None, 5, 400.0)}
    for g in machine.gpus:
        for link in g.links[:8]:
            link.version = 42
    topo = T.discover(nvml=tf.FakeNvml(machine), sysfs=str(tmp_path))
    assert {g.nvlink.generation for g in topo.gpus} == {None}
    assert "GPU 0: unknown NVLink version code 42" in topo.notes
    assert "missing" in T.describe_nominal(topo) and "nccl" not in T.nominal_links(topo)


def test_nvswitch_recognised_in_sys_when_nvml_cannot_say(tmp_path):
    """A driver without nvmlDeviceGetNvLinkRemoteDeviceType: the remote's /sys class (an NVIDIA
    bridge, 0x0680) says NVSwitch; without /sys the links go to "other" and no pair is claimed."""
    fail = {"nvmlDeviceGetNvLinkRemoteDeviceType": tf.NVML_ERROR_NOT_SUPPORTED}
    topo, _, _ = _discover(tmp_path, "8xH100", fail=fail)
    assert {(g.nvlink.to_switch, g.nvlink.to_other) for g in topo.gpus} == {(18, 0)}
    assert len(topo.nvlink_pairs) == 28 and topo.notes == ()
    bare = T.discover(nvml=tf.FakeNvml(tf.h100(), fail=fail), sysfs=str(tmp_path / "empty"))
    assert {(g.nvlink.links, g.nvlink.to_switch, g.nvlink.to_other) for g in bare.gpus} == {(18, 0, 18)}
    assert bare.nvlink_pairs == () and "nccl" not in T.nominal_links(bare)
    assert "far end NVML did not name" in T.describe_nominal(bare)["missing"]["basis"]


def test_nvml_only_without_sys(tmp_path):
    """NVML's answers alone (an empty /sys, as in some containers): no NUMA from /sys, NVML's."""
    machine = tf.h100()
    topo = T.discover(nvml=tf.FakeNvml(machine), sysfs=str(tmp_path))
    assert [g.numa_node for g in topo.gpus] == [0] * 4 + [1] * 4
    assert all(g.pci_path == () and g.local_cpus is None for g in topo.gpus)
    assert topo.pci_gpus == () and topo.nics == () and topo.numa_nodes is None and topo.pci_links == {}
    assert T.nominal_links(topo)["pcie"] == T.NominalLink(PCIE5_X16, 10.0)  # no uplink seen: own link


def test_failing_queries_leave_fields_empty_and_say_why(tmp_path):
    topo, _, _ = _discover(tmp_path, "2xL40S", fail={"nvmlDeviceGetUUID": tf.NVML_ERROR_UNKNOWN,
                                                     "nvmlDeviceGetMaxPcieLinkGeneration": tf.NVML_ERROR_NOT_SUPPORTED})
    assert [g.uuid for g in topo.gpus] == [None, None]
    assert topo.notes == ("GPU 0: nvmlDeviceGetUUID failed: Unknown Error",
                          "GPU 1: nvmlDeviceGetUUID failed: Unknown Error")
    assert [g.pcie.gen for g in topo.gpus] == [4, 4]  # Not Supported by NVML: /sys's value, no note


def test_nvml_shut_down_after_discovery(tmp_path):
    machine = tf.h100()
    fake = tf.FakeNvml(machine)
    T.discover(nvml=fake, sysfs=str(tmp_path))
    assert fake.initialised == 0 and fake.calls[0] == "nvmlInit" and fake.calls[-1] == "nvmlShutdown"


# --------------------------------------------------------------------------------------------------
# Without a GPU


@pytest.mark.parametrize("code, text", [
    (tf.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML not found (libnvidia-ml.so.1 could not be loaded: is the NVIDIA "
                                      "driver installed?)"),
    (tf.NVML_ERROR_DRIVER_NOT_LOADED, "the NVIDIA driver is not loaded (NVML: Driver Not Loaded)"),
    (tf.NVML_ERROR_NO_PERMISSION, "NVML: insufficient permissions to open the GPUs"),
    (tf.NVML_ERROR_UNKNOWN, "NVML failed to initialise: Unknown Error"),
])
def test_no_nvml_still_reports_sys(tmp_path, code, text):
    topo, _, _ = _discover(tmp_path, "8xH100", init_error=code)
    assert topo.nvml == T.NvmlInfo(available=False, error=text)
    assert topo.gpus == () and topo.nvlink_pairs == () and topo.pci_links == {}
    assert len(topo.pci_gpus) == 8 and len(topo.nics) == 9 and topo.numa_nodes == 2
    assert T.nominal_links(topo) == {}
    assert T.to_dict(topo)["nominal"] == {"gpus": [], "links": {}}


def test_nvml_with_no_gpu(tmp_path):
    machine = dataclasses.replace(tf.l40s_pair(), gpus=[])
    topo = T.discover(nvml=tf.FakeNvml(machine), sysfs=str(tmp_path))
    assert topo.nvml.error == "NVML sees no GPU" and not topo.nvml.available
    assert topo.nvml.driver_version == "580.65.06"


def test_pynvml_not_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    topo = T.discover(sysfs=str(tmp_path))
    assert topo.nvml.error == ("nvidia-ml-py is not installed (pip install 'jax_flexlink[cuda]', or pip "
                               "install nvidia-ml-py)")


def test_real_pynvml_without_a_driver():
    pytest.importorskip("pynvml")
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    topo = T.discover()
    assert topo.gpus == () and topo.nvml.error.startswith("NVML not found")


def test_fake_matches_the_real_pynvml():
    """Every function and constant the fake stands in for exists in nvidia-ml-py, with its arity."""
    pynvml = pytest.importorskip("pynvml")
    for name, nargs in tf.PYNVML_FUNCTIONS.items():
        real = getattr(pynvml, name)
        params = [p for p in inspect.signature(real).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert len(params) == nargs, (name, params)
    for name in dir(tf.FakeNvml):
        if name.startswith("NVML_"):
            assert getattr(pynvml, name) == getattr(tf.FakeNvml, name), name
    assert issubclass(pynvml.NVMLError_NotSupported, pynvml.NVMLError)
    assert pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND).value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND


# --------------------------------------------------------------------------------------------------
# Nominal speeds and fits


def test_nominal_links_per_machine(tmp_path):
    expect = {
        "8xH100": {"nccl": (450.0, 10.18), "pcie": (31.508, 10.0), "rdma": (50.0, 15.0)},
        "8xH800": {"nccl": (200.0, 10.18), "pcie": (PCIE5_X16, 10.0), "rdma": (43.75, 15.0)},
        "2xL40S": {"nccl": (PCIE4_X16, 5.6), "pcie": (PCIE4_X16, 10.0)},
        "2xA100-bridged": {"nccl": (300.0, 4.54), "pcie": (PCIE4_X16, 10.0)},
    }
    for name, want in expect.items():
        topo, _, _ = _discover(tmp_path / name, name)
        got = T.nominal_links(topo)
        assert {k: tuple(v) for k, v in got.items()} == want, name
        assert list(got) == list(want)  # nccl (the primary) first
        gbps, latency = got["nccl"]  # a plain (gbps, latency_us) pair
        assert (gbps, latency) == want["nccl"]
    desc = T.describe_nominal(_discover(tmp_path / "again", "8xH100")[0])
    assert desc["pcie"]["basis"] == ("GPU 0: gen5 x16 uplink at 0000:17:01.0 shared by 2 GPUs, 31.508 GB/s per "
                                     "direction (host staging)")
    assert desc["nccl"]["wire"] == "nvlink" and desc["pcie"]["wire"] == "pcie" and desc["rdma"]["wire"] == "nic"
    assert "18 x NVLink 4 (25 GB/s per link and direction), through NVSwitch: 450 GB/s" in desc["nccl"]["basis"]


def test_nominal_links_of_a_subgroup(tmp_path):
    topo, _, _ = _discover(tmp_path, "8xH100")
    # GPUs 0 and 2 sit behind different switches: nobody shares an uplink.
    assert T.nominal_links(topo, [0, 2]) == {"nccl": (450.0, 4.54), "pcie": (PCIE5_X16, 10.0), "rdma": (50.0, 15.0)}
    assert T.nominal_links(topo, [0, 1])["pcie"] == (31.508, 10.0)
    with pytest.raises(KeyError, match="no GPU 9"):
        T.nominal_links(topo, [0, 9])
    l40s, _, _ = _discover(tmp_path / "l40s", "2xL40S")
    assert T.describe_nominal(l40s)["nccl"]["wire"] == "pcie"
    assert "same wires as the pcie link" in T.describe_nominal(l40s)["nccl"]["basis"]
    assert T.describe_nominal(l40s, [0]) == {"pcie": {"gbps": PCIE4_X16, "latency_us": 10.0, "wire": "pcie",
                                                      "basis": "GPU 0: PCIe gen4 x16, 31.507 GB/s per direction "
                                                               "(host staging)"}}


def test_nominal_fits(tmp_path):
    topo, _, _ = _discover(tmp_path, "8xH100")
    fits = T.nominal_fits(topo, ["nccl", "pcie:staged@chunk=4M"])
    assert list(fits) == list(T.COLLECTIVES)
    n = 8
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "ppermute": 1.0, "all_to_all": (n - 1) / n}
    steps = {"all_reduce": 14, "all_gather": 7, "reduce_scatter": 7, "ppermute": 1, "all_to_all": 7}
    for coll, ((a_nccl, b_nccl), (a_pcie, b_pcie)) in fits.items():
        assert a_nccl == pytest.approx((3.6 + steps[coll] * 0.47) * 1e-6)
        assert b_nccl == pytest.approx(factor[coll] / 450e9)
        assert a_pcie == pytest.approx(10e-6) and b_pcie == pytest.approx(factor[coll] / 31.508e9)
    assert T.nominal_fits(topo, ["pcie"], collectives=["ppermute"]) == {"ppermute": [(pytest.approx(10e-6), 1 / 31.508e9)]}
    l40s, _, _ = _discover(tmp_path / "l40s", "2xL40S")
    (a, b), = T.nominal_fits(l40s, ["nccl"], collectives=["all_reduce"])["all_reduce"]
    assert a == pytest.approx((3.6 + 2 * 1.0) * 1e-6) and b == pytest.approx(1 / PCIE4_X16 / 1e9)
    with pytest.raises(KeyError, match="no nominal speed for link 'rdma'"):
        T.nominal_fits(l40s, ["nccl", "rdma"])
    with pytest.raises(KeyError, match="link 'shm'"):
        T.nominal_fits(l40s, ["shm"])
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        T.nominal_fits(l40s, ["nccl"], gpus=[0])


def test_rates_and_parsing():
    assert T.link_kind("nccl") == "nccl" and T.link_kind("pcie:host@chunk=1M") == "pcie"
    assert T.link_kind("emulated@gbps=1") == "emulated"
    assert T.pcie_gbps(3, 16) == 15.754 and T.pcie_gbps(6, 16) == 121.0 and T.pcie_gbps(1, 1) == 0.25
    assert T.pcie_gbps(None, 16) is None and T.pcie_gbps(7, 16) is None and T.pcie_gbps(4, 0) is None
    assert T.nvlink_gbps(1, 4) == 80.0 and T.nvlink_gbps(5, 18) == 900.0 and T.nvlink_gbps(6, 18) is None
    assert T.nvlink_gbps(4, 0) is None
    assert T.normalize_bus_id(b"00000000:1B:00.0\x00") == "0000:1b:00.0"
    assert T.normalize_bus_id("0001:C3:00.1") == "0001:c3:00.1"
    for bad in ("", "1b:00.0", "00000000:1B:00", "zzzz:00:00.0"):
        with pytest.raises(ValueError, match="not a PCI bus id"):
            T.normalize_bus_id(bad)
    assert [T._gen(s) for s in ("2.5 GT/s PCIe", "5 GT/s", "8.0 GT/s PCIe", "16.0 GT/s PCIe", "32.0 GT/s PCIe",
                                "64.0 GT/s PCIe", "Unknown", "", None, "3 GT/s")] == [1, 2, 3, 4, 5, 6, None, None,
                                                                                         None, None]
    assert [T._width(s) for s in ("16", "x8", "0", "junk", None)] == [16, 8, None, None, None]
    assert [T._rate_gbit(s) for s in ("400 Gb/sec (4X NDR)", "100 Gb/sec (2X HDR)", "", "fast")] == [400.0, 100.0,
                                                                                                     None, None]


# --------------------------------------------------------------------------------------------------
# JSON


@pytest.mark.parametrize("name", list(tf.MACHINES))
def test_json_round_trip(tmp_path, name):
    topo, _, _ = _discover(tmp_path, name)
    text = T.dumps(topo)
    doc = json.loads(text)
    assert doc["format"] == "jax_flexlink.topology" and doc["version"] == 1
    back = T.loads(text)
    assert back == topo
    assert T.dumps(back) == text
    assert doc["nominal"]["links"] == json.loads(json.dumps(T.describe_nominal(topo)))
    path = tmp_path / "t.json"
    path.write_text(text)
    assert T.load(str(path)) == topo


def test_json_fields(tmp_path):
    doc = T.to_dict(_discover(tmp_path, "8xH100")[0])
    assert list(doc) == ["format", "version", "host", "sysfs", "nvml", "numa_nodes", "gpus", "nvlink_pairs",
                         "pci_gpus", "pci_links", "nics", "notes", "nominal"]
    g = doc["gpus"][0]
    assert g == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:19:00.0", "uuid": "GPU-h100-0",
                 "memory_bytes": 85520809984, "numa_node": 0, "local_cpus": "0-55,112-167", "architecture": "hopper",
                 "pcie": {"gen": 5, "width": 16, "current_gen": 5, "current_width": 16, "gbps": PCIE5_X16},
                 "nvlink": {"links": 18, "generation": 4, "nvml_version": 4, "to_gpu": 0, "to_switch": 18,
                            "to_other": 0, "switches": tf.H100_SWITCHES, "gbps": 450.0},
                 "pci_path": ["0000:17:01.0", "0000:18:00.0", "0000:18:08.0"]}
    assert doc["nvlink_pairs"][0] == {"gpus": [0, 1], "links": 18, "generation": 4, "via": "nvswitch", "gbps": 450.0}
    assert doc["nics"][0] == {"name": "mlx5_0", "kind": "rdma", "rate_gbit": 400.0, "state": "ACTIVE",
                              "link_layer": "InfiniBand", "ports": 1, "pci_bus_id": "0000:29:00.0", "numa_node": 0,
                              "netdevs": ["ibp0"], "pci_path": ["0000:17:01.0", "0000:18:00.0", "0000:18:10.0"]}
    assert doc["nominal"]["gpus"] == list(range(8))


def test_docs_schema_lists_every_field(tmp_path):
    """docs/topology.md documents every key the JSON has."""
    text = open(os.path.join(ROOT, "docs", "topology.md"), encoding="utf-8").read()
    doc = T.to_dict(_discover(tmp_path, "8xH100")[0])
    keys = set(doc) | set(doc["nvml"]) | set(doc["gpus"][0]) | set(doc["gpus"][0]["pcie"]) \
        | set(doc["gpus"][0]["nvlink"]) | set(doc["nvlink_pairs"][0]) | set(doc["pci_gpus"][0]) | set(doc["nics"][0]) \
        | set(doc["nominal"]) | set(doc["nominal"]["links"]["nccl"])
    missing = sorted(k for k in keys if f"`{k}`" not in text and f"`{k}[]`" not in text)
    assert not missing, missing


def _valid(tmp_path):
    return T.to_dict(_discover(tmp_path, "2xA100-bridged")[0])


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="something"), "format: expected 'jax_flexlink.topology', got 'something'"),
    (lambda d: d.update(version=2), "version: this jax_flexlink reads topology version 1, the file has 2 "
                                    "(written by a newer jax_flexlink)"),
    (lambda d: d.update(version="1"), "version: expected an integer, got '1'"),
    (lambda d: d.pop("version"), "version: missing"),
    (lambda d: d["gpus"][0].pop("index"), "gpus[0].index: missing"),
    (lambda d: d["gpus"][1].update(name=None), "gpus[1].name: expected a string, got None"),
    (lambda d: d["gpus"][0]["pcie"].update(gen="five"), "gpus[0].pcie.gen: expected an integer or null, got 'five'"),
    (lambda d: d["gpus"][0]["nvlink"].update(links=True), "gpus[0].nvlink.links: expected an integer or null"),
    (lambda d: d["gpus"][0].update(pci_path=["0000:00:02.0", 7]), "gpus[0].pci_path[1]: expected a string, got 7"),
    (lambda d: d["gpus"][1].update(index=0), "gpus: duplicate GPU index in [0, 0]"),
    (lambda d: d["gpus"].append(3), "gpus[2]: expected an object, got 3"),
    (lambda d: d["nvlink_pairs"][0].update(gpus=[0, 5]), "nvlink_pairs[0].gpus: expected two different GPU indices"),
    (lambda d: d["nvlink_pairs"][0].update(gpus=[1, 1]), "nvlink_pairs[0].gpus: expected two different GPU indices"),
    (lambda d: d["nvlink_pairs"][0].update(via="pcie"), "nvlink_pairs[0].via: expected 'direct' or 'nvswitch'"),
    (lambda d: d["nvlink_pairs"][0].update(links=0), "nvlink_pairs[0].links: expected a positive integer, got 0"),
    (lambda d: d.update(nics=[{"name": "x", "kind": "carrier-pigeon"}]), "nics[0].kind: expected 'rdma' or 'ethernet'"),
    (lambda d: d.update(nics=[{"name": "x", "kind": "rdma", "rate_gbit": "fast"}]), "nics[0].rate_gbit: expected a number"),
    (lambda d: d.update(pci_links={"0000:00:02.0": 5}), "pci_links.0000:00:02.0: expected an object or null, got 5"),
    (lambda d: d.update(nvml=[]), "nvml: expected an object or null, got []"),
    (lambda d: d.update(notes="none"), "notes: expected a list or null, got 'none'"),
])
def test_bad_documents(tmp_path, change, message):
    doc = _valid(tmp_path)
    change(doc)
    with pytest.raises(T.TopologyError) as info:
        T.from_dict(doc)
    assert str(info.value).startswith(message), str(info.value)


def test_bad_text():
    with pytest.raises(T.TopologyError, match="not JSON"):
        T.loads("{")
    with pytest.raises(T.TopologyError, match="expected a JSON object, got list"):
        T.loads("[]")


def test_unknown_keys_and_missing_optionals_are_accepted():
    topo = T.from_dict({"format": T.FORMAT, "version": 1, "gpus": [{"index": 0, "name": "G", "pci_bus_id": "x",
                                                                     "future_field": 1}], "later": {}})
    assert topo.gpus == (T.Gpu(index=0, name="G", pci_bus_id="x"),) and topo.nvml == T.NvmlInfo()


# --------------------------------------------------------------------------------------------------
# The command


def _main(args, nvml=None):
    out, err = io.StringIO(), io.StringIO()
    rc = T.main(args, nvml=nvml, out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def test_command_json_and_report(tmp_path):
    machine = tf.h100()
    root = tf.build_sysfs(str(tmp_path / "sys"), machine)
    rc, out, err = _main(["--json", "--sysfs", root], nvml=tf.FakeNvml(machine))
    assert rc == 0 and err == ""
    assert T.from_dict(json.loads(out)) == T.discover(nvml=tf.FakeNvml(machine), sysfs=root)
    rc, out, err = _main(["--sysfs", root], nvml=tf.FakeNvml(machine))
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[1] == "NVML 13.580.65.06, driver 580.65.06, CUDA driver API 13.0"
    assert "GPUs (8):" in lines
    row = next(line for line in lines if "0000:19:00.0  79.6 GiB" in line)
    assert row.split() == ["0", "NVIDIA", "H100", "80GB", "HBM3", "0000:19:00.0", "79.6", "GiB", "0", "gen5", "x16",
                           "(gen5", "x16)", "63.016", "18", "x", "NVLink", "4", "(18", "to", "NVSwitch;", "450",
                           "GB/s)"]
    assert "  GPU0  X      NV18S  NV18S  NV18S  NV18S  NV18S  NV18S  NV18S" in lines
    assert any(line.startswith("  nccl       450 GB/s   10.18 us   GPU 0: 18 x NVLink 4") for line in lines)
    assert any(line.startswith("  mlx5_0     rdma InfiniBand  400 Gb/s  ACTIVE  PCI 0000:29:00.0") for line in lines)


def test_command_subgroup_and_load(tmp_path):
    machine = tf.l40s_pair()
    root = tf.build_sysfs(str(tmp_path / "sys"), machine)
    path = tmp_path / "l40s.json"
    path.write_text(T.dumps(T.discover(nvml=tf.FakeNvml(machine), sysfs=root)))
    rc, out, _ = _main(["--load", str(path)])
    assert rc == 0 and "  0    NVIDIA L40S  0000:01:00.0  45.0 GiB  0     gen4 x16 (gen1 x16)  31.507  none" in out
    rc, out, _ = _main(["--load", str(path), "--json", "--gpus", "1"])
    assert rc == 0 and json.loads(out)["nominal"]["gpus"] == [1]
    assert set(json.loads(out)["nominal"]["links"]) == {"pcie"}
    rc, out, _ = _main(["--load", str(path), "--gpus", "0,1"])
    assert rc == 0 and "Nominal link speeds for GPUs [0, 1]:" in out


@pytest.mark.parametrize("args, message", [
    (["--gpus", "0,7"], "--gpus 0,7: 'no GPU 7 (GPUs: [0, 1])'"),
    (["--gpus", "one"], "--gpus one: invalid literal"),
])
def test_command_bad_gpus(tmp_path, args, message):
    machine = tf.l40s_pair()
    path = tmp_path / "t.json"
    path.write_text(T.dumps(T.discover(nvml=tf.FakeNvml(machine), sysfs=str(tmp_path))))
    rc, out, err = _main(["--load", str(path), *args])
    assert rc == 2 and message in err


def test_command_bad_file_and_usage(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "jax_flexlink.topology", "version": 9}')
    rc, out, err = _main(["--load", str(bad)])
    assert rc == 2 and out == "" and "bad.json: version: this jax_flexlink reads topology version 1" in err
    rc, _, err = _main(["--load", str(tmp_path / "absent.json")])
    assert rc == 2 and "No such file" in err
    rc, _, err = _main(["--bogus"])
    assert rc == 2 and "unrecognized arguments: --bogus" in err


def test_command_without_nvml(tmp_path):
    machine = tf.h100()
    root = tf.build_sysfs(str(tmp_path / "sys"), machine)
    fake = tf.FakeNvml(machine, init_error=tf.NVML_ERROR_LIBRARY_NOT_FOUND)
    rc, out, err = _main(["--sysfs", root], nvml=fake)
    assert rc == 1 and err == ""
    assert out.splitlines()[1] == ("no NVIDIA GPU visible: NVML not found (libnvidia-ml.so.1 could not be loaded: "
                                   "is the NVIDIA driver installed?)")
    assert "NVIDIA PCI devices in /sys (8):" in out and "NICs (9):" in out and "Traceback" not in out
    rc, out, err = _main(["--json", "--sysfs", root], nvml=fake)
    assert rc == 1 and json.loads(out)["nvml"]["available"] is False
    assert err == ("jax_flexlink.topology: no NVIDIA GPU visible: NVML not found (libnvidia-ml.so.1 could not be "
                   "loaded: is the NVIDIA driver installed?)\n")


@pytest.mark.parametrize("how", [["-m", "jax_flexlink.topology"], [os.path.join("jax_flexlink", "topology.py")]])
def test_command_on_this_machine(tmp_path, how):
    """This machine has no NVIDIA driver: exit status 1, a clear line, no traceback; the file runs on
    its own too (before the package is built)."""
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    machine = tf.l40s_pair()
    root = tf.build_sysfs(str(tmp_path / "sys"), machine)
    res = subprocess.run([sys.executable, *how, "--json", "--sysfs", root], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith("jax_flexlink.topology: no NVIDIA GPU visible: ")
    doc = json.loads(res.stdout)
    assert doc["gpus"] == [] and [g["pci_bus_id"] for g in doc["pci_gpus"]] == ["0000:01:00.0", "0000:81:00.0"]
