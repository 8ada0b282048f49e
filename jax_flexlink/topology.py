"""The machine FlexLink runs on: GPUs, NVLink, PCIe, NUMA, RDMA NICs; nominal link speeds.

    python -m jax_flexlink.topology            # a readable report
    python -m jax_flexlink.topology --json     # the JSON a topology model loads (docs/topology.md)
    python -m jax_flexlink.topology --load FILE   # the report of a recorded machine

From Python:

    from jax_flexlink import topology
    topo = topology.discover()                  # NVML (nvidia-ml-py) and /sys; never raises for a
                                                # missing GPU, driver or NVML: topo.nvml.error says why
    topology.nominal_links(topo)                # {"nccl": NominalLink(gbps, latency_us), "pcie": ...}
    topology.nominal_fits(topo, ["nccl", "pcie"])   # stage-1 fits {collective: [(alpha_s, beta_s_per_byte)]}
    topology.dumps(topo); topology.loads(text)  # JSON, format "jax_flexlink.topology" version 1

This file uses nothing but the standard library (and pynvml when it is installed, the `cuda` extra),
so `python3 jax_flexlink/topology.py` also works on a checkout that is not built yet.

Exit status of the command: 0 when NVML reported at least one GPU (or a loaded file has one), 1 when
no NVIDIA GPU is visible through NVML (the report, with what /sys shows, is printed all the same),
2 on a usage error or a file that is not a valid topology.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import socket
import sys
from typing import Any, Iterable, NamedTuple, Sequence

FORMAT = "jax_flexlink.topology"
VERSION = 1

# --------------------------------------------------------------------------------------------------
# Nominal rates (docs/topology.md, "Nominal speeds", gives the sources)

# NVLink: GB/s (1e9 B/s) per link and per direction. NVIDIA quotes bidirectional totals per GPU:
# P100 4 links 160 GB/s, V100 6 links 300 GB/s, A100 12 links 600 GB/s, H100 18 links 900 GB/s
# (H800: 8 links, 400 GB/s), B200 18 links 1.8 TB/s.
NVLINK_GBPS_PER_LINK = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}

# PCIe: GB/s per lane and per direction after line encoding (8b/10b to gen 2, 128b/130b gens 3-5,
# gen 6 FLIT mode 242/256 of 64 GT/s).
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.9846, 4: 1.9692, 5: 3.9385, 6: 7.5625}
_PCIE_GTS_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}

# The NVLink generation of each NVML architecture (nvmlDeviceGetArchitecture); None: no NVLink.
_ARCH = {2: ("kepler", None), 3: ("maxwell", None), 4: ("pascal", 1), 5: ("volta", 2),
         6: ("turing", 2), 7: ("ampere", 3), 8: ("ada", None), 9: ("hopper", 4), 10: ("blackwell", 5)}
# nvmlDeviceGetNvLinkVersion's codes as nvml.h defines them (NVML_NVLINK_VERSION_1_0 = 1, 2_0 = 2,
# 2_2 = 3, 3_0 = 4, 3_1 = 5, 4_0 = 6, 5_0 = 7). Drivers have not always returned these codes (hwloc
# reads 4 as "v4" on H100), so the architecture decides when it is known.
_NVML_NVLINK_CODE_TO_GEN = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5}

# Latency model of NCCL's ring (src/graph/tuning.cc): a base latency plus one hardware latency per
# ring step (LL protocol): base 3.6 us, NVLink 0.47 us per step, PCI 1.0 us per step.
NCCL_BASE_LATENCY_US = 3.6
NCCL_STEP_LATENCY_US = {"nvlink": 0.47, "pci": 1.0}
# Estimates, no published source: measured values replace them (stage 1). pcie: a device-to-host
# and a host-to-device cudaMemcpyAsync (~2-3 us each to start and cross the bus) plus cross-device
# ordering through host flags and the side-stream fork/join. rdma: a verbs loopback through the
# switch (~3-5 us) plus the same staging and ordering on both ends.
PCIE_LATENCY_US = 10.0
RDMA_LATENCY_US = 15.0

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "ppermute", "all_to_all")


class TopologyError(ValueError):
    """A topology file (or dict) that is not valid: the message names the field."""


# --------------------------------------------------------------------------------------------------
# The data


@dataclasses.dataclass(frozen=True)
class Pcie:
    """A device's PCIe link. gen/width: the link's nominal (maximum) rate, the lower of the device's
    and its slot's; current_*: what it runs at now (GPUs train down when idle)."""
    gen: int | None = None
    width: int | None = None
    current_gen: int | None = None
    current_width: int | None = None

    @property
    def gbps(self) -> float | None:
        """Nominal GB/s per direction: lanes x the generation's per-lane rate."""
        return pcie_gbps(self.gen, self.width)


@dataclasses.dataclass(frozen=True)
class GpuNvlink:
    """A GPU's active NVLinks and where they go."""
    links: int = 0                      # active links
    generation: int | None = None       # NVLink generation (1-5), from the architecture or NVML
    nvml_version: int | None = None     # nvmlDeviceGetNvLinkVersion's raw code (link 0 that answered)
    to_gpu: int = 0                     # links to another GPU of this machine
    to_switch: int = 0                  # links to an NVSwitch
    to_other: int = 0                   # links to something else (CPU/NPU, a hidden GPU, unknown)
    switches: tuple[str, ...] = ()      # PCI bus ids of the NVSwitches its links reach

    @property
    def gbps(self) -> float | None:
        """Nominal GB/s per direction over all active links."""
        return nvlink_gbps(self.generation, self.links)


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int                          # NVML index (PCI bus order)
    name: str
    pci_bus_id: str                     # sysfs form, "0000:18:00.0"
    uuid: str | None = None
    memory_bytes: int | None = None
    numa_node: int | None = None
    local_cpus: str | None = None       # cpulist of the GPU's NUMA node, "0-55,112-167"
    architecture: str | None = None     # "hopper", ...
    pcie: Pcie = Pcie()
    nvlink: GpuNvlink = GpuNvlink()
    pci_path: tuple[str, ...] = ()      # PCI bridges from the root port down to the GPU (sysfs)


@dataclasses.dataclass(frozen=True)
class NvlinkPair:
    """NVLink between two GPUs: `links` direct links, or through NVSwitch (then `links` is the smaller
    of the two GPUs' links into the switches, what bounds the pair)."""
    gpus: tuple[int, int]
    links: int
    generation: int | None
    via: str                            # "direct" | "nvswitch"

    @property
    def gbps(self) -> float | None:
        return nvlink_gbps(self.generation, self.links)


@dataclasses.dataclass(frozen=True)
class PciGpu:
    """An NVIDIA display or 3D controller as /sys shows it (with or without NVML)."""
    pci_bus_id: str
    device_id: str | None = None        # "0x2330"
    numa_node: int | None = None
    pcie: Pcie = Pcie()
    pci_path: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Nic:
    """A network device: an RDMA device of /sys/class/infiniband (kind "rdma"), or a netdev of
    /sys/class/net backed by a device and not part of an RDMA device (kind "ethernet")."""
    name: str
    kind: str                           # "rdma" | "ethernet"
    rate_gbit: float | None = None      # Gb/s (bits), the fastest active port / the netdev's speed
    state: str | None = None            # "ACTIVE", "DOWN" (rdma); "up", "down" (ethernet)
    link_layer: str | None = None       # "InfiniBand" | "Ethernet" (rdma)
    ports: int = 0
    pci_bus_id: str | None = None
    numa_node: int | None = None
    netdevs: tuple[str, ...] = ()
    pci_path: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return (self.state or "").upper() in ("ACTIVE", "UP")


@dataclasses.dataclass(frozen=True)
class NvmlInfo:
    available: bool = False
    error: str | None = None            # why no GPU is visible through NVML
    driver_version: str | None = None
    cuda_driver_version: int | None = None   # 13000 = CUDA 13.0
    nvml_version: str | None = None


@dataclasses.dataclass(frozen=True)
class Topology:
    host: str
    sysfs: str
    nvml: NvmlInfo
    gpus: tuple[Gpu, ...] = ()
    nvlink_pairs: tuple[NvlinkPair, ...] = ()
    pci_gpus: tuple[PciGpu, ...] = ()
    pci_links: dict = dataclasses.field(default_factory=dict)   # bridge bus id -> Pcie
    nics: tuple[Nic, ...] = ()
    numa_nodes: int | None = None
    notes: tuple[str, ...] = ()

    def gpu(self, index: int) -> Gpu:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"no GPU {index} (GPUs: {[g.index for g in self.gpus]})")

    def pair(self, a: int, b: int) -> NvlinkPair | None:
        key = (min(a, b), max(a, b))
        for p in self.nvlink_pairs:
            if p.gpus == key:
                return p
        return None


def pcie_gbps(gen: int | None, width: int | None) -> float | None:
    if gen is None or width is None or gen not in PCIE_GBPS_PER_LANE or width <= 0:
        return None
    return round(PCIE_GBPS_PER_LANE[gen] * width, 3)


def nvlink_gbps(generation: int | None, links: int) -> float | None:
    if not links or generation not in NVLINK_GBPS_PER_LINK:
        return None
    return NVLINK_GBPS_PER_LINK[generation] * links


# --------------------------------------------------------------------------------------------------
# /sys

_BDF = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML's "00000000:18:00.0" (or b"...") -> sysfs's "0000:18:00.0"."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    text = bus_id.strip().rstrip("\x00").lower()
    if not _BDF.match(text):
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain, rest = text.split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


class _Sysfs:
    def __init__(self, root: str):
        self.root = root

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def read(self, *parts: str) -> str | None:
        try:
            with open(self.path(*parts), encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError:  # missing, or unreadable (a netdev's speed while it is down: EINVAL)
            return None

    def listdir(self, *parts: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(*parts)))
        except OSError:
            return []

    def pci_device_dir(self, bus_id: str) -> str:
        return self.path("bus", "pci", "devices", bus_id)

    def has_pci_device(self, bus_id: str) -> bool:
        return os.path.isdir(self.pci_device_dir(bus_id))

    def pci_path(self, bus_id: str) -> tuple[str, ...]:
        """The PCI functions above the device, root port first (from the device's real path)."""
        real = os.path.realpath(self.pci_device_dir(bus_id))
        parts = [p for p in real.split(os.sep) if _BDF.match(p)]
        return tuple(parts[:-1]) if parts and parts[-1] == bus_id else tuple(parts)

    def int_attr(self, base: str, name: str) -> int | None:
        raw = self.read(base, name)
        if raw is None:
            return None
        try:
            return int(raw, 0)
        except ValueError:
            return None

    def pci_numa_node(self, bus_id: str) -> int | None:
        node = self.int_attr(self.pci_device_dir(bus_id), "numa_node")
        return None if node is None or node < 0 else node

    def pci_link(self, bus_id: str) -> Pcie:
        """The device's link from /sys: the lower of its own and (when it has one) its parent
        port's maximum, and the current state."""
        base = self.pci_device_dir(bus_id)
        gen, width = _gen(self.read(base, "max_link_speed")), _width(self.read(base, "max_link_width"))
        path = self.pci_path(bus_id)
        if path:
            parent = self.pci_device_dir(path[-1])
            pgen, pwidth = _gen(self.read(parent, "max_link_speed")), _width(self.read(parent, "max_link_width"))
            gen = _min(gen, pgen)
            width = _min(width, pwidth)
        return Pcie(gen=gen, width=width, current_gen=_gen(self.read(base, "current_link_speed")),
                    current_width=_width(self.read(base, "current_link_width")))

    def bridge_link(self, bus_id: str) -> Pcie:
        """A bridge's own link attributes (no parent): what the link it reports can carry."""
        base = self.pci_device_dir(bus_id)
        return Pcie(gen=_gen(self.read(base, "max_link_speed")), width=_width(self.read(base, "max_link_width")),
                    current_gen=_gen(self.read(base, "current_link_speed")),
                    current_width=_width(self.read(base, "current_link_width")))


def _min(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _gen(speed: str | None) -> int | None:
    """'16.0 GT/s PCIe' / '8 GT/s' / '2.5 GT/s' -> 4 / 3 / 1; 'Unknown', '' -> None."""
    if not speed:
        return None
    m = re.match(r"\s*([0-9.]+)\s*GT/s", speed)
    if not m:
        return None
    try:
        return _PCIE_GTS_TO_GEN.get(float(m.group(1)))
    except ValueError:
        return None


def _width(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        width = int(raw.strip().lstrip("xX"))
    except ValueError:
        return None
    return width if width > 0 else None


def _sys_nvidia_gpus(sysfs: _Sysfs) -> list[PciGpu]:
    out = []
    for bus_id in sysfs.listdir("bus", "pci", "devices"):
        base = sysfs.pci_device_dir(bus_id)
        vendor, cls = sysfs.read(base, "vendor"), sysfs.read(base, "class")
        if (vendor or "").lower() != "0x10de" or not (cls or "").lower().startswith(("0x0300", "0x0302")):
            continue
        out.append(PciGpu(pci_bus_id=bus_id, device_id=sysfs.read(base, "device"),
                          numa_node=sysfs.pci_numa_node(bus_id), pcie=sysfs.pci_link(bus_id),
                          pci_path=sysfs.pci_path(bus_id)))
    return out


def _device_bus_id(sysfs: _Sysfs, device_link: str) -> str | None:
    """The PCI bus id behind a class device's `device` link, or None (virtio, platform devices)."""
    if not os.path.exists(device_link):
        return None
    name = os.path.basename(os.path.realpath(device_link))
    return name if _BDF.match(name) else None


def _rate_gbit(raw: str | None) -> float | None:
    """'400 Gb/sec (4X NDR)' -> 400.0."""
    if not raw:
        return None
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", raw)
    return float(m.group(1)) if m else None


def _sys_nics(sysfs: _Sysfs) -> list[Nic]:
    nics: list[Nic] = []
    claimed: set[str] = set()
    for dev in sysfs.listdir("class", "infiniband"):
        base = sysfs.path("class", "infiniband", dev)
        ports = sysfs.listdir(base, "ports")
        rates, states, layers = [], [], []
        for port in ports:
            pbase = os.path.join(base, "ports", port)
            state = sysfs.read(pbase, "state")  # "4: ACTIVE"
            state = state.split(":", 1)[-1].strip() if state else None
            states.append(state)
            layers.append(sysfs.read(pbase, "link_layer"))
            rate = _rate_gbit(sysfs.read(pbase, "rate"))
            if rate is not None and (state or "").upper() == "ACTIVE":
                rates.append(rate)
        bus_id = _device_bus_id(sysfs, os.path.join(base, "device"))
        netdevs = tuple(sysfs.listdir(base, "device", "net"))
        claimed.update(netdevs)
        state = "ACTIVE" if any((s or "").upper() == "ACTIVE" for s in states) else (states[0] if states else None)
        nics.append(Nic(name=dev, kind="rdma", rate_gbit=max(rates) if rates else None, state=state,
                        link_layer=next((layer for layer in layers if layer), None), ports=len(ports),
                        pci_bus_id=bus_id, numa_node=sysfs.pci_numa_node(bus_id) if bus_id else None,
                        netdevs=netdevs, pci_path=sysfs.pci_path(bus_id) if bus_id else ()))
    for ifname in sysfs.listdir("class", "net"):
        base = sysfs.path("class", "net", ifname)
        if ifname in claimed or not os.path.exists(os.path.join(base, "device")):
            continue  # an RDMA device's netdev (listed above), or virtual (lo, bridges, veth)
        bus_id = _device_bus_id(sysfs, os.path.join(base, "device"))
        speed = sysfs.int_attr(base, "speed")  # Mb/s; -1 or unreadable while down
        nics.append(Nic(name=ifname, kind="ethernet",
                        rate_gbit=speed / 1000.0 if speed and speed > 0 else None,
                        state=sysfs.read(base, "operstate"), ports=1, pci_bus_id=bus_id,
                        numa_node=sysfs.pci_numa_node(bus_id) if bus_id else None, netdevs=(ifname,),
                        pci_path=sysfs.pci_path(bus_id) if bus_id else ()))
    return nics


def _numa_nodes(sysfs: _Sysfs) -> int | None:
    nodes = [n for n in sysfs.listdir("devices", "system", "node") if re.fullmatch(r"node\d+", n)]
    return len(nodes) or None


# --------------------------------------------------------------------------------------------------
# NVML


def _text(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


def _nvml_error_text(nvml, e: Exception) -> str:
    value = getattr(e, "value", None)
    if value == getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12):
        return ("NVML not found (libnvidia-ml.so.1 could not be loaded: is the NVIDIA driver "
                "installed?)")
    if value == getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", 9):
        return "the NVIDIA driver is not loaded (NVML: Driver Not Loaded)"
    if value == getattr(nvml, "NVML_ERROR_NO_PERMISSION", 4):
        return "NVML: insufficient permissions to open the GPUs"
    return f"NVML failed to initialise: {e}"


class _Nvml:
    """Calls into pynvml (or a stand-in) where any single query may fail: a failed query gives None
    and, unless the feature is merely absent (Not Supported), a note."""

    def __init__(self, nvml, notes: list[str]):
        self.nvml = nvml
        self.notes = notes
        self.error_cls = getattr(nvml, "NVMLError", Exception)

    def absent(self, e) -> bool:
        return getattr(e, "value", None) in (getattr(self.nvml, "NVML_ERROR_NOT_SUPPORTED", 3),
                                             getattr(self.nvml, "NVML_ERROR_INVALID_ARGUMENT", 2),
                                             getattr(self.nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13))

    def call(self, what: str, fn_name: str, *args):
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.error_cls as e:
            if not self.absent(e):
                self.notes.append(f"{what}: {fn_name} failed: {e}")
            return None


def _nvml_gpu(q: _Nvml, index: int, sysfs: _Sysfs) -> tuple[Gpu, Any] | None:
    handle = q.call(f"GPU {index}", "nvmlDeviceGetHandleByIndex", index)
    if handle is None:
        return None
    pci = q.call(f"GPU {index}", "nvmlDeviceGetPciInfo", handle)
    try:
        bus_id = normalize_bus_id(pci.busId) if pci is not None else None
    except ValueError:
        bus_id = None
    if bus_id is None:
        q.notes.append(f"GPU {index}: no PCI bus id from NVML")
        bus_id = ""
    name = q.call(f"GPU {index}", "nvmlDeviceGetName", handle)
    uuid = q.call(f"GPU {index}", "nvmlDeviceGetUUID", handle)
    mem = q.call(f"GPU {index}", "nvmlDeviceGetMemoryInfo", handle)
    arch_code = q.call(f"GPU {index}", "nvmlDeviceGetArchitecture", handle)
    arch, arch_gen = _ARCH.get(arch_code, (None, None)) if arch_code is not None else (None, None)
    pcie = Pcie(gen=q.call(f"GPU {index}", "nvmlDeviceGetMaxPcieLinkGeneration", handle),
                width=q.call(f"GPU {index}", "nvmlDeviceGetMaxPcieLinkWidth", handle),
                current_gen=q.call(f"GPU {index}", "nvmlDeviceGetCurrPcieLinkGeneration", handle),
                current_width=q.call(f"GPU {index}", "nvmlDeviceGetCurrPcieLinkWidth", handle))
    on_sys = bool(bus_id) and sysfs.has_pci_device(bus_id)
    if on_sys:
        sys_link = sysfs.pci_link(bus_id)
        pcie = Pcie(gen=pcie.gen if pcie.gen is not None else sys_link.gen,
                    width=pcie.width if pcie.width is not None else sys_link.width,
                    current_gen=pcie.current_gen if pcie.current_gen is not None else sys_link.current_gen,
                    current_width=pcie.current_width if pcie.current_width is not None else sys_link.current_width)
    numa = sysfs.pci_numa_node(bus_id) if on_sys else None
    if numa is None:
        node = q.call(f"GPU {index}", "nvmlDeviceGetNumaNodeId", handle)
        numa = node if isinstance(node, int) and node >= 0 else None
    gpu = Gpu(index=index, name=_text(name) if name is not None else "unknown", pci_bus_id=bus_id,
              uuid=_text(uuid) if uuid is not None else None,
              memory_bytes=int(mem.total) if mem is not None else None, numa_node=numa,
              local_cpus=sysfs.read(sysfs.pci_device_dir(bus_id), "local_cpulist") if on_sys else None,
              architecture=arch, pcie=pcie, pci_path=sysfs.pci_path(bus_id) if on_sys else (),
              nvlink=GpuNvlink(generation=arch_gen))
    return gpu, handle


def _is_nvswitch(sysfs: _Sysfs, bus_id: str | None) -> bool:
    """An NVIDIA non-PCI bridge (class 0x0680) in /sys: how hwloc recognises an NVSwitch."""
    if not bus_id:
        return False
    base = sysfs.pci_device_dir(bus_id)
    return ((sysfs.read(base, "vendor") or "").lower() == "0x10de"
            and (sysfs.read(base, "class") or "").lower().startswith("0x0680"))


def _nvlinks(q: _Nvml, gpu: Gpu, handle, gpu_bus_ids: dict[str, int], sysfs: _Sysfs):
    """The GPU's active links: (GpuNvlink, {peer GPU index: links})."""
    nvml = q.nvml
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    t_gpu = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_GPU", 0)
    t_switch = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    links = to_gpu = to_switch = to_other = 0
    codes: list[int] = []
    peers: dict[int, int] = {}
    switches: set[str] = set()
    for link in range(max_links):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except q.error_cls as e:
            if not q.absent(e):
                q.notes.append(f"GPU {gpu.index} NVLink {link}: nvmlDeviceGetNvLinkState failed: {e}")
            break  # no NVLink (Not Supported at link 0) or no link of this number
        if state != enabled:
            continue
        links += 1
        code = q.call(f"GPU {gpu.index} NVLink {link}", "nvmlDeviceGetNvLinkVersion", handle, link)
        if code:
            codes.append(code)
        remote = q.call(f"GPU {gpu.index} NVLink {link}", "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        try:
            remote_id = normalize_bus_id(remote.busId) if remote is not None else None
        except ValueError:
            remote_id = None
        kind = q.call(f"GPU {gpu.index} NVLink {link}", "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        if kind is None and _is_nvswitch(sysfs, remote_id):  # older drivers: no remote device type
            kind = t_switch
        if remote_id in gpu_bus_ids and kind in (None, t_gpu):
            to_gpu += 1
            peer = gpu_bus_ids[remote_id]
            peers[peer] = peers.get(peer, 0) + 1
        elif kind == t_switch:
            to_switch += 1
            if remote_id:
                switches.add(remote_id)
        else:
            to_other += 1
    generation = gpu.nvlink.generation
    decoded = _NVML_NVLINK_CODE_TO_GEN.get(codes[0]) if codes else None
    if generation is None and links:
        generation = decoded
        if generation is None and codes:
            q.notes.append(f"GPU {gpu.index}: unknown NVLink version code {codes[0]}")
    info = GpuNvlink(links=links, generation=generation if links else None,
                     nvml_version=codes[0] if codes else None, to_gpu=to_gpu, to_switch=to_switch,
                     to_other=to_other, switches=tuple(sorted(switches)))
    return info, peers


def _pairs(gpus: Sequence[Gpu], direct: dict[int, dict[int, int]]) -> list[NvlinkPair]:
    pairs = []
    for i, a in enumerate(gpus):
        for b in gpus[i + 1:]:
            # Each end counts the pair's links; one end may have failed to say where a link goes.
            n_direct = max(direct.get(a.index, {}).get(b.index, 0), direct.get(b.index, {}).get(a.index, 0))
            gen = _min(a.nvlink.generation, b.nvlink.generation)
            if n_direct:
                pairs.append(NvlinkPair(gpus=(a.index, b.index), links=n_direct, generation=gen, via="direct"))
                continue
            sa, sb = a.nvlink, b.nvlink
            # Through NVSwitch: both reach a switch, and the same one when NVML named them (GPUs
            # whose links reach disjoint switch sets are in different NVLink domains).
            if sa.to_switch and sb.to_switch and (not sa.switches or not sb.switches
                                                  or set(sa.switches) & set(sb.switches)):
                pairs.append(NvlinkPair(gpus=(a.index, b.index), links=min(sa.to_switch, sb.to_switch),
                                        generation=gen, via="nvswitch"))
    return pairs


def discover(nvml: Any = None, sysfs: str = "/sys") -> Topology:
    """The machine as NVML and /sys show it.

    nvml: the pynvml module (default: `import pynvml`) or a stand-in with the same functions.
    sysfs: the root of /sys (a recorded or fake tree in tests).
    Never raises because a GPU, the driver, NVML or pynvml is missing: `topo.nvml.error` says why and
    `topo.gpus` is empty; what /sys shows (NVIDIA PCI devices, NICs, NUMA nodes) is reported anyway.
    """
    fs = _Sysfs(sysfs)
    notes: list[str] = []
    info = NvmlInfo()
    gpus: list[Gpu] = []
    pairs: list[NvlinkPair] = []
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415 - optional (the `cuda` extra, nvidia-ml-py)
        except ImportError:
            nvml = None
            info = NvmlInfo(error="nvidia-ml-py is not installed (pip install 'jax_flexlink[cuda]', "
                                  "or pip install nvidia-ml-py)")
    if nvml is not None:
        info, gpus, pairs = _discover_nvml(nvml, fs, notes)
    pci_links: dict[str, Pcie] = {}
    for g in gpus:
        for bridge in g.pci_path:
            pci_links.setdefault(bridge, fs.bridge_link(bridge))
    return Topology(host=socket.gethostname(), sysfs=sysfs, nvml=info, gpus=tuple(gpus),
                    nvlink_pairs=tuple(pairs), pci_gpus=tuple(_sys_nvidia_gpus(fs)),
                    pci_links=pci_links, nics=tuple(_sys_nics(fs)), numa_nodes=_numa_nodes(fs),
                    notes=tuple(notes))


def _discover_nvml(nvml, fs: _Sysfs, notes: list[str]):
    error_cls = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except error_cls as e:
        return NvmlInfo(error=_nvml_error_text(nvml, e)), [], []
    except OSError as e:  # a broken library
        return NvmlInfo(error=f"NVML could not be loaded: {e}"), [], []
    try:
        q = _Nvml(nvml, notes)
        driver = q.call("system", "nvmlSystemGetDriverVersion")
        cuda = q.call("system", "nvmlSystemGetCudaDriverVersion")
        version = q.call("system", "nvmlSystemGetNVMLVersion")
        count = q.call("system", "nvmlDeviceGetCount") or 0
        found = [r for r in (_nvml_gpu(q, i, fs) for i in range(count)) if r is not None]
        bus_ids = {g.pci_bus_id: g.index for g, _ in found if g.pci_bus_id}
        gpus, direct = [], {}
        for g, handle in found:
            link_info, peers = _nvlinks(q, g, handle, bus_ids, fs)
            gpus.append(dataclasses.replace(g, nvlink=link_info))
            direct[g.index] = peers
        info = NvmlInfo(available=bool(gpus), error=None if gpus else "NVML sees no GPU",
                        driver_version=_text(driver) if driver is not None else None,
                        cuda_driver_version=int(cuda) if cuda is not None else None,
                        nvml_version=_text(version) if version is not None else None)
        return info, gpus, _pairs(gpus, direct)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - nothing to do about a failing shutdown
            pass


# --------------------------------------------------------------------------------------------------
# Nominal link speeds (stage 1's starting point)


class NominalLink(NamedTuple):
    """A link's nominal bus bandwidth (GB/s, the nccl-tests busbw it could reach: the emulated links'
    and the balancer's convention) and per-call latency (us, AllReduce over the whole group)."""
    gbps: float
    latency_us: float


def _group(topo: Topology, gpus: Iterable[int] | None) -> list[Gpu]:
    if gpus is None:
        return list(topo.gpus)
    return [topo.gpu(i) for i in gpus]


def _ring_steps(collective: str, n: int) -> int:
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1,
            "all_to_all": n - 1, "ppermute": 1}[collective]


def _bus_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw / algbw (docs/bench.md): time = size * factor / busbw."""
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective == "ppermute":
        return 1.0
    return (n - 1) / n


def _pcie_share(topo: Topology, gpu: Gpu, group: Sequence[Gpu]) -> tuple[float | None, str]:
    """The GPU's host-staging bandwidth: its own link, and every upstream link it shares with other
    GPUs of the group (a PCIe switch's uplink), divided among them."""
    own = gpu.pcie.gbps
    best, why = own, f"PCIe gen{gpu.pcie.gen} x{gpu.pcie.width}"
    for bridge in gpu.pci_path:
        link = topo.pci_links.get(bridge)
        cap = link.gbps if link is not None else None
        if cap is None:
            continue
        sharing = sum(1 for g in group if bridge in g.pci_path)
        if sharing > 1 and (best is None or cap / sharing < best):
            best, why = cap / sharing, (f"gen{link.gen} x{link.width} uplink at {bridge} shared by "
                                        f"{sharing} GPUs")
    return best, why


def describe_nominal(topo: Topology, gpus: Iterable[int] | None = None) -> dict[str, dict]:
    """nominal_links with the reasoning: {link kind: {"gbps", "latency_us", "wire", "basis"}};
    "wire" is what the bytes cross: "nvlink", "pcie" (nccl without NVLink shares it with pcie), "nic".

    Kinds: "nccl" and "pcie" when the group has GPUs with known rates, "rdma" when /sys shows an
    active RDMA NIC. Unknown rates leave a kind out (its "basis" in the result's "missing" entry).
    """
    group = _group(topo, gpus)
    n = len(group)
    out: dict[str, dict] = {}
    missing: list[str] = []
    if not group:
        return {"missing": {"basis": "no GPUs"}}
    # pcie: the slowest GPU's host-staging bandwidth bounds the group.
    shares = [(_pcie_share(topo, g, group), g) for g in group]
    known = [(bw, why, g) for (bw, why), g in shares if bw is not None]
    pcie = None
    if len(known) == len(group):
        bw, why, g = min(known, key=lambda t: t[0])
        pcie = round(bw, 3)
        out["pcie"] = {"gbps": pcie, "latency_us": PCIE_LATENCY_US, "wire": "pcie",
                       "basis": f"GPU {g.index}: {why}, {pcie:g} GB/s per direction (host staging)"}
    else:
        missing.append("pcie: PCIe generation/width unknown for GPU "
                       + ", ".join(str(g.index) for (bw, _), g in shares if bw is None))
    # nccl: NVLink when every pair of the group has it, else NCCL's ring crosses PCIe.
    steps = 2 * (n - 1)
    if n >= 2 and all(topo.pair(a.index, b.index) is not None for i, a in enumerate(group) for b in group[i + 1:]):
        if all(topo.pair(a.index, b.index).via == "nvswitch" for i, a in enumerate(group) for b in group[i + 1:]):
            per_gpu = [(g.nvlink.gbps, g) for g in group]
            how = "through NVSwitch"
        else:  # direct links (or mixed): a GPU's NVLink bandwidth to the rest of the group
            per_gpu = []
            for g in group:
                total = 0.0
                for other in group:
                    p = topo.pair(g.index, other.index) if other is not g else None
                    total += (p.gbps or 0.0) if p is not None else 0.0
                per_gpu.append((total or None, g))
            how = "direct links to the group's other GPUs"
        if all(bw is not None for bw, _ in per_gpu):
            bw, g = min(per_gpu, key=lambda t: t[0])
            out["nccl"] = {"gbps": bw, "wire": "nvlink",
                           "latency_us": round(NCCL_BASE_LATENCY_US + steps * NCCL_STEP_LATENCY_US["nvlink"], 3),
                           "basis": f"GPU {g.index}: {g.nvlink.links} x NVLink {g.nvlink.generation} "
                                    f"({NVLINK_GBPS_PER_LINK[g.nvlink.generation]:g} GB/s per link and "
                                    f"direction), {how}: {bw:g} GB/s"}
        else:
            missing.append("nccl: NVLink generation unknown")
    elif n >= 2 and any(g.nvlink.to_other for g in group):
        missing.append("nccl: GPUs have NVLinks whose far end NVML did not name, so which GPUs they join "
                       "is unknown")
    elif n >= 2 and pcie is not None:
        nv = [p for i, a in enumerate(group) for b in group[i + 1:] if (p := topo.pair(a.index, b.index))]
        out["nccl"] = {"gbps": pcie, "wire": "pcie",
                       "latency_us": round(NCCL_BASE_LATENCY_US + steps * NCCL_STEP_LATENCY_US["pci"], 3),
                       "basis": ("no NVLink between some GPUs of the group" if nv else "no NVLink")
                                + ": NCCL's ring crosses PCIe, the same wires as the pcie link"}
    elif n >= 2:
        missing.append("nccl: no NVLink and PCIe rate unknown")
    # rdma: NIC loopback, the active RDMA NICs' rate shared by the group's GPUs.
    rdma = [nic for nic in topo.nics if nic.kind == "rdma" and nic.active and nic.rate_gbit]
    if rdma:
        total = sum(nic.rate_gbit for nic in rdma) / 8.0
        per = min(total / n, max(nic.rate_gbit for nic in rdma) / 8.0)
        out["rdma"] = {"gbps": round(per, 3), "latency_us": RDMA_LATENCY_US, "wire": "nic",
                       "basis": f"{len(rdma)} active RDMA NIC(s), {total:g} GB/s together, over {n} GPUs "
                                "(not a FlexLink link yet; it also crosses each GPU's PCIe link)"}
    if missing:
        out["missing"] = {"basis": "; ".join(missing)}
    order = ("nccl", "pcie", "rdma", "missing")
    return {k: out[k] for k in order if k in out}


def nominal_links(topo: Topology, gpus: Iterable[int] | None = None) -> dict[str, NominalLink]:
    """Nominal (GB/s bus bandwidth, latency us) per link kind for a group of GPUs (default: all):
    {"nccl": NominalLink(450.0, 10.18), "pcie": NominalLink(31.5, 10.0), "rdma": ...}.

    Without a tuning cache, stage 1 starts from these (docs/topology.md, "Wiring into the engine");
    `nominal_fits` turns them into the balancer's α–β fits.
    """
    return {k: NominalLink(v["gbps"], v["latency_us"]) for k, v in describe_nominal(topo, gpus).items()
            if k != "missing"}


def link_kind(spec: str) -> str:
    """'nccl', 'pcie:host@chunk=4M' -> 'nccl', 'pcie' (FLEXLINK_LINKS syntax: kind[:name][@...])."""
    return spec.split("@", 1)[0].split(":", 1)[0].strip()


def nominal_fits(topo: Topology, links: Sequence[str], gpus: Iterable[int] | None = None,
                 collectives: Sequence[str] = COLLECTIVES) -> dict[str, list[tuple[float, float]]]:
    """Stage-1 fits from nominal speeds, in the shape tune() returns and the tuning cache stores:
    {collective: [(alpha_s, beta_s_per_byte) per link, in `links` order]}.

    links: the engine's link specs or kinds, primary first (e.g. _flexlink.links(): "nccl", "pcie").
    beta is per byte of nccl-tests size (docs/bench.md): busbw factor / (gbps * 1e9); alpha: NCCL's
    ring latency for the collective's steps on the nccl link, the constant estimates on the others.
    Raises KeyError naming a link whose kind has no nominal speed on this topology.
    """
    group = list(_group(topo, gpus))
    n = len(group)
    desc = describe_nominal(topo, gpus)
    if n < 2:
        raise ValueError(f"nominal_fits needs a group of at least 2 GPUs, got {n}")
    out: dict[str, list[tuple[float, float]]] = {}
    for coll in collectives:
        row = []
        for spec in links:
            kind = link_kind(spec)
            if kind not in desc or kind == "missing":
                why = desc.get("missing", {}).get("basis", "")
                raise KeyError(f"no nominal speed for link {spec!r} (kind {kind!r}) on this topology"
                               + (f": {why}" if why else ""))
            gbps = desc[kind]["gbps"]
            if kind == "nccl":
                step = NCCL_STEP_LATENCY_US["nvlink" if desc[kind]["wire"] == "nvlink" else "pci"]
                alpha_us = NCCL_BASE_LATENCY_US + _ring_steps(coll, n) * step
            else:
                alpha_us = desc[kind]["latency_us"]
            row.append((alpha_us * 1e-6, _bus_factor(coll, n) / (gbps * 1e9)))
        out[coll] = row
    return out


# --------------------------------------------------------------------------------------------------
# JSON


def _pcie_dict(p: Pcie) -> dict:
    return {"gen": p.gen, "width": p.width, "current_gen": p.current_gen,
            "current_width": p.current_width, "gbps": p.gbps}


def to_dict(topo: Topology) -> dict:
    """The JSON document (docs/topology.md). `gbps` fields and "nominal" are derived; load() recomputes
    them from the raw fields."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "host": topo.host,
        "sysfs": topo.sysfs,
        "nvml": dataclasses.asdict(topo.nvml),
        "numa_nodes": topo.numa_nodes,
        "gpus": [{
            "index": g.index, "name": g.name, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid,
            "memory_bytes": g.memory_bytes, "numa_node": g.numa_node, "local_cpus": g.local_cpus,
            "architecture": g.architecture, "pcie": _pcie_dict(g.pcie),
            "nvlink": {"links": g.nvlink.links, "generation": g.nvlink.generation,
                       "nvml_version": g.nvlink.nvml_version, "to_gpu": g.nvlink.to_gpu,
                       "to_switch": g.nvlink.to_switch, "to_other": g.nvlink.to_other,
                       "switches": list(g.nvlink.switches), "gbps": g.nvlink.gbps},
            "pci_path": list(g.pci_path)} for g in topo.gpus],
        "nvlink_pairs": [{"gpus": list(p.gpus), "links": p.links, "generation": p.generation,
                          "via": p.via, "gbps": p.gbps} for p in topo.nvlink_pairs],
        "pci_gpus": [{"pci_bus_id": g.pci_bus_id, "device_id": g.device_id, "numa_node": g.numa_node,
                      "pcie": _pcie_dict(g.pcie), "pci_path": list(g.pci_path)} for g in topo.pci_gpus],
        "pci_links": {k: _pcie_dict(v) for k, v in sorted(topo.pci_links.items())},
        "nics": [{"name": c.name, "kind": c.kind, "rate_gbit": c.rate_gbit, "state": c.state,
                  "link_layer": c.link_layer, "ports": c.ports, "pci_bus_id": c.pci_bus_id,
                  "numa_node": c.numa_node, "netdevs": list(c.netdevs), "pci_path": list(c.pci_path)}
                 for c in topo.nics],
        "notes": list(topo.notes),
        "nominal": {"gpus": [g.index for g in topo.gpus], "links": describe_nominal(topo)} if topo.gpus
        else {"gpus": [], "links": {}},
    }


def dumps(topo: Topology, indent: int | None = 2) -> str:
    return json.dumps(to_dict(topo), indent=indent, sort_keys=False)


class _Reader:
    def __init__(self, where: str):
        self.where = where

    def fail(self, key: str, expected: str, value) -> TopologyError:
        return TopologyError(f"{self.where}{key}: expected {expected}, got {value!r}")

    def get(self, d: dict, key: str, kind: str, optional: bool = True, default=None):
        if not isinstance(d, dict):
            raise TopologyError(f"{self.where.rstrip('.') or 'topology'}: expected an object, got {d!r}")
        if key not in d:
            if optional:
                return default
            raise TopologyError(f"{self.where}{key}: missing")
        v = d[key]
        if v is None and optional:
            return default
        ok = {"int": isinstance(v, int) and not isinstance(v, bool),
              "num": isinstance(v, (int, float)) and not isinstance(v, bool),
              "str": isinstance(v, str), "bool": isinstance(v, bool), "list": isinstance(v, list),
              "dict": isinstance(v, dict)}[kind]
        if not ok:
            names = {"int": "an integer", "num": "a number", "str": "a string", "bool": "true or false",
                     "list": "a list", "dict": "an object"}
            raise self.fail(key, names[kind] + (" or null" if optional else ""), v)
        return v

    def sub(self, key) -> "_Reader":
        return _Reader(f"{self.where}{key}.")

    def strings(self, d: dict, key: str) -> tuple[str, ...]:
        items = self.get(d, key, "list", default=[])
        for i, s in enumerate(items):
            if not isinstance(s, str):
                raise self.fail(f"{key}[{i}]", "a string", s)
        return tuple(items)


def _read_pcie(r: _Reader, d) -> Pcie:
    if d is None:
        return Pcie()
    return Pcie(gen=r.get(d, "gen", "int"), width=r.get(d, "width", "int"),
                current_gen=r.get(d, "current_gen", "int"), current_width=r.get(d, "current_width", "int"))


def from_dict(d: dict) -> Topology:
    """A Topology from the JSON document; TopologyError naming the field when it is not valid."""
    r = _Reader("")
    if not isinstance(d, dict):
        raise TopologyError(f"topology: expected a JSON object, got {type(d).__name__}")
    fmt = d.get("format")
    if fmt != FORMAT:
        raise TopologyError(f"format: expected {FORMAT!r}, got {fmt!r} (not a jax_flexlink topology)")
    version = r.get(d, "version", "int", optional=False)
    if version != VERSION:
        raise TopologyError(f"version: this jax_flexlink reads topology version {VERSION}, the file has "
                            f"{version}" + (" (written by a newer jax_flexlink)" if version > VERSION else ""))
    nv = r.get(d, "nvml", "dict", default={})
    rn = r.sub("nvml")
    nvml = NvmlInfo(available=rn.get(nv, "available", "bool", default=False), error=rn.get(nv, "error", "str"),
                    driver_version=rn.get(nv, "driver_version", "str"),
                    cuda_driver_version=rn.get(nv, "cuda_driver_version", "int"),
                    nvml_version=rn.get(nv, "nvml_version", "str"))
    gpus = []
    for i, g in enumerate(r.get(d, "gpus", "list", default=[])):
        rg = r.sub(f"gpus[{i}]")
        nl = rg.get(g, "nvlink", "dict", default={})
        rl = rg.sub("nvlink")
        gpus.append(Gpu(
            index=rg.get(g, "index", "int", optional=False), name=rg.get(g, "name", "str", optional=False),
            pci_bus_id=rg.get(g, "pci_bus_id", "str", optional=False), uuid=rg.get(g, "uuid", "str"),
            memory_bytes=rg.get(g, "memory_bytes", "int"), numa_node=rg.get(g, "numa_node", "int"),
            local_cpus=rg.get(g, "local_cpus", "str"), architecture=rg.get(g, "architecture", "str"),
            pcie=_read_pcie(rg.sub("pcie"), rg.get(g, "pcie", "dict")),
            nvlink=GpuNvlink(links=rl.get(nl, "links", "int", default=0),
                             generation=rl.get(nl, "generation", "int"),
                             nvml_version=rl.get(nl, "nvml_version", "int"),
                             to_gpu=rl.get(nl, "to_gpu", "int", default=0),
                             to_switch=rl.get(nl, "to_switch", "int", default=0),
                             to_other=rl.get(nl, "to_other", "int", default=0),
                             switches=rl.strings(nl, "switches")),
            pci_path=rg.strings(g, "pci_path")))
    indices = [g.index for g in gpus]
    if len(set(indices)) != len(indices):
        raise TopologyError(f"gpus: duplicate GPU index in {indices}")
    pairs = []
    for i, p in enumerate(r.get(d, "nvlink_pairs", "list", default=[])):
        rp = r.sub(f"nvlink_pairs[{i}]")
        ends = rp.get(p, "gpus", "list", optional=False)
        if len(ends) != 2 or not all(isinstance(e, int) and e in indices for e in ends) or ends[0] == ends[1]:
            raise rp.fail("gpus", f"two different GPU indices of {indices}", ends)
        via = rp.get(p, "via", "str", optional=False)
        if via not in ("direct", "nvswitch"):
            raise rp.fail("via", "'direct' or 'nvswitch'", via)
        links = rp.get(p, "links", "int", optional=False)
        if links < 1:
            raise rp.fail("links", "a positive integer", links)
        pairs.append(NvlinkPair(gpus=(min(ends), max(ends)), links=links,
                                generation=rp.get(p, "generation", "int"), via=via))
    pci_gpus = []
    for i, g in enumerate(r.get(d, "pci_gpus", "list", default=[])):
        rg = r.sub(f"pci_gpus[{i}]")
        pci_gpus.append(PciGpu(pci_bus_id=rg.get(g, "pci_bus_id", "str", optional=False),
                               device_id=rg.get(g, "device_id", "str"), numa_node=rg.get(g, "numa_node", "int"),
                               pcie=_read_pcie(rg.sub("pcie"), rg.get(g, "pcie", "dict")),
                               pci_path=rg.strings(g, "pci_path")))
    pci_links = {}
    links_doc = r.get(d, "pci_links", "dict", default={})
    for k in links_doc:
        pci_links[k] = _read_pcie(r.sub(f"pci_links[{k}]"), r.sub("pci_links").get(links_doc, k, "dict"))
    nics = []
    for i, c in enumerate(r.get(d, "nics", "list", default=[])):
        rc = r.sub(f"nics[{i}]")
        kind = rc.get(c, "kind", "str", optional=False)
        if kind not in ("rdma", "ethernet"):
            raise rc.fail("kind", "'rdma' or 'ethernet'", kind)
        nics.append(Nic(name=rc.get(c, "name", "str", optional=False), kind=kind,
                        rate_gbit=rc.get(c, "rate_gbit", "num"), state=rc.get(c, "state", "str"),
                        link_layer=rc.get(c, "link_layer", "str"), ports=rc.get(c, "ports", "int", default=0),
                        pci_bus_id=rc.get(c, "pci_bus_id", "str"), numa_node=rc.get(c, "numa_node", "int"),
                        netdevs=rc.strings(c, "netdevs"), pci_path=rc.strings(c, "pci_path")))
    return Topology(host=r.get(d, "host", "str", default=""), sysfs=r.get(d, "sysfs", "str", default=""),
                    nvml=nvml, gpus=tuple(gpus), nvlink_pairs=tuple(pairs), pci_gpus=tuple(pci_gpus),
                    pci_links=pci_links, nics=tuple(nics), numa_nodes=r.get(d, "numa_nodes", "int"),
                    notes=r.strings(d, "notes"))


def loads(text: str) -> Topology:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TopologyError(f"not JSON: {e}") from None
    return from_dict(doc)


def load(path: str) -> Topology:
    with open(path, encoding="utf-8") as f:
        return loads(f.read())


# --------------------------------------------------------------------------------------------------
# The report


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def _opt(v, fmt="{}") -> str:
    return "?" if v is None else fmt.format(v)


def format_report(topo: Topology) -> str:
    lines = [f"jax_flexlink.topology: host {topo.host or '?'}, /sys at {topo.sysfs or '?'}"]
    nv = topo.nvml
    if nv.available:
        cuda = (f"{nv.cuda_driver_version // 1000}.{nv.cuda_driver_version % 1000 // 10}"
                if nv.cuda_driver_version else "?")
        lines.append(f"NVML {nv.nvml_version or '?'}, driver {nv.driver_version or '?'}, CUDA driver API {cuda}")
    else:
        lines.append(f"no NVIDIA GPU visible: {nv.error or 'unknown reason'}")
    lines.append(f"NUMA nodes: {_opt(topo.numa_nodes)}")
    if topo.gpus:
        lines.append("")
        lines.append(f"GPUs ({len(topo.gpus)}):")
        rows = [("idx", "name", "PCI bus id", "memory", "NUMA", "PCIe max (now)", "GB/s", "NVLink")]
        for g in topo.gpus:
            pcie = f"gen{_opt(g.pcie.gen)} x{_opt(g.pcie.width)} (gen{_opt(g.pcie.current_gen)} x{_opt(g.pcie.current_width)})"
            nl = g.nvlink
            if nl.links:
                where = ", ".join(f"{n} {w}" for n, w in ((nl.to_gpu, "to GPUs"), (nl.to_switch, "to NVSwitch"),
                                                          (nl.to_other, "to other")) if n)
                nvl = f"{nl.links} x NVLink {_opt(nl.generation)} ({where}; {_opt(nl.gbps, '{:g}')} GB/s)"
            else:
                nvl = "none"
            rows.append((str(g.index), g.name, g.pci_bus_id, _gib(g.memory_bytes), _opt(g.numa_node), pcie,
                         _opt(g.pcie.gbps, "{:g}"), nvl))
        lines += _table(rows)
        if len(topo.gpus) > 1:
            lines.append("")
            lines.append("NVLink between GPUs (NV<links>, via NVSwitch marked S; - none):")
            head = ["", *[f"GPU{g.index}" for g in topo.gpus]]
            rows = [tuple(head)]
            for a in topo.gpus:
                row = [f"GPU{a.index}"]
                for b in topo.gpus:
                    if a is b:
                        row.append("X")
                        continue
                    p = topo.pair(a.index, b.index)
                    row.append("-" if p is None else f"NV{p.links}{'S' if p.via == 'nvswitch' else ''}")
                rows.append(tuple(row))
            lines += _table(rows)
    lines.append("")
    if topo.pci_gpus:
        lines.append(f"NVIDIA PCI devices in /sys ({len(topo.pci_gpus)}):")
        for g in topo.pci_gpus:
            lines.append(f"  {g.pci_bus_id}  device {g.device_id or '?'}  NUMA {_opt(g.numa_node)}  "
                         f"PCIe gen{_opt(g.pcie.gen)} x{_opt(g.pcie.width)}")
    else:
        lines.append("NVIDIA PCI devices in /sys: none")
    if topo.nics:
        lines.append(f"NICs ({len(topo.nics)}):")
        for c in topo.nics:
            rate = f"{c.rate_gbit:g} Gb/s" if c.rate_gbit else "rate ?"
            layer = f" {c.link_layer}" if c.link_layer else ""
            net = f"  netdev {','.join(c.netdevs)}" if c.netdevs and c.kind == "rdma" else ""
            lines.append(f"  {c.name:<10} {c.kind}{layer}  {rate}  {c.state or '?'}  "
                         f"PCI {c.pci_bus_id or '-'}  NUMA {_opt(c.numa_node)}{net}")
    else:
        lines.append("NICs: none")
    if topo.gpus:
        lines.append("")
        lines.append(f"Nominal link speeds for stage 1 (all {len(topo.gpus)} GPUs; bus bandwidth, "
                     "AllReduce latency):")
        for kind, v in describe_nominal(topo).items():
            if kind == "missing":
                lines.append(f"  missing: {v['basis']}")
            else:
                lines.append(f"  {kind:<5} {v['gbps']:>8g} GB/s {v['latency_us']:>7g} us   {v['basis']}")
    for note in topo.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def main(argv: Sequence[str] | None = None, *, nvml: Any = None, out=None, err=None) -> int:
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    p = argparse.ArgumentParser(
        prog="python -m jax_flexlink.topology",
        description="The machine's GPUs (NVML through nvidia-ml-py), NVLink, PCIe, NUMA nodes and NICs "
                    "(/sys), and the nominal link speeds stage 1 starts from.",
        epilog="exit status: 0 GPUs found, 1 no NVIDIA GPU visible (the report is printed anyway), "
               "2 usage error or invalid --load file. Schema: docs/topology.md.")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the report")
    p.add_argument("--load", metavar="FILE", help="report a recorded topology (JSON) instead of this machine")
    p.add_argument("--sysfs", default="/sys", metavar="DIR", help="root of /sys (default /sys)")
    p.add_argument("--gpus", metavar="LIST", help="nominal speeds for these GPU indices only, e.g. 0,1,2,3")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):  # --help, usage errors
            a = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if a.load:
        try:
            topo = load(a.load)
        except (OSError, TopologyError) as e:
            print(f"jax_flexlink.topology: {a.load}: {e}", file=err)
            return 2
    else:
        topo = discover(nvml=nvml, sysfs=a.sysfs)
    if a.gpus:
        try:
            chosen = [int(x) for x in a.gpus.split(",") if x.strip()]
            nominal = describe_nominal(topo, chosen)
        except (ValueError, KeyError) as e:
            print(f"jax_flexlink.topology: --gpus {a.gpus}: {e}", file=err)
            return 2
    if a.json:
        doc = to_dict(topo)
        if a.gpus:
            doc["nominal"] = {"gpus": chosen, "links": nominal}
        out.write(json.dumps(doc, indent=2) + "\n")
    else:
        out.write(format_report(topo))
        if a.gpus:
            out.write(f"\nNominal link speeds for GPUs {chosen}:\n")
            for kind, v in nominal.items():
                out.write(f"  {kind:<5} {v.get('gbps', '')!s:>8} GB/s {v.get('latency_us', '')!s:>7} us   "
                          f"{v['basis']}\n" if kind != "missing" else f"  missing: {v['basis']}\n")
    if not topo.gpus:
        if a.json:  # the report says it itself; with --json stdout is the document
            print(f"jax_flexlink.topology: no NVIDIA GPU visible: {topo.nvml.error or 'unknown reason'}",
                  file=err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
