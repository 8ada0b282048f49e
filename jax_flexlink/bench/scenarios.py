"""Named setups (`--scenario`): device count, link spec and default sweep. Pure Python, no jax."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    devices: int | None = 8             # None: every device of the platform
    platform: str = "cpu"               # "cpu": host devices (--devices sets XLA_FLAGS); "gpu": jax's GPUs
    links: str | None = None            # FLEXLINK_LINKS syntax; None = the library's default links
    requires: str | None = None         # link kinds the installed jax_flexlink must have, see check()
    defaults: dict = dataclasses.field(default_factory=dict)  # flag defaults this scenario changes
    unavailable: str | None = None      # set when the scenario cannot run at all yet


# NVLink : PCIe : NIC ~ 160 : 50 : 45 (an H800 node), scaled down 1000x so that this machine's real
# copy speed is not the bottleneck: shm alone reaches 1.4-2.9 GB/s AllReduce and 0.4-2.4 GB/s
# AllGather busbw with 8 device threads on 2 cores (the low end: 64 MiB outputs, page faults), above
# the 0.255 GB/s these three links add up to, so the pacing, not the CPU, limits the rates. (At 500x,
# 0.51 GB/s, AllGather at 64 MiB was CPU-bound: 0.37-0.41 GB/s; docs/multipath.md.)
H800_LINKS = ("emulated:nvlink@gbps=0.16,latency_us=5;"
              "emulated:pcie@gbps=0.05,latency_us=10;"
              "emulated:nic@gbps=0.045,latency_us=15")

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("host8", "8 host (CPU) devices in one process, the library's default links (shm)."),
    Scenario("emulated-h800",
             "8 host devices over three emulated links with H800-like ratios "
             "(NVLink:PCIe:NIC = 160:50:45, scaled to 0.16/0.05/0.045 GB/s busbw).",
             links=H800_LINKS, requires="emulated",
             # Warm-up calls double as the balancer's stage-2 convergence before timing.
             defaults={"minbytes": "64K", "maxbytes": "64M", "stepfactor": 4.0, "warmup_iters": 12}),
    Scenario("gpu",
             "every local GPU (jax.devices('gpu')) in one process, or the first --devices N; the CUDA "
             "module's links. Needs a jax with a CUDA plugin; a build without the CUDA module skips the "
             "FlexLink side (benchmarks/gpu_check.sh).",
             devices=None, platform="gpu",
             defaults={"minbytes": "4K", "maxbytes": "256M", "stepfactor": 4.0}),
    Scenario("multiprocess",
             "jax.distributed processes on this machine, one job of python -m jax_flexlink.launch per "
             "configuration (--mp-configs, default 2x1, 4x1 and 2 emulated hosts x 2 processes); the mesh "
             "spans all processes' devices; native = jax.lax over gloo.",
             devices=None,  # per configuration (--mp-configs), not --devices
             defaults={"minbytes": "64K", "maxbytes": "64M", "stepfactor": 4.0, "mode": "outofplace"}),
]}
DEFAULT_SCENARIO = "host8"


def get(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}") from None


def check(scenario: Scenario, flexlink) -> None:
    """Raises RuntimeError when the installed jax_flexlink cannot run the scenario (never fakes it)."""
    if scenario.unavailable:
        raise RuntimeError(scenario.unavailable)
    if scenario.requires and not flexlink.has_configure():
        raise RuntimeError(requirement(scenario) + ": this jax_flexlink has no configure(links=...)")


def requirement(scenario: Scenario) -> str:
    return f"scenario {scenario.name!r} requires links {scenario.requires!r}"


def describe() -> str:
    return "\n".join(f"  {s.name:<14} {s.description}" for s in SCENARIOS.values())
