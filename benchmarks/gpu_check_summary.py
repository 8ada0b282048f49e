"""OUTDIR/summary.md from what benchmarks/gpu_check.sh left in OUTDIR (standard library only).

    python3 benchmarks/gpu_check_summary.py OUTDIR [TOTAL_SECONDS]

Reads steps.tsv (one line per step: name, result, seconds, exit status, log, note), topology.json,
gpus.txt, pytest_gpu.xml (JUnit), bench.json (schema jax_flexlink.bench/1) and the C++ binaries'
logs; any of them may be missing (a step that did not run), which the summary says. Targets are the
issue's (12, "Performance"): a 4 KiB AllReduce within 10 us of the native collective, FlexLink never
below NCCL alone at any size.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import xml.etree.ElementTree as ET

OVERHEAD_TARGET_US = 10.0


def _read(out: str, name: str) -> str | None:
    try:
        with open(os.path.join(out, name), encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def steps(out: str) -> list[dict]:
    rows = []
    for line in (_read(out, "steps.tsv") or "").splitlines():
        parts = (line.split("\t") + [""] * 6)[:6]
        rows.append(dict(zip(("name", "result", "seconds", "rc", "log", "note"), parts)))
    return rows


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def steps_table(rows: list[dict]) -> list[str]:
    lines = ["| step | result | time (s) | note | log |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        result = f"**{r['result']}**" if r["result"] in ("FAIL", "TIMEOUT") else r["result"]
        lines.append(f"| {r['name']} | {result} | {r['seconds']} | {_cell(r['note'])} | {r['log']} |")
    return lines


def topology_section(out: str) -> list[str]:
    text = _read(out, "topology.json")
    if text is None:
        return ["No topology.json (the topology step did not run)."]
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return [f"topology.json is not JSON: {e}"]
    lines = []
    nvml = doc.get("nvml") or {}
    gpus = doc.get("gpus") or []
    if not gpus:
        lines.append(f"No GPU through NVML: {nvml.get('error')}. /sys shows {len(doc.get('pci_gpus') or [])} "
                     f"NVIDIA PCI device(s), {len(doc.get('nics') or [])} NIC(s).")
        return lines
    names = sorted({g.get("name") for g in gpus})
    lines.append(f"{len(gpus)} × {', '.join(map(str, names))}; driver {nvml.get('driver_version')}, "
                 f"CUDA driver API {nvml.get('cuda_driver_version')}, NUMA nodes {doc.get('numa_nodes')}.")
    lines.append("")
    lines.append("| GPU | PCI bus id | NUMA | PCIe | NVLink |")
    lines.append("| --- | --- | --- | --- | --- |")
    for g in gpus:
        p, n = g.get("pcie") or {}, g.get("nvlink") or {}
        nvl = f"{n.get('links')} × NVLink {n.get('generation')} ({n.get('gbps')} GB/s)" if n.get("links") else "none"
        lines.append(f"| {g.get('index')} | {g.get('pci_bus_id')} | {g.get('numa_node')} | gen{p.get('gen')} "
                     f"x{p.get('width')} ({p.get('gbps')} GB/s) | {nvl} |")
    nominal = (doc.get("nominal") or {}).get("links") or {}
    if nominal:
        lines += ["", "Nominal link speeds (stage 1's starting point without a tuning cache):", "",
                  "| link | GB/s | latency (us) | basis |", "| --- | --- | --- | --- |"]
        for kind, v in nominal.items():
            lines.append(f"| {kind} | {v.get('gbps', '')} | {v.get('latency_us', '')} | {_cell(v.get('basis', ''))} |")
    rdma = [c for c in doc.get("nics") or [] if c.get("kind") == "rdma"]
    if rdma:
        nics = ", ".join(f"{c.get('name')} {c.get('rate_gbit')} Gb/s {c.get('state')}" for c in rdma)
        lines += ["", f"RDMA NICs: {len(rdma)} ({nics})."]
    return lines


def pytest_section(out: str) -> list[str]:
    text = _read(out, "pytest_gpu.xml")
    if text is None:
        return ["No pytest_gpu.xml (the pytest step did not run)."]
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        return [f"pytest_gpu.xml is not valid XML: {e}"]
    passed, failed, skipped, reasons, failures = 0, 0, 0, {}, []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            el = case.find("failure") if case.find("failure") is not None else case.find("error")
            failures.append((name, (el.get("message") or "").splitlines()[0][:200] if el.get("message") else ""))
        elif case.find("skipped") is not None:
            skipped += 1
            why = (case.find("skipped").get("message") or "").splitlines()
            reasons[why[0][:200] if why else ""] = reasons.get(why[0][:200] if why else "", 0) + 1
        else:
            passed += 1
    lines = [f"{passed} passed, {failed} failed, {skipped} skipped."]
    for why, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        lines.append(f"- skipped {count}: {why}")
    for name, msg in failures[:20]:
        lines.append(f"- FAILED {name}: {msg}")
    if len(failures) > 20:
        lines.append(f"- ... and {len(failures) - 20} more (pytest_gpu.log)")
    return lines


def _fmt(v, nd=1):
    if v is None:
        return "—"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def bench_section(out: str) -> list[str]:
    text = _read(out, "bench.json")
    if text is None:
        return ["No bench.json (the bench step did not run or did not finish)."]
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return [f"bench.json is not JSON: {e}"]
    rows = doc.get("rows") or []
    summary = doc.get("summary") or {}
    lines = [f"`{doc.get('command', '')}`: {doc.get('devices')} devices, links {doc.get('links')}, "
             f"jax {(doc.get('versions') or {}).get('jax')}; out of bounds {summary.get('out_of_bounds')}, "
             f"ok {summary.get('ok')}."]
    for s in summary.get("skipped") or []:
        lines.append(f"- FlexLink side skipped: {_cell(s if isinstance(s, str) else json.dumps(s))}")
    if not rows:
        lines.append("No rows (every section skipped or failed).")
        return lines
    by_coll: dict[str, list[dict]] = {}
    for r in rows:
        by_coll.setdefault(r.get("collective", "?"), []).append(r)
    for coll, rs in by_coll.items():
        lines += ["", f"**{coll}** ({rs[0].get('dtype')}, {rs[0].get('op')}, "
                      f"{'in-place' if rs[0].get('inplace') else 'out-of-place'}):", "",
                  "| size (B) | FlexLink (us) | native (us) | FlexLink busbw (GB/s) | native busbw (GB/s) | speedup | #wrong | links |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rs:
            shares = r.get("shares") or {}
            links = " ".join(f"{k}:{v * 100:.0f}%" for k, v in shares.items()) if shares else "—"
            lines.append(f"| {r.get('bytes')} | {_fmt(r.get('time_us'))} | {_fmt(r.get('baseline_time_us'))} | "
                         f"{_fmt(r.get('busbw_gbps'), 2)} | {_fmt(r.get('baseline_busbw_gbps'), 2)} | "
                         f"{_fmt(r.get('speedup'), 2)} | {r.get('wrong')} | {links} |")
    lines.append("")
    small = [r for r in rows if r.get("collective") == "all_reduce" and r.get("bytes") == 4096
             and r.get("baseline_time_us") is not None]
    for r in small:
        extra = r["time_us"] - r["baseline_time_us"]
        verdict = "within" if extra <= OVERHEAD_TARGET_US else "NOT within"
        lines.append(f"- 4 KiB AllReduce: FlexLink {r['time_us']:.1f} us, native {r['baseline_time_us']:.1f} us: "
                     f"{extra:+.1f} us, {verdict} the {OVERHEAD_TARGET_US:g} us target.")
    speedups = [(r["speedup"], r) for r in rows if isinstance(r.get("speedup"), (int, float))]
    if speedups:
        low, r = min(speedups, key=lambda t: t[0])
        lines.append(f"- Lowest speedup (native time / FlexLink time): {low:.2f}x at {r.get('collective')} "
                     f"{r.get('bytes')} B ({'meets' if low >= 1.0 else 'misses'} \"never below NCCL alone\").")
        high, r = max(speedups, key=lambda t: t[0])
        lines.append(f"- Highest speedup: {high:.2f}x at {r.get('collective')} {r.get('bytes')} B.")
    wrong = sum(int(r.get("wrong") or 0) for r in rows)
    lines.append(f"- Wrong elements, all rows: {wrong}.")
    return lines


def cpp_section(out: str, rows: list[dict]) -> list[str]:
    logs = [r for r in rows if r["log"].startswith("cpp_")]
    if not logs:
        skip = next((r for r in rows if r["name"] == "cpp"), None)
        return [skip["note"] if skip else "No CUDA C++ binary ran."]
    lines = []
    for r in logs:
        tail = (_read(out, r["log"]) or "").splitlines()[-15:]
        lines += [f"`{r['name']}`: {r['result']} in {r['seconds']} s", "", "```", *tail, "```", ""]
    return lines


def render(out: str, total: str | None = None) -> str:
    rows = steps(out)
    bad = [r["name"] for r in rows if r["result"] in ("FAIL", "TIMEOUT")]
    gpus = (_read(out, "gpus.txt") or "").splitlines()
    env = _read(out, "environment.txt") or ""
    after_git = env.split("# git\n", 1)[1].splitlines() if "# git\n" in env else []
    commit = after_git[0] if after_git and not after_git[0].startswith("#") else "?"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# gpu_check summary", "",
             f"{when}; commit `{commit}`; total {total or '?'} s; "
             f"{'**FAILED**: ' + ', '.join(bad) if bad else 'every step passed or was skipped for the reason given'}.",
             "", f"jax: {gpus[0] if gpus else 'not checked'}", ""]
    lines += steps_table(rows)
    for title, section in (("Topology", topology_section(out)), ("gpu-marked tests", pytest_section(out)),
                           ("CUDA C++ binaries", cpp_section(out, rows)),
                           ("Bench: FlexLink vs native", bench_section(out))):
        lines += ["", f"## {title}", ""] + section
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = argv[0]
    text = render(out, argv[1] if len(argv) > 1 else None)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
