"""--scenario multiprocess: its flags, configurations, launcher command, output relay, JSON merge,
the launches of --mp-launches and their summary, and the table of rows whose FlexLink side failed (no
processes started here; test_e2e.py runs it)."""
import io
import json

import pytest

from jax_flexlink.bench import cli, launches, multiprocess, report, table
from jax_flexlink.bench.multiprocess import MpConfig

from bench_rows import _doc, _row


def test_default_configurations_and_sweep():
    c = cli.parse(["--scenario", "multiprocess"])
    assert c.mp_configs == [MpConfig("2x1", 2, 1, None), MpConfig("4x1", 4, 1, None), MpConfig("2hx2x1", 4, 1, 2)]
    assert c.sizes == [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    assert c.collectives == ["all_reduce", "all_gather"] and c.modes == [False]  # out-of-place by default
    assert c.mp_timeout == multiprocess.DEFAULT_TIMEOUT_S
    assert c.mp_keep_freed_memory is True
    assert cli.parse(["--scenario", "multiprocess", "--no-mp-keep-freed-memory"]).mp_keep_freed_memory is False
    assert cli.parse(["--scenario", "multiprocess", "--both"]).modes == [False, True]
    c = cli.parse(["--scenario", "multiprocess", "--mp-configs", "3x2,2hx3x1", "--mp-timeout", "30"])
    assert c.mp_configs == [MpConfig("3x2", 3, 2, None), MpConfig("2hx3x1", 6, 1, 2)] and c.mp_timeout == 30
    assert cli.parse([]).mp_configs == [] and cli.parse([]).modes == [False, True]  # host8 unchanged
    assert c.mp_launches == 1 and cli.parse(["--scenario", "multiprocess", "--mp-launches", "3"]).mp_launches == 3


@pytest.mark.parametrize("argv, message", [
    (["--mp-configs", "2x1"], "--mp-configs applies only to --scenario multiprocess"),
    (["--mp-timeout", "5"], "--mp-timeout applies only to --scenario multiprocess"),
    (["--no-mp-keep-freed-memory"], "--mp-keep-freed-memory applies only to --scenario multiprocess"),
    (["--mp-launches", "2"], "--mp-launches applies only to --scenario multiprocess"),
    (["--scenario", "multiprocess", "--mp-launches", "0"], "--mp-launches must be >= 1, got 0"),
    (["--scenario", "multiprocess", "--mp-launches", "two"], "invalid int value"),
    (["--scenario", "multiprocess", "--mp-configs", "2"], "bad multiprocess configuration '2'"),
    (["--scenario", "multiprocess", "--mp-configs", "2x0"], "counts must be >= 1"),
    (["--scenario", "multiprocess", "--mp-configs", "0hx2x1"], "counts must be >= 1"),
    (["--scenario", "multiprocess", "--mp-configs", "1x4"], "has one process"),
    (["--scenario", "multiprocess", "--mp-configs", "2x1,2x1"], "listed twice"),
    (["--scenario", "multiprocess", "--mp-timeout", "0"], "--mp-timeout must be > 0"),
    (["--scenario", "multiprocess", "--devices", "4"], "--devices does not apply to --scenario multiprocess"),
    (["--scenario", "multiprocess", "--plot", "x.png"], "--plot is not supported"),
])
def test_usage_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_describe():
    assert MpConfig("2x1", 2, 1, None).describe() == "2 processes x 1 host device = 2 devices"
    assert (MpConfig("2hx2x2", 4, 2, 2).describe()
            == "2 emulated hosts x 2 processes x 2 host devices = 8 devices")


def test_launcher_command():
    c = MpConfig("2hx2x1", 4, 1, 2)
    cmd = multiprocess.launcher_command(c, 90, "/tmp/o.json", ["--scenario", "multiprocess", "-b", "1M"],
                                        python="py")
    assert cmd == ["py", "-m", "jax_flexlink.launch", "-n", "4", "--devices-per-process", "1", "--hosts", "2",
                   "--timeout", "90", "--", "py", "-m", "jax_flexlink.bench.mp_worker", "--config", "2hx2x1",
                   "--json-out", "/tmp/o.json", "--", "--scenario", "multiprocess", "-b", "1M"]
    assert "--hosts" not in multiprocess.launcher_command(MpConfig("2x1", 2, 1, None), 1, "o", [])
    assert "--no-keep-freed-memory" not in cmd
    cmd = multiprocess.launcher_command(MpConfig("2x1", 2, 1, None), 1, "o", [], python="py", keep_freed_memory=False)
    assert cmd[:cmd.index("--")] == ["py", "-m", "jax_flexlink.launch", "-n", "2", "--devices-per-process", "1",
                                     "--no-keep-freed-memory", "--timeout", "1"]


def test_worker_arguments():
    from jax_flexlink.bench import mp_worker
    a = mp_worker.parse_args(["--config", "2x1", "--json-out", "f.json", "--", "--scenario", "multiprocess",
                              "-C", "all_gather"])
    assert (a.config, a.json_out, a.bench_argv) == ("2x1", "f.json", ["--scenario", "multiprocess", "-C",
                                                                      "all_gather"])


def test_relay_and_environment():
    assert multiprocess.relay_line("[0] #  size") == ("out", "#  size")
    assert multiprocess.relay_line("[1] Traceback") == ("err", "[1] Traceback")  # others keep their prefix
    assert multiprocess.relay_line("[10] x") == ("err", "[10] x")
    assert multiprocess.relay_line("[0] [Gloo] Rank 0 is connected") == ("err", "[0] [Gloo] Rank 0 is connected")
    assert multiprocess.worker_env({})["FLEXLINK_TIMEOUT_S"] == multiprocess.WORKER_FLEXLINK_TIMEOUT_S
    assert multiprocess.worker_env({"FLEXLINK_TIMEOUT_S": "7"})["FLEXLINK_TIMEOUT_S"] == "7"


def test_exit_status():
    assert multiprocess.exit_status([0, 0, 0]) == 0
    assert multiprocess.exit_status([0, 1, 0]) == 1
    assert multiprocess.exit_status([0, 124]) == 1
    assert multiprocess.exit_status([2, 2]) == 2 and multiprocess.exit_status([2, 1]) == 1
    assert "deadline" in multiprocess.status_text(124) and multiprocess.status_text(0) == "ok"


def _bw_row(devices, algbw, **kw):
    """A row whose busbw follows AllReduce's factor on its device count, both sides."""
    f = 2 * (devices - 1) / devices
    return _row(devices=devices, algbw_gbps=algbw, busbw_gbps=algbw * f, baseline_algbw_gbps=algbw / 2,
                baseline_busbw_gbps=algbw / 2 * f, **kw)


def _flex_failed_row(**kw):
    r = _row(time_us=None, time_min_us=None, time_max_us=None, time_median_us=None, time_mean_us=None,
             algbw_gbps=None, busbw_gbps=None, wrong=None, speedup=None, speedup_median=None, speedup_mean=None,
             flexlink_error="rank 0: DEADLINE_EXCEEDED: flexlink: ...", devices=2,
             baseline_algbw_gbps=0.02048, baseline_busbw_gbps=0.02048)
    r.update(kw)
    return r


def test_rows_whose_flexlink_side_failed():
    line = table.size_line({False: _flex_failed_row()}, [False], True)
    assert line.split()[4:13] == ["ERROR", "-", "-", "-", "200.0", "0.02", "0.02", "0", "N/A"]
    lines = table.footer([_flex_failed_row()], baseline=True)
    assert lines[0] == "# Out of bounds values : 0 OK"  # the native side was checked
    assert lines[1] == "# Avg bus bandwidth    : N/A (no FlexLink row ran)"
    assert table.footer([_flex_failed_row(baseline_wrong=5)], True)[0] == "# Out of bounds values : 5 FAILED"
    assert report.validate(_doc([_flex_failed_row()])) == []
    # FlexLink's time may be missing only where the row says why.
    bad = _flex_failed_row()
    del bad["flexlink_error"]
    assert any("time_us" in e for e in report.validate(_doc([bad])))


def _config_doc(name, processes, rows, errors=(), ok=True):
    d = _doc(rows)
    d["summary"].update(errors=list(errors), skipped=[], ok=ok)
    d["multiprocess"] = {"config": name, "processes": processes}
    for r in d["rows"]:
        r["config"] = name
    return d


def test_merge():
    a = MpConfig("2x1", 2, 1, None)
    b = MpConfig("4x1", 4, 1, None)
    c = MpConfig("2hx2x1", 4, 1, 2)
    docs = [(a, 0, _config_doc("2x1", 2, [_bw_row(2, 0.04), _bw_row(2, 0.02)])),
            (b, 1, _config_doc("4x1", 4, [_flex_failed_row(devices=4, baseline_busbw_gbps=0.03072)],
                               errors=["4x1: AllReduce sum float: FlexLink: rank 0: ..."], ok=False)),
            (c, 124, None)]
    docs[1][2]["started_utc"], docs[1][2]["finished_utc"] = "t5", "t9"
    m = multiprocess.merge(docs, "python -m jax_flexlink.bench --scenario multiprocess", ["--scenario", "multiprocess"])
    assert report.validate(m) == []
    assert [r["config"] for r in m["rows"]] == ["2x1", "2x1", "4x1"]
    s = m["summary"]
    assert not s["ok"] and s["out_of_bounds"] == 0
    assert s["errors"] == ["4x1: AllReduce sum float: FlexLink: rank 0: ...",
                           "2hx2x1: FAILED: the launcher's deadline passed (exit 124) (no JSON)"]
    assert s["avg_busbw_gbps"] == pytest.approx((0.04 + 0.02) / 2)
    assert s["baseline_avg_busbw_gbps"] == pytest.approx((0.02 + 0.01 + 0.03072) / 3)
    assert [(x["config"], x["exit_status"]) for x in m["configurations"]] == [("2x1", 0), ("4x1", 1), ("2hx2x1", 124)]
    assert m["devices"] == 4 and m["scenario"] == "multiprocess"
    assert (m["started_utc"], m["finished_utc"]) == ("t0", "t9")  # first start, last end
    ok = multiprocess.merge(docs[:1], "cmd", [])
    assert ok["summary"]["ok"] and ok["summary"]["errors"] == []


class _Lowers:
    def __init__(self, exc=None):
        self.exc = exc

    def lower(self, arg):
        if self.exc:
            raise self.exc


def test_worker_lowering_probe():
    """One process stands in for the job (no jax.distributed client: every exchange is its own value)."""
    import io

    from jax_flexlink.bench import mp_worker
    cfg = cli.parse(["--scenario", "multiprocess", "--_impl", "lax"])
    out = io.StringIO()
    r = mp_worker.make_runner(cfg, 0, 1, "2x1", out=out)
    r.section = ("all_reduce", "sum", "float")
    r.probe_flexlink(_Lowers(), None)
    assert r.flex_failed == {} and r.errors == []
    with pytest.raises(NotImplementedError, match="no such target"):
        r.probe_flexlink(_Lowers(NotImplementedError("no such target")), None)
    assert r.flex_failed == {}
    r.probe_flexlink(_Lowers(ValueError("group spans hosts\nbad layout")), None)
    msg = "rank 0: ValueError while lowering: group spans hosts ... bad layout"
    assert r.flex_failed == {("all_reduce", "sum", "float"): msg}
    assert r.errors == [f"2x1: AllReduce sum float: FlexLink: {msg}"]
    assert f"# FlexLink ERROR AllReduce sum float: {msg}" in out.getvalue()
    quiet = mp_worker.make_runner(cfg, 1, 2, "2x1", out=io.StringIO())
    assert not quiet.reporting and r.reporting  # only rank 0 prints


_FAILING_FLEXLINK = """
import io, json, sys
import jax
from jax_flexlink.bench import cli, mp_worker

def explode(x):
    raise RuntimeError("engine broke")

def failing_body(x):
    return jax.pure_callback(explode, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

cfg = cli.parse(["--scenario", "multiprocess", "--_impl", "lax", "-b", "4K", "-e", "16K", "-n", "2", "-w", "1",
                 "--both"])
out = io.StringIO()
r = mp_worker.make_runner(cfg, 0, 1, "2x1", out=out)
r.setup()
r.flex.body = lambda coll, op, n: failing_body
r.run_section("all_reduce", "sum", "float")
json.dump({"text": out.getvalue(), "rows": r.rows, "errors": r.errors}, sys.stdout)
sys.stdout.flush()
"""


def test_worker_reports_a_flexlink_side_that_fails_while_running():
    """A FlexLink body that lowers but raises when it runs (a host callback that throws): the section
    prints the error once, every row has it, the native side is timed and checked alone. One process
    stands in for the job; in a subprocess, because the failed callback's error stays in jax's runtime
    tokens until the process exits."""
    import json
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", _FAILING_FLEXLINK], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    text, rows, errors = got["text"], got["rows"], got["errors"]
    assert text.count("# FlexLink ERROR AllReduce sum float: rank 0: ") == 1, text
    assert "engine broke" in text
    assert len(rows) == 4  # 4K and 16K (the scenario's factor 4), both modes
    for row in rows:
        assert "engine broke" in row["flexlink_error"] and row["time_us"] is None and row["speedup"] is None
        assert row["baseline_wrong"] == 0 and row["baseline_time_us"] > 0 and row["aliased"] is None
    assert len(errors) == 1 and errors[0].startswith("2x1: AllReduce sum float: FlexLink: rank 0: ")
    assert text.count("ERROR       -       -       -") == 2 * 2  # each size line, both modes


def _point_row(config, bytes_, speedup, launch=None, **kw):
    fields = dict(bytes=bytes_, speedup=speedup, time_us=100.0, baseline_time_us=100.0 * (speedup or 3.0))
    fields.update(kw)
    r = _row(**fields)
    r["config"] = config
    if launch is not None:
        r["launch"] = launch
    return r


def test_points_across_launches():
    rows = [_point_row("2x1", 1 << 20, 2.5, 1), _point_row("2x1", 4 << 20, 4.0, 1),
            _point_row("2x1", 1 << 20, 3.5, 2), _point_row("2x1", 4 << 20, 5.0, 2),
            _point_row("2x1", 1 << 20, 3.2, 3), _point_row("2x1", 4 << 20, 0.5, 3),
            # Another configuration, mode and collective at the same size are other points.
            _point_row("4x1", 1 << 20, 6.0, 1), _point_row("2x1", 1 << 20, 7.0, 1, inplace=True),
            _point_row("2x1", 1 << 20, 8.0, 1, collective="all_gather", op="none"),
            # A launch whose FlexLink side failed: no speedup, but its launch is listed.
            _point_row("4x1", 1 << 20, None, 2, time_us=None)]
    pts = launches.points(rows)
    assert [(p["config"], p["collective"], p["bytes"], p["inplace"]) for p in pts] == [
        ("2x1", "all_reduce", 1 << 20, False), ("2x1", "all_reduce", 4 << 20, False),
        ("4x1", "all_reduce", 1 << 20, False), ("2x1", "all_reduce", 1 << 20, True),
        ("2x1", "all_gather", 1 << 20, False)]
    a, b, c = pts[:3]
    assert a["launches"] == [1, 2, 3] and a["speedups"] == [2.5, 3.5, 3.2]
    assert (a["speedup_min"], a["speedup_median"], a["speedup_max"]) == (2.5, 3.2, 3.5)
    assert a["time_median_us"] == 100.0 and a["baseline_time_median_us"] == pytest.approx(320.0)
    assert (b["speedup_min"], b["speedup_median"], b["speedup_max"]) == (0.5, 4.0, 5.0)
    assert c["launches"] == [1, 2] and c["speedups"] == [6.0, None] and c["speedup_median"] == 6.0
    assert c["time_median_us"] == 100.0 and c["baseline_time_median_us"] == 450.0  # native ran in both
    # A row without a launch number is launch 1 (a document of one launch).
    assert launches.points([_point_row("2x1", 1, 2.0)])[0]["launches"] == [1]
    # Reaching a target by the median over the launches, and in every launch, from a size on.
    assert launches.at_least(pts, 3.0) == (5, 3, 5)
    assert launches.at_least(pts, 3.0, min_bytes=4 << 20) == (1, 0, 1)
    assert launches.at_least(pts, 1.0) == (5, 4, 5)
    assert launches.at_least(launches.points([_point_row("2x1", 1, None)]), 1.0) == (0, 0, 0)
    text = launches.lines(pts, 3)
    assert text[0].startswith("# Across 3 launches of each configuration: speedup = native time / FlexLink time "
                              "(each launch's medians)")
    assert text[2].split() == ["2x1", "all_reduce", "sum", "float", str(1 << 20), "out-of-place", "100.0", "320.0",
                               "2.50x", "3.20x", "3.50x", "2.50x", "3.50x", "3.20x"]
    assert text[4].split()[-5:] == ["6.00x", "6.00x", "6.00x", "6.00x", "N/A"]
    assert text[-1] == "# Never slower than native: by the median over the launches at 5 of 5 points, in every launch at 4 of 5"


def test_merge_numbers_the_launches():
    a, b = MpConfig("2x1", 2, 1, None), MpConfig("4x1", 4, 1, None)
    docs = [(a, 0, _config_doc("2x1", 2, [_bw_row(2, 0.04, speedup=2.0)])),
            (b, 0, _config_doc("4x1", 4, [_bw_row(4, 0.04, speedup=5.0)])),
            (a, 1, _config_doc("2x1", 2, [_bw_row(2, 0.04, speedup=4.0)], errors=["2x1: AllReduce: ..."], ok=False)),
            (b, 124, None)]
    m = multiprocess.merge(docs, "cmd", [], launch_numbers=[1, 1, 2, 2])
    assert report.validate(m) == []
    assert [(r["config"], r["launch"]) for r in m["rows"]] == [("2x1", 1), ("4x1", 1), ("2x1", 2)]
    assert [(c["config"], c["launch"], c["exit_status"]) for c in m["configurations"]] == [
        ("2x1", 1, 0), ("4x1", 1, 0), ("2x1", 2, 1), ("4x1", 2, 124)]
    assert m["summary"]["errors"] == ["launch 2: 2x1: AllReduce: ...",
                                      "4x1 (launch 2): FAILED: the launcher's deadline passed (exit 124) (no JSON)"]
    assert m["launches"]["count"] == 2
    assert [(p["config"], p["speedups"]) for p in m["launches"]["points"]] == [("2x1", [2.0, 4.0]), ("4x1", [5.0])]
    # The documents' own rows are not changed; one launch merges as before, without launch numbers.
    assert "launch" not in docs[0][2]["rows"][0]
    one = multiprocess.merge(docs[:2], "cmd", [])
    assert "launches" not in one and "launch" not in one["rows"][0] and "launch" not in one["configurations"][0]


def test_launches_take_turns(monkeypatch, tmp_path):
    """run() with --mp-launches 2 over two configurations: the launcher runs 2x1, 4x1, 2x1, 4x1 (each
    launch's JSON its own file), and the output ends with the points across the launches."""
    started = []

    def fake_run_one(cmd, timeout_s, out):
        config, json_out = cmd[cmd.index("--config") + 1], cmd[cmd.index("--json-out") + 1]
        started.append((config, json_out))
        n = int(config[0])
        with open(json_out, "w") as f:
            json.dump(_config_doc(config, n, [_bw_row(n, 0.04, speedup=float(len(started)))]), f)
        return 0
    monkeypatch.setattr(multiprocess, "_run_one", fake_run_one)
    out_json = tmp_path / "m.json"
    cfg = cli.parse(["--scenario", "multiprocess", "--mp-configs", "2x1,4x1", "--mp-launches", "2",
                     "--json", str(out_json)])
    out = io.StringIO()
    assert multiprocess.run(cfg, out) == 0
    assert [c for c, _ in started] == ["2x1", "4x1", "2x1", "4x1"]
    assert len({j for _, j in started}) == 4
    text = out.getvalue()
    assert "# ===== configuration 4x1 (launch 2 of 2): ok" in text
    assert "each launched 2 times, the configurations taking turns" in text
    tail = text[text.index("# Across 2 launches"):].splitlines()
    assert tail[2].split()[-5:] == ["1.00x", "2.00x", "3.00x", "1.00x", "3.00x"]  # 2x1: launches 1 and 3
    assert tail[3].split()[-5:] == ["2.00x", "3.00x", "4.00x", "2.00x", "4.00x"]
    assert tail[4] == "# Never slower than native: by the median over the launches at 2 of 2 points, in every launch at 2 of 2"
    doc = json.loads(out_json.read_text())
    assert report.validate(doc) == [] and doc["launches"]["count"] == 2
    assert [r["launch"] for r in doc["rows"]] == [1, 1, 2, 2]
