"""The benchmark's SendRecv (ppermute, ring shift +1) and AlltoAll: the bodies it times and the exact
outputs it checks them against, run through jax.lax on the suite's 8 host devices.

data.expected_output is built on the host from the convention alone; here lax's collectives, run as the
benchmark runs them (backend's bodies inside jax.jit(jax.shard_map(...)) over the mesh axis "x"), must
produce exactly that, rank by rank, for sizes that are and are not multiples of the block size.
"""
import types

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_flexlink.bench import backend, collectives as C, data

N = 8
DTYPES = ["float", "bfloat16", "half", "double", "int8", "uint8", "int32", "uint64"]
SIZES = [4096, 4100, 1000, 24, 12345]  # bytes requested per rank; most are not multiples of n x itemsize


@pytest.fixture(scope="module")
def mesh():
    return backend.make_mesh(N)


def _run(body, x_host, mesh, donate=False):
    """Runs body on every rank's row of x_host (nranks, elems); returns each rank's output, by rank."""
    sharding = NamedSharding(mesh, P(backend.AXIS))
    x = jax.device_put(x_host.reshape(-1), sharding)
    assert x.dtype == x_host.dtype
    out = backend.compile_collective(body, mesh, donate)(x)
    rank_of = {d: i for i, d in enumerate(mesh.devices.flat)}
    by_rank = [None] * N
    for shard in out.addressable_shards:
        by_rank[rank_of[shard.device]] = np.asarray(shard.data)
    return by_rank


def _inputs(kind, dtype, size):
    coll = C.COLLECTIVES[kind]
    count, in_elems, out_elems = coll.counts(size, C.DTYPES[dtype].itemsize, N)
    x = data.make_inputs("sum", dtype, N, in_elems, seed=7)
    return count, out_elems, x


def _wrong(outs, expected):
    return [data.count_wrong(o, expected[r]) for r, o in enumerate(outs)]


@pytest.mark.parametrize("kind", ["ppermute", "all_to_all"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_lax_matches_expected(mesh, kind, dtype, size):
    count, out_elems, x = _inputs(kind, dtype, size)
    if count == 0:  # the runner skips these sizes; the convention says why
        assert C.COLLECTIVES[kind].actual_bytes(0, C.DTYPES[dtype].itemsize, N) == 0
        return
    expected = data.expected_output(kind, "sum", x)
    assert expected.shape == (N, out_elems)
    body, desc = backend.native_body(kind, "sum", N)
    outs = _run(body, x, mesh)
    assert [o.shape for o in outs] == [(out_elems,)] * N and outs[0].dtype == x.dtype
    assert _wrong(outs, expected) == [0] * N, desc


@pytest.mark.parametrize("kind", ["ppermute", "all_to_all"])
def test_selftest_side_matches_expected(mesh, kind):
    """The self-test's "FlexLink" side (--_impl lax) runs the same lax collective."""
    _, _, x = _inputs(kind, "float", 4100)
    selftest = backend.load_flexlink("lax").body(kind, "sum", N)
    assert _wrong(_run(selftest, x, mesh), data.expected_output(kind, "sum", x)) == [0] * N


@pytest.mark.parametrize("kind", ["ppermute", "all_to_all"])
def test_in_place_matches_expected(mesh, kind):
    _, _, x = _inputs(kind, "float", 4096)
    body, _ = backend.native_body(kind, "sum", N)
    assert _wrong(_run(body, x, mesh, donate=True), data.expected_output(kind, "sum", x)) == [0] * N


def test_the_check_sees_a_wrong_shift(mesh):
    """A ring shift by -1 instead of +1, or no shift, is wrong on every rank (the check can fail)."""
    _, _, x = _inputs("ppermute", "float", 4096)
    expected = data.expected_output("ppermute", "sum", x)
    back = [(i, (i - 1) % N) for i in range(N)]
    for body in (lambda v: lax.ppermute(v, backend.AXIS, back), lambda v: v):
        wrong = _wrong(_run(body, x, mesh), expected)
        assert all(w > 0.9 * x.shape[1] for w in wrong), wrong


def test_the_check_sees_a_wrong_exchange(mesh):
    """Not exchanging, or exchanging untiled blocks in another layout, is caught per rank."""
    _, _, x = _inputs("all_to_all", "int32", 4096)
    expected = data.expected_output("all_to_all", "sum", x)
    block = x.shape[1] // N

    def transposed(v):  # rank r gets every rank's block r, but laid out element-major
        y = lax.all_to_all(v.reshape(N, block), backend.AXIS, 0, 0, tiled=False)
        return y.reshape(N, block).T.reshape(-1)
    for body in (lambda v: v, transposed):
        wrong = _wrong(_run(body, x, mesh), expected)
        assert all(w > 0 for w in wrong), wrong
    # The right answer with blocks (n, block) instead of the flat buffer is the same thing.
    blocks = lambda v: lax.all_to_all(v.reshape(N, -1), backend.AXIS, 0, 0, tiled=True).reshape(-1)  # noqa: E731
    assert _wrong(_run(blocks, x, mesh), expected) == [0] * N


def test_flexlink_side_calls_the_api_as_lax_is_called():
    """FlexLink's bodies call jax_flexlink.ppermute / all_to_all with the baseline's arguments."""
    calls = []
    api = types.SimpleNamespace(
        ppermute=lambda x, axis_name, perm: calls.append(("ppermute", axis_name, perm)) or x,
        all_to_all=lambda x, axis_name, split_axis, concat_axis, **kw: calls.append(
            ("all_to_all", axis_name, split_axis, concat_axis, kw)) or x)
    flex = backend.FlexLink(api, "recording")
    flex.body("ppermute", "sum", 4)("x")
    flex.body("all_to_all", "sum", 4)("x")
    assert calls == [("ppermute", "x", [(0, 1), (1, 2), (2, 3), (3, 0)]),
                     ("all_to_all", "x", 0, 0, {"tiled": True})]


@pytest.mark.parametrize("kind", ["ppermute", "all_to_all"])
def test_an_api_without_them_is_unsupported(kind):
    flex = backend.FlexLink(types.SimpleNamespace(psum=lax.psum), "old")
    with pytest.raises(backend.Unsupported, match=f"old has no {kind}"):
        flex.body(kind, "sum", 8)
