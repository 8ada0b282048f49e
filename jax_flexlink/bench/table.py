"""The nccl-tests style text table, built from the JSON row dicts (one dict per size and mode).

    #                                       out-of-place ................................. in-place ...
    #                                       FlexLink                      native
    #       size      count   type  redop     time  algbw  busbw #wrong     time  algbw  busbw #wrong speedup   mean
    #        (B) (elements)                   (us) (GB/s) (GB/s)            (us) (GB/s) (GB/s)            (x)    (x)

`time` is the run's statistic (median by default); `speedup` compares that statistic, and the column
after it the other one (mean when the table shows medians), so a stall-dominated row shows as a gap
between the two.
"""

from __future__ import annotations

import math

MODE_TITLES = {False: "out-of-place", True: "in-place"}

_LEAD = ["size", "count", "type", "redop"]
_LEAD_W = [12, 12, 9, 6]
_MEAS = ["time", "algbw", "busbw", "#wrong"]
_MEAS_UNITS = ["(us)", "(GB/s)", "(GB/s)", ""]
_MEAS_W = [9, 7, 7, 7]
_SPEED_W = 8
_OTHER_W = 7


def other_stat(stat: str) -> str:
    """The statistic shown next to the speedup: the one the table's times do not use."""
    return "mean" if stat == "median" else "median"


def fmt_time(us: float | None) -> str:
    """nccl-tests: 2 decimals below 100 us, 1 below 10 ms, none above."""
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "N/A"
    if us >= 10000:
        return f"{us:.0f}"
    if us >= 100:
        return f"{us:.1f}"
    return f"{us:.2f}"


def fmt_bw(gbps: float | None) -> str:
    if gbps is None or (isinstance(gbps, float) and math.isnan(gbps)):
        return "N/A"
    return f"{gbps:.2f}"


def fmt_wrong(n: int | None) -> str:
    return "N/A" if n is None else str(n)


def fmt_speedup(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "N/A"
    return f"{x:.2f}x"


def fmt_shares(shares: dict[str, float] | None) -> str:
    if not shares:
        return "-"
    return " ".join(f"{name}:{100 * frac:.0f}%" for name, frac in shares.items())


def _group_width(baseline: bool) -> int:
    w = sum(_MEAS_W) + len(_MEAS_W)
    return w * 2 + _SPEED_W + 1 + _OTHER_W + 1 if baseline else w


def header(title: str, modes: list[bool], baseline: bool, flex_label: str = "FlexLink",
           base_label: str = "native", stat: str = "median") -> list[str]:
    lead_w = sum(_LEAD_W) + len(_LEAD_W) - 1
    gw = _group_width(baseline)
    meas_w = sum(_MEAS_W) + len(_MEAS_W)
    line1 = "#" + " " * lead_w
    line2 = "#" + " " * lead_w
    line3 = "#" + " ".join(f"{h:>{w}}" for h, w in zip(_LEAD, _LEAD_W))
    line4 = "#" + " ".join(f"{h:>{w}}" for h, w in zip(["(B)", "(elements)", "", ""], _LEAD_W))
    for inplace in modes:
        line1 += " " + f"{MODE_TITLES[inplace]:^{gw - 1}}"
        impls = [flex_label] + ([base_label] if baseline else [])
        line2 += "".join(" " + f"{('-- ' + name + ' ').ljust(meas_w - 2, '-')}" + " " for name in impls)
        if baseline:
            line2 += " " * (_SPEED_W + 1 + _OTHER_W + 1)
        for _ in impls:
            line3 += "".join(f" {h:>{w}}" for h, w in zip(_MEAS, _MEAS_W))
            line4 += "".join(f" {h:>{w}}" for h, w in zip(_MEAS_UNITS, _MEAS_W))
        if baseline:
            line3 += f" {'speedup':>{_SPEED_W}} {other_stat(stat):>{_OTHER_W}}"
            line4 += f" {'(x)':>{_SPEED_W}} {'(x)':>{_OTHER_W}}"
    line3 += "  links"
    return [f"# {title}", line1.rstrip(), line2.rstrip(), line3, line4.rstrip()]


def size_line(rows: dict[bool, dict], modes: list[bool], baseline: bool, stat: str = "median") -> str:
    """One line for one size: rows maps inplace -> JSON row."""
    any_row = next(iter(rows.values()))
    lead = [str(any_row["bytes"]), str(any_row["count"]), any_row["dtype"], any_row["op"]]
    line = " " + " ".join(f"{v:>{w}}" for v, w in zip(lead, _LEAD_W))
    shares: dict[str, float] = {}
    for inplace in modes:
        r = rows.get(inplace)
        if r and r.get("flexlink_error"):  # its FlexLink side raised (the error is printed above)
            vals = ["ERROR", "-", "-", "-"]
        else:
            vals = ([fmt_time(r["time_us"]), fmt_bw(r["algbw_gbps"]), fmt_bw(r["busbw_gbps"]),
                     fmt_wrong(r["wrong"])] if r else ["-"] * 4)
        if baseline:
            vals += ([fmt_time(r["baseline_time_us"]), fmt_bw(r["baseline_algbw_gbps"]),
                      fmt_bw(r["baseline_busbw_gbps"]), fmt_wrong(r["baseline_wrong"])] if r else ["-"] * 4)
        widths = _MEAS_W * (2 if baseline else 1)
        line += "".join(f" {v:>{w}}" for v, w in zip(vals, widths))
        if baseline:
            other = r.get(f"speedup_{other_stat(stat)}") if r else None
            line += f" {fmt_speedup(r['speedup']) if r else '-':>{_SPEED_W}}"
            line += f" {fmt_speedup(other) if r else '-':>{_OTHER_W}}"
        if r and r.get("shares"):
            shares = r["shares"]  # the last mode's split; JSON keeps each mode's
    return line + "  " + fmt_shares(shares)


def footer(rows: list[dict], baseline: bool) -> list[str]:
    """nccl-tests' two footer lines (over FlexLink rows), plus the native average and the total check."""
    checked = [r for r in rows if r.get("wrong") is not None or r.get("baseline_wrong") is not None]
    wrong = sum(r.get("wrong") or 0 for r in checked) + sum(r.get("baseline_wrong") or 0 for r in rows)
    busbw = [r["busbw_gbps"] for r in rows if r.get("busbw_gbps") is not None]
    avg = sum(busbw) / len(busbw) if busbw else math.nan
    status = "OK" if wrong == 0 else "FAILED"
    if not rows:
        status = "(no rows ran)"
    elif not checked:
        status = "OK (not checked: -c 0)"
    lines = [f"# Out of bounds values : {wrong} {status}",
             f"# Avg bus bandwidth    : {avg:.4f} " if busbw else
             f"# Avg bus bandwidth    : N/A ({'no rows' if not rows else 'no FlexLink row ran'})"]
    if baseline:
        b = [r["baseline_busbw_gbps"] for r in rows if r.get("baseline_busbw_gbps") is not None]
        if b:
            lines.append(f"# Avg bus bandwidth (native baseline) : {sum(b) / len(b):.4f} ")
        for stat in ("median", "mean"):  # the geometric mean over rows, and the worst row
            vals = [r[f"speedup_{stat}"] for r in rows if r.get(f"speedup_{stat}")]
            if vals:
                geo = math.exp(sum(math.log(x) for x in vals) / len(vals))
                lines.append(f"# Speedup (native time / FlexLink time) by {stat}s: geometric mean {geo:.2f}x, "
                             f"lowest {min(vals):.2f}x")
    return lines
