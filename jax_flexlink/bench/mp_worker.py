"""One process of `--scenario multiprocess` (started by bench/multiprocess.py through the launcher):

    python -m jax_flexlink.launch -n N ... -- python -m jax_flexlink.bench.mp_worker \\
        --config NAME --json-out FILE -- BENCH ARGS...

Every process runs the same sweep as the one-process bench (runner.Runner), over a mesh of all
processes' devices; what differs is what runner.Runner's hooks say: only rank 0 prints and writes the
JSON, a call's time is the slowest process's, #wrong sums every process's shards, and a FlexLink side
that raises does not end the section: its error is reported, the native side is timed alone.

Cross-process agreement goes through jax.distributed's key-value store, not through a collective, so
that it works whatever state a failed FlexLink collective left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# The key-value store's wait: long enough for the slowest process to finish a 64 MiB row's calls (and
# a FlexLink call to reach its own deadline); the launcher's deadline bounds the job anyway.
EXCHANGE_TIMEOUT_MS = 600_000

# The native baseline across processes: XLA:CPU's gloo collectives (jax 0.10's default), set explicitly
# so that another default cannot change what the column measures.
CPU_COLLECTIVES = "gloo"

# A row's measured fields (runner.Runner._measure's), all None where nothing could be timed.
_MEASURED = [f"{side}{k}" for side in ("", "baseline_") for k in (
    "time_us", "time_min_us", "time_max_us", "time_median_us", "time_mean_us", "algbw_gbps", "busbw_gbps",
    "wrong", "faults_per_call")] + ["speedup", "speedup_median", "speedup_mean", "shares", "aliased"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_flexlink.bench.mp_worker",
                                description="one process of python -m jax_flexlink.bench --scenario "
                                            "multiprocess (started by it; not for direct use)")
    p.add_argument("--config", required=True, help="the configuration's name, for the output")
    p.add_argument("--json-out", required=True, help="where rank 0 writes this configuration's JSON")
    p.add_argument("bench_argv", nargs=argparse.REMAINDER, help="-- the bench's own arguments")
    a = p.parse_args(argv)
    if a.bench_argv and a.bench_argv[0] == "--":
        a.bench_argv = a.bench_argv[1:]
    return a


class FlexLinkFailed(Exception):
    """The FlexLink side of a call raised (while tracing, compiling, running or blocking on it)."""


def _guarded(fn):
    """fn with its errors marked as FlexLink's, and blocked on inside: XLA reports a failed call when
    its output is waited for. The timing's own block_until_ready then returns at once."""
    import jax

    def call(arg):
        try:
            return jax.block_until_ready(fn(arg))
        except Exception as e:
            raise FlexLinkFailed(str(e)) from e
    return call


def make_runner(cfg, rank: int, nprocs: int, config_name: str, out=sys.stdout):
    import jax

    from jax_flexlink._src import compat

    from . import runner, timing

    class MultiprocessRunner(runner.Runner):
        reporting = rank == 0

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.client = compat.distributed_client()
            self.seq = 0
            self.section = None
            self.flex_failed: dict = {}    # section -> the error that stopped its FlexLink side

        # --- agreement between processes ----------------------------------------------------
        def exchange(self, value):
            """Every process's value (JSON-able), in rank order."""
            if self.client is None or nprocs == 1:
                return [value]
            self.seq += 1
            prefix = f"jax_flexlink.bench/{config_name}/{self.seq}/"
            self.client.key_value_set(prefix + str(rank), json.dumps(value))
            return [json.loads(self.client.blocking_key_value_get(prefix + str(r), EXCHANGE_TIMEOUT_MS))
                    for r in range(nprocs)]

        def job_timings(self, timings):
            """Per call, the slowest process's time: the call is done when every process is; and per
            call the most page faults of any process.

            This is the first exchange after a row's calls, so it also carries whether they ran: a
            process whose FlexLink side raised sends its error instead (_record_failure), and every
            process then learns it here, at the same point of the sequence of exchanges."""
            got = self.exchange({"samples": [t.samples_s for t in timings], "faults": [t.faults for t in timings],
                                 "error": None})
            failed = next(((r, g["error"]) for r, g in enumerate(got) if g["error"]), None)
            if failed is not None:
                raise _OtherRankFailed(self._note_failure(*failed))
            def most_faults(k, n):
                if any(g["faults"][k] is None for g in got):
                    return None
                return [max(g["faults"][k][i] for g in got) for i in range(n)]
            return [timing.Timing([max(g["samples"][k][i] for g in got) for i in range(len(t.samples_s))],
                                  t.warmup, most_faults(k, len(t.samples_s)))
                    for k, t in enumerate(timings)]

        def _record_failure(self, message: str) -> str:
            got = self.exchange({"samples": None, "faults": None, "error": message})
            r, e = next((r, g["error"]) for r, g in enumerate(got) if g["error"])
            return self._note_failure(r, e)

        def job_wrong(self, local):
            counts = self.exchange(local)
            return None if any(c is None for c in counts) else sum(counts)

        # --- the sweep ------------------------------------------------------------------------
        def setup(self):
            self.cfg.devices = jax.device_count()  # the mesh: every process's devices, process-major
            super().setup()

        def preamble(self):
            super().preamble()
            local = jax.local_device_count()
            self.say(f"# multiprocess configuration {config_name}: {nprocs} processes x {local} host "
                     f"device{'s' if local > 1 else ''} = {jax.device_count()} devices, "
                     f"{_hosts_text()}; native = jax.lax over "
                     f"{CPU_COLLECTIVES}; times are the slowest process's per "
                     "call; #wrong sums every process's shards")
            self.say(f"# malloc: {_malloc_text()}")

        def probe_flexlink(self, fn, arg):
            """As in one process, and agreed: every process skips the section if one cannot lower it
            (NotImplementedError), and any other error there is the section's FlexLink error, so that
            its native side is still timed (in one process such an error ends the section)."""
            skip = error = None
            try:
                fn.lower(arg)
            except NotImplementedError as e:
                skip = str(e)
            except Exception as e:
                error = f"{type(e).__name__} while lowering: {runner._one_line(e)}"
            got = self.exchange({"skip": skip, "error": error})
            skipped = next((g["skip"] for g in got if g["skip"]), None)
            if skipped is not None:
                raise NotImplementedError(skipped)
            failed = next(((r, g["error"]) for r, g in enumerate(got) if g["error"]), None)
            if failed is not None:
                self._note_failure(*failed)

        def run_section(self, coll_name, op, dtype):
            self.section = (coll_name, op, dtype)
            super().run_section(coll_name, op, dtype)

        def _measure(self, impls, x, expected, inplace, iters, nbytes, factor, sides=("", "baseline_")):
            error = self.flex_failed.get(self.section)
            if error is None:
                try:
                    return super()._measure([_guarded(impls[0])] + impls[1:], x, expected, inplace, iters,
                                            nbytes, factor, sides)
                except FlexLinkFailed as e:
                    error = self._record_failure(runner._one_line(e))
                except _OtherRankFailed as e:
                    error = e.error
            if len(impls) > 1:
                res = super()._measure(impls[1:], x, expected, inplace, iters, nbytes, factor,
                                       sides=("baseline_",))
                res["aliased"] = None  # the field says whether FlexLink's output aliased its input
            else:  # --baseline none: nothing left to time
                res = dict.fromkeys(_MEASURED, None)
            res["flexlink_error"] = error
            return res

        def _note_failure(self, r: int, message: str) -> str:
            coll, op, dtype = self.section
            error = f"rank {r}: {message}"
            self.flex_failed[self.section] = error
            title = runner.collectives.COLLECTIVES[coll].title
            op_label = op if runner.collectives.COLLECTIVES[coll].has_op else "none"
            self.say(f"# FlexLink ERROR {title} {op_label} {dtype}: {error} -- its FlexLink column is not run "
                     "again in this section; native is timed alone")
            self.errors.append(f"{config_name}: {title} {op_label} {dtype}: FlexLink: {error}")
            return error

        def document(self):
            doc = super().document()
            doc["multiprocess"] = {"config": config_name, "processes": nprocs,
                                   "devices_per_process": jax.local_device_count(),
                                   "hosts": _env_int("FLEXLINK_NUM_HOSTS"),
                                   "cpu_collectives": CPU_COLLECTIVES}
            for row in doc["rows"]:
                row["config"] = config_name
                row["processes"] = nprocs
            self.last_doc = doc
            return doc

    class _OtherRankFailed(Exception):
        def __init__(self, error):
            self.error = error

    return MultiprocessRunner(cfg, out)


def _env_int(name: str):
    v = os.environ.get(name)
    return int(v) if v and v.isdigit() else None


def _malloc_text() -> str:
    """The glibc malloc settings of this process (the launcher's --keep-freed-memory gives them)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    mine = [e for e in tunables.split(":") if e.startswith("glibc.malloc.")]
    return ("GLIBC_TUNABLES " + ":".join(mine) + " (freed memory kept for reuse, FlexLink and native alike)"
            if mine else "glibc's default settings (freed memory returned to the kernel)")


def _hosts_text() -> str:
    h = os.environ.get("FLEXLINK_NUM_HOSTS")
    return f"{h} emulated hosts (FLEXLINK_HOST_ID {os.environ.get('FLEXLINK_HOST_ID')} here)" if h else "one host"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    from jax_flexlink import launch
    if os.environ.get("FLEXLINK_PROCESS_ID", "0") != "0":
        # Only rank 0's stdout is the table; what other ranks print (gloo's connection notes from C++
        # included) goes to stderr, still prefixed with their rank by the launcher.
        sys.stdout.flush()
        os.dup2(2, 1)
    rank, nprocs = launch.initialize(initialization_timeout=120)
    import jax
    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    from . import cli
    from .backend import BenchError
    from . import report
    cfg = cli.parse(a.bench_argv)
    cfg.json_path = cfg.plot_path = None  # rank 0 writes --json-out below; the driver merges the files
    bench = make_runner(cfg, rank, nprocs, a.config)
    try:
        status = bench.run()
    except BenchError as e:
        print(f"jax_flexlink.bench: error: {e}", file=sys.stderr)
        status = 2
    if rank == 0 and getattr(bench, "last_doc", None) is not None:
        report.write_json(a.json_out, bench.last_doc)
    # The last exchange: no process exits before rank 0 has written the JSON (the launcher stops the
    # others when one exits non-zero), and all exit with the job's status.
    try:
        return max(bench.exchange(status))
    except Exception as e:  # another process is gone; the launcher is stopping the job
        print(f"jax_flexlink.bench: the final exchange between processes failed: {e}", file=sys.stderr)
        return status or 1


if __name__ == "__main__":
    sys.exit(main())
