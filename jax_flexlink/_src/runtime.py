"""Runtime control of the engine: deadlines, statistics."""
from __future__ import annotations

from jax_flexlink import _flexlink

AVAILABLE_LINKS = ("shm",)


def configure(*, timeout_s: float | None = None, links: str | None = None) -> None:
  """Sets engine options for the collectives that run from now on.

  timeout_s: the deadline of every wait in a collective (default: FLEXLINK_TIMEOUT_S or 300 s).
  links: the link set; this build has one CPU link, "shm".
  """
  if timeout_s is not None:
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    _flexlink.set_timeout(float(timeout_s))
  if links is not None:
    names = [part.strip() for part in links.split(";") if part.strip()]
    unknown = [n for n in names if n.split(":")[0].split("@")[0] not in AVAILABLE_LINKS]
    if not names or unknown:
      raise ValueError(f"links={links!r}: unknown link kind(s) {unknown or [links]}; "
                       f"this build provides {list(AVAILABLE_LINKS)}")


def timeout_s() -> float:
  return float(_flexlink.timeout())


def stats() -> dict:
  """Per-link totals since start or the last reset_stats(): bytes, calls, seconds, healthy."""
  return _flexlink.stats()


def reset_stats() -> None:
  _flexlink.reset_stats()
