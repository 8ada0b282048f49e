"""Short end-to-end runs of `python -m jax_flexlink.bench`, their exit status and their --json."""
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import jax_flexlink.bench
from jax_flexlink.bench import report

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(jax_flexlink.bench.__file__))))


def _native_reason():
    try:
        importlib.import_module("jax_flexlink._flexlink")
    except ImportError as e:
        return f"jax_flexlink._flexlink is not importable (native module not built: {e})"
    return None


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("XLA_FLAGS", None)  # --devices must do it
    env.pop("JAX_FLEXLINK_BENCH_REEXEC", None)
    env.pop("GLIBC_TUNABLES", None)  # the launcher's malloc settings, as printed, are its own
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _bench(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "jax_flexlink.bench", *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _check_doc(path, n_rows, impl_label=None):
    doc = json.loads(path.read_text())
    assert report.validate(doc) == []
    assert len(doc["rows"]) == n_rows
    assert doc["summary"]["ok"] and doc["summary"]["out_of_bounds"] == 0
    for r in doc["rows"]:
        assert r["wrong"] == 0 and r["baseline_wrong"] == 0
        assert r["time_min_us"] <= r["time_us"] <= r["time_max_us"]
        assert r["busbw_gbps"] > 0 and r["speedup"] > 0
        assert r["faults_per_call"] >= 0 and r["baseline_faults_per_call"] >= 0
    if impl_label:
        assert impl_label in doc["flexlink_impl"]
    return doc


def test_harness_selftest_run(tmp_path):
    """The whole pipeline with jax.lax standing in for FlexLink (works without the native module)."""
    out = tmp_path / "self.json"
    p = _bench(["--_impl", "lax", "-C", "all", "-b", "4K", "-e", "64K", "-f", "4", "-n", "2", "-w", "1",
                "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# Out of bounds values : 0 OK" in p.stdout and "# Avg bus bandwidth" in p.stdout
    doc = _check_doc(out, 5 * 3 * 2, impl_label="self-test")
    assert doc["devices"] == 8 and {r["devices"] for r in doc["rows"]} == {8}
    assert {r["collective"] for r in doc["rows"]} == {"all_reduce", "all_gather", "reduce_scatter",
                                                      "ppermute", "all_to_all"}
    assert doc["summary"]["skipped"] == []
    ag = [r for r in doc["rows"] if r["collective"] == "all_gather"]
    assert [r["bytes"] for r in ag if not r["inplace"]] == [4096, 16384, 65536]
    assert [r["count"] for r in ag if not r["inplace"]] == [128, 512, 2048]
    # the default statistic is the median; the mean is there too, with its own speedup
    assert doc["settings"]["stat"] == "median" and "speedup    mean" in p.stdout
    for r in doc["rows"]:
        assert r["time_us"] == r["time_median_us"] and r["speedup"] == r["speedup_median"]
        assert r["speedup_mean"] == pytest.approx(r["baseline_time_mean_us"] / r["time_mean_us"])


def test_stat_mean(tmp_path):
    out = tmp_path / "mean.json"
    p = _bench(["--_impl", "lax", "-C", "all_reduce", "-b", "4K", "-e", "4K", "-n", "3", "-w", "0",
                "--outofplace", "--stat", "mean", "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# time = mean over iterations" in p.stdout and "speedup  median" in p.stdout
    (r,) = json.loads(out.read_text())["rows"]
    assert r["time_us"] == r["time_mean_us"] and r["speedup"] == r["speedup_mean"]
    assert r["baseline_time_us"] == r["baseline_time_mean_us"]


def test_every_op_and_dtype_matches_lax(tmp_path):
    """The expected outputs agree with jax.lax for every collective, op and dtype (64-bit ones too)."""
    out = tmp_path / "all.json"
    p = _bench(["--_impl", "lax", "-C", "all", "-o", "all", "-d", "all", "-b", "4K", "-e", "4K", "-n", "1",
                "-w", "0", "--outofplace", "--baseline", "none", "--devices", "4", "--json", str(out)],
               timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert report.validate(doc) == []
    combos = {(r["collective"], r["op"], r["dtype"]) for r in doc["rows"]}
    n_dtypes = len(doc["settings"]["dtypes"])
    assert n_dtypes >= 10 and len(combos) == (4 + 1 + 4 + 1 + 1) * n_dtypes
    assert {c for c, op, _ in combos if op == "none"} == {"all_gather", "ppermute", "all_to_all"}
    assert all(r["wrong"] == 0 for r in doc["rows"])


def test_selftest_sendrecv_and_alltoall(tmp_path):
    """-C ppermute,all_to_all end to end with jax.lax standing in: every row exact, nccl-tests' sizes,
    counts and bus bandwidths, sizes that are not multiples of the block included."""
    out = tmp_path / "move.json"
    p = _bench(["--_impl", "lax", "-C", "ppermute,all_to_all", "-b", "1000", "-e", "9000", "-i", "4000",
                "-d", "float,bf16", "-n", "2", "-w", "1", "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# Out of bounds values : 0 OK" in p.stdout and "Skipped" not in p.stdout
    assert "busbw = algbw x 1 (SendRecv), (n-1)/n (AlltoAll);" in p.stdout
    assert "# SendRecv  op none  type float  on 8 devices  ring shift +1" in p.stdout
    assert "(native = lax.ppermute(ring +1))" in p.stdout
    assert "# AlltoAll  op none  type bfloat16  on 8 devices  (native = lax.all_to_all(0, 0, tiled=True))" \
        in p.stdout
    doc = _check_doc(out, 2 * 2 * 3 * 2)
    sizes = {}
    for r in doc["rows"]:
        assert r["op"] == "none" and r["devices"] == 8
        f = 1.0 if r["collective"] == "ppermute" else 7 / 8
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * f)
        assert r["baseline_busbw_gbps"] == pytest.approx(r["baseline_algbw_gbps"] * f)
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert isinstance(r["aliased"], bool) == r["inplace"]
        sizes.setdefault((r["collective"], r["dtype"]), []).append((r["bytes"], r["count"]))
    # requested 1000, 5000, 9000 bytes per rank; each size once per mode
    assert sizes[("ppermute", "float")] == [(1000, 250)] * 2 + [(5000, 1250)] * 2 + [(9000, 2250)] * 2
    assert sizes[("all_to_all", "float")] == [(992, 31)] * 2 + [(4992, 156)] * 2 + [(8992, 281)] * 2
    assert sizes[("all_to_all", "bfloat16")] == [(992, 62)] * 2 + [(4992, 312)] * 2 + [(8992, 562)] * 2


def _flexlink_refusal(name):
    """jax_flexlink's NotImplementedError when this build cannot lower its `name` (None when it can)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_flexlink
    from jax_flexlink.bench import backend
    flex = backend.FlexLink(jax_flexlink, "jax_flexlink")
    mesh = backend.make_mesh(8)
    f = backend.compile_collective(flex.body(name, "sum", 8), mesh, donate=False)
    try:
        f.lower(jax.ShapeDtypeStruct((8 * 64,), np.float32, sharding=NamedSharding(mesh, P("x"))))
    except NotImplementedError as e:
        return str(e)
    return None


def test_flexlink_run(tmp_path):
    """The real FlexLink, every collective. ppermute and all_to_all run where this build's engine has
    them; where it has not, their sections are skipped with jax_flexlink's own reason (and no row)."""
    reason = _native_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "flexlink.json"
    p = _bench(["-C", "all", "-b", "4K", "-e", "256K", "-f", "8", "-n", "3", "-w", "1", "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# Out of bounds values : 0 OK" in p.stdout
    refused = {name: _flexlink_refusal(name) for name in ("ppermute", "all_to_all")}
    ran = 3 + sum(r is None for r in refused.values())
    doc = _check_doc(out, ran * 3 * 2, impl_label="jax_flexlink")
    assert doc["versions"]["jax_flexlink"] not in ("", "unknown")
    for r in doc["rows"]:
        if r["shares"] is not None:
            assert sum(r["shares"].values()) == pytest.approx(1.0)
    skipped = {s["collective"]: s["reason"] for s in doc["summary"]["skipped"]}
    assert set(skipped) == {name for name, r in refused.items() if r is not None}
    for name, why in skipped.items():
        assert refused[name] in why and f"skipped: jax_flexlink cannot run it: {refused[name]}" in p.stdout
        assert not [r for r in doc["rows"] if r["collective"] == name]
    for name in set(refused) - set(skipped):
        assert len([r for r in doc["rows"] if r["collective"] == name]) == 6


def test_wrong_results_are_counted_and_fail(tmp_path):
    """A collective that corrupts one element per rank: #wrong counts it and the exit status is 1."""
    out = tmp_path / "wrong.json"
    script = textwrap.dedent(f"""
        import os, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        from jax_flexlink.bench import cli
        cfg = cli.parse(["-C", "all_reduce,all_gather", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0",
                         "--devices", "4", "--json", {str(out)!r}])
        cli.ensure_device_count(4, may_restart=False)
        import types
        from jax import lax
        from jax_flexlink.bench import backend, runner
        def bad_psum(x, axis):
            return lax.psum(x, axis).at[0].add(1)
        def bad_gather(x, axis_name, **kw):
            return lax.all_gather(x, axis_name, **kw).at[-1].add(1)
        api = types.SimpleNamespace(psum=bad_psum, all_gather=bad_gather)
        backend.load_flexlink = lambda impl: backend.FlexLink(api, "broken")
        sys.exit(runner.run(cfg))
    """)
    p = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "# Out of bounds values : 16 FAILED" in p.stdout
    doc = json.loads(out.read_text())
    assert report.validate(doc) == []
    assert [r["wrong"] for r in doc["rows"]] == [4, 4, 4, 4]
    assert all(r["baseline_wrong"] == 0 for r in doc["rows"]) and not doc["summary"]["ok"]


def test_a_failing_collective_is_reported_and_fails(tmp_path):
    """An exception inside a collective ends that section with an error line; the exit status is 1."""
    script = textwrap.dedent("""
        import sys
        from jax_flexlink.bench import cli
        cfg = cli.parse(["-C", "all_reduce,all_gather", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0",
                         "--devices", "2", "--baseline", "none"])
        cli.ensure_device_count(2, may_restart=False)
        import types
        from jax import lax
        from jax_flexlink.bench import backend, runner
        def boom(x, axis_name):
            raise RuntimeError("link exploded")
        api = types.SimpleNamespace(psum=boom, all_gather=lax.all_gather)
        backend.load_flexlink = lambda impl: backend.FlexLink(api, "broken")
        sys.exit(runner.run(cfg))
    """)
    p = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "link exploded" in p.stdout and "FAILED" in p.stdout
    assert "AllGather" in p.stdout  # the next section still ran


# A FlexLink whose ppermute jax_flexlink refuses to lower (as an engine without the target does) and
# whose all_to_all is lax's, or one that raises while running (host callback) when argv[1] == "runtime".
_FAKE_MOVEMENT = textwrap.dedent("""
    import sys
    from jax_flexlink.bench import cli
    cfg = cli.parse(["-C", "ppermute,all_to_all", "-b", "4K", "-e", "16K", "-f", "4", "-n", "1", "-w", "0",
                     "--devices", "4", "--json", sys.argv[2]])
    cli.ensure_device_count(4, may_restart=False)
    import types
    import jax
    from jax import lax
    from jax.extend.core import Primitive
    from jax.interpreters import mlir
    from jax_flexlink.bench import backend, runner
    refused_p = Primitive("refused_ppermute")
    refused_p.def_abstract_eval(lambda x: x)
    def refuse(ctx, x):
        raise NotImplementedError("jax_flexlink.ppermute: this build of jax_flexlink's engine has no "
                                  "ppermute (rebuild it)")
    mlir.register_lowering(refused_p, refuse)
    def failing_all_to_all(x, axis_name, split_axis, concat_axis, *, tiled):
        def boom(v):
            raise RuntimeError("link exploded mid-call")
        y = lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)
        return jax.pure_callback(boom, jax.ShapeDtypeStruct(y.shape, y.dtype), y)
    api = types.SimpleNamespace(ppermute=lambda x, axis_name, perm: refused_p.bind(x),
                                all_to_all=failing_all_to_all if sys.argv[1] == "runtime" else lax.all_to_all)
    backend.load_flexlink = lambda impl: backend.FlexLink(api, "fake")
    sys.exit(runner.run(cfg))
""")


def test_a_flexlink_side_that_cannot_lower_is_skipped_with_the_reason(tmp_path):
    """jax_flexlink refusing to lower (NotImplementedError) skips that section's FlexLink side, says why,
    lists it at the end and in the JSON; it is not a wrong result, so the exit status stays 0."""
    out = tmp_path / "skip.json"
    p = subprocess.run([sys.executable, "-c", _FAKE_MOVEMENT, "lower", str(out)], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    reason = "jax_flexlink.ppermute: this build of jax_flexlink's engine has no ppermute (rebuild it)"
    assert f"# SendRecv none float: skipped: fake cannot run it: {reason}" in p.stdout
    assert "# SendRecv  op none" not in p.stdout  # no table for it
    assert "# AlltoAll  op none  type float  on 4 devices" in p.stdout  # the next section ran
    assert "# Skipped on the FlexLink side : 1 (SendRecv none float; reasons above)" in p.stdout
    assert "ERROR" not in p.stdout and "Traceback" not in p.stderr
    doc = json.loads(out.read_text())
    assert report.validate(doc) == [] and doc["summary"]["ok"]
    assert doc["summary"]["skipped"] == [{"collective": "ppermute", "op": "none", "dtype": "float",
                                          "reason": f"fake cannot run it: {reason}"}]
    assert {r["collective"] for r in doc["rows"]} == {"all_to_all"} and len(doc["rows"]) == 2 * 2
    assert all(r["wrong"] == 0 and r["baseline_wrong"] == 0 for r in doc["rows"])


def test_a_flexlink_side_that_raises_while_running_fails(tmp_path):
    """A FlexLink call that fails at run time: an ERROR line with the cause, the run goes on, exit 1."""
    out = tmp_path / "fail.json"
    p = subprocess.run([sys.executable, "-c", _FAKE_MOVEMENT, "runtime", str(out)], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "# ERROR AlltoAll none float: JaxRuntimeError: " in p.stdout
    assert "RuntimeError: link exploded mid-call" in p.stdout.split("# ERROR AlltoAll")[1].splitlines()[0]
    assert "# Errors : 1 FAILED" in p.stdout and "# Skipped on the FlexLink side : 1" in p.stdout
    assert "# Out of bounds values : 0 (no rows ran)" in p.stdout
    doc = json.loads(out.read_text())
    assert report.validate(doc) == [] and not doc["summary"]["ok"] and doc["rows"] == []
    assert len(doc["summary"]["errors"]) == 1 and "link exploded" in doc["summary"]["errors"][0]


_FAKE_CONFIGURE = textwrap.dedent("""
    import sys, types
    from jax_flexlink.bench import cli
    cfg = cli.parse(sys.argv[1:] + ["-C", "all_reduce", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0",
                                    "--devices", "2", "--outofplace"])
    cli.ensure_device_count(2, may_restart=False)
    from jax import lax
    from jax_flexlink.bench import backend, runner
    def configure(*, links=None):
        if "emulated" in links:
            raise ValueError("unknown link kind(s) ['emulated']")
        print("CONFIGURED", links)
    api = types.SimpleNamespace(psum=lax.psum, all_gather=lax.all_gather, configure=configure)
    backend.load_flexlink = lambda impl: backend.FlexLink(api, "fake")
    sys.exit(runner.run(cfg))
""")


def test_links_are_passed_to_configure():
    p = subprocess.run([sys.executable, "-c", _FAKE_CONFIGURE, "--links", "shm;tcp"], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "CONFIGURED shm;tcp" in p.stdout and "links shm;tcp" in p.stdout


def test_emulated_scenario_without_emulated_links_fails_clearly():
    p = subprocess.run([sys.executable, "-c", _FAKE_CONFIGURE, "--scenario", "emulated-h800"], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "scenario 'emulated-h800' requires links 'emulated'" in p.stderr
    assert "unknown link kind" in p.stderr


def test_multiprocess_scenario_self_test(tmp_path):
    """Two launches (2 processes, 2 emulated hosts x 2 processes), jax.lax over gloo on both sides: the
    launcher plumbing, rank 0's table, cross-process timing and #wrong, the merged JSON."""
    out = tmp_path / "mp.json"
    p = _bench(["--scenario", "multiprocess", "--mp-configs", "2x1,2hx2x1", "-b", "64K", "-e", "256K", "-n", "2",
                "-w", "1", "--_impl", "lax", "--mp-timeout", "240", "--json", str(out)], timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert report.validate(doc) == [] and doc["summary"]["ok"]
    assert [(c["config"], c["processes"], c["hosts"], c["exit_status"]) for c in doc["configurations"]] == [
        ("2x1", 2, None, 0), ("2hx2x1", 4, 2, 0)]
    rows = doc["rows"]
    assert len(rows) == 8  # 2 configurations x 2 collectives x 2 sizes, out-of-place
    assert {(r["config"], r["devices"]) for r in rows} == {("2x1", 2), ("2hx2x1", 4)}
    assert all(r["wrong"] == 0 and r["baseline_wrong"] == 0 and r["time_us"] > 0 for r in rows)
    assert all(r["faults_per_call"] >= 0 and r["baseline_faults_per_call"] >= 0 for r in rows)
    lines = p.stdout.splitlines()
    assert sum(ln.startswith("# AllReduce  op sum  type float  on 4 devices") for ln in lines) == 1
    assert not any(re.match(r"\[\d+\] ", ln) for ln in lines), "only rank 0 prints, without the launcher's prefix"
    assert "2 emulated hosts (FLEXLINK_HOST_ID host0 here)" in p.stdout
    assert ("# malloc: GLIBC_TUNABLES glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=33554432 "
            "(freed memory kept for reuse, FlexLink and native alike)") in p.stdout


def test_multiprocess_scenario_reports_a_failing_flexlink_side_per_section(tmp_path):
    """Until the engine spans processes, a FlexLink group across processes fails at FlexLink's deadline:
    each section says so, the native side is still timed and checked, and the exit status is 1. With
    an engine that spans processes the same run must pass with every element right."""
    out = tmp_path / "mp.json"
    env = dict(_env(), FLEXLINK_TIMEOUT_S="3")
    p = subprocess.run([sys.executable, "-m", "jax_flexlink.bench", "--scenario", "multiprocess", "--mp-configs",
                        "2x1", "-b", "64K", "-e", "256K", "-n", "2", "-w", "1", "--mp-timeout", "240",
                        "--no-mp-keep-freed-memory", "--json", str(out)], env=env, capture_output=True, text=True,
                       timeout=400)
    assert "# malloc: glibc's default settings (freed memory returned to the kernel)" in p.stdout
    doc = json.loads(out.read_text())
    assert report.validate(doc) == []
    rows = doc["rows"]
    assert len(rows) == 4 and all(r["baseline_wrong"] == 0 and r["baseline_time_us"] > 0 for r in rows)
    failed = [r for r in rows if r.get("flexlink_error")]
    if not failed:
        assert p.returncode == 0 and all(r["wrong"] == 0 for r in rows), p.stdout + p.stderr
        return
    assert p.returncode == 1, p.stdout + p.stderr
    assert len(failed) == 4 and all(r["time_us"] is None and r["speedup"] is None for r in failed)
    assert "# FlexLink ERROR AllReduce sum float: rank " in p.stdout
    assert "# FlexLink ERROR AllGather none float: rank " in p.stdout
    assert p.stdout.count("ERROR       -       -       -") == 4
    assert len(doc["summary"]["errors"]) == 2 and not doc["summary"]["ok"]
    assert "# 2x1" in p.stdout and "FAILED (exit 1" in p.stdout


def test_gpu_scenario_without_a_gpu_fails_clearly():
    """This machine has no GPU: exit status 2 and a sentence that says so, no traceback."""
    env = dict(_env())
    env.pop("JAX_PLATFORMS", None)  # as on a GPU machine; jax skips CUDA without one
    p = subprocess.run([sys.executable, "-m", "jax_flexlink.bench", "--scenario", "gpu", "-b", "4K", "-e", "4K"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "jax_flexlink.bench: error: --scenario gpu: jax sees no GPU (" in p.stderr
    # No traceback of the bench's. jax logs one of its own for a plugin that fails to initialise (the
    # CUDA plugin installed without cuDNN or a driver: "Jax plugin configuration error"); its frames
    # are jax's.
    frames = [ln for ln in p.stderr.splitlines() if ln.lstrip().startswith('File "')]
    assert "Traceback" not in p.stderr or "Jax plugin configuration error" in p.stderr, p.stderr
    assert not [f for f in frames if "jax_flexlink" in f], p.stderr
