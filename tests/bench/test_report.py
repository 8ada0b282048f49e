"""JSON schema, table formatting and scenarios of jax_flexlink.bench."""
import json
import math

import pytest

from jax_flexlink.bench import report, scenarios, table

from bench_rows import _doc, _row  # noqa: F401 - shared with test_multiprocess.py


def test_valid_document():
    assert report.validate(_doc([_row(), _row(inplace=True, aliased=True)])) == []


def test_issue_required_row_fields_are_in_schema():
    required = ("collective op dtype bytes count devices inplace time_us algbw_gbps busbw_gbps wrong "
                "baseline_time_us baseline_busbw_gbps speedup shares").split()
    assert set(required) <= set(report.ROW_FIELDS)
    for k in ("machine", "versions", "links", "command", "rows"):
        assert k in report.TOP_FIELDS


@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d.pop("machine"), "machine"),
    (lambda d: d["rows"][0].pop("busbw_gbps"), "busbw_gbps"),
    (lambda d: d["rows"][0].update(inplace="yes"), "inplace"),
    (lambda d: d["rows"][0].update(bytes=True), "bytes"),
    (lambda d: d["rows"][0].update(shares={"shm": 1.5}), "shares"),
    (lambda d: d["versions"].pop("jaxlib"), "jaxlib"),
    (lambda d: d["summary"].pop("ok"), "ok"),
    (lambda d: d.update(schema="other"), "schema"),
])
def test_invalid_documents(mutate, msg):
    d = _doc([_row()])
    mutate(d)
    errs = report.validate(d)
    assert errs and any(msg in e for e in errs), errs


def _movement_row(collective, **kw):
    """A SendRecv (busbw = algbw) or AlltoAll (busbw = algbw x 7/8) row on 8 devices."""
    f = 1.0 if collective == "ppermute" else 0.875
    fields = dict(collective=collective, op="none", baseline_impl=f"lax.{collective}",
                  busbw_gbps=0.04096 * f, baseline_busbw_gbps=0.02048 * f)
    return _row(**dict(fields, **kw))


def test_sendrecv_and_alltoall_rows_are_valid():
    assert report.validate(_doc([_movement_row("ppermute"), _movement_row("all_to_all", count=128)])) == []


@pytest.mark.parametrize("row,msg", [
    (_movement_row("ppermute", op="sum"), "has no reduction"),
    (_row(op="none"), "reduces"),
    (_movement_row("ppermute", busbw_gbps=0.04096 * 0.875), "is not algbw x 1 (= 0.04096) for SendRecv"),
    (_movement_row("all_to_all", baseline_busbw_gbps=0.02048),
     "baseline_busbw_gbps 0.02048 is not algbw x (n-1)/n (= 0.01792"),
    (_row(busbw_gbps=0.04096 * 0.875), "not algbw x 2(n-1)/n"),
    (_row(collective="broadcast"), "unknown collective 'broadcast'"),
])
def test_rows_must_follow_their_collective(row, msg):
    errs = report.validate(_doc([row]))
    assert any(msg in e for e in errs), errs


def test_summary_skipped():
    d = _doc([_row()])
    d["summary"]["skipped"] = [{"collective": "ppermute", "op": "none", "dtype": "float",
                                "reason": "jax_flexlink cannot run it: ..."}]
    assert report.validate(d) == []
    d["summary"]["skipped"] = ["ppermute"]
    assert any("summary.skipped" in e for e in report.validate(d))


def test_baseline_none_rows_are_valid():
    r = _row(baseline="none", baseline_impl=None, baseline_time_us=None, baseline_time_min_us=None,
             baseline_time_max_us=None, baseline_time_median_us=None, baseline_algbw_gbps=None,
             baseline_busbw_gbps=None, baseline_wrong=None, speedup=None, shares=None, wrong=None,
             baseline_time_mean_us=None, speedup_median=None, speedup_mean=None)
    assert report.validate(_doc([r])) == []


def test_write_json_turns_nan_into_null(tmp_path):
    p = tmp_path / "sub" / "out.json"
    report.write_json(str(p), _doc([_row(speedup=math.nan)]))
    d = json.loads(p.read_text())
    assert d["rows"][0]["speedup"] is None and report.validate(d) == []


def test_table_formatting():
    assert table.fmt_time(12.345) == "12.35" and table.fmt_time(123.45) == "123.5"
    assert table.fmt_time(12345.6) == "12346" and table.fmt_time(None) == "N/A"
    assert table.fmt_bw(math.nan) == "N/A" and table.fmt_bw(1.234) == "1.23"
    assert table.fmt_wrong(None) == "N/A" and table.fmt_speedup(2.0) == "2.00x"
    assert table.fmt_shares({"shm": 0.625, "tcp": 0.375}) == "shm:62% tcp:38%"
    assert table.fmt_shares(None) == "-"


@pytest.mark.parametrize("modes", [[False], [True], [False, True]])
@pytest.mark.parametrize("baseline", [True, False])
def test_table_lines_line_up(modes, baseline):
    head = table.header("AllReduce sum float", modes, baseline)
    rows = {m: _row(inplace=m) for m in modes}
    line = table.size_line(rows, modes, baseline)
    assert head[3].startswith("#") and head[3][1:].split()[:4] == ["size", "count", "type", "redop"]
    # the header's column names and the row's values end at the same offsets
    ends_h = [i + len(w) for i, w in _words(" " + head[3][1:])]
    ends_r = [i + len(w) for i, w in _words(line)]
    n = len(ends_r) - 1  # the last field (links) is free-form
    assert ends_h[:n] == ends_r[:n]
    assert "shm:100%" in line
    assert ("speedup" in head[3]) == baseline
    assert ("in-place" in head[1]) == (True in modes)


def _words(s):
    i, out = 0, []
    for w in s.split():
        i = s.index(w, i)
        out.append((i, w))
        i += len(w)
    return out


def test_footer_without_rows():
    """Every section skipped or failed: the footer says no row ran, not that the check passed or was off."""
    lines = table.footer([], baseline=True)
    assert lines == ["# Out of bounds values : 0 (no rows ran)", "# Avg bus bandwidth    : N/A (no rows)"]


def test_footer():
    rows = [_row(), _row(busbw_gbps=0.1, wrong=3)]
    lines = table.footer(rows, baseline=True)
    assert lines[0] == "# Out of bounds values : 3 FAILED"
    assert lines[1].startswith("# Avg bus bandwidth    : 0.0858")
    assert table.footer([_row()], True)[0] == "# Out of bounds values : 0 OK"
    slow = _row(speedup_median=0.5, speedup_mean=0.25)
    lines = table.footer([_row(), slow], baseline=True)
    assert "by medians: geometric mean 1.00x, lowest 0.50x" in lines[3]
    assert "by means: geometric mean 0.71x, lowest 0.25x" in lines[4]


def test_size_line_shows_both_statistics():
    head = table.header("AllReduce", [False], True, stat="median")
    assert head[3].split()[-3:] == ["speedup", "mean", "links"]
    line = table.size_line({False: _row(speedup=2.0, speedup_median=2.0, speedup_mean=1.25)}, [False], True)
    assert line.split()[-3:] == ["2.00x", "1.25x", "shm:100%"]
    head = table.header("AllReduce", [False], True, stat="mean")
    assert head[3].split()[-3:] == ["speedup", "median", "links"]
    line = table.size_line({False: _row(speedup=1.25, speedup_median=2.0, speedup_mean=1.25)}, [False], True,
                           stat="mean")
    assert line.split()[-3:] == ["1.25x", "2.00x", "shm:100%"]


def test_scenarios():
    assert scenarios.get("host8").devices == 8 and scenarios.get("host8").links is None
    h800 = scenarios.get("emulated-h800")
    assert h800.links.count("emulated:") == 3 and h800.requires == "emulated"

    class NoConfigure:
        def has_configure(self):
            return False
    with pytest.raises(RuntimeError, match=r"requires links 'emulated'"):
        scenarios.check(h800, NoConfigure())
    scenarios.check(scenarios.get("host8"), NoConfigure())
    mp = scenarios.get("multiprocess")
    assert mp.unavailable is None and mp.devices is None  # its --mp-configs give the device counts
    scenarios.check(mp, NoConfigure())
    with pytest.raises(ValueError, match="host8"):
        scenarios.get("nope")


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    p = tmp_path / "bw.png"
    report.plot(str(p), [_row(), _row(bytes=8192), _row(collective="all_gather", op="none")])
    assert p.stat().st_size > 1000


def test_plot_sendrecv_and_alltoall(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    titles = []
    real_savefig = plt.Figure.savefig

    def savefig(fig, *a, **kw):
        titles.extend((ax.get_title(), ax.get_ylabel(), len(ax.get_lines())) for ax in fig.axes)
        return real_savefig(fig, *a, **kw)
    monkeypatch.setattr(plt.Figure, "savefig", savefig)
    p = tmp_path / "bw.png"
    rows = [_movement_row("all_to_all"), _movement_row("ppermute"), _movement_row("ppermute", bytes=8192),
            _row(), _movement_row("ppermute", inplace=True)]
    report.plot(str(p), rows)
    assert p.stat().st_size > 1000
    # one panel per collective, in the CLI's order; FlexLink and native per mode
    assert titles == [("AllReduce (all_reduce)", "busbw = algbw x 2(n-1)/n (GB/s)", 2),
                      ("SendRecv (ppermute, ring shift +1)", "busbw = algbw x 1 (GB/s)", 4),
                      ("AlltoAll (all_to_all)", "busbw = algbw x (n-1)/n (GB/s)", 2)]
