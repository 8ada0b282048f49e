"""Stage 1's starting point on GPUs: the machine's nominal link speeds (jax_flexlink.topology).

Without a tuning-cache entry, a GPU group's calls below the profiling size would take the primary
link alone until stage 1 has measured; with the topology's nominal α–β fits installed as the
balancer's seed they are split from the first call as the link rates predict, and stage 1 still
runs at the first large call and replaces the seed with measurements. The seed is per group size
(the fits' bus factors and NCCL's ring latency depend on it) and is forgotten when the links change.
"""
from __future__ import annotations

import sys

from jax_flexlink._src.config import ENV


def seed_from_topology(module, topo=None) -> str:
  """Installs nominal fits for every group size 2..#GPUs on `module` (the CUDA module) for its
  configured links. Returns what happened, in a sentence (also logged at FLEXLINK_DEBUG=INFO)."""
  from jax_flexlink import topology  # noqa: PLC0415 - NVML and /sys only where GPU links are chosen

  links = list(module.links())
  if len(links) < 2:
    return _say(f"no nominal seed: one GPU link ({links[0] if links else 'none'}), nothing to split")
  if topo is None:
    topo = topology.discover()
  if len(topo.gpus) < 2:
    why = topo.nvml.error or f"{len(topo.gpus)} GPU visible"
    return _say(f"no nominal seed for links {';'.join(links)}: {why}")
  seeded = []
  for n in range(2, len(topo.gpus) + 1):
    try:
      fits = topology.nominal_fits(topo, links, gpus=range(n))
    except KeyError as e:
      return _say(f"no nominal seed for links {';'.join(links)}: {e.args[0]}")
    module.seed_model(n, fits)
    seeded.append(n)
  basis = topology.describe_nominal(topo, range(len(topo.gpus)))
  speeds = ", ".join(f"{link} {basis[topology.link_kind(link)]['gbps']:g} GB/s" for link in links)
  return _say(f"nominal seed for links {';'.join(links)} ({speeds}), groups of {seeded[0]}..{seeded[-1]} GPUs")


def _say(message: str) -> str:
  if ENV.debug_level:
    print(f"[flexlink] {message}", file=sys.stderr)
  return message
