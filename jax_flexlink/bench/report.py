"""The --json document (and its schema check) and the --plot figure."""

from __future__ import annotations

import json
import math
import os
import platform

from .collectives import COLLECTIVES

SCHEMA = "jax_flexlink.bench/1"

# field -> allowed types (None allowed where listed). The required row fields come first.
_NUM = (int, float)
ROW_FIELDS: dict[str, tuple] = {
    "collective": (str,), "op": (str,), "dtype": (str,), "bytes": (int,), "count": (int,),
    "devices": (int,), "inplace": (bool,),
    "time_us": _NUM, "algbw_gbps": _NUM, "busbw_gbps": _NUM, "wrong": (int, type(None)),
    "baseline_time_us": _NUM + (type(None),), "baseline_busbw_gbps": _NUM + (type(None),),
    "speedup": _NUM + (type(None),), "shares": (dict, type(None)),
    # extras
    "iters": (int,), "warmup": (int,), "time_min_us": _NUM, "time_max_us": _NUM, "time_median_us": _NUM,
    "baseline": (str,), "baseline_impl": (str, type(None)), "baseline_algbw_gbps": _NUM + (type(None),),
    "baseline_time_min_us": _NUM + (type(None),), "baseline_time_max_us": _NUM + (type(None),),
    "baseline_time_median_us": _NUM + (type(None),),
    "time_mean_us": _NUM, "baseline_time_mean_us": _NUM + (type(None),),
    "speedup_median": _NUM + (type(None),), "speedup_mean": _NUM + (type(None),),
    "baseline_wrong": (int, type(None)), "aliased": (bool, type(None)),
    # minor page faults per timed call in the process (the most of any process across processes)
    "faults_per_call": _NUM + (type(None),), "baseline_faults_per_call": _NUM + (type(None),),
}
# FlexLink's measured fields: null in a row with a `flexlink_error` (the error text) instead.
FLEX_MEASURED = ("time_us", "algbw_gbps", "busbw_gbps", "time_min_us", "time_max_us", "time_median_us",
                 "time_mean_us")
TOP_FIELDS: dict[str, tuple] = {
    "schema": (str,), "machine": (dict,), "versions": (dict,), "links": (str,), "command": (str,),
    "argv": (list,), "scenario": (str,), "devices": (int,), "baseline": (str,), "settings": (dict,),
    "started_utc": (str,), "finished_utc": (str,), "summary": (dict,), "notes": (list,), "rows": (list,),
}
VERSION_FIELDS = ("python", "jax", "jaxlib", "jax_flexlink", "numpy")
SUMMARY_FIELDS = ("out_of_bounds", "ok", "avg_busbw_gbps")


def machine_info() -> dict:
    info = {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
            "processor": platform.processor() or _cpu_model(), "cpu_count": os.cpu_count()}
    try:
        info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def versions(flexlink_version: str) -> dict:
    import numpy
    out = {"python": platform.python_version(), "numpy": numpy.__version__,
           "jax_flexlink": flexlink_version}
    try:
        import jax
        import jaxlib
        out["jax"] = jax.__version__
        out["jaxlib"] = getattr(jaxlib, "__version__", None) or jax.lib.__version__
    except Exception:
        out.setdefault("jax", "not imported")
        out.setdefault("jaxlib", "not imported")
    return out


def _finite(x):
    """JSON has no NaN: NaN/inf become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def clean(obj):
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean(v) for v in obj]
    return _finite(obj)


def validate(doc: dict) -> list[str]:
    """Schema problems of a --json document ([] when it is valid)."""
    errs = []
    if not isinstance(doc, dict):
        return ["document is not an object"]
    for k, types in TOP_FIELDS.items():
        if k not in doc:
            errs.append(f"missing top-level field {k!r}")
        elif not isinstance(doc[k], types):
            errs.append(f"top-level {k!r} has type {type(doc[k]).__name__}")
    if doc.get("schema") not in (None, SCHEMA):
        errs.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    for k in VERSION_FIELDS:
        if k not in doc.get("versions", {}):
            errs.append(f"versions lacks {k!r}")
    for k in SUMMARY_FIELDS:
        if k not in doc.get("summary", {}):
            errs.append(f"summary lacks {k!r}")
    skipped = doc.get("summary", {}).get("skipped") if isinstance(doc.get("summary"), dict) else None
    if skipped is not None and not (isinstance(skipped, list) and all(
            isinstance(s, dict) and {"collective", "op", "dtype", "reason"} <= set(s) for s in skipped)):
        errs.append("summary.skipped must be a list of {collective, op, dtype, reason}")
    for i, row in enumerate(doc.get("rows", []) if isinstance(doc.get("rows"), list) else []):
        if not isinstance(row, dict):
            errs.append(f"rows[{i}] is not an object")
            continue
        flex_failed = isinstance(row.get("flexlink_error"), str)
        for k, types in ROW_FIELDS.items():
            if k not in row:
                errs.append(f"rows[{i}] lacks {k!r}")
            elif flex_failed and k in FLEX_MEASURED and row[k] is None:
                pass  # a row whose FlexLink side raised (--scenario multiprocess) has no FlexLink time
            elif not isinstance(row[k], types) or (isinstance(row[k], bool) and bool not in types):
                errs.append(f"rows[{i}].{k} has type {type(row[k]).__name__}")
        errs.extend(f"rows[{i}]: {e}" for e in _row_conventions(row))
        sh = row.get("shares")
        if isinstance(sh, dict) and not all(isinstance(v, _NUM) and 0 <= v <= 1 for v in sh.values()):
            errs.append(f"rows[{i}].shares must map link names to fractions in [0, 1]")
    return errs


def _row_conventions(row: dict) -> list[str]:
    """A row's collective is known, its op is 'none' exactly when the collective has no reduction, and
    busbw = algbw x the collective's nccl-tests factor for the row's device count (both sides)."""
    coll = COLLECTIVES.get(row.get("collective"))
    if coll is None:
        return [f"unknown collective {row.get('collective')!r}; expected one of {', '.join(COLLECTIVES)}"]
    errs = []
    if (row.get("op") == "none") == coll.has_op:
        errs.append(f"op {row.get('op')!r} for {coll.name}, which " +
                    ("reduces (sum, prod, max, min)" if coll.has_op else "has no reduction ('none')"))
    devices = row.get("devices")
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        factor = coll.busbw_factor(devices)
        for prefix in ("", "baseline_"):
            alg, bus = row.get(f"{prefix}algbw_gbps"), row.get(f"{prefix}busbw_gbps")
            if isinstance(alg, _NUM) and isinstance(bus, _NUM) and not math.isclose(
                    bus, alg * factor, rel_tol=1e-9, abs_tol=1e-12):
                errs.append(f"{prefix}busbw_gbps {bus} is not algbw x {coll.busbw_formula} "
                            f"(= {alg * factor}) for {coll.title} on {devices} devices")
    return errs


def write_json(path: str, doc: dict) -> None:
    doc = clean(doc)
    errs = validate(doc)
    if errs:  # a bug in the harness, not the user's fault: still write, but say so
        doc.setdefault("notes", []).append("schema problems: " + "; ".join(errs))
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def check_plot_available() -> None:
    """Raises RuntimeError (before any run) when --plot cannot work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib, an optional extra: pip install 'jax_flexlink[plot]' "
                           "(or pip install matplotlib)") from e


def plot(path: str, rows: list[dict], title: str = "") -> None:
    """busbw against size, FlexLink and native, log-x, one panel per collective."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    from .sizes import format_size

    collectives = [c for c in COLLECTIVES if any(r["collective"] == c for r in rows)]
    fig, axes = plt.subplots(1, max(1, len(collectives)), figsize=(6 * max(1, len(collectives)), 4.5),
                             squeeze=False)
    for ax, coll in zip(axes[0], collectives):
        mine = [r for r in rows if r["collective"] == coll]
        series = list(dict.fromkeys((r["op"], r["dtype"], r["inplace"]) for r in mine))
        for op, dtype, inplace in series:
            rs = sorted((r for r in mine if (r["op"], r["dtype"], r["inplace"]) == (op, dtype, inplace)),
                        key=lambda r: r["bytes"])
            tag = f"{dtype} {op if op != 'none' else ''} {'in-place' if inplace else 'out-of-place'}"
            tag = " ".join(tag.split())
            xs = [r["bytes"] for r in rs]
            ax.plot(xs, [r["busbw_gbps"] for r in rs], marker="o", ms=3, label=f"FlexLink {tag}")
            if any(r.get("baseline_busbw_gbps") is not None for r in rs):
                ax.plot(xs, [r.get("baseline_busbw_gbps") for r in rs], marker="x", ms=3, ls="--",
                        label=f"native {tag}")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_size(int(v)) if v >= 1 else ""))
        ax.set_xlabel("size per rank (bytes)")
        info = COLLECTIVES[coll]
        ax.set_ylabel(f"busbw = algbw x {info.busbw_formula} (GB/s)")
        ax.set_title(f"{info.title} ({coll}{', ring shift +1' if coll == 'ppermute' else ''})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
