"""`--scenario multiprocess`: the sweep across jax.distributed processes, one launch per configuration.

For each configuration (`--mp-configs`, default 2x1,4x1,2hx2x1; `--mp-launches K` times, the
configurations taking turns, then launches.py's summary across the launches) this process runs

    python -m jax_flexlink.launch -n P --devices-per-process K [--hosts H] --timeout S -- \\
        python -m jax_flexlink.bench.mp_worker --config NAME --json-out FILE -- <the bench's arguments>

relays rank 0's output (the table; its "[0] " prefix dropped, other ranks' lines kept as they come),
and at the end merges the configurations' JSON documents and says which configurations failed.
This process never starts jax's backend; importing it does not import jax.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading

from . import launches

DEFAULT_CONFIGS = "2x1,4x1,2hx2x1"
DEFAULT_TIMEOUT_S = 1200.0
# FlexLink's own deadline for a collective in the workers, unless the caller set one: a group that
# cannot form (an engine without cross-process support) then fails a row in a minute, not in 300 s.
WORKER_FLEXLINK_TIMEOUT_S = "60"
_KILL_GRACE_S = 30.0   # past the launcher's own deadline, before this process gives up on it

_SPEC_RE = re.compile(r"(?:(\d+)hx)?(\d+)x(\d+)")


@dataclasses.dataclass(frozen=True)
class MpConfig:
    name: str
    processes: int           # in all
    devices_per_process: int
    hosts: int | None        # emulated hosts (the launcher's --hosts), None for one host

    def describe(self) -> str:
        per = f"{self.devices_per_process} host device{'s' if self.devices_per_process > 1 else ''}"
        if self.hosts:
            return (f"{self.hosts} emulated hosts x {self.processes // self.hosts} processes x {per} "
                    f"= {self.processes * self.devices_per_process} devices")
        return f"{self.processes} processes x {per} = {self.processes * self.devices_per_process} devices"


def parse_configs(text: str) -> list[MpConfig]:
    """'PxK' (P processes, K devices each) or 'HhxPxK' (H emulated hosts of P processes each), comma
    separated: '2x1,4x1,2hx2x1'. Raises ValueError with the rule."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        m = _SPEC_RE.fullmatch(item)
        if not m:
            raise ValueError(f"bad multiprocess configuration {item!r}: expected PxK (P processes x K devices "
                             "each, e.g. 2x1) or HhxPxK (H emulated hosts x P processes x K devices, e.g. 2hx2x1)")
        hosts, procs, devs = (int(m.group(1)) if m.group(1) else None), int(m.group(2)), int(m.group(3))
        if procs < 1 or devs < 1 or hosts == 0:
            raise ValueError(f"bad multiprocess configuration {item!r}: counts must be >= 1")
        total = procs * (hosts or 1)
        if total < 2:
            raise ValueError(f"multiprocess configuration {item!r} has one process; the multiprocess scenario "
                             "needs at least two (use the host8 scenario for one)")
        out.append(MpConfig(item, total, devs, hosts))
    if len({c.name for c in out}) != len(out):
        raise ValueError(f"a multiprocess configuration is listed twice in {text!r}")
    return out


def launcher_command(c: MpConfig, timeout_s: float, json_out: str, bench_argv: list[str],
                     python: str = sys.executable, keep_freed_memory: bool = True) -> list[str]:
    cmd = [python, "-m", "jax_flexlink.launch", "-n", str(c.processes),
           "--devices-per-process", str(c.devices_per_process)]
    if c.hosts:
        cmd += ["--hosts", str(c.hosts)]
    if not keep_freed_memory:
        cmd += ["--no-keep-freed-memory"]
    cmd += ["--timeout", f"{timeout_s:g}", "--", python, "-m", "jax_flexlink.bench.mp_worker",
            "--config", c.name, "--json-out", json_out, "--", *bench_argv]
    return cmd


def relay_line(line: str) -> tuple[str, str]:
    """(stream, text) for a line of the launcher's stdout: rank 0's lines are the table, printed
    without the launcher's '[0] ' prefix, except gloo's connection notes (printed from C++ on the first
    native call, in the middle of a table), which go to stderr like everything of the other ranks."""
    if not line.startswith("[0] "):
        return "err", line
    text = line[4:]
    return ("err", line) if text.startswith("[Gloo] ") else ("out", text)


def worker_env(environ=os.environ) -> dict:
    env = dict(environ)
    env.setdefault("FLEXLINK_TIMEOUT_S", WORKER_FLEXLINK_TIMEOUT_S)
    return env


def status_text(code: int) -> str:
    if code == 0:
        return "ok"
    if code == 124:
        return "FAILED: the launcher's deadline passed (exit 124)"
    if code == 1:
        return "FAILED (exit 1: wrong elements or a collective that raised; see its table)"
    if code == 2:
        return "FAILED (exit 2: a setup error; see its messages)"
    return f"FAILED (exit {code})"


def exit_status(codes: list[int]) -> int:
    """0 when every configuration passed; 2 when every failure was a setup error; else 1."""
    bad = [c for c in codes if c != 0]
    if not bad:
        return 0
    return 2 if all(c == 2 for c in bad) else 1


def merge(docs: list[tuple[MpConfig, int, dict | None]], command: str, argv: list[str],
          launch_numbers: list[int] | None = None) -> dict:
    """One --json document (schema jax_flexlink.bench/1) from the configurations' documents: every row
    (with its `config`), summaries combined, and `configurations` saying how each one ended. With
    `launch_numbers` (one per document, --mp-launches), every row and configuration entry also has its
    `launch`, and `launches` has the points across them (launches.points)."""
    numbered = launch_numbers is not None
    nums = launch_numbers if numbered else [1] * len(docs)
    got = [d for _, _, d in docs if d]
    base = dict(got[0]) if got else {}
    rows = []
    for (_, _, d), k in zip(docs, nums):
        for r in (d or {}).get("rows", []):
            rows.append(dict(r, launch=k) if numbered else r)
    errors = [e if not numbered else f"launch {k}: {e}"
              for (_, _, d), k in zip(docs, nums) if d for e in d.get("summary", {}).get("errors", [])]
    errors += [f"{c.name}{f' (launch {k})' if numbered else ''}: {status_text(code)} (no JSON)"
               for (c, code, d), k in zip(docs, nums) if d is None]
    skipped = [dict(s, config=d["multiprocess"]["config"]) for d in got
               for s in d.get("summary", {}).get("skipped", [])]
    bus = [r["busbw_gbps"] for r in rows if r.get("busbw_gbps") is not None]
    bbus = [r["baseline_busbw_gbps"] for r in rows if r.get("baseline_busbw_gbps") is not None]
    wrong = sum((r.get("wrong") or 0) + (r.get("baseline_wrong") or 0) for r in rows)
    summary = {"out_of_bounds": wrong, "ok": all(code == 0 for _, code, _ in docs) and wrong == 0,
               "errors": errors, "skipped": skipped,
               "avg_busbw_gbps": sum(bus) / len(bus) if bus else None,
               "baseline_avg_busbw_gbps": sum(bbus) / len(bbus) if bbus else None}
    if got:  # the run's span: the first configuration's start, the last one's end
        base["finished_utc"] = got[-1].get("finished_utc", base.get("finished_utc"))
    base.update({"command": command, "argv": list(argv), "scenario": "multiprocess",
                 "devices": max((c.processes * c.devices_per_process for c, _, _ in docs), default=0),
                 "summary": summary, "rows": rows,
                 "notes": [n for d in got for n in d.get("notes", [])],
                 "configurations": [dict({"config": c.name, "processes": c.processes,
                                          "devices_per_process": c.devices_per_process, "hosts": c.hosts,
                                          "exit_status": code, "status": status_text(code)},
                                         **({"launch": k} if numbered else {}))
                                    for (c, code, _), k in zip(docs, nums)]})
    if numbered:
        base["launches"] = {"count": max(nums, default=0), "points": launches.points(rows)}
    return base


def _run_one(cmd: list[str], timeout_s: float, out) -> int:
    """Runs the launcher, relays its stdout; stderr (launcher and ranks' messages) passes through."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=worker_env(),
                            text=True, errors="replace", bufsize=1)

    def pump():
        for line in proc.stdout:
            stream, text = relay_line(line.rstrip("\n"))
            print(text, file=out if stream == "out" else sys.stderr, flush=True)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s + _KILL_GRACE_S)
    except subprocess.TimeoutExpired:  # the launcher stops its ranks by its deadline; it did not
        print(f"# the launcher did not exit {_KILL_GRACE_S:g} s after its deadline; killing it (its ranks "
              "die with it)", file=out, flush=True)
        proc.kill()
        code = proc.wait(timeout=_KILL_GRACE_S)
    except KeyboardInterrupt:  # the launcher got the Ctrl-C too and stops its ranks
        proc.wait(timeout=_KILL_GRACE_S)
        raise
    reader.join(timeout=_KILL_GRACE_S)
    return code


def run(cfg, out=sys.stdout) -> int:
    from .cli import command_line
    configs = cfg.mp_configs
    k_total = cfg.mp_launches
    command = command_line(cfg.argv)
    print(f"# jax_flexlink.bench: {command}", file=out)
    each = f", each launched {k_total} times, the configurations taking turns" if k_total > 1 else ""
    print(f"# scenario multiprocess: {len(configs)} configurations ({', '.join(c.name for c in configs)}){each}, "
          f"each launch one job of python -m jax_flexlink.launch (deadline {cfg.mp_timeout:g} s); rank 0 prints its "
          "table", file=out, flush=True)
    results, numbers = [], []
    with tempfile.TemporaryDirectory(prefix="flexlink-bench-mp-") as tmp:
        for k in range(1, k_total + 1):
            for c in configs:
                name = c.name if k_total == 1 else f"{c.name} (launch {k} of {k_total})"
                json_out = os.path.join(tmp, f"{c.name}.{k}.json")
                cmd = launcher_command(c, cfg.mp_timeout, json_out, cfg.argv,
                                       keep_freed_memory=cfg.mp_keep_freed_memory)
                print(f"\n# ===== configuration {name}: {c.describe()}", file=out)
                print(f"# {shlex.join(cmd)}", file=out, flush=True)
                code = _run_one(cmd, cfg.mp_timeout, out)
                doc = None
                if os.path.exists(json_out):
                    with open(json_out) as f:
                        doc = json.load(f)
                print(f"# ===== configuration {name}: {status_text(code)}", file=out, flush=True)
                results.append((c, code, doc))
                numbers.append(k)
    print("", file=out)
    for (c, code, _), k in zip(results, numbers):
        name = c.name if k_total == 1 else f"{c.name}/{k}"
        print(f"# {name:<8} {c.describe():<62} {status_text(code)}", file=out)
    merged = merge(results, command, cfg.argv, numbers if k_total > 1 else None)
    if k_total > 1:
        print("", file=out)
        for line in launches.lines(merged["launches"]["points"], k_total, cfg.stat):
            print(line, file=out)
    status = exit_status([code for _, code, _ in results])
    if cfg.json_path:
        from . import report
        report.write_json(cfg.json_path, merged)
        print(f"# wrote {cfg.json_path}", file=out)
    out.flush()
    return status
