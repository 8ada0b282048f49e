"""The native engine on its own (``_flexlink.engine_run``: the code path an FFI handler runs, on
numpy arrays, GIL released), with Python threads standing in for devices: results, groups,
zero-size, validation, the deadline when a rank never arrives, and the runtime controls (timeout,
stats)."""
import itertools
import random
import re
import threading
import time

import jax
import numpy as np
import pytest

import jax_flexlink as flx
from helpers import N, make_data, per_device, run_python

from jax_flexlink import _flexlink as fl  # noqa: E402  (a missing extension must fail, not skip)

_run_ids = itertools.count(random.randrange(1 << 40, 1 << 41))
LABEL = "psum over axes ('engine_test',)"


def run_ranks(kind, op, groups, group_sizes, inputs, outs, *, axis=0, label=LABEL,
              devices=None, join_s=60):
    """One collective: a thread per device (default: every device of ``groups``) calls engine_run
    with the same run id. Returns {device: exception} for the ranks that raised."""
    run_id = next(_run_ids)
    devices = list(groups) if devices is None else list(devices)
    errors = {}

    def work(d):
        try:
            fl.engine_run(kind, op, list(groups), list(group_sizes), d, run_id, inputs[d],
                          outs[d], axis=axis, label=label)
        except Exception as e:  # noqa: BLE001
            errors[d] = e

    threads = [threading.Thread(target=work, args=(d,), daemon=True) for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    assert not any(t.is_alive() for t in threads), "engine_run did not return (deadline ignored?)"
    return errors


@pytest.fixture
def short_timeout():
    old = fl.timeout()
    yield fl.set_timeout
    fl.set_timeout(old)


def _lax_reference(body, stacked):
    """What lax computes for the same per-rank inputs (rank r = mesh position r)."""
    mesh_ = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    return np.asarray(per_device(body, mesh_)(stacked))


@pytest.mark.parametrize("dtype,op", [("int32", "sum"), ("uint8", "sum"), ("int64", "max"),
                                      ("int16", "min"), ("uint32", "prod"), ("float64", "max")])
def test_all_reduce_matches_lax(dtype, op):
    shape = (1001,)
    xs = make_data(dtype, (N,) + shape, seed=100)
    outs = {d: np.empty(shape, dtype) for d in range(N)}
    errors = run_ranks("all_reduce", op, range(N), [N], {d: xs[d].copy() for d in range(N)}, outs)
    assert not errors, errors
    lax_op = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}.get(op)
    if lax_op is not None:
        want = _lax_reference(lambda v: lax_op(v, "x"), xs)
    else:  # lax has no pprod; integer products wrap exactly like numpy's
        want = np.broadcast_to(np.prod(xs, axis=0, dtype=dtype), (N,) + shape)
    for d in range(N):
        assert np.array_equal(outs[d], want[d]), f"rank {d}"


def test_all_reduce_in_place():
    """all_reduce may alias its output to its input: passing the same array works."""
    xs = make_data("int32", (N, 4097), seed=101)
    bufs = {d: xs[d].copy() for d in range(N)}
    errors = run_ranks("all_reduce", "sum", range(N), [N], bufs, bufs)
    assert not errors, errors
    want = _lax_reference(lambda v: jax.lax.psum(v, "x"), xs)
    for d in range(N):
        assert np.array_equal(bufs[d], want[d])


@pytest.mark.parametrize("populate,huge,stream_bytes", [
    (True, True, 256 << 10), (False, True, 256 << 10), (True, False, 0), (False, False, 1 << 40)])
def test_output_preparation_and_store_variants_agree(populate, huge, stream_bytes):
    """Fresh outputs (np.empty of 4 MiB: new mappings) faulted in by madvise or by stores, with or
    without huge pages, written with streaming or cached stores: the same bytes."""
    saved = (fl.populate_outputs(), fl.huge_page_outputs(), fl.shm_streaming_bytes())
    fl.set_populate_outputs(populate)
    fl.set_huge_page_outputs(huge)
    fl.set_shm_streaming_bytes(stream_bytes)
    try:
        count = (4 << 20) // 4 + 3  # not a whole number of pages or cache lines
        xs = make_data("int32", (N, count), seed=107)
        outs = {d: np.empty(count, np.int32) for d in range(N)}
        errors = run_ranks("all_reduce", "sum", range(N), [N], {d: xs[d] for d in range(N)}, outs)
        assert not errors, errors
        want = xs.sum(axis=0, dtype=np.int32)
        for d in range(N):
            assert np.array_equal(outs[d], want), f"all_reduce rank {d}"
        gathered = {d: np.empty(N * count, np.int32) for d in range(N)}
        errors = run_ranks("all_gather", "sum", range(N), [N], {d: xs[d] for d in range(N)}, gathered)
        assert not errors, errors
        for d in range(N):
            assert np.array_equal(gathered[d], xs.reshape(-1)), f"all_gather rank {d}"
    finally:
        fl.set_populate_outputs(saved[0])
        fl.set_huge_page_outputs(saved[1])
        fl.set_shm_streaming_bytes(saved[2])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_float_sum_in_rank_order(dtype):
    """Rank order, not device id order or arrival order: group [3,1,4,0,6,2,7,5]."""
    group = [3, 1, 4, 0, 6, 2, 7, 5]
    xs = {d: make_data(dtype, (3001,), seed=102 + d) for d in range(N)}
    expected = np.zeros(3001, dtype)
    for d in group:
        expected = expected + xs[d]
    for rep in range(2):
        outs = {d: np.empty(3001, dtype) for d in range(N)}
        errors = run_ranks("all_reduce", "sum", group, [N], xs, outs)
        assert not errors, errors
        for d in range(N):
            assert outs[d].tobytes() == expected.tobytes(), f"device {d}, repetition {rep}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_sum_accumulates_in_float32(dtype):
    """float16/bfloat16 are summed in float32 in rank order and rounded once."""
    group = [6, 2, 0, 4, 1, 7, 3, 5]
    xs = {d: make_data(dtype, (2049,), seed=105 + d) for d in range(N)}
    acc = np.zeros(2049, np.float32)
    for d in group:
        acc = acc + xs[d].astype(np.float32)
    expected = acc.astype(xs[0].dtype)
    outs = {d: np.empty(2049, xs[0].dtype) for d in range(N)}
    errors = run_ranks("all_reduce", "sum", group, [N], xs, outs)
    assert not errors, errors
    for d in range(N):
        assert outs[d].tobytes() == expected.tobytes(), f"device {d}"


def test_bool_and_complex():
    b = {d: make_data("bool", (77,), seed=110 + d) for d in range(N)}
    for op, fn in (("max", np.logical_or.reduce), ("min", np.logical_and.reduce)):
        outs = {d: np.empty(77, bool) for d in range(N)}
        assert not run_ranks("all_reduce", op, range(N), [N], b, outs)
        want = fn([b[d] for d in range(N)])
        assert all(np.array_equal(outs[d], want) for d in range(N)), op
    c = {d: make_data("complex128", (33,), seed=120 + d) for d in range(N)}
    outs = {d: np.empty(33, np.complex128) for d in range(N)}
    assert not run_ranks("all_reduce", "sum", range(N), [N], c, outs)
    want = np.zeros(33, np.complex128)
    for d in range(N):
        want = want + c[d]
    assert all(outs[d].tobytes() == want.tobytes() for d in range(N))


def test_uneven_groups():
    groups, sizes = [6, 0, 2, 1, 3, 4, 5, 7], [1, 2, 5]  # {6}, {0, 2}, {1, 3, 4, 5, 7}
    xs = {d: make_data("int64", (50,), seed=130 + d) for d in range(N)}
    outs = {d: np.empty(50, np.int64) for d in range(N)}
    assert not run_ranks("all_reduce", "sum", groups, sizes, xs, outs)
    start = 0
    for size in sizes:
        members = groups[start:start + size]
        start += size
        want = np.sum([xs[d] for d in members], axis=0, dtype=np.int64)
        for d in members:
            assert np.array_equal(outs[d], want), f"device {d} of group {members}"


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_all_gather_axis(axis):
    group = [2, 7, 0, 5, 1, 4, 3, 6]
    shape = (2, 3, 5)
    xs = {d: make_data("int32", shape, seed=140 + d) for d in range(N)}
    want = np.concatenate([xs[d] for d in group], axis=axis)  # rank r's block at position r
    outs = {d: np.empty(want.shape, np.int32) for d in range(N)}
    assert not run_ranks("all_gather", "sum", group, [N], xs, outs, axis=axis)
    for d in range(N):
        assert np.array_equal(outs[d], want), f"device {d}"


@pytest.mark.parametrize("axis", [0, 1])
def test_reduce_scatter_axis(axis):
    group = [4, 1, 6, 3, 0, 7, 2, 5]
    in_shape = [3, 5]
    in_shape[axis] *= N
    xs = {d: make_data("int64", tuple(in_shape), seed=150 + d) for d in range(N)}
    total = np.sum([xs[d] for d in group], axis=0, dtype=np.int64)
    blocks = np.split(total, N, axis=axis)
    outs = {d: np.empty(blocks[0].shape, np.int64) for d in range(N)}
    assert not run_ranks("reduce_scatter", "sum", group, [N], xs, outs, axis=axis)
    for rank, d in enumerate(group):
        assert np.array_equal(outs[d], blocks[rank]), f"device {d} (rank {rank})"


def test_zero_size_returns_without_rendezvous(short_timeout):
    """Zero-size buffers return at once on every rank: one rank alone must not wait or time out."""
    short_timeout(0.5)
    x = np.empty((0, 3), np.float32)
    out = np.empty((0, 3), np.float32)
    t0 = time.monotonic()
    errors = run_ranks("all_reduce", "sum", range(N), [N], {3: x}, {3: out}, devices=[3])
    assert not errors, errors
    assert time.monotonic() - t0 < 0.4


def test_device_not_in_any_group():
    x = np.zeros(4, np.int32)
    errors = run_ranks("all_reduce", "sum", [0, 1, 2, 3], [4], {9: x}, {9: x.copy()},
                       devices=[9])
    assert isinstance(errors.get(9), RuntimeError), errors


def test_deadline_names_collective_group_and_missing_rank(short_timeout):
    """7 of 8 ranks arrive; after the deadline each gets an error that names the collective (its
    label), the group (device ids) and the rank that never arrived."""
    timeout = 0.5
    short_timeout(timeout)
    group = list(range(2048, 2048 + N))  # device ids as in process 1 of a multi-process job
    missing_rank = 5
    missing = group[missing_rank]
    present = [d for d in group if d != missing]
    xs = {d: np.ones(1024, np.float32) for d in group}
    outs = {d: np.empty(1024, np.float32) for d in group}
    t0 = time.monotonic()
    errors = run_ranks("all_reduce", "sum", group, [N], xs, outs, devices=present,
                       label=LABEL, join_s=30)
    elapsed = time.monotonic() - t0
    assert sorted(errors) == present, f"ranks without an error: {set(present) - set(errors)}"
    assert elapsed >= timeout * 0.9, f"gave up after {elapsed:.2f}s, before the deadline"
    assert elapsed < timeout + 10, f"took {elapsed:.2f}s for a {timeout}s deadline"
    for d, e in errors.items():
        assert isinstance(e, RuntimeError), f"device {d}: {type(e).__name__}: {e}"
        msg = str(e)
        assert LABEL in msg, f"device {d}: label missing from {msg!r}"
        for g in group:
            assert str(g) in msg, f"device {d}: group member {g} missing from {msg!r}"
        names_missing = re.search(rf"\b{missing_rank}\b", msg) or msg.count(str(missing)) >= 2
        assert names_missing, (
            f"device {d}: missing rank {missing_rank} ({missing}) not named: {msg!r}")


def test_waits_block_rather_than_spin(short_timeout):
    """While 7 ranks wait for the 8th, the process burns (almost) no CPU time."""
    timeout = 1.0
    short_timeout(timeout)
    group = list(range(N))
    xs = {d: np.ones(16, np.float32) for d in group}
    outs = {d: np.empty(16, np.float32) for d in group}
    cpu0, t0 = time.process_time(), time.monotonic()
    errors = run_ranks("all_reduce", "sum", group, [N], xs, outs, devices=group[:-1])
    cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    assert len(errors) == N - 1
    assert wall >= timeout * 0.9
    assert cpu < 0.5 * timeout, f"{cpu:.2f}s of CPU time in {wall:.2f}s of waiting: spinning?"


def test_timeout_controls():
    old = fl.timeout()
    try:
        fl.set_timeout(12.5)
        assert fl.timeout() == 12.5
        flx.configure(timeout_s=7.0)
        assert fl.timeout() == 7.0
    finally:
        fl.set_timeout(old)


def test_timeout_from_environment():
    res = run_python("""
        from jax_flexlink import _flexlink
        print("TIMEOUT", _flexlink.timeout())
    """, env_extra={"FLEXLINK_TIMEOUT_S": "42.5"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TIMEOUT 42.5" in res.stdout, res.stdout


def test_default_timeout_is_300s():
    res = run_python("""
        import jax_flexlink
        from jax_flexlink import _flexlink
        print("TIMEOUT", _flexlink.timeout())
    """, env_remove=("FLEXLINK_TIMEOUT_S",))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TIMEOUT 300" in res.stdout, res.stdout


def test_stats_count_calls_and_reset(mesh1d):
    f = per_device(lambda v: flx.psum(v, "x"), mesh1d)
    x = make_data("float32", (N, 1024), seed=160)
    f(x).block_until_ready()  # compile and warm up
    flx.reset_stats()
    s0 = flx.stats()
    assert all(link["calls"] == 0 and link["bytes"] == 0 for link in s0["links"].values()), s0
    for _ in range(3):
        f(x).block_until_ready()
    s = flx.stats()
    assert s["links"], s
    calls = sum(link["calls"] for link in s["links"].values())
    moved = sum(link["bytes"] for link in s["links"].values())
    assert calls >= 3, s
    assert moved >= 3 * 1024 * 4, s
    fields = {"bytes", "calls", "seconds", "healthy"}
    assert all(set(link) >= fields for link in s["links"].values())
    assert all(link["healthy"] for link in s["links"].values()), s
    assert set(s) >= set(fl.stats()) | {"plans", "offload_fraction"}
    flx.reset_stats()
    assert all(link["calls"] == 0 for link in flx.stats()["links"].values())


# ---- k-operand calls, on every link set ---------------------------------------------------------

_AUTOTUNE_DEFAULT = fl.autotune_min_bytes()
# Link sets an engine_run call can run on; "shm;tcp" splits every call 60/40 (pinned shares).
LINK_SETS = ["shm", "tcp", "emulated:e@gbps=2", "shm;tcp"]


@pytest.fixture(params=LINK_SETS)
def links(request):
    flx.configure(links=request.param, autotune_min_bytes=0)
    yield request.param
    flx.configure(links="shm", autotune_min_bytes=_AUTOTUNE_DEFAULT)


def _bucket(nbytes):
    return 1 << (int(nbytes).bit_length() - 1)


def pin_split(links, kind, message_bytes):
    """With two links, pins this call's bucket to 60/40 so the ranges cut through the parts."""
    if ";" in links:
        fl.set_shares(kind, _bucket(message_bytes), [0.6, 0.4], pinned=True)


def message_bytes(kind, xs_of_rank):
    total = sum(x.nbytes for x in xs_of_rank)
    return total * (N if kind == "all_gather" else 1)


# 13 gradient-like leaves: float32 matrices, bfloat16 vectors, an int32 counter, ...; some far above
# the staging size (16 KiB per rank), most below.
LEAVES = [("float32", (64, 33)), ("bfloat16", (7,)), ("int32", ()), ("float16", (5, 3)),
          ("float64", (1000,)), ("uint8", (17,)), ("float32", (70001,)), ("complex64", (9,)),
          ("int64", (2, 2)), ("bfloat16", (40003,)), ("float32", (1,)), ("uint16", (129,)),
          ("int8", (31,))]


def leaves(seed, specs=LEAVES):
    return {d: [make_data(dt, shape, seed=seed + 13 * d + i) for i, (dt, shape) in enumerate(specs)]
            for d in range(N)}


def separate_calls(kind, op, xs, make_out, axis=0):
    """Each operand in a call of its own: what a k-operand call must equal bitwise."""
    k = len(xs[0])
    want = {d: [None] * k for d in range(N)}
    for i in range(k):
        outs = {d: make_out(xs[d][i]) for d in range(N)}
        errors = run_ranks(kind, op, range(N), [N], {d: xs[d][i] for d in range(N)}, outs, axis=axis)
        assert not errors, errors
        for d in range(N):
            want[d][i] = outs[d]
    return want


def test_multi_operand_all_reduce_equals_separate_calls(links):
    xs = leaves(500)
    pin_split(links, "all_reduce", message_bytes("all_reduce", xs[0]))
    outs = {d: [np.empty_like(x) for x in xs[d]] for d in range(N)}
    fl.reset_stats()
    errors = run_ranks("all_reduce", "sum", range(N), [N], xs, outs)
    assert not errors, errors
    if ";" in links:  # the split ran: both links carried bytes of this one call
        stats = fl.stats()["links"]
        assert stats["shm"]["calls"] == 1 and stats["tcp"]["calls"] == 1, stats
        assert stats["shm"]["bytes"] + stats["tcp"]["bytes"] == sum(x.nbytes for x in xs[0]), stats
    want = separate_calls("all_reduce", "sum", xs, np.empty_like)
    for d in range(N):
        for i, (got, ref) in enumerate(zip(outs[d], want[d])):
            assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes(), f"device {d} operand {i}"
    # Integers against numpy (integer sums wrap there too).
    for i, (dt, _) in enumerate(LEAVES):
        if np.issubdtype(np.dtype(dt), np.integer):
            expected = np.sum([xs[d][i] for d in range(N)], axis=0, dtype=dt)
            assert np.array_equal(outs[0][i], expected), f"operand {i}"


def test_multi_operand_in_place_subset(links):
    """Results 0, 3 and 9 alias their operands (output_operand_aliases of a subset)."""
    xs = leaves(520, [(dt if dt != "complex64" else "float64", s) for dt, s in LEAVES])
    pin_split(links, "all_reduce", message_bytes("all_reduce", xs[0]))
    want = separate_calls("all_reduce", "max", {d: [x.copy() for x in xs[d]] for d in range(N)},
                          np.empty_like)
    bufs = {d: [x.copy() for x in xs[d]] for d in range(N)}
    outs = {d: [b if i in (0, 3, 9) else np.empty_like(b) for i, b in enumerate(bufs[d])]
            for d in range(N)}
    errors = run_ranks("all_reduce", "max", range(N), [N], bufs, outs)
    assert not errors, errors
    for d in range(N):
        for i in range(len(LEAVES)):
            assert outs[d][i].tobytes() == want[d][i].tobytes(), f"device {d} operand {i}"
        assert outs[d][3] is bufs[d][3]


@pytest.mark.parametrize("axis", [0, 1])
def test_multi_operand_gather_and_scatter(links, axis):
    specs = [("float32", (3, 37)), ("bfloat16", (1, 5)), ("int32", (4, 20001)), ("uint8", (2, 1)),
             ("float16", (1000, 3))]
    xs = leaves(540, specs)
    pin_split(links, "all_gather", message_bytes("all_gather", xs[0]))

    def gathered(x):
        shape = list(x.shape)
        shape[axis] *= N
        return np.empty(shape, x.dtype)

    outs = {d: [gathered(x) for x in xs[d]] for d in range(N)}
    assert not run_ranks("all_gather", "sum", range(N), [N], xs, outs, axis=axis)
    for i in range(len(specs)):
        want = np.concatenate([xs[d][i] for d in range(N)], axis=axis)
        for d in range(N):
            assert outs[d][i].tobytes() == want.tobytes(), f"all_gather device {d} operand {i}"
    # reduce_scatter of the gathered arrays back: rank r gets the sum of block r.
    ins = {d: [np.ascontiguousarray(o) for o in outs[d]] for d in range(N)}
    pin_split(links, "reduce_scatter", message_bytes("reduce_scatter", ins[0]))
    scattered = {d: [np.empty_like(x) for x in xs[d]] for d in range(N)}
    assert not run_ranks("reduce_scatter", "sum", range(N), [N], ins, scattered, axis=axis)
    want = separate_calls("reduce_scatter", "sum", ins,
                          lambda x: np.empty(x.shape[:axis] + (x.shape[axis] // N,) + x.shape[axis + 1:], x.dtype),
                          axis=axis)
    for d in range(N):
        for i in range(len(specs)):
            assert scattered[d][i].tobytes() == want[d][i].tobytes(), f"reduce_scatter device {d} operand {i}"


def test_multi_operand_mismatched_count_fails_every_rank():
    xs = {d: [np.ones(10, np.float32), np.ones(3, np.int32)] for d in range(N)}
    xs[5] = xs[5][:1]
    outs = {d: [np.empty_like(x) for x in xs[d]] for d in range(N)}
    errors = run_ranks("all_reduce", "sum", range(N), [N], xs, outs)
    assert sorted(errors) == list(range(N)), errors
    for e in errors.values():
        assert "disagree" in str(e) and "rank 5" in str(e) and "of 2 operands" in str(e), str(e)


def test_multi_operand_counts_once_in_stats():
    xs = leaves(560)
    outs = {d: [np.empty_like(x) for x in xs[d]] for d in range(N)}
    fl.reset_stats()
    assert not run_ranks("all_reduce", "sum", range(N), [N], xs, outs)
    shm = fl.stats()["links"]["shm"]
    assert shm["calls"] == 1, shm
    assert shm["bytes"] == sum(x.nbytes for x in xs[0]), shm


def test_engine_run_operand_lists_must_match():
    with pytest.raises(ValueError, match="same non-zero length"):
        fl.engine_run("all_reduce", "sum", [0], [1], 0, next(_run_ids), [np.ones(3)], [])
    with pytest.raises(ValueError, match="same non-zero length"):
        fl.engine_run("all_reduce", "sum", [0], [1], 0, next(_run_ids), [np.ones(3)],
                      [np.ones(3), np.ones(3)])
    # A list of one is the same call as the bare arrays.
    x, out = np.arange(4.0), np.empty(4)
    fl.engine_run("all_reduce", "sum", [0], [1], 0, next(_run_ids), (x,), [out])
    assert np.array_equal(out, x)


# ---- ppermute and all_to_all --------------------------------------------------------------------

def run_ppermute(group, pairs, xs, **kw):
    outs = {d: ([np.full_like(x, 7) for x in xs[d]] if isinstance(xs[d], list) else np.full_like(xs[d], 7))
            for d in xs}
    run_id = next(_run_ids)
    errors = {}

    def work(d):
        try:
            fl.engine_run("ppermute", "", list(group), [len(group)], d, run_id, xs[d], outs[d],
                          pairs=pairs, **kw)
        except Exception as e:  # noqa: BLE001
            errors[d] = e

    threads = [threading.Thread(target=work, args=(d,), daemon=True) for d in group]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return outs, errors


def ppermute_reference(group, pairs, xs, d):
    rank = list(group).index(d)
    for s, t in pairs:
        if t == rank:
            return xs[group[s]]
    return np.zeros_like(xs[d])


PAIR_SETS = {
    "identity": [(r, r) for r in range(N)],
    "shift+1": [(r, (r + 1) % N) for r in range(N)],
    "shift-1": [(r, (r - 1) % N) for r in range(N)],
    "swap": [(0, 1), (1, 0)],
    "partial": [(0, 3), (5, 1), (2, 2)],
    "none": [],
}


@pytest.mark.parametrize("pairs", list(PAIR_SETS), ids=list(PAIR_SETS))
def test_ppermute_pairs(links, pairs):
    group = [3, 1, 4, 0, 6, 2, 7, 5]
    pin_split(links, "ppermute", 40003 * 4)
    for dtype, shape in (("float32", (40003,)), ("bfloat16", (7, 3)), ("int8", (1,)), ("complex128", (129,))):
        xs = {d: make_data(dtype, shape, seed=600 + d) for d in range(N)}
        outs, errors = run_ppermute(group, PAIR_SETS[pairs], xs)
        assert not errors, errors
        for d in group:
            want = ppermute_reference(group, PAIR_SETS[pairs], xs, d)
            assert outs[d].tobytes() == want.tobytes(), f"{dtype} device {d}"


def test_ppermute_matches_lax():
    """lax.ppermute on the same per-rank inputs (rank r = mesh position r)."""
    perm = [(0, 2), (2, 4), (4, 6), (6, 0), (1, 7)]
    xs = make_data("float32", (N, 1001), seed=620)
    want = _lax_reference(lambda v: jax.lax.ppermute(v, "x", perm), xs)
    outs, errors = run_ppermute(range(N), perm, {d: xs[d] for d in range(N)})
    assert not errors, errors
    for d in range(N):
        assert outs[d].tobytes() == want[d].tobytes(), f"device {d}"


def test_ppermute_of_several_operands(links):
    xs = leaves(640)
    pairs = PAIR_SETS["shift-1"][:5] + [(6, 6)]
    pin_split(links, "ppermute", message_bytes("all_reduce", xs[0]))
    outs, errors = run_ppermute(range(N), pairs, xs)
    assert not errors, errors
    for d in range(N):
        for i in range(len(LEAVES)):
            want = ppermute_reference(list(range(N)), pairs, {r: xs[r][i] for r in range(N)}, d)
            assert outs[d][i].tobytes() == want.tobytes(), f"device {d} operand {i}"


@pytest.mark.parametrize("bad,match", [
    ([(0, 1), (0, 2)], "sources must be unique"),
    ([(0, 1), (2, 1)], "destinations must be unique"),
    ([(0, 8)], "outside the group of 8"),
])
def test_ppermute_bad_pairs(bad, match):
    xs = {d: np.ones(4, np.float32) for d in range(N)}
    _, errors = run_ppermute(range(N), bad, xs)
    assert sorted(errors) == list(range(N)) and all(match in str(e) for e in errors.values()), errors


def test_ppermute_mismatched_pairs_fail_every_rank():
    xs = {d: np.ones(4, np.float32) for d in range(N)}
    outs = {d: np.empty(4, np.float32) for d in range(N)}
    run_id = next(_run_ids)
    errors = {}

    def work(d):
        try:
            pairs = [(0, 1)] if d != 4 else [(1, 0)]
            fl.engine_run("ppermute", "", list(range(N)), [N], d, run_id, xs[d], outs[d], pairs=pairs)
        except Exception as e:  # noqa: BLE001
            errors[d] = e

    threads = [threading.Thread(target=work, args=(d,)) for d in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(errors) == list(range(N)), errors
    assert all("disagree" in str(e) and "0->1" in str(e) and "1->0" in str(e) for e in errors.values())


def run_ppermute_in_place(group, pairs, bufs, in_place=None):
    """ppermute with `out` aliasing `x` (the array itself) for the operands `in_place` picks (all by
    default); returns each device's results (its buffers, or the separate outputs)."""
    k = len(bufs[group[0]]) if isinstance(bufs[group[0]], list) else None
    pick = (lambda i: True) if in_place is None else (lambda i: i in in_place)
    if k is None:
        outs = {d: bufs[d] for d in group}
    else:
        outs = {d: [b if pick(i) else np.full_like(b, 7) for i, b in enumerate(bufs[d])] for d in group}
    run_id = next(_run_ids)
    errors = {}

    def work(d):
        try:
            fl.engine_run("ppermute", "", list(group), [len(group)], d, run_id, bufs[d], outs[d], pairs=pairs)
        except Exception as e:  # noqa: BLE001
            errors[d] = e

    threads = [threading.Thread(target=work, args=(d,), daemon=True) for d in group]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    return outs


@pytest.mark.parametrize("pairs", list(PAIR_SETS), ids=list(PAIR_SETS))
def test_ppermute_in_place(links, pairs):
    """`out` aliasing `x` (the array itself): the result is bitwise the out-of-place one, staged
    (small), one chunk and many chunks (links/shm_inplace.h), on every link set and split."""
    group = [3, 1, 4, 0, 6, 2, 7, 5]
    pin_split(links, "ppermute", 300007 * 4)
    for dtype, shape in (("float32", (300007,)), ("bfloat16", (7, 3)), ("int8", (40001,)),
                         ("complex128", (129, 3))):
        xs = {d: make_data(dtype, shape, seed=650 + d) for d in range(N)}
        want, errors = run_ppermute(group, PAIR_SETS[pairs], xs)
        assert not errors, errors
        bufs = {d: xs[d].copy() for d in range(N)}
        got = run_ppermute_in_place(group, PAIR_SETS[pairs], bufs)
        for d in group:
            assert got[d] is bufs[d]
            assert got[d].tobytes() == want[d].tobytes(), f"{dtype} device {d}"
            assert want[d].tobytes() == ppermute_reference(group, PAIR_SETS[pairs], xs, d).tobytes()


def test_ppermute_in_place_subset_of_several_operands(links):
    xs = leaves(660)
    pairs = PAIR_SETS["shift+1"]
    pin_split(links, "ppermute", message_bytes("all_reduce", xs[0]))
    bufs = {d: [x.copy() for x in xs[d]] for d in range(N)}
    got = run_ppermute_in_place(list(range(N)), pairs, bufs, in_place={0, 3, 6, 9, 12})
    for d in range(N):
        for i in range(len(LEAVES)):
            want = ppermute_reference(list(range(N)), pairs, {r: xs[r][i] for r in range(N)}, d)
            assert got[d][i].tobytes() == want.tobytes(), f"device {d} operand {i}"
        assert got[d][6] is bufs[d][6] and got[d][7] is not bufs[d][7]


def test_output_overlapping_the_input_is_an_error():
    """In place means the output *is* the input; any other overlap is refused (by every kind but
    all_reduce), before any rendezvous."""
    b = np.ones(9, np.float32)
    for kind, kw in (("ppermute", {"pairs": [(0, 1)]}), ("all_to_all", {})):
        with pytest.raises(RuntimeError, match="overlaps the input.*the input buffer itself"):
            fl.engine_run(kind, "", [0, 1], [2], 0, next(_run_ids), b[:8], b[1:], **kw)
    with pytest.raises(RuntimeError, match="overlaps the input.*only all_reduce, ppermute and all_to_all"):
        fl.engine_run("all_gather", "", [0, 1], [2], 0, next(_run_ids), b[:4], b[:8])


def all_to_all_reference(xs, group, axis, d):
    rank = list(group).index(d)
    blocks = [np.split(xs[g], len(group), axis=axis)[rank] for g in group]
    return np.concatenate(blocks, axis=axis)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_all_to_all_axes(links, axis):
    group = [2, 7, 0, 5, 1, 4, 3, 6]
    shape = [3, 5, 7]
    shape[axis] *= N
    pin_split(links, "all_to_all", int(np.prod(shape)) * 4)
    for dtype in ("float32", "bfloat16", "int64", "bool"):
        xs = {d: make_data(dtype, tuple(shape), seed=700 + d) for d in range(N)}
        outs = {d: np.empty_like(xs[d]) for d in range(N)}
        assert not run_ranks("all_to_all", "", group, [N], xs, outs, axis=axis)
        for d in group:
            want = all_to_all_reference(xs, group, axis, d)
            assert outs[d].tobytes() == want.tobytes(), f"{dtype} device {d}"


@pytest.mark.parametrize("split_axis,concat_axis", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_all_to_all_matches_lax(split_axis, concat_axis):
    """lax.all_to_all (tiled) for each (split_axis, concat_axis): the split axis moved to the front,
    ours about axis 0, and the received blocks moved back and concatenated along concat_axis — the
    reshapes and transposes a Python lowering wraps around the custom call."""
    xs = make_data("int32", (N, 2 * N, 3 * N), seed=720)
    want = _lax_reference(lambda v: jax.lax.all_to_all(v, "x", split_axis, concat_axis, tiled=True), xs)
    moved = {d: np.ascontiguousarray(np.moveaxis(xs[d], split_axis, 0)) for d in range(N)}
    outs = {d: np.empty_like(moved[d]) for d in range(N)}
    assert not run_ranks("all_to_all", "", range(N), [N], moved, outs, axis=0)
    for d in range(N):
        blocks = np.split(outs[d], N, axis=0)  # block j: rank j's chunk d, split axis in front
        got = np.concatenate([np.moveaxis(b, 0, split_axis) for b in blocks], axis=concat_axis)
        assert np.array_equal(got, want[d]), f"device {d}"


def test_all_to_all_of_several_operands(links):
    specs = [("float32", (8, 40)), ("bfloat16", (16, 8)), ("int64", (8, 8 * 3001)), ("uint16", (24, 8))]
    xs = leaves(740, specs)
    pin_split(links, "all_to_all", sum(x.nbytes for x in xs[0]) * N)
    outs = {d: [np.empty_like(x) for x in xs[d]] for d in range(N)}
    assert not run_ranks("all_to_all", "", range(N), [N], xs, outs, axis=1)
    for i in range(len(specs)):
        for d in range(N):
            want = all_to_all_reference({r: xs[r][i] for r in range(N)}, list(range(N)), 1, d)
            assert outs[d][i].tobytes() == want.tobytes(), f"device {d} operand {i}"


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_all_to_all_in_place(links, axis):
    """`out` aliasing `x`: bitwise the out-of-place result, every axis, one and many chunks."""
    group = [2, 7, 0, 5, 1, 4, 3, 6]
    for base in ([3, 5, 7], [30, 41, 70]):
        shape = list(base)
        shape[axis] *= N
        pin_split(links, "all_to_all", int(np.prod(shape)) * 4)
        for dtype in ("float32", "bfloat16", "int64", "bool"):
            xs = {d: make_data(dtype, tuple(shape), seed=760 + d) for d in range(N)}
            bufs = {d: xs[d].copy() for d in range(N)}
            assert not run_ranks("all_to_all", "", group, [N], bufs, bufs, axis=axis)
            for d in group:
                want = all_to_all_reference(xs, group, axis, d)
                assert bufs[d].tobytes() == want.tobytes(), f"{dtype} {shape} device {d}"


def test_all_to_all_in_place_subset_of_several_operands(links):
    specs = [("float32", (8, 40)), ("bfloat16", (16, 8)), ("int64", (8, 8 * 3001)), ("uint16", (24, 8))]
    xs = leaves(780, specs)
    pin_split(links, "all_to_all", sum(x.nbytes for x in xs[0]) * N)
    bufs = {d: [x.copy() for x in xs[d]] for d in range(N)}
    outs = {d: [b if i in (0, 2) else np.empty_like(b) for i, b in enumerate(bufs[d])] for d in range(N)}
    assert not run_ranks("all_to_all", "", range(N), [N], bufs, outs, axis=1)
    for i in range(len(specs)):
        for d in range(N):
            want = all_to_all_reference({r: xs[r][i] for r in range(N)}, list(range(N)), 1, d)
            assert outs[d][i].tobytes() == want.tobytes(), f"device {d} operand {i}"
    assert outs[0][2] is bufs[0][2]


def test_all_to_all_errors():
    x = np.ones((3, 7), np.float32)
    errors = run_ranks("all_to_all", "", range(N), [N], {d: x for d in range(N)},
                       {d: np.empty_like(x) for d in range(N)}, axis=1)
    assert sorted(errors) == list(range(N))
    assert all("split evenly into 8 blocks" in str(e) for e in errors.values()), errors
    with pytest.raises(RuntimeError, match="same size"):
        fl.engine_run("all_to_all", "", [0, 1, 2, 3, 4], [2, 3], 0, next(_run_ids), np.ones(4), np.ones(4))


@pytest.mark.parametrize("kind", ["ppermute", "all_to_all"])
def test_stage1_profiles_the_new_kinds(kind):
    """The first large call of a kind without fits runs stage 1 for that kind (nested calls of the
    kind itself on scratch buffers), installs per-link fits for it, and still returns the right
    result."""
    flx.configure(links="emulated:a@gbps=0.4;emulated:b@gbps=0.2", autotune_min_bytes=1 << 20)
    saved_max = fl.tune_max_bytes()
    fl.set_tune_max_bytes(1 << 20)
    try:
        group = list(range(N))
        xs = {d: make_data("float32", (N, 32768), seed=800 + d) for d in range(N)}  # 1 MiB per rank
        if kind == "ppermute":
            pairs = PAIR_SETS["shift+1"]
            outs, errors = run_ppermute(group, pairs, xs)
            assert not errors, errors
            wants = {d: ppermute_reference(group, pairs, xs, d) for d in group}
        else:
            outs = {d: np.empty_like(xs[d]) for d in group}
            assert not run_ranks("all_to_all", "", group, [N], xs, outs, axis=0)
            wants = {d: all_to_all_reference(xs, group, 0, d) for d in group}
        for d in group:
            assert outs[d].tobytes() == wants[d].tobytes(), f"device {d}"
        fits = fl.group_fits(group)
        assert fits is not None and kind in fits["fits"], fits
        # One (alpha, beta) per link; which is faster is timing, left to test_multipath (exclusive).
        assert len(fits["fits"][kind]) == 2 and all(beta > 0 for _, beta in fits["fits"][kind]), fits
    finally:
        fl.set_tune_max_bytes(saved_max)
        flx.configure(links="shm", autotune_min_bytes=_AUTOTUNE_DEFAULT)
