"""Warm-up, then iterations timed around block_until_ready; per-iteration samples give mean/min/max.

FlexLink and the native baseline are timed alternately, call by call, so that background load on a
shared machine does not favour either, and in alternating order (A B, B A, A B, ...), so that what one
call leaves behind (dirty cache lines, the allocator's free lists) does not always land on the same one.

Each timed call also counts the process's minor page faults (`getrusage`, every thread: XLA's work
runs on its own threads), so that a row can say how much of its time the kernel spent faulting in
fresh buffers (docs/launch.md, "Malloc settings").

The statistic a table reports is chosen by the caller: the median by default, because on a shared VM
single calls stall for several times their usual time (host page faults, preemption) and a mean over
5-50 calls follows those stalls more than the collective; the mean is kept too (docs/bench.md).

In-place (donated input): a donated buffer is consumed by the call, so every iteration needs a fresh
input. `make_arg` builds it *outside* the timed region (an on-device copy of the seeded input, completed
before the clock starts), so the time is the collective alone, on an input whose pages are already
touched — like a gradient buffer that was just computed. Out-of-place reuses one input; the previous
output is dropped before the next call, as in a training loop.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable

try:
    import resource
except ImportError:  # not a Unix: no fault counts
    resource = None

# Default iteration count scales down with the size so a sweep to 64 MiB finishes in minutes on 2 cores.
AUTO_BYTES_BUDGET = 256 << 20
AUTO_MIN_ITERS = 10
AUTO_MAX_ITERS = 50

# --runs R > 1: the pause before each turn (docs/bench.md, "--turn-pause-ms"): what one side's calls
# leave running (across processes, gloo's and XLA's threads) slowed the other side's next calls for
# longer than the turn's untimed call; a pause lets it end before the next side's turn.
DEFAULT_TURN_PAUSE_MS = 5.0

STATS = ("median", "mean")


def auto_iters(nbytes: int) -> int:
    """Iterations for a size when -n is not given: ~256 MiB moved per rank, clamped to [5, 50]."""
    if nbytes <= 0:
        return AUTO_MAX_ITERS
    return max(AUTO_MIN_ITERS, min(AUTO_MAX_ITERS, AUTO_BYTES_BUDGET // nbytes))


@dataclasses.dataclass
class Timing:
    samples_s: list[float]
    warmup: int
    faults: list[int] | None = None  # minor page faults per timed call (None: not counted)

    @property
    def iters(self) -> int:
        return len(self.samples_s)

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.samples_s) if self.samples_s else math.nan

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s) if self.samples_s else math.nan

    @property
    def min_s(self) -> float:
        return min(self.samples_s) if self.samples_s else math.nan

    @property
    def max_s(self) -> float:
        return max(self.samples_s) if self.samples_s else math.nan

    @property
    def faults_per_call(self) -> float | None:
        return statistics.fmean(self.faults) if self.faults else None

    def value(self, stat: str) -> float:
        """The time by `stat`: 'median' or 'mean'."""
        if stat not in STATS:
            raise ValueError(f"unknown statistic {stat!r}; expected one of {', '.join(STATS)}")
        return self.median_s if stat == "median" else self.mean_s


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


def _block(x):
    import jax
    return jax.block_until_ready(x)


def time_calls(fn: Callable[[Any], Any], make_arg: Callable[[], Any], warmup: int, iters: int,
               probe: Callable[[Any], Any] | None = None) -> tuple[Timing, Any, Any]:
    """Runs fn(make_arg()) warmup + iters times; times only fn + block_until_ready.

    probe(arg), if given, runs untimed just before the last timed call (e.g. to note the donated input's
    buffer addresses). Returns (Timing, the last output, probe's result).
    """
    timings, outs, probed = time_interleaved([fn], make_arg, warmup, iters, [probe])
    return timings[0], outs[0], probed[0]


def time_interleaved(fns: list[Callable[[Any], Any]], make_arg: Callable[[], Any], warmup: int, iters: int,
                     probes: list | None = None, runs: int = 1,
                     turn_pause_s: float = 0.0) -> tuple[list[Timing], list[Any], list[Any]]:
    """Times several implementations of one collective, alternating them and reversing the order every
    other round (A B, B A, A B, ...), so that load from other processes on a shared machine, and what
    each call leaves behind for the next, fall on all of them alike.

    runs = 1: call by call. runs = R > 1: after the warm-up, each turn is one untimed call and then R
    timed calls of one implementation in a row. The untimed call meets what the other implementation
    left behind (its cache lines, the allocator's free lists, XLA's worker threads still spinning,
    and across processes the other collective's exit skew between the processes); the timed ones
    measure the implementation in a steady state of its own, as a loop of one collective does
    (nccl-tests' back-to-back iterations). turn_pause_s > 0 (with runs > 1): a sleep before each
    turn, so that what the other side left running has ended too, not only met the untimed call.

    Each call gets its own make_arg() (made and completed before the clock starts). probes[k](arg) runs
    untimed before fns[k]'s last timed call. Returns per fn: Timing, last output, probe result.
    """
    if iters < 1:
        raise ValueError("iters must be >= 1")
    if runs < 1:
        raise ValueError("runs must be >= 1")
    if not turn_pause_s >= 0:
        raise ValueError("turn_pause_s must be >= 0")
    probes = list(probes or []) + [None] * (len(fns) - len(probes or []))
    outs: list[Any] = [None] * len(fns)
    samples: list[list[float]] = [[] for _ in fns]
    faults: list[list[int]] = [[] for _ in fns]
    probed: list[Any] = [None] * len(fns)

    def call(k: int, timed: bool):
        arg = _block(make_arg())
        if timed and len(samples[k]) == iters - 1 and probes[k] is not None:
            probed[k] = probes[k](arg)
        outs[k] = None  # drop the previous output before the next call, as a training loop would
        f0 = _minor_faults()
        t0 = time.perf_counter()
        out = fns[k](arg)
        _block(out)
        dt = time.perf_counter() - t0
        df = _minor_faults() - f0
        outs[k] = out
        del arg, out
        if timed:
            samples[k].append(dt)
            faults[k].append(df)

    def order(i: int):
        return range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))

    warm = max(0, warmup)
    for i in range(warm):
        for k in order(i):
            call(k, False)
    for i in range(warm, warm + (iters + runs - 1) // runs):
        for k in order(i):
            if runs > 1:
                if turn_pause_s:
                    time.sleep(turn_pause_s)
                call(k, False)
            for _ in range(min(runs, iters - len(samples[k]))):
                call(k, True)
    return [Timing(s, warm, f if resource else None) for s, f in zip(samples, faults)], outs, probed


def bandwidths(nbytes: int, seconds: float, busbw_factor: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s), nccl-tests formulas: algbw = bytes / time."""
    if not seconds or seconds <= 0 or math.isnan(seconds):
        return math.nan, math.nan
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * busbw_factor


def memcpy_gbps(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """This machine's single-thread copy speed, read+write bytes per second / 1e9 (a reference point)."""
    import numpy as np
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch pages
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9
