"""`--mp-launches K`: each multiprocess configuration launched K times, and the speedups side by side.

A launch's table compares FlexLink with the native collective inside one job, call by call or in
turns, so what the machine does to both sides within the launch cancels out. What does not cancel is
the launch itself: on a shared VM, the same command's whole job can run 2-2.5x slower than the one
before it (docs/multiprocess.md, "Session 38"), and not always by the same factor for both sides. So
one launch's speedup at one point is a sample, and a claim such as "at least 3x from 1 MiB" is
judged on several launches: this module groups the rows of K launches by point (configuration,
collective, op, type, size, mode) and reports, per point, each launch's speedup and their minimum,
median and maximum. The launches of all configurations take turns (2x1, 4x1, 2x1, 4x1, ...), so a
slow stretch of the machine falls on several configurations rather than on every launch of one.

Imports nothing of jax: the parent process of the multiprocess scenario never starts a backend.
"""

from __future__ import annotations

import statistics

from . import table

_KEY = ("config", "collective", "op", "dtype", "bytes", "inplace")


def points(rows: list[dict]) -> list[dict]:
    """One dict per point, in the order the points first appear: the point's key fields, `launches`
    (the launch numbers that produced a row for it), `speedups` (each such launch's speedup, None where
    its FlexLink side failed or there was no baseline), `time_us` and `baseline_time_us` (the same
    launches' times), and `speedup_min`, `speedup_median`, `speedup_max` over the launches that have a
    speedup (None if none has), `time_median_us` and `baseline_time_median_us` likewise."""
    by_key: dict[tuple, dict] = {}
    for r in rows:
        key = tuple(r.get(k) for k in _KEY)
        p = by_key.get(key)
        if p is None:
            p = by_key[key] = {k: r.get(k) for k in _KEY}
            p.update(launches=[], speedups=[], time_us=[], baseline_time_us=[])
        p["launches"].append(r.get("launch", 1))
        p["speedups"].append(r.get("speedup"))
        p["time_us"].append(r.get("time_us"))
        p["baseline_time_us"].append(r.get("baseline_time_us"))
    for p in by_key.values():
        s = [x for x in p["speedups"] if x is not None]
        p["speedup_min"] = min(s) if s else None
        p["speedup_median"] = statistics.median(s) if s else None
        p["speedup_max"] = max(s) if s else None
        for field in ("time_us", "baseline_time_us"):
            t = [x for x in p[field] if x is not None]
            p[field.replace("_us", "_median_us")] = statistics.median(t) if t else None
    return list(by_key.values())


def at_least(pts: list[dict], target: float, min_bytes: int = 0) -> tuple[int, int, int]:
    """(points whose median speedup over the launches reaches `target`, points whose every launch
    reaches it, points with a speedup at all), counting points of at least `min_bytes`."""
    pts = [p for p in pts if p["bytes"] >= min_bytes and p["speedup_median"] is not None]
    return (sum(p["speedup_median"] >= target for p in pts), sum(p["speedup_min"] >= target for p in pts), len(pts))


def lines(pts: list[dict], launches: int, stat: str = "median") -> list[str]:
    """The summary printed after the launches: one line per point, then a count against 1x (never
    slower than native), over all points."""
    out = [f"# Across {launches} launches of each configuration: speedup = native time / FlexLink time "
           f"(each launch's {stat}s), per launch in launch order; min / median / max over the launches; "
           "times: the median over the launches of each launch's time",
           f"# {'config':<8} {'collective':<15} {'op':<4} {'type':<8} {'size (B)':>10} {'mode':<12} "
           f"{'FlexLink us':>11} {'native us':>10} {'min':>7} {'median':>7} {'max':>7}  per launch"]
    for p in pts:
        per = " ".join(table.fmt_speedup(x) for x in p["speedups"])
        out.append(f"  {p['config'] or '-':<8} {p['collective']:<15} {p['op']:<4} {p['dtype']:<8} {p['bytes']:>10} "
                   f"{table.MODE_TITLES[bool(p['inplace'])]:<12} {table.fmt_time(p['time_median_us']):>11} "
                   f"{table.fmt_time(p['baseline_time_median_us']):>10} {table.fmt_speedup(p['speedup_min']):>7} "
                   f"{table.fmt_speedup(p['speedup_median']):>7} {table.fmt_speedup(p['speedup_max']):>7}  {per}")
    median_ok, every_ok, n = at_least(pts, 1.0)
    out.append(f"# Never slower than native: by the median over the launches at {median_ok} of {n} points, "
               f"in every launch at {every_ok} of {n}")
    return out
