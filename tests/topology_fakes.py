"""Recorded machines for tests/test_topology.py: a stand-in for pynvml and a fake /sys tree.

Each machine is described once (`Machine`): its GPUs as NVML reports them and its PCI tree, NICs and
NUMA nodes as /sys shows them. `FakeNvml(machine)` answers the pynvml calls jax_flexlink.topology
makes, with pynvml's names, constants and error classes (checked against the real nvidia-ml-py in
test_topology.py); `build_sysfs(root, machine)` writes the /sys files and links it reads.

Machines: 8 x H100 SXM (HGX: 18 NVLink 4 links per GPU into 4 NVSwitches, two GPUs and two NDR
InfiniBand NICs behind each PCIe switch), 8 x H800 (8 NVLink links per GPU, each GPU behind its own
PCIe switch, RoCE NICs and an Ethernet port), 2 x L40S (PCIe only, idle links trained down), and
2 x A100 PCIe joined by NVLink bridges (12 direct links).
"""
from __future__ import annotations

import dataclasses
import os

# pynvml's values (nvml.h)
NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_UNKNOWN = 999


@dataclasses.dataclass
class Link:
    remote: str                # NVML bus id of the far end ("00000000:C5:00.0")
    remote_type: int           # NVML_NVLINK_DEVICE_TYPE_*
    version: int = 6           # nvmlDeviceGetNvLinkVersion's code
    active: bool = True


@dataclasses.dataclass
class FakeGpu:
    nvml_bus_id: str           # NVML's form: 8-digit domain, upper case
    name: str
    uuid: str
    memory: int
    arch: int                  # NVML_DEVICE_ARCH_*
    max_gen: int
    max_width: int
    cur_gen: int
    cur_width: int
    numa: int                  # what nvmlDeviceGetNumaNodeId says
    links: list[Link] | None   # None: NVLink not supported (the call raises)
    max_links: int = 18        # links after `links` up to this many exist but are inactive


@dataclasses.dataclass
class PciNode:
    bdf: str
    parent: str | None         # None: a root port of its domain's root complex
    vendor: str = "0x10de"
    cls: str = "0x060400"      # PCI bridge
    device: str = "0x0000"
    numa: int = -1
    cpus: str | None = None
    max_speed: str | None = None
    max_width: str | None = None
    cur_speed: str | None = None
    cur_width: str | None = None


@dataclasses.dataclass
class FakeNic:
    name: str                  # infiniband device (mlx5_0) or netdev (eno1)
    bdf: str | None
    kind: str                  # "rdma" | "ethernet"
    rate: str | None = None    # rdma port rate text, "400 Gb/sec (4X NDR)"
    state: str = "4: ACTIVE"   # rdma port state text
    link_layer: str = "InfiniBand"
    netdevs: tuple[str, ...] = ()
    speed: str | None = None   # ethernet /sys/class/net/X/speed (Mb/s); None: unreadable
    operstate: str = "up"


@dataclasses.dataclass
class Machine:
    name: str
    gpus: list[FakeGpu]
    pci: list[PciNode]
    nics: list[FakeNic]
    numa_nodes: int
    driver: str = "580.65.06"
    cuda: int = 13000
    nvml_version: str = "13.580.65.06"


# --------------------------------------------------------------------------------------------------
# The stand-in for pynvml


class NVMLError(Exception):
    def __new__(cls, value):
        sub = {NVML_ERROR_NOT_SUPPORTED: NVMLError_NotSupported,
               NVML_ERROR_LIBRARY_NOT_FOUND: NVMLError_LibraryNotFound,
               NVML_ERROR_DRIVER_NOT_LOADED: NVMLError_DriverNotLoaded}.get(value, cls) if cls is NVMLError else cls
        obj = Exception.__new__(sub)
        obj.value = value
        return obj

    def __init__(self, value):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return {NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_LIBRARY_NOT_FOUND:
                "NVML Shared Library Not Found", NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
                NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument", NVML_ERROR_UNKNOWN: "Unknown Error",
                NVML_ERROR_NO_PERMISSION: "Insufficient Permissions"}.get(self.value, f"error {self.value}")


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_DriverNotLoaded(NVMLError):
    pass


class _PciInfo:
    def __init__(self, bus_id: str):
        self.busId = bus_id.encode()                   # pynvml gives bytes
        self.busIdLegacy = bus_id[4:].encode()
        domain, bus, rest = bus_id.split(":")
        self.domain, self.bus, self.device = int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)


class _Memory:
    def __init__(self, total):
        self.total, self.free, self.used = total, total, 0


class FakeNvml:
    """The subset of pynvml that jax_flexlink.topology calls. `init_error`: an NVML error code
    nvmlInit raises; `fail`: {function name: error code} raised by that call on every GPU."""
    NVMLError = NVMLError
    NVML_SUCCESS = NVML_SUCCESS
    NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = NVML_ERROR_NO_PERMISSION
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_UNKNOWN = NVML_ERROR_UNKNOWN
    NVML_FEATURE_DISABLED = 0
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 36
    NVML_NVLINK_DEVICE_TYPE_GPU = 0x00
    NVML_NVLINK_DEVICE_TYPE_IBMNPU = 0x01
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02
    NVML_NVLINK_DEVICE_TYPE_UNKNOWN = 0xFF

    def __init__(self, machine: Machine | None, init_error: int | None = None, fail: dict | None = None):
        self.machine = machine
        self.init_error = init_error
        self.fail = dict(fail or {})
        self.initialised = 0
        self.calls: list[str] = []

    def _check(self, name):
        self.calls.append(name)
        if not self.initialised:
            raise NVMLError(1)  # Uninitialized
        if name in self.fail:
            raise NVMLError(self.fail[name])

    def _gpu(self, handle) -> FakeGpu:
        return self.machine.gpus[handle]

    # system
    def nvmlInit(self):
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self):
        self.calls.append("nvmlShutdown")
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self):
        self._check("nvmlSystemGetDriverVersion")
        return self.machine.driver

    def nvmlSystemGetCudaDriverVersion(self):
        self._check("nvmlSystemGetCudaDriverVersion")
        return self.machine.cuda

    def nvmlSystemGetNVMLVersion(self):
        self._check("nvmlSystemGetNVMLVersion")
        return self.machine.nvml_version

    def nvmlDeviceGetCount(self):
        self._check("nvmlDeviceGetCount")
        return len(self.machine.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.machine.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return index

    # device
    def nvmlDeviceGetName(self, h):
        self._check("nvmlDeviceGetName")
        return self._gpu(h).name

    def nvmlDeviceGetUUID(self, h):
        self._check("nvmlDeviceGetUUID")
        return self._gpu(h).uuid

    def nvmlDeviceGetPciInfo(self, h):
        self._check("nvmlDeviceGetPciInfo")
        return _PciInfo(self._gpu(h).nvml_bus_id)

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        self._check("nvmlDeviceGetMemoryInfo")
        return _Memory(self._gpu(h).memory)

    def nvmlDeviceGetArchitecture(self, h):
        self._check("nvmlDeviceGetArchitecture")
        return self._gpu(h).arch

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        self._check("nvmlDeviceGetMaxPcieLinkGeneration")
        return self._gpu(h).max_gen

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        self._check("nvmlDeviceGetMaxPcieLinkWidth")
        return self._gpu(h).max_width

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        self._check("nvmlDeviceGetCurrPcieLinkGeneration")
        return self._gpu(h).cur_gen

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        self._check("nvmlDeviceGetCurrPcieLinkWidth")
        return self._gpu(h).cur_width

    def nvmlDeviceGetNumaNodeId(self, h):
        self._check("nvmlDeviceGetNumaNodeId")
        return self._gpu(h).numa

    def _link(self, name, h, link) -> Link | None:
        self._check(name)
        g = self._gpu(h)
        if g.links is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if link >= g.max_links:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return g.links[link] if link < len(g.links) else None

    def nvmlDeviceGetNvLinkState(self, h, link):
        found = self._link("nvmlDeviceGetNvLinkState", h, link)
        return 1 if found is not None and found.active else 0

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        found = self._link("nvmlDeviceGetNvLinkVersion", h, link)
        if found is None or not found.active:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return found.version

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        found = self._link("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
        if found is None or not found.active:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _PciInfo(found.remote)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        found = self._link("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
        if found is None or not found.active:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return found.remote_type


# Every pynvml function FakeNvml stands in for, with its number of arguments (checked against the
# real nvidia-ml-py when it is installed).
PYNVML_FUNCTIONS = {name: getattr(FakeNvml, name).__code__.co_argcount - 1
                    for name in dir(FakeNvml) if name.startswith("nvml")}


# --------------------------------------------------------------------------------------------------
# The fake /sys


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def _pci_dir(machine: Machine, root: str, bdf: str) -> str:
    nodes = {n.bdf: n for n in machine.pci}
    chain = []
    cur = bdf
    while cur is not None:
        chain.append(cur)
        cur = nodes[cur].parent
    top = chain[-1]
    domain_bus = top.rsplit(":", 1)[0]  # "0000:17"
    return os.path.join(root, "devices", f"pci{domain_bus}", *reversed(chain))


def build_sysfs(root: str, machine: Machine) -> str:
    """Writes machine's /sys under `root` (a tmp dir) and returns it."""
    for node in machine.pci:
        d = _pci_dir(machine, root, node.bdf)
        os.makedirs(d, exist_ok=True)
        _write(os.path.join(d, "vendor"), node.vendor)
        _write(os.path.join(d, "class"), node.cls)
        _write(os.path.join(d, "device"), node.device)
        _write(os.path.join(d, "numa_node"), str(node.numa))
        if node.cpus is not None:
            _write(os.path.join(d, "local_cpulist"), node.cpus)
        for attr, value in (("max_link_speed", node.max_speed), ("max_link_width", node.max_width),
                            ("current_link_speed", node.cur_speed), ("current_link_width", node.cur_width)):
            if value is not None:
                _write(os.path.join(d, attr), value)
        link = os.path.join(root, "bus", "pci", "devices", node.bdf)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(d, os.path.dirname(link)), link)
    net = os.path.join(root, "class", "net")
    os.makedirs(net, exist_ok=True)
    os.makedirs(os.path.join(root, "devices", "virtual", "net", "lo"), exist_ok=True)
    os.symlink(os.path.relpath(os.path.join(root, "devices", "virtual", "net", "lo"), net), os.path.join(net, "lo"))
    for nic in machine.nics:
        pci = _pci_dir(machine, root, nic.bdf) if nic.bdf else None
        if nic.kind == "rdma":
            ib = os.path.join(root, "class", "infiniband", nic.name)
            os.makedirs(os.path.join(ib, "ports", "1"), exist_ok=True)
            _write(os.path.join(ib, "ports", "1", "rate"), nic.rate or "")
            _write(os.path.join(ib, "ports", "1", "state"), nic.state)
            _write(os.path.join(ib, "ports", "1", "link_layer"), nic.link_layer)
            os.symlink(os.path.relpath(pci, ib), os.path.join(ib, "device"))
            for netdev in nic.netdevs:
                os.makedirs(os.path.join(pci, "net", netdev), exist_ok=True)
                _netdev(root, netdev, pci, speed="400000", operstate="up")
        else:
            _netdev(root, nic.name, pci, speed=nic.speed, operstate=nic.operstate)
    for i in range(machine.numa_nodes):
        os.makedirs(os.path.join(root, "devices", "system", "node", f"node{i}"), exist_ok=True)
    _write(os.path.join(root, "devices", "system", "node", "online"), f"0-{machine.numa_nodes - 1}")
    return root


def _netdev(root, name, pci, speed, operstate):
    d = os.path.join(root, "devices", "net-fake", name)
    os.makedirs(d, exist_ok=True)
    if pci is None:  # a device on another bus (virtio): the netdev has a device, not a PCI one
        pci = os.path.join(root, "devices", f"virtio-{name}")
        os.makedirs(pci, exist_ok=True)
    os.symlink(os.path.relpath(pci, d), os.path.join(d, "device"))
    if speed is not None:
        _write(os.path.join(d, "speed"), speed)
    _write(os.path.join(d, "operstate"), operstate)
    link = os.path.join(root, "class", "net", name)
    os.symlink(os.path.relpath(d, os.path.dirname(link)), link)


# --------------------------------------------------------------------------------------------------
# The machines

GEN = {1: "2.5 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe", 5: "32.0 GT/s PCIe"}
ARCH_AMPERE, ARCH_ADA, ARCH_HOPPER = 7, 8, 9
T_GPU, T_SWITCH = 0x00, 0x02


def _bridge(bdf, parent, gen=5, width=16, numa=-1):
    return PciNode(bdf, parent, vendor="0x1000", cls="0x060400", numa=numa, max_speed=GEN[gen],
                   max_width=str(width), cur_speed=GEN[gen], cur_width=str(width))


def _gpu_node(bdf, parent, device, gen, width, cur_gen, cur_width, numa, cpus):
    return PciNode(bdf, parent, vendor="0x10de", cls="0x030200", device=device, numa=numa, cpus=cpus,
                   max_speed=GEN[gen], max_width=str(width), cur_speed=GEN[cur_gen], cur_width=str(cur_width))


def _nic_node(bdf, parent, numa):
    return PciNode(bdf, parent, vendor="0x15b3", cls="0x020700", device="0x1021", numa=numa,
                   max_speed=GEN[5], max_width="16", cur_speed=GEN[5], cur_width="16")


def nvml_id(bdf: str) -> str:
    """sysfs "0000:18:00.0" -> NVML "00000000:18:00.0" (upper case hex)."""
    return "0000" + bdf.upper()


CPUS = {0: "0-55,112-167", 1: "56-111,168-223"}

# 8 x H100: four PCIe switches (uplinks at root ports 0000:X:01.0), two GPUs and two NICs behind each.
H100_GPU_BDF = ["0000:19:00.0", "0000:1a:00.0", "0000:3b:00.0", "0000:3c:00.0",
                "0000:9b:00.0", "0000:9c:00.0", "0000:bb:00.0", "0000:bc:00.0"]
H100_SWITCHES = ["0000:c5:00.0", "0000:c6:00.0", "0000:c7:00.0", "0000:c8:00.0"]  # NVSwitch bus ids


def h100() -> Machine:
    pci, nics, gpus = [], [], []
    for s, (rc, up) in enumerate([("0000:17:01.0", "0000:18:00.0"), ("0000:39:01.0", "0000:3a:00.0"),
                                  ("0000:99:01.0", "0000:9a:00.0"), ("0000:b9:01.0", "0000:ba:00.0")]):
        numa = 0 if s < 2 else 1
        pci += [_bridge(rc, None, numa=numa), _bridge(up, rc, numa=numa)]
        for k in range(2):
            gpu_bdf = H100_GPU_BDF[2 * s + k]
            down = f"{up[:8]}{8 + k:02x}.0"      # switch downstream port "0000:18:08.0"
            pci += [_bridge(down, up, numa=numa),
                    _gpu_node(gpu_bdf, down, "0x2330", 5, 16, 5, 16, numa, CPUS[numa])]
            nic_down = f"{up[:8]}{0x10 + k:02x}.0"
            nic_bdf = f"{gpu_bdf[:5]}{int(gpu_bdf[5:7], 16) + 0x10:02x}:00.0"
            pci += [_bridge(nic_down, up, numa=numa), _nic_node(nic_bdf, nic_down, numa)]
            nics.append(FakeNic(f"mlx5_{2 * s + k}", nic_bdf, "rdma", rate="400 Gb/sec (4X NDR)",
                                netdevs=(f"ibp{2 * s + k}",)))
    for i, bdf in enumerate(H100_GPU_BDF):
        links = [Link(nvml_id(H100_SWITCHES[j % 4]), T_SWITCH, version=4) for j in range(18)]
        gpus.append(FakeGpu(nvml_id(bdf), "NVIDIA H100 80GB HBM3", f"GPU-h100-{i}", 85520809984, ARCH_HOPPER,
                            5, 16, 5, 16, 0 if i < 4 else 1, links))
    for j, bdf in enumerate(H100_SWITCHES):  # NVSwitches: PCI bridges (class 0x0680), their own root port
        pci += [_bridge(f"0000:c4:0{j + 1}.0", None, numa=1),
                PciNode(bdf, f"0000:c4:0{j + 1}.0", cls="0x068001", device="0x22a3", numa=1)]
    nics.append(FakeNic("eno1", None, "ethernet", speed=None, operstate="down"))  # virtio-like, no PCI
    return Machine("8xH100", gpus, pci, nics, numa_nodes=2)


# 8 x H800: every GPU behind its own PCIe switch; 8 of 18 NVLinks active; RoCE NICs.
H800_GPU_BDF = ["0000:0f:00.0", "0000:34:00.0", "0000:48:00.0", "0000:5a:00.0",
                "0000:87:00.0", "0000:ae:00.0", "0000:c2:00.0", "0000:d7:00.0"]


def h800() -> Machine:
    pci, nics, gpus = [], [], []
    for i, bdf in enumerate(H800_GPU_BDF):
        numa = 0 if i < 4 else 1
        bus = int(bdf[5:7], 16)
        rc, up, down = f"0000:{bus - 3:02x}:01.0", f"0000:{bus - 2:02x}:00.0", f"0000:{bus - 1:02x}:00.0"
        nic_down, nic_bdf = f"0000:{bus - 1:02x}:01.0", f"0000:{bus + 1:02x}:00.0"
        pci += [_bridge(rc, None, numa=numa), _bridge(up, rc, numa=numa), _bridge(down, up, numa=numa),
                _gpu_node(bdf, down, "0x2324", 5, 16, 5, 16, numa, CPUS[numa]),
                _bridge(nic_down, up, numa=numa), _nic_node(nic_bdf, nic_down, numa)]
        nics.append(FakeNic(f"mlx5_{i}", nic_bdf, "rdma", rate="400 Gb/sec (4X NDR)", link_layer="Ethernet",
                            netdevs=(f"ens{i}np0",)))
        links = [Link(nvml_id(H100_SWITCHES[j % 4]), T_SWITCH, version=6) for j in range(8)]
        links += [Link("", T_SWITCH, active=False) for _ in range(10)]
        gpus.append(FakeGpu(nvml_id(bdf), "NVIDIA H800", f"GPU-h800-{i}", 85520809984, ARCH_HOPPER,
                            5, 16, 5, 16, numa, links))
    pci += [_bridge("0000:e0:01.0", None, gen=4, width=4, numa=1),
            PciNode("0000:e1:00.0", "0000:e0:01.0", vendor="0x8086", cls="0x020000", device="0x1593", numa=1,
                    max_speed=GEN[4], max_width="4", cur_speed=GEN[4], cur_width="4")]
    nics.append(FakeNic("eno1", "0000:e1:00.0", "ethernet", speed="25000", operstate="up"))
    # One port down: listed, not counted for rdma.
    nics[3] = dataclasses.replace(nics[3], state="1: DOWN")
    return Machine("8xH800", gpus, pci, nics, numa_nodes=2)


def l40s_pair() -> Machine:
    """2 x L40S on the root complex's own ports, no NVLink; idle links trained down to gen 1."""
    pci = [_bridge("0000:00:01.0", None, gen=4, numa=0),
           _gpu_node("0000:01:00.0", "0000:00:01.0", "0x26b9", 4, 16, 1, 16, 0, "0-31"),
           _bridge("0000:80:01.0", None, gen=4, numa=1),
           _gpu_node("0000:81:00.0", "0000:80:01.0", "0x26b9", 4, 16, 1, 8, 1, "32-63"),
           _bridge("0000:40:01.0", None, gen=3, width=8, numa=0),
           PciNode("0000:41:00.0", "0000:40:01.0", vendor="0x8086", cls="0x020000", device="0x1572", numa=0,
                   max_speed=GEN[3], max_width="8", cur_speed=GEN[3], cur_width="8")]
    gpus = [FakeGpu("00000000:01:00.0", "NVIDIA L40S", "GPU-l40s-0", 48305799168, ARCH_ADA, 4, 16, 1, 16, 0, None),
            FakeGpu("00000000:81:00.0", "NVIDIA L40S", "GPU-l40s-1", 48305799168, ARCH_ADA, 4, 16, 1, 8, 1, None)]
    nics = [FakeNic("enp65s0f0", "0000:41:00.0", "ethernet", speed="10000", operstate="up")]
    return Machine("2xL40S", gpus, pci, nics, numa_nodes=2)


def a100_bridged() -> Machine:
    """2 x A100 PCIe joined by three NVLink bridges (12 links), both on NUMA node 0."""
    pci = [_bridge("0000:00:02.0", None, gen=4, numa=0),
           _gpu_node("0000:21:00.0", "0000:00:02.0", "0x20f1", 4, 16, 4, 16, 0, "0-15"),
           _bridge("0000:00:03.0", None, gen=4, numa=0),
           _gpu_node("0000:22:00.0", "0000:00:03.0", "0x20f1", 4, 16, 4, 16, 0, "0-15")]
    gpus = [FakeGpu("00000000:21:00.0", "NVIDIA A100-PCIE-40GB", "GPU-a100-0", 42949672960, ARCH_AMPERE,
                    4, 16, 4, 16, 0, [Link("00000000:22:00.0", T_GPU, version=4) for _ in range(12)], max_links=12),
            FakeGpu("00000000:22:00.0", "NVIDIA A100-PCIE-40GB", "GPU-a100-1", 42949672960, ARCH_AMPERE,
                    4, 16, 4, 16, 0, [Link("00000000:21:00.0", T_GPU, version=4) for _ in range(12)], max_links=12)]
    return Machine("2xA100-bridged", gpus, pci, [], numa_nodes=1)


MACHINES = {"8xH100": h100, "8xH800": h800, "2xL40S": l40s_pair, "2xA100-bridged": a100_bridged}
