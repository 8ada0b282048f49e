"""jax_flexlink.diagnose() and `python -m jax_flexlink.diagnose`: the report from real calls, its
wording from synthetic stats() dicts (health, failovers, stragglers as docs/diagnose.md specifies),
straggler statistics from the engine's rendezvous, and the command line."""
import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flexlink as flx
from jax_flexlink import _flexlink
from jax_flexlink._src import diagnose as dg
from helpers import mesh

N = 8
_AUTOTUNE_DEFAULT = _flexlink.autotune_min_bytes()
_TUNE_MAX_DEFAULT = _flexlink.tune_max_bytes()
_run_ids = itertools.count(random.randrange(1 << 41, 1 << 42))


@pytest.fixture(autouse=True)
def _restore_links():
    yield
    flx.configure(links="shm", autotune_min_bytes=_AUTOTUNE_DEFAULT, tune_max_bytes=_TUNE_MAX_DEFAULT)


def _psum_and_gather(calls, per_device):
    m = mesh((N,), ("x",))
    x = jax.device_put(np.ones((N * per_device,), np.float32), NamedSharding(m, P("x")))
    psum = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=m, in_specs=P("x"), out_specs=P("x")))
    gather = jax.jit(jax.shard_map(lambda v: flx.all_gather(v, "x", tiled=True), mesh=m, in_specs=P("x"),
                                   out_specs=P("x")))
    for _ in range(calls):
        np.testing.assert_array_equal(np.asarray(psum(x)), np.full(N * per_device, N, np.float32))
        assert np.asarray(gather(x)).shape == (N * N * per_device,)


# --- stats()["stragglers"] from real calls --------------------------------------------------------

def test_stragglers_after_real_jax_calls():
    flx.reset_stats()
    _psum_and_gather(calls=10, per_device=256)
    entries = [s for s in flx.stats()["stragglers"] if s["group"] == "[0, 1, 2, 3, 4, 5, 6, 7]"]
    assert sorted(s["rank"] for s in entries) == list(range(N))
    calls = entries[0]["calls"]
    assert calls >= 20  # 10 psums + 10 all_gathers (stage-1 profiling calls would add more)
    # Every completed call has exactly one last rank.
    assert sum(s["last"] for s in entries) == calls
    for s in entries:
        assert s["device"] == s["rank"] and s["calls"] == calls and s["expected_last"] == calls / N
        late = s["lateness_s"]
        assert 0 <= late["p50"] <= late["p90"] <= late["max"] < 60
        assert (late["max"] > 0) == (s["last"] > 0) or late["max"] == 0
        assert 0 <= s["p_value"] <= 1 and isinstance(s["flagged"], bool) and s["absent"] == 0
    flx.reset_stats()
    assert not [s for s in flx.stats()["stragglers"] if s["group"] == "[0, 1, 2, 3, 4, 5, 6, 7]"]


def _engine_run_calls(devices, calls, sleeper=None, sleep_s=0.0):
    """`calls` all_reduces through the engine (engine_run: the FFI handler's path), a thread per
    device; `sleeper` sleeps `sleep_s` before each of its calls."""
    run_id = next(_run_ids)
    errors = []

    def work(d):
        x = np.ones(64, np.float32)
        y = np.zeros(64, np.float32)
        try:
            for _ in range(calls):
                if d == sleeper:
                    time.sleep(sleep_s)
                _flexlink.engine_run("all_reduce", "sum", list(devices), [len(devices)], d, run_id, x, y)
                assert y[0] == len(devices)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(d,), daemon=True) for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)


def test_a_sleeping_rank_is_flagged_and_diagnosed():
    devices = list(range(40, 48))
    flx.reset_stats()
    _engine_run_calls(devices, calls=32, sleeper=45, sleep_s=0.005)
    entries = {s["rank"]: s for s in flx.stats()["stragglers"] if dg.group_key(s["group"]) == dg.group_key(devices)}
    assert len(entries) == N
    slow = entries[5]
    # At least half (a loaded machine can deschedule a peer for longer than the sleep).
    assert slow["device"] == 45 and slow["flagged"] and slow["last"] >= 16 and slow["calls"] == 32
    assert slow["lateness_s"]["p50"] > 0.5e-3
    assert not any(s["flagged"] for r, s in entries.items() if r != 5)
    report = flx.diagnose()
    found = [f for f in report.findings if f.startswith("rank 5 (device 45) of group [40..47] arrived last in")]
    assert len(found) == 1, report.findings
    assert f"arrived last in {slow['last']} of 32 calls (expected 4), median " in found[0] and "ms late" in found[0]
    flx.reset_stats()


# --- the report from real calls --------------------------------------------------------------------

def test_report_from_real_calls():
    # Two links and stage 1 on the first 256 KiB call: the groups get fits, the links traffic.
    flx.configure(links="shm;tcp", autotune_min_bytes="64K", tune_max_bytes="128K")
    _psum_and_gather(calls=1, per_device=64 * 1024)
    # Stage 1 may find that splitting does not pay on this machine; pinned halves give both links
    # traffic whatever it found (the fits stay).
    for p in flx.stats()["plans"]:
        _flexlink.set_shares(p["collective"], p["bucket_bytes"], [0.5, 0.5], pinned=True)
    flx.reset_stats()
    _psum_and_gather(calls=6, per_device=64 * 1024)
    report = flx.diagnose()
    assert isinstance(report, flx.DiagnosisReport) and report.live
    assert [l.name for l in report.links] == ["shm", "tcp"] and report.links[0].primary
    for l in report.links:
        assert l.calls > 0 and l.observed_bytes_per_s > 0, l
    group = next(g for g in report.groups if g.group == "[0,1,2,3,4,5,6,7]")
    kinds = {p["collective"] for p in group.plans}
    assert {"all_reduce", "all_gather"} <= kinds
    for p in group.plans:
        assert set(p["shares"]) == {"shm", "tcp"} and abs(sum(p["shares"].values()) - 1) < 1e-6
    assert "all_reduce" in group.fits and set(group.fits["all_reduce"]) == {"shm", "tcp"}
    assert all(l.expected_bytes_per_s.get("all_reduce", 0) > 0 for l in report.links)
    assert len(group.stragglers) == N
    text = str(report)
    assert "Findings:" in text and "shm (primary)" in text and "tcp:" in text and "plan all_reduce" in text
    d = json.loads(report.to_json())
    assert d["links"][0]["name"] == "shm" and d["groups"] and d["findings"]
    if "health" not in flx.stats():
        assert any(n.startswith(dg.HEALTH_NOT_AVAILABLE) for n in report.notes)
        assert all(l.state == "unknown" for l in report.links)


# --- the wording, from synthetic stats() -----------------------------------------------------------

G = "[0,1,2,3,4,5,6,7]"
T0 = 1764590584.0  # a fixed unix time


def _synthetic():
    return {
        "links": {"shm": {"bytes": 8 << 30, "calls": 100, "seconds": 2.0, "healthy": True, "state": "healthy"},
                  "tcp": {"bytes": 1 << 30, "calls": 100, "seconds": 4.0, "healthy": False, "state": "unhealthy"},
                  "pcie": {"bytes": 1 << 30, "calls": 50, "seconds": 2.0, "healthy": True, "state": "degraded"}},
        "plans": [{"collective": "all_reduce", "bucket_bytes": 1 << 20, "shares": {"shm": 0.9, "tcp": 0.0, "pcie": 0.1},
                   "mode": "balanced", "epoch": 3, "group": list(range(8))}],
        "offload_fraction": 0.2,
        "health": [
            {"group": G, "link": "tcp", "state": "unhealthy", "since": T0, "since_call": 5,
             "reason": "error at call 5: connection reset by peer", "expected_bytes_per_s": 1e9,
             "observed_bytes_per_s": None, "errors": 1, "failovers": 3, "probes": 0},
            {"group": G, "link": "pcie", "state": "degraded", "since": T0 + 10, "since_call": 40,
             "reason": "observed 1.2 GB/s over the last 8 calls, 31% of the profiled 3.9 GB/s",
             "expected_bytes_per_s": 3.9e9, "observed_bytes_per_s": 1.2e9, "errors": 0, "failovers": 0, "probes": 0},
            {"group": G, "link": "shm", "state": "healthy", "since": T0 - 100, "since_call": 0, "reason": "",
             "expected_bytes_per_s": 4e9, "observed_bytes_per_s": 4.2e9, "errors": 0, "failovers": 0, "probes": 0},
            {"group": "[0,1]", "link": "emulated", "state": "healthy", "since": T0 + 20, "since_call": 12,
             "reason": "probe passed", "expected_bytes_per_s": 1e9, "observed_bytes_per_s": 1e9, "errors": 1,
             "failovers": 1, "probes": 1},
        ],
        "failovers": {"count": 4, "recent": [
            {"group": G, "collective": "all_reduce", "call": c, "link": "tcp", "to": "shm",
             "reason": "error at call 5: connection reset by peer", "bytes": 1 << 20, "seconds": 0.012, "time": T0 + c}
            for c in (5, 6, 7)] + [
            {"group": "[0,1]", "collective": "all_gather", "call": 9, "link": "emulated", "to": "shm",
             "reason": "missed its deadline (hang) at call 9", "bytes": 4096, "seconds": 0.5, "time": T0 + 15}]},
        "stragglers": [
            {"group": G, "rank": r, "device": r, "calls": 50, "last": 40 if r == 3 else (10 if r == 0 else 0),
             "expected_last": 6.25, "lateness_s": {"p50": 0.0021 if r == 3 else 3e-6, "p90": 0.003, "max": 0.004},
             "flagged": r == 3, "p_value": 1e-30 if r == 3 else 0.5, "absent": 2 if r == 6 else 0}
            for r in range(8)],
    }


FINDINGS = [
    # (the finding's start, words it must contain)
    ("link tcp in group [0..7] is unhealthy since ", ["(call 5): error at call 5: connection reset by peer",
                                                      "its bytes went to shm in 3 failovers"]),
    ("link pcie in group [0..7] is degraded since ", ["(call 40): observed 1.2 GB/s over the last 8 calls",
                                                      "31% of the profiled 3.9 GB/s; stage 2 moves its load"]),
    ("link emulated in group [0,1] failed over 1 time ", ["call 9", "missed its deadline (hang)",
                                                          "went to shm", "not marked unhealthy now"]),
    ("rank 3 (device 3) of group [0..7] arrived last in 40 of 50 calls (expected 6.25), median 2.1 ms late",
     ["p90 3.0 ms", "max 4.0 ms"]),
    ("rank 6 (device 6) of group [0..7] never arrived in 2 calls", []),
]


def test_findings_from_synthetic_stats():
    report = dg.build_report(_synthetic(), config={"links_list": ["shm", "tcp", "pcie"]}, now=T0 + 30)
    assert len(report.findings) == len(FINDINGS), report.findings
    for (start, words), finding in zip(FINDINGS, report.findings):
        assert finding.startswith(start), (start, finding)
        for w in words:
            assert w in finding, (w, finding)
    # Unhealthy before degraded, links before ranks: the most urgent first (the order above).
    assert not any(n.startswith(dg.HEALTH_NOT_AVAILABLE) for n in report.notes)
    assert {l.name: l.state for l in report.links} == {"shm": "healthy", "tcp": "unhealthy", "pcie": "degraded"}
    text = str(report)
    for start, _ in FINDINGS:
        assert start in text
    assert "Failovers: 4" in text and "tcp -> shm" in text
    assert "health tcp: unhealthy since" in text and "failovers 3" in text
    # The health tracker's expectation where stage 1 has no fit in the report.
    assert "pcie: degraded, 50 calls, 1.0 GiB in 2.00 s, observed 0.537 GB/s, expected 3.9 GB/s (health tracker, " \
           "observed 14% of it)" in text
    assert "plan all_reduce from 1.0 MiB: shm 90%, tcp 0%, pcie 10% (balanced)" in text
    assert "rank 0 (device 0)" not in "\n".join(report.findings)  # not flagged: not a finding
    json.loads(report.to_json())


def test_findings_without_health_tracking():
    stats = _synthetic()
    del stats["health"], stats["failovers"]
    for e in stats["links"].values():
        del e["state"]
    stats["links"]["tcp"]["healthy"] = True
    fits = {G: {"fits": {"all_reduce": [(10e-6, 1 / 4e9), (50e-6, 1 / 1e9), (20e-6, 1 / 2e9)]},
                "links": ["shm", "tcp", "pcie"]}}
    report = dg.build_report(stats, fits=fits, config={"links_list": ["shm", "tcp", "pcie"]})
    assert any(n.startswith(dg.HEALTH_NOT_AVAILABLE) for n in report.notes)
    assert {l.state for l in report.links} == {"unknown"}  # no state is invented
    # Shown, not judged: tcp's 1 GiB in 4 s against what its fit predicts for 100 calls of that much,
    # 50 us + 1 GiB / 1 GB/s = 1.08 s, i.e. 0.27 of 0.99 GB/s.
    tcp = next(l for l in report.links if l.name == "tcp")
    assert tcp.expected_bytes_per_s["all_reduce"] == pytest.approx((1 << 30) / (100 * 50e-6 + (1 << 30) / 1e9))
    assert "tcp: health unknown, 100 calls, 1.0 GiB in 4.00 s, observed 0.268 GB/s, expected 0.995 GB/s " \
           "(all_reduce fit, observed 27% of it)" in str(report)
    assert not [f for f in report.findings if f.startswith("link ")]
    assert any(f.startswith("rank 3 (device 3) of group [0..7] arrived last in 40 of 50") for f in report.findings)
    assert report.failovers is None and "Failovers:" not in str(report)


def test_nothing_wrong_says_so():
    stats = {"links": {"shm": {"bytes": 1 << 20, "calls": 4, "seconds": 0.001, "healthy": True}},
             "plans": [], "offload_fraction": 0.0,
             "stragglers": [{"group": "[0,1]", "rank": r, "device": r, "calls": 4, "last": 2, "expected_last": 2.0,
                             "lateness_s": {"p50": 1e-6, "p90": 1e-6, "max": 1e-6}, "flagged": False,
                             "p_value": 0.7, "absent": 0} for r in (0, 1)]}
    report = dg.build_report(stats)
    assert report.findings == ["no problems found: 1 link (shm), 4 link calls, failovers not tracked, "
                               "no straggler in 4 calls over 1 group"]


def test_tune_cache_entries(tmp_path):
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"format": "flexlink-tune", "version": 1, "entries": [
        {"host": "me", "links": "shm;tcp", "ranks": 8, "max_bytes": 1 << 20,
         "fits": {"all_reduce": [], "all_gather": []}},
        {"host": "other", "links": "shm;tcp", "ranks": 8, "max_bytes": 1 << 20, "fits": {}}]}))
    info = dg.read_tune_cache(str(path), "me", "shm; tcp")
    assert [e["matches"] for e in info["entries"]] == [True, False]
    assert info["entries"][0]["collectives"] == ["all_gather", "all_reduce"]
    # Entries carry the processes their group spans (format 3; a version-2 file's are in-process
    # groups and still read by the engine, so they still match).
    identity = {"version": 3, "oldest_readable_version": 2, "fingerprint": "fp", "engine": "e1"}
    for version, matches in ((2, True), (3, True), (1, False), (4, False)):
        path.write_text(json.dumps({"version": version, "entries": [
            {"host": "me", "links": "shm;tcp", "ranks": 4, "processes": 2, "fingerprint": "fp", "engine": "e1",
             "max_bytes": 1 << 20, "fits": {"all_reduce": []}}]}))
        info = dg.read_tune_cache(str(path), "me", "shm;tcp", identity)
        assert [(e["processes"], e["matches"]) for e in info["entries"]] == [(2, matches)], (version, info)
    lines = dg.format_report(dg.Report(findings=[], notes=[], links=[], groups=[], failovers=None,
                                       config={"tune_cache": info}, live=False, time=0.0))
    assert "4 ranks in 2 processes" in lines, lines
    path.write_text("{not json")
    assert "corrupt" in dg.read_tune_cache(str(path), "me", "shm")["error"]
    assert "no file" in dg.read_tune_cache(str(tmp_path / "none.json"), "me", "shm")["error"]


def test_group_forms():
    assert dg.group_key([0, 1, 2]) == dg.group_key("[0, 1, 2]") == "[0,1,2]"
    assert dg.group_label("[4,5,6,7]") == "[4..7]" and dg.group_label([0, 2, 4]) == "[0,2,4]"


# --- the command line ------------------------------------------------------------------------------

def _cli(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "jax_flexlink.diagnose", *args], capture_output=True, text=True,
                          env=e, timeout=120)


def test_cli_configuration_only():
    out = _cli(env={"FLEXLINK_LINKS": "shm;tcp"})
    assert out.returncode == 0, out.stderr
    assert "links: shm;tcp" in out.stdout and dg.LIVE_HINT in out.stdout and "tuning cache" in out.stdout
    js = _cli("--json")
    assert js.returncode == 0, js.stderr
    d = json.loads(js.stdout)
    assert d["live"] is False and d["config"]["links_spec"] == "shm" and dg.LIVE_HINT in d["notes"]


def test_cli_run_self_check():
    out = _cli("--run", "--json", env={"FLEXLINK_LINKS": "shm;tcp"})
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["live"] is True and "self-check: psum and all_gather results were exact" in d["notes"]
    assert {l["name"] for l in d["links"]} == {"shm", "tcp"}
    assert all(l["calls"] > 0 for l in d["links"] if l["name"] == "shm")
    assert any(len(g["stragglers"]) == 8 for g in d["groups"])


def test_module_import_keeps_diagnose_callable():
    import jax_flexlink.diagnose  # noqa: F401,PLC0415 - shadows the function with the module

    assert isinstance(flx.diagnose(), flx.DiagnosisReport)
