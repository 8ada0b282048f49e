"""Timing helpers of jax_flexlink.bench."""
import math

import pytest

from jax_flexlink.bench import timing


def test_auto_iters_scale_down_with_size():
    assert timing.auto_iters(4 << 10) == timing.AUTO_MAX_ITERS
    assert timing.auto_iters(64 << 20) == timing.AUTO_MIN_ITERS
    assert timing.auto_iters(16 << 20) == 16
    its = [timing.auto_iters(1 << k) for k in range(10, 31)]
    assert its == sorted(its, reverse=True)


def test_bandwidths():
    alg, bus = timing.bandwidths(1_000_000_000, 0.5, 1.75)
    assert alg == pytest.approx(2.0) and bus == pytest.approx(3.5)
    assert all(math.isnan(v) for v in timing.bandwidths(100, 0.0, 1.0))


def test_time_calls_counts_and_keeps_setup_outside():
    calls, made = [], []

    def make():
        made.append(1)
        return len(made)

    def fn(x):
        calls.append(x)
        return x * 10

    t, out, probed = timing.time_calls(fn, make, warmup=2, iters=3, probe=lambda a: ("probe", a))
    assert t.iters == 3 and t.warmup == 2 and len(calls) == 5 and len(made) == 5
    assert out == 50 and probed == ("probe", 5)
    assert t.min_s <= t.mean_s <= t.max_s
    with pytest.raises(ValueError):
        timing.time_calls(fn, make, 0, 0)


def test_statistics_median_and_mean():
    t = timing.Timing([1.0, 2.0, 30.0], warmup=0)  # one stalled call
    assert t.value("median") == 2.0 and t.value("mean") == pytest.approx(11.0)
    with pytest.raises(ValueError, match="unknown statistic"):
        t.value("p90")


def test_memcpy_reference_is_positive():
    assert timing.memcpy_gbps(1 << 20, 1) > 0


def test_interleaved_alternates_and_separates():
    log = []

    def fa(x):
        log.append(("a", x))
        return ("a", x)

    def fb(x):
        log.append(("b", x))
        return ("b", x)

    counter = iter(range(100))
    ts, outs, probed = timing.time_interleaved([fa, fb], lambda: next(counter), warmup=1, iters=2,
                                               probes=[lambda a: a, None])
    # call by call, and the order reversed every other round: what a call leaves behind for the next
    # (cache lines, allocator state) does not always fall on the same implementation
    assert [n for n, _ in log] == ["a", "b", "b", "a", "a", "b"]
    assert [x for _, x in log] == list(range(6))  # a fresh argument for every call
    assert [t.iters for t in ts] == [2, 2] and outs == [("a", 4), ("b", 5)] and probed == [4, None]


def _recorder(log):
    """make(name): a collective stand-in that logs (name, its argument) and returns them."""
    def make(name):
        def f(x):
            log.append((name, x))
            return (name, x)
        return f
    return make


def test_interleaved_in_runs():
    log = []
    make = _recorder(log)
    counter = iter(range(100))
    ts, outs, probed = timing.time_interleaved([make("a"), make("b")], lambda: next(counter), warmup=1, iters=3,
                                               probes=[None, lambda a: a], runs=2)
    # warm-up call by call; then turns of one untimed call and up to 2 timed ones, the order reversed
    # every other turn, until each side has its 3 samples
    assert [n for n, _ in log] == ["a", "b"] + ["b"] * 3 + ["a"] * 3 + ["a"] * 2 + ["b"] * 2
    assert [t.iters for t in ts] == [3, 3]
    assert outs == [("a", 9), ("b", 11)] and probed == [None, 11]
    with pytest.raises(ValueError, match="runs must be >= 1"):
        timing.time_interleaved([make("a")], lambda: 0, warmup=0, iters=1, runs=0)


def test_a_pause_before_each_turn(monkeypatch):
    """turn_pause_s sleeps before every turn (each side's untimed call), never during a turn or the
    warm-up, and only with runs > 1; the timed calls are the same as without it."""
    log = []
    monkeypatch.setattr(timing.time, "sleep", lambda s: log.append(("sleep", s)))
    make = _recorder(log)
    counter = iter(range(100))
    ts, _, _ = timing.time_interleaved([make("a"), make("b")], lambda: next(counter), warmup=1, iters=3,
                                       runs=2, turn_pause_s=0.004)
    names = [n for n, _ in log]
    assert names == (["a", "b"] + ["sleep", "b", "b", "b"] + ["sleep", "a", "a", "a"] + ["sleep", "a", "a"]
                     + ["sleep", "b", "b"])
    assert all(s == 0.004 for n, s in log if n == "sleep") and [t.iters for t in ts] == [3, 3]
    log.clear()
    timing.time_interleaved([make("a"), make("b")], lambda: 0, warmup=1, iters=3, runs=1, turn_pause_s=0.004)
    assert "sleep" not in [n for n, _ in log]  # call by call: no turns
    with pytest.raises(ValueError, match="turn_pause_s must be >= 0"):
        timing.time_interleaved([make("a")], lambda: 0, warmup=0, iters=1, runs=2, turn_pause_s=-1)


def test_page_faults_are_counted_per_timed_call():
    """A call that touches fresh memory (an anonymous mapping, whatever the allocator does) shows its
    page faults; one that touches nothing shows few. Warm-up calls are not counted."""
    import mmap

    pages = 1024

    def touch(_):
        m = mmap.mmap(-1, pages * mmap.PAGESIZE)
        for p in range(pages):
            m[p * mmap.PAGESIZE] = 1
        m.close()
        return 0

    ts, _, _ = timing.time_interleaved([touch, lambda x: x], lambda: 0, warmup=2, iters=3)
    assert [len(t.faults) for t in ts] == [3, 3]
    assert ts[0].faults_per_call >= pages * 0.9, ts[0].faults
    assert ts[1].faults_per_call < pages / 10, ts[1].faults
    assert timing.Timing([1.0], 0).faults_per_call is None  # not counted
