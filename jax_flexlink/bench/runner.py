"""Runs the sweep: for each collective, op and dtype, each size; prints a line per size as it goes."""

from __future__ import annotations

import datetime
import sys
import warnings

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import backend, collectives, data, report, scenarios, table, timing
from .backend import BenchError, Unsupported
from .cli import Config, command_line

# A donated input that XLA cannot alias (AllGather/ReduceScatter change the shape) is still consumed;
# that is the point of the in-place rows, so the warning is noise here.
warnings.filterwarnings("ignore", message=".*[Dd]onated buffers were not usable.*")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _wrong(out, expected: np.ndarray, mesh_devices: list) -> int:
    """Elements that differ from the expected output, over all ranks' shards."""
    rank_of = {d: i for i, d in enumerate(mesh_devices)}
    total = 0
    for shard in out.addressable_shards:
        r = rank_of[shard.device]
        total += data.count_wrong(np.asarray(shard.data), expected[0 if expected.shape[0] == 1 else r])
    return total


def _interleaving(runs: int, pause_ms: float = 0.0) -> str:
    if runs == 1:
        return "call by call"
    return f"in turns of 1 untimed + {runs} timed calls" + (f", each turn after a {pause_ms:g} ms pause" if pause_ms else "")


def _one_line(e: BaseException) -> str:
    """An exception's message on one line: its first line, and its last one where they differ (an
    error that carries a traceback, such as XLA's for a failed host callback, names the cause last)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[-1] != lines[0]:
        return f"{lines[0]} ... {lines[-1]}"
    return lines[0] if lines else ""


def _pointers(arr) -> set[int]:
    try:
        return {s.data.unsafe_buffer_pointer() for s in arr.addressable_shards}
    except Exception:
        return set()


def _shares(before: dict | None, after: dict | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    total = sum(v for v in delta.values() if v > 0)
    if total <= 0:
        return None
    return {k: v / total for k, v in delta.items() if v > 0}


class Runner:
    def __init__(self, cfg: Config, out=sys.stdout):
        self.cfg = cfg
        self.out = out
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.errors: list[str] = []
        self.skipped: list[dict] = []   # sections whose FlexLink side could not run, with the reason

    def say(self, line: str = "") -> None:
        if self.reporting:
            print(line, file=self.out, flush=True)

    # Where one job spans several processes (bench/mp_worker.py), these combine what each process
    # measured and counted on its own devices into the job's; in one process they change nothing.
    reporting = True                 # whether this process prints the table

    def job_timings(self, timings: list) -> list:
        return timings

    def job_wrong(self, local: int | None) -> int | None:
        return local

    def probe_flexlink(self, fn, arg) -> None:
        """Lowers the section's FlexLink program once; NotImplementedError: this build cannot run it."""
        fn.lower(arg)

    # -------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        self.scenario = scenarios.get(cfg.scenario)
        if any(collectives.DTYPES[d].itemsize == 8 for d in cfg.dtypes):
            jax.config.update("jax_enable_x64", True)  # else jax silently computes double/int64 in 32 bits
        self.flex = backend.load_flexlink(cfg.impl)
        try:
            scenarios.check(self.scenario, self.flex)
        except RuntimeError as e:
            raise BenchError(str(e)) from e
        if cfg.links:
            try:
                self.flex.configure_links(cfg.links)
            except BenchError as e:
                if self.scenario.requires and cfg.links == self.scenario.links:
                    raise BenchError(f"{scenarios.requirement(self.scenario)}: {e}") from e
                raise
        self.mesh = backend.make_mesh(cfg.devices, cfg.platform)
        self.mesh_devices = list(self.mesh.devices.flat)
        cfg.devices = len(self.mesh_devices)  # the gpu scenario's 0 ("all") resolved
        self.sharding = NamedSharding(self.mesh, P(backend.AXIS))
        self.copy_gbps = timing.memcpy_gbps()
        self.started = _now()

    def preamble(self) -> None:
        cfg = self.cfg
        d0 = self.mesh_devices[0]
        self.say(f"# jax_flexlink.bench: {command_line(cfg.argv)}")
        self.say(f"# scenario {cfg.scenario}: {cfg.devices} x {d0.platform} devices, links "
                 f"{cfg.links or 'default'}; FlexLink = {self.flex.label}; baseline {cfg.baseline}")
        iters = f"{cfg.iters}" if cfg.iters else (f"auto ({timing.AUTO_MIN_ITERS}..{timing.AUTO_MAX_ITERS}, "
                                                  "scaled with size)")
        self.say(f"# iters {iters}, warmup {cfg.warmup}, check {int(cfg.check)}, seed {cfg.seed}; "
                 f"jax {jax.__version__}, jax_flexlink {self.flex.version()}")
        self.say(f"# reference: single-thread memcpy {self.copy_gbps:.1f} GB/s (read+write) on this machine")
        other = table.other_stat(cfg.stat)
        self.say(f"# time = {cfg.stat} over iterations (FlexLink and native interleaved "
                 f"{_interleaving(cfg.runs, cfg.turn_pause_ms)}, order alternating; min/median/mean/max in --json); algbw = bytes/time; busbw = algbw x "
                 f"{collectives.busbw_legend(cfg.collectives)}; speedup = native time / "
                 f"FlexLink time; '{other}' = the same ratio of {other} times")
        if self.flex.selftest:
            self.say("# WARNING: self-test mode: the 'FlexLink' columns are jax.lax, not FlexLink")

    # -------------------------------------------------------------------------------------------------
    def run_section(self, coll_name: str, op: str, dtype: str) -> None:
        cfg = self.cfg
        coll = collectives.COLLECTIVES[coll_name]
        n = cfg.devices
        op_label = op if coll.has_op else "none"
        itemsize = collectives.DTYPES[dtype].itemsize
        try:
            flex_body = self.flex.body(coll_name, op, n)
        except Unsupported as e:
            self._skip(coll, op_label, dtype, str(e))
            return
        native = None
        if cfg.baseline == "native":
            nbody, nimpl = backend.native_body(coll_name, op, n)
            native = (nbody, nimpl)
        fns = {}
        for inplace in cfg.modes:
            fns[("flex", inplace)] = backend.compile_collective(flex_body, self.mesh, inplace)
            if native:
                fns[("native", inplace)] = backend.compile_collective(native[0], self.mesh, inplace)
        first = next((s for s in cfg.sizes if coll.counts(s, itemsize, n)[0] > 0), None)
        if first is not None:
            # jax_flexlink raises NotImplementedError at lowering for what this build cannot run (an
            # engine without the collective's target, a dtype it lacks): the FlexLink side is skipped
            # with jax_flexlink's reason. Anything else it raises fails the section (below, in run).
            shape = (n * coll.counts(first, itemsize, n)[1],)
            arg = jax.ShapeDtypeStruct(shape, collectives.DTYPES[dtype], sharding=self.sharding)
            try:
                self.probe_flexlink(fns[("flex", cfg.modes[0])], arg)
            except NotImplementedError as e:
                self._skip(coll, op_label, dtype, f"{self.flex.label} cannot run it: {_one_line(e)}")
                return
        title = f"{coll.title}  op {op_label}  type {dtype}  on {n} devices"
        if coll_name == "ppermute":
            title += "  ring shift +1 (rank i sends to i+1)"
        if native:
            title += f"  (native = {native[1]})"
        self.say()
        for line in table.header(title, cfg.modes, native is not None, stat=cfg.stat):
            self.say(line)
        factor = coll.busbw_factor(n)
        for size in cfg.sizes:
            count, in_elems, _ = coll.counts(size, itemsize, n)
            if count == 0:
                self.say(f"# {size} bytes: skipped, less than one {dtype} element per rank")
                continue
            nbytes = coll.actual_bytes(count, itemsize, n)
            inputs = data.make_inputs(op if coll.has_op else "sum", dtype, n, in_elems, cfg.seed)
            expected = data.expected_output(coll_name, op, inputs) if cfg.check else None
            x = jax.device_put(inputs.reshape(-1), self.sharding)
            if x.dtype != inputs.dtype:
                raise BenchError(f"jax holds {dtype} data as {x.dtype}; the run would not measure {dtype}")
            del inputs
            iters = cfg.iters or timing.auto_iters(nbytes)
            by_mode = {}
            for inplace in cfg.modes:
                row = {"collective": coll_name, "op": op_label, "dtype": dtype, "bytes": nbytes,
                       "count": count, "devices": n, "inplace": inplace, "iters": iters,
                       "warmup": cfg.warmup, "baseline": cfg.baseline,
                       "baseline_impl": native[1] if native else None}
                impls = [fns[("flex", inplace)]] + ([fns[("native", inplace)]] if native else [])
                row.update(self._measure(impls, x, expected, inplace, iters, nbytes, factor))
                by_mode[inplace] = row
                self.rows.append(row)
            del x
            self.say(table.size_line(by_mode, cfg.modes, native is not None, stat=cfg.stat))

    def _skip(self, coll, op_label: str, dtype: str, reason: str) -> None:
        """The FlexLink side of a section cannot run: a '# ... skipped' line, the note and summary."""
        self.say(f"# {coll.title} {op_label} {dtype}: skipped: {reason}")
        self.notes.append(f"{coll.name} {op_label} {dtype} skipped: {reason}")
        self.skipped.append({"collective": coll.name, "op": op_label, "dtype": dtype, "reason": reason})

    def _measure(self, impls: list, x, expected, inplace: bool, iters: int, nbytes: int,
                 factor: float, sides: tuple = ("", "baseline_")) -> dict:
        """Times FlexLink (impls[0]) and the baseline (impls[1], if any) interleaved; checks both.

        sides names the row fields each of impls fills: "" FlexLink's, "baseline_" the baseline's
        (("baseline_",) times the baseline alone; FlexLink's fields stay None)."""
        cfg = self.cfg
        if inplace:  # a donated input is consumed: a fresh, completed on-device copy per call (untimed)
            def make_arg():
                return jax.device_put(x, self.sharding, may_alias=False)
        else:
            def make_arg():
                return x
        before = self.flex.link_bytes()
        ts, outs, probed = timing.time_interleaved(impls, make_arg, cfg.warmup, iters,
                                                   [_pointers if inplace else None], runs=cfg.runs,
                                                   turn_pause_s=cfg.turn_pause_ms / 1000)
        ts = self.job_timings(ts)
        res = {"shares": _shares(before, self.flex.link_bytes()),
               "aliased": (bool(probed[0]) and _pointers(outs[0]) == probed[0]) if inplace else None}
        wrongs = [self.job_wrong(_wrong(o, expected, self.mesh_devices) if cfg.check else None) for o in outs]
        del outs
        for prefix in ("", "baseline_"):
            k = sides.index(prefix) if prefix in sides else None
            t = ts[k] if k is not None and k < len(ts) else None
            algbw, busbw = timing.bandwidths(nbytes, t.value(cfg.stat), factor) if t else (None, None)
            res.update({f"{prefix}time_us": t.value(cfg.stat) * 1e6 if t else None,
                        f"{prefix}time_min_us": t.min_s * 1e6 if t else None,
                        f"{prefix}time_max_us": t.max_s * 1e6 if t else None,
                        f"{prefix}time_median_us": t.median_s * 1e6 if t else None,
                        f"{prefix}time_mean_us": t.mean_s * 1e6 if t else None,
                        f"{prefix}faults_per_call": t.faults_per_call if t else None,
                        f"{prefix}algbw_gbps": algbw, f"{prefix}busbw_gbps": busbw,
                        f"{prefix}wrong": wrongs[k] if t else None})
        for stat in timing.STATS:
            ok = len(ts) > 1 and sides[:2] == ("", "baseline_") and ts[0].value(stat) > 0
            res[f"speedup_{stat}"] = ts[1].value(stat) / ts[0].value(stat) if ok else None
        res["speedup"] = res[f"speedup_{cfg.stat}"]
        return res

    # -------------------------------------------------------------------------------------------------
    def document(self) -> dict:
        cfg = self.cfg
        rows = self.rows
        wrong = sum((r["wrong"] or 0) + (r["baseline_wrong"] or 0) for r in rows)
        bus = [r["busbw_gbps"] for r in rows if r["busbw_gbps"] is not None]
        bbus = [r["baseline_busbw_gbps"] for r in rows if r["baseline_busbw_gbps"] is not None]
        stats = self.flex.stats()
        summary = {"out_of_bounds": wrong, "ok": wrong == 0 and not self.errors, "errors": self.errors,
                   "skipped": self.skipped,
                   "checked": cfg.check,
                   "avg_busbw_gbps": sum(bus) / len(bus) if bus else None,
                   "baseline_avg_busbw_gbps": sum(bbus) / len(bbus) if bbus else None,
                   "memcpy_gbps": self.copy_gbps}
        if stats:
            summary["flexlink_stats"] = stats
        machine = report.machine_info()
        machine["memcpy_gbps_1thread"] = self.copy_gbps
        machine["device_platform"] = self.mesh_devices[0].platform
        return {"schema": report.SCHEMA, "machine": machine, "versions": report.versions(self.flex.version()),
                "links": cfg.links or "default", "flexlink_impl": self.flex.label,
                "command": command_line(cfg.argv), "argv": list(cfg.argv), "scenario": cfg.scenario,
                "devices": cfg.devices, "baseline": cfg.baseline, "settings": cfg.settings,
                "started_utc": self.started, "finished_utc": _now(), "summary": summary,
                "notes": self.notes, "rows": rows}

    def run(self) -> int:
        self.setup()
        self.preamble()
        cfg = self.cfg
        for coll in cfg.collectives:
            has_op = collectives.COLLECTIVES[coll].has_op
            for op in (cfg.ops if has_op else ["sum"]):
                for dtype in cfg.dtypes:
                    try:
                        self.run_section(coll, op, dtype)
                    except Exception as e:  # a failing collective fails the run, not the harness
                        msg = (f"{collectives.COLLECTIVES[coll].title} {op if has_op else 'none'} {dtype}: "
                               f"{type(e).__name__}: {_one_line(e)}")
                        self.say(f"# ERROR {msg}")
                        self.errors.append(msg)
        self.say()
        for line in table.footer(self.rows, cfg.baseline == "native"):
            self.say(line)
        if self.skipped:
            what = "; ".join(f"{collectives.COLLECTIVES[s['collective']].title} {s['op']} {s['dtype']}"
                             for s in self.skipped)
            self.say(f"# Skipped on the FlexLink side : {len(self.skipped)} ({what}; reasons above)")
        if self.errors:
            self.say(f"# Errors : {len(self.errors)} FAILED ({'; '.join(self.errors)})")
        doc = self.document()
        if cfg.json_path:
            report.write_json(cfg.json_path, doc)
            self.say(f"# wrote {cfg.json_path}")
        if cfg.plot_path:
            report.plot(cfg.plot_path, self.rows, title=f"{command_line(cfg.argv)}")
            self.say(f"# wrote {cfg.plot_path}")
        return 0 if doc["summary"]["ok"] else 1


def run(cfg: Config, out=sys.stdout) -> int:
    try:
        return Runner(cfg, out).run()
    except BenchError as e:
        print(f"jax_flexlink.bench: error: {e}", file=sys.stderr)
        return 2
