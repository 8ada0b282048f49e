"""Every collective x every dtype lax accepts, and shapes (0-d, zero-size, odd, 64 MiB), vs lax."""
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flexlink as flx
from helpers import (ALL_DTYPES, COMPLEX_DTYPES, N, abs64, assert_leaf_close, assert_leaf_equal,
                     compare_with_lax, host, make_data, mesh, per_device)

# name -> (make_body(m), local shape of each device's input, is a sum)
OPS = {
    "psum": (lambda m: lambda v: m.psum(v, "x"), (5, 3), True),
    "pmean": (lambda m: lambda v: m.pmean(v, "x"), (5, 3), True),
    "pmax": (lambda m: lambda v: m.pmax(v, "x"), (5, 3), False),
    "pmin": (lambda m: lambda v: m.pmin(v, "x"), (5, 3), False),
    "all_gather": (lambda m: lambda v: m.all_gather(v, "x"), (5, 3), False),
    "all_gather_tiled_axis1": (lambda m: lambda v: m.all_gather(v, "x", axis=1, tiled=True),
                               (5, 3), False),
    "psum_scatter_tiled": (lambda m: lambda v: m.psum_scatter(v, "x", tiled=True), (24, 3), True),
    "psum_scatter_dim1": (lambda m: lambda v: m.psum_scatter(v, "x", scatter_dimension=1),
                          (3, 8), True),
}


def _lax_accepts(op, dtype):
    # lax itself rejects these (tested in test_errors.py): psum_scatter of bool (TypeError) and
    # max/min of complex (XLA: unsupported reduction computation).
    if op.startswith("psum_scatter") and dtype == "bool":
        return False
    if op in ("pmax", "pmin") and dtype in COMPLEX_DTYPES:
        return False
    return True


CASES = [(op, dt) for op in OPS for dt in ALL_DTYPES if _lax_accepts(op, dt)]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("op,dtype", CASES, ids=[f"{o}-{d}" for o, d in CASES])
def test_op_dtype(op, dtype, check_vma, mesh1d):
    make_body, shape, sum_like = OPS[op]
    x = make_data(dtype, (N,) + shape, seed=zlib.crc32(f"{op}-{dtype}".encode()))
    compare_with_lax(make_body, mesh1d, (x,), check_vma=check_vma, sum_like=sum_like)


# Shapes: 0-d, zero-size, sizes not divisible by 8 or by a cache block, more than one block.
REDUCE_SHAPES = [(), (0,), (2, 0, 3), (1,), (7,), (3, 5, 7), (1001,), (100003,)]
SCATTER_SHAPES = [(8,), (8, 0), (24, 0, 2), (56,), (104, 3, 5), (8 * 12501,)]


@pytest.mark.parametrize("shape", REDUCE_SHAPES, ids=str)
def test_shapes_reduce_and_gather(shape, mesh1d):
    """psum (float32), pmax (int32), pmin (float64), all_gather untiled/tiled on each shape, in one
    program per shape."""
    xf = make_data("float32", (N,) + shape, seed=1)
    xi = make_data("int32", (N,) + shape, seed=2)
    xd = make_data("float64", (N,) + shape, seed=3)

    def make_body(m):
        def body(f, i, d):
            out = {"psum": m.psum(f, "x"), "pmax": m.pmax(i, "x"), "pmin": m.pmin(d, "x"),
                   "ag": m.all_gather(i, "x")}
            if len(shape) and shape[-1]:  # lax rejects tiled gathers along a zero-size dim
                out["ag_tiled"] = m.all_gather(f, "x", tiled=True, axis=len(shape) - 1)
            return out
        return body

    got, want = _compare_mixed(make_body, (xf, xi, xd), sum_keys=("psum",))
    assert got["ag"].shape == (N, N) + shape


@pytest.mark.parametrize("shape", SCATTER_SHAPES, ids=str)
def test_shapes_scatter(shape, mesh1d):
    x = make_data("float32", (N,) + shape, seed=4)
    xi = make_data("int64", (N,) + shape, seed=5)

    def make_body(m):
        def body(f, i):
            out = {"tiled": m.psum_scatter(f, "x", tiled=True),
                   "tiled_int": m.psum_scatter(i, "x", tiled=True)}
            if shape[0] == N:
                out["untiled"] = m.psum_scatter(f, "x")
            return out
        return body

    _compare_mixed(make_body, (x, xi), sum_keys=("tiled", "untiled"))


def _compare_mixed(make_body, args, sum_keys):
    """compare_with_lax for a dict of results where only ``sum_keys`` are float sums."""
    m1 = mesh((N,), ("x",))
    want_fn = per_device(make_body(jax.lax), m1)
    got_fn = per_device(make_body(flx), m1)
    want = host(want_fn(*args))
    got = host(got_fn(*args))
    got2 = host(got_fn(*args))
    assert sorted(got) == sorted(want)
    ref = host(want_fn(*[abs64(a) for a in args]))
    for k in want:
        assert got[k].tobytes() == got2[k].tobytes(), f"{k}: not bitwise identical run-to-run"
        if k in sum_keys:
            assert_leaf_close(got[k], want[k], ref[k], N, k)
        else:
            assert_leaf_equal(got[k], want[k], k)
    return got, want


@pytest.mark.large
def test_psum_64mib_per_device(mesh1d):
    """One 64 MiB-per-device AllReduce (int32, so bitwise) and a float32 sum of the same size."""
    elems = 64 * 2**20 // 4
    xi = np.arange(N * elems, dtype=np.uint32)
    xi *= np.uint32(2654435761)  # wraps: a scrambled, full-range int32 pattern
    xi = xi.view(np.int32).reshape(N, elems)
    xi = jax.device_put(xi, jax.sharding.NamedSharding(mesh1d, jax.P("x")))
    body = lambda m: lambda v: m.psum(v, "x")  # noqa: E731
    want = per_device(body(jax.lax), mesh1d)(xi)
    got = per_device(body(flx), mesh1d)(xi)
    assert got.shape == want.shape == (N, elems) and got.dtype == want.dtype
    assert _count_differences(got, want) == 0


@pytest.mark.large
def test_all_gather_64mib_per_device(mesh1d):
    elems = 8 * 2**20 // 4  # 8 MiB in, 64 MiB out per device
    x = np.arange(N * elems, dtype=np.float32).reshape(N, elems)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh1d, jax.P("x")))
    body = lambda m: lambda v: m.all_gather(v, "x", tiled=True)  # noqa: E731
    want = per_device(body(jax.lax), mesh1d)(x)
    got = per_device(body(flx), mesh1d)(x)
    assert got.shape == want.shape == (N, N * elems) and got.dtype == want.dtype
    assert _count_differences(got, want) == 0


def _count_differences(a, b):
    """Compared on the devices: fetching 512 MiB to the host costs seconds."""
    return int(jax.jit(lambda u, v: jnp.sum(u != v))(a, b))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_float_sum_in_fixed_rank_order(dtype, mesh1d, reversed_mesh):
    """The documented invariant: floats are reduced in rank order 0..n-1 (float16/bfloat16 in
    float32, rounded once), so the result is exactly the sequential sum; the rank is the position in
    the mesh (device order reversed on the second mesh)."""
    x = make_data(dtype, (N, 4099), seed=7)
    acc = np.zeros(4099, np.float32 if dtype != "float64" else np.float64)
    for r in range(N):
        acc = acc + x[r].astype(acc.dtype)
    expected = acc.astype(x.dtype)
    for m in (mesh1d, reversed_mesh):
        got = np.asarray(per_device(lambda v: flx.psum(v, "x"), m)(x))
        for d in range(N):
            assert got[d].tobytes() == expected.tobytes(), f"device slot {d} on {m.devices}"


def test_python_scalars(mesh1d):
    """Python scalars (constant-folded by lax for psum/pmean): lax's values, dtypes, weak types."""
    x = make_data("float32", (N, 3), seed=8)

    def make_body(m):
        return lambda v: (m.psum(1.0, "x"), m.psum(3, "x"), m.pmean(2.0, "x"), m.pmax(5, "x"),
                          m.pmin(-1.5, "x"), m.psum((v, 2), "x"))

    for check_vma in (True, False):
        want_fn = jax.shard_map(make_body(jax.lax), mesh=mesh1d, in_specs=jax.P("x"),
                                out_specs=jax.P(), check_vma=check_vma)
        got_fn = jax.shard_map(make_body(flx), mesh=mesh1d, in_specs=jax.P("x"),
                               out_specs=jax.P(), check_vma=check_vma)
        want = jax.jit(want_fn)(x)
        got = jax.jit(got_fn)(x)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert g.weak_type == w.weak_type, f"weak_type {g.weak_type} != lax's {w.weak_type}"
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


def test_integer_wraparound(mesh1d):
    """Integer sums wrap exactly like lax (values chosen to overflow every integer type)."""
    for dt in ["int8", "uint8", "int64", "uint64"]:
        info = np.iinfo(dt)
        x = np.full((N, 4), info.max, dtype=dt)
        x[:, 1] = info.min
        compare_with_lax(lambda m: lambda v: (m.psum(v, "x"), m.pmean(v, "x")), mesh1d, (x,))
