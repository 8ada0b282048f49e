"""Runtime control of the engine: links, deadlines, statistics."""
from __future__ import annotations

from jax_flexlink import _flexlink


def configure(*, links: str | None = None, timeout_s: float | None = None) -> None:
  """Sets engine options for the collectives that run from now on (not while any is running).

  links: which links carry the collectives, in FLEXLINK_LINKS syntax: `kind[:name][@key=value,...]`
    separated by `;`, the first being the primary, e.g. "shm;tcp" or
    "emulated:nvlink@gbps=2.0,latency_us=5;emulated:pcie@gbps=0.6,latency_us=10". Kinds: shm, tcp,
    emulated (a real link, shm by default, paced to `gbps` bus bandwidth and `latency_us` per call).
  timeout_s: the deadline of every wait in a collective (default: FLEXLINK_TIMEOUT_S or 300 s).
  """
  if timeout_s is not None:
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    _flexlink.set_timeout(float(timeout_s))
  if links is not None:
    _flexlink.configure_links(links)
    load_cached_model()


def load_cached_model() -> None:
  """Stage 1 from the tuning cache, when this link set was tuned before on this host (for a group of
  all local devices); otherwise plans start from equal shares until tune() runs."""
  if len(_flexlink.links()) > 1:
    import jax  # noqa: PLC0415 - the backend must exist to count devices; only multi-link setups ask
    from jax_flexlink._src import tune  # noqa: PLC0415 - tune imports the public API modules
    tune.load_cached(len(jax.devices()))


def links() -> list[str]:
  """Names of the configured links, primary first."""
  return list(_flexlink.links())


def timeout_s() -> float:
  return float(_flexlink.timeout())


def stats() -> dict:
  """What the engine did since start or the last reset_stats().

  {"links": {name: {"bytes", "calls", "seconds", "healthy"}},   # per link of the current set
   "plans": [{"collective", "bucket_bytes", "shares": {name: fraction}, "mode", "group", ...}],
   "offload_fraction": bytes not on the primary link / all bytes}
  """
  raw = _flexlink.stats()
  names = links()
  per_link = {name: raw["links"][name] for name in names if name in raw["links"]}
  total = sum(s["bytes"] for s in per_link.values())
  offloaded = sum(s["bytes"] for name, s in per_link.items() if name != names[0])
  return {
      "links": per_link,
      "plans": list(_flexlink.plans()),
      "offload_fraction": offloaded / total if total else 0.0,
  }


def reset_stats() -> None:
  _flexlink.reset_stats()
