"""The expected-output generator: exact for every collective, op and dtype, whatever the order."""
import itertools

import numpy as np
import pytest

from jax_flexlink.bench import collectives as C
from jax_flexlink.bench import data

DTYPES = sorted(C.DTYPES)
OPS = ["sum", "prod", "max", "min"]


def _fold(op, rows):
    """Reduce in the dtype itself, in the given row order (each step rounded, ints wrapping)."""
    fn = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    acc = rows[0].copy()
    with np.errstate(over="ignore"):
        for r in rows[1:]:
            acc = fn(acc, r).astype(acc.dtype)
    return acc


def _pairwise(op, rows):
    while len(rows) > 1:
        nxt = [_fold(op, rows[i:i + 2]) for i in range(0, len(rows) - 1, 2)]
        if len(rows) % 2:
            nxt.append(rows[-1])
        rows = nxt
    return rows[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("nranks", [2, 8])
def test_all_reduce_exact_in_any_order(dtype, op, nranks):
    x = data.make_inputs(op, dtype, nranks, 4096, seed=3)
    assert x.shape == (nranks, 4096) and x.dtype == C.DTYPES[dtype]
    exp = data.expected_output("all_reduce", op, x)
    assert exp.shape == (1, 4096) and exp.dtype == x.dtype
    rows = list(x)
    rng = np.random.default_rng(0)
    orders = [rows, rows[::-1], [rows[i] for i in rng.permutation(nranks)]]
    for order in orders:
        assert np.array_equal(_fold(op, order), exp[0]), f"order-dependent {op} {dtype}"
    assert np.array_equal(_pairwise(op, rows), exp[0])
    # Not degenerate: the inputs vary, and so do the results (except prod of +-1 / 1,2 values).
    assert len(np.unique(x.astype(np.float64))) > 1
    if op != "prod":
        assert len(np.unique(exp.astype(np.float64))) > 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_reduce_scatter_expected(dtype, op):
    n = 4
    x = data.make_inputs(op, dtype, n, n * 256, seed=1)
    exp = data.expected_output("reduce_scatter", op, x)
    assert exp.shape == (n, 256)
    full = data.expected_output("all_reduce", op, x)[0]
    for r in range(n):
        assert np.array_equal(exp[r], full[r * 256:(r + 1) * 256])
        assert np.array_equal(_fold(op, [row[r * 256:(r + 1) * 256] for row in x[::-1]]), exp[r])


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_expected(dtype):
    x = data.make_inputs("sum", dtype, 8, 100, seed=2)
    exp = data.expected_output("all_gather", "sum", x)
    assert exp.shape == (1, 800)
    for r in range(8):
        assert np.array_equal(exp[0, r * 100:(r + 1) * 100], x[r])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 8])
def test_ppermute_expected_is_the_ring_shift(dtype, n):
    x = data.make_inputs("sum", dtype, n, 37, seed=4)
    exp = data.expected_output("ppermute", "sum", x)
    assert exp.shape == (n, 37) and exp.dtype == x.dtype
    for src, dst in C.ring_perm(n):  # rank dst holds what rank src sent
        assert np.array_equal(exp[dst], x[src])
    if n > 1:
        assert not np.array_equal(exp, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block", [(1, 5), (2, 3), (8, 1), (8, 17)])
def test_all_to_all_expected(dtype, n, block):
    x = data.make_inputs("sum", dtype, n, n * block, seed=5)
    exp = data.expected_output("all_to_all", "sum", x)
    assert exp.shape == (n, n * block) and exp.dtype == x.dtype
    for r in range(n):
        for j in range(n):  # rank r's block j is rank j's block r
            assert np.array_equal(exp[r, j * block:(j + 1) * block], x[j, r * block:(r + 1) * block])
    if n > 1 and block > 0:
        assert not np.array_equal(exp, x)


def test_all_to_all_needs_whole_blocks():
    with pytest.raises(ValueError, match="all_to_all input of 10 elements"):
        data.expected_output("all_to_all", "sum", np.zeros((4, 10), np.float32))


@pytest.mark.parametrize("dtype,n", [("half", 16), ("half", 64), ("bfloat16", 64), ("bfloat16", 300),
                                     ("float", 64)])
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_exact_for_many_ranks(dtype, n, op):
    x = data.make_inputs(op, dtype, n, 512)
    exp = data.expected_output("all_reduce", op, x)[0]
    assert np.array_equal(_fold(op, list(x)), exp)
    assert np.array_equal(_fold(op, list(x[::-1])), exp)
    assert np.all(np.isfinite(exp.astype(np.float64)))


def test_integer_sums_wrap_like_the_dtype():
    x = np.full((8, 4), 100, np.int8)
    assert np.array_equal(data.expected_output("all_reduce", "sum", x)[0],
                          np.full(4, (800 + 128) % 256 - 128, np.int8))
    y = np.full((9, 2), 2, np.uint8)
    assert np.array_equal(data.expected_output("all_reduce", "prod", y)[0], np.zeros(2, np.uint8))


def test_inputs_deterministic_and_seeded():
    a = data.make_inputs("sum", "float", 8, 1000, seed=5)
    b = data.make_inputs("sum", "float", 8, 1000, seed=5)
    c = data.make_inputs("sum", "float", 8, 1000, seed=6)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert not np.array_equal(a[0], a[1])  # ranks differ


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_ranges_fit_dtype(dtype):
    for op, n in itertools.product(OPS, (2, 8, 64)):
        lo, hi = data.value_range(op, dtype, n)
        info = np.iinfo(C.DTYPES[dtype]) if C.DTYPES[dtype].kind in "iu" else None
        if info is not None:
            assert info.min <= lo <= hi <= info.max
        x = data.make_inputs(op, dtype, n, 64)
        assert float(x.astype(np.float64).min()) >= min(lo, -hi) and float(x.astype(np.float64).max()) <= hi


def test_count_wrong():
    e = np.arange(10, dtype=np.float32)
    a = e.copy()
    assert data.count_wrong(a, e) == 0
    a[3] = -1
    a[7] = np.nan
    assert data.count_wrong(a, e) == 2
    assert data.count_wrong(a[:5], e) == 10  # shape mismatch: everything is wrong
