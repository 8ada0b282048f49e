"""Short end-to-end runs of `python -m jax_flexlink.bench`, their exit status and their --json."""
import importlib
import json
import os
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
    doc = _check_doc(out, 3 * 3 * 2, impl_label="self-test")
    assert doc["devices"] == 8 and {r["devices"] for r in doc["rows"]} == {8}
    assert {r["collective"] for r in doc["rows"]} == {"all_reduce", "all_gather", "reduce_scatter"}
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
    assert n_dtypes >= 10 and len(combos) == (4 + 1 + 4) * n_dtypes
    assert all(r["wrong"] == 0 for r in doc["rows"])


def test_flexlink_run(tmp_path):
    reason = _native_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "flexlink.json"
    p = _bench(["-C", "all", "-b", "4K", "-e", "256K", "-f", "8", "-n", "3", "-w", "1", "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# Out of bounds values : 0 OK" in p.stdout
    doc = _check_doc(out, 3 * 3 * 2, impl_label="jax_flexlink")
    assert doc["versions"]["jax_flexlink"] not in ("", "unknown")
    for r in doc["rows"]:
        if r["shares"] is not None:
            assert sum(r["shares"].values()) == pytest.approx(1.0)


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


def test_unavailable_scenario_fails_clearly():
    p = _bench(["--scenario", "multiprocess"], timeout=120)
    assert p.returncode == 2 and "not implemented yet" in p.stderr
