"""Bench report rows and documents for the bench tests (tests/bench/test_report.py,
test_multiprocess.py): one valid row, one valid document, to vary per test."""
from jax_flexlink.bench import report


def _row(**kw):
    r = dict(collective="all_reduce", op="sum", dtype="float", bytes=4096, count=1024, devices=8,
             inplace=False, iters=5, warmup=2, wrong=0, shares={"shm": 1.0}, aliased=None,
             time_us=100.0, time_min_us=90.0, time_max_us=120.0, time_median_us=95.0,
             algbw_gbps=0.04096, busbw_gbps=0.07168,
             baseline="native", baseline_impl="lax.psum", baseline_wrong=0, speedup=2.0,
             baseline_time_us=200.0, baseline_time_min_us=150.0, baseline_time_max_us=250.0,
             baseline_time_median_us=190.0, baseline_algbw_gbps=0.02048, baseline_busbw_gbps=0.03584,
             time_mean_us=101.0, baseline_time_mean_us=205.0, speedup_median=2.0, speedup_mean=2.03,
             faults_per_call=0.0, baseline_faults_per_call=1.5)
    r.update(kw)
    return r


def _doc(rows):
    return {"schema": report.SCHEMA, "machine": report.machine_info(),
            "versions": {"python": "3", "jax": "0.10.2", "jaxlib": "0.10.2", "jax_flexlink": "0.1.0",
                         "numpy": "2"},
            "links": "default", "command": "python -m jax_flexlink.bench", "argv": [], "scenario": "host8",
            "devices": 8, "baseline": "native", "settings": {}, "started_utc": "t0", "finished_utc": "t1",
            "summary": {"out_of_bounds": 0, "ok": True, "avg_busbw_gbps": 0.07}, "notes": [], "rows": rows}
