"""ppermute and all_to_all against lax: every dtype, permutations (identity, ring, pairs, partial with
zero-filled ranks), 2-D meshes and axis tuples, every split/concat axis pair tiled and not, groups,
grad and vmap, and replacement mode."""
import itertools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_flexlink as flx
from helpers import (ALL_DTYPES, N, assert_tree_equal, compare_with_lax, host, make_data, mesh,
                     per_device)

P = jax.sharding.PartitionSpec

PERMS = {
    "identity": [(i, i) for i in range(N)],
    "ring_forward": [(i, (i + 1) % N) for i in range(N)],
    "ring_backward": [(i, (i - 1) % N) for i in range(N)],
    "pairs": [(i, i ^ 1) for i in range(N)],
    "partial": [(0, 3), (3, 5), (6, 0)],   # ranks 1, 2, 4, 6, 7 receive nothing: zeros
    "one_pair": [(2, 7)],
    "negative": [(-1, 0), (0, -1)],        # lax takes indices modulo the group size
}


@pytest.mark.parametrize("perm", sorted(PERMS))
def test_ppermute_perms(perm, mesh1d):
    x = make_data("float32", (N, 5, 3), seed=zlib.crc32(perm.encode()))
    compare_with_lax(lambda m: lambda v: m.ppermute(v, "x", PERMS[perm]), mesh1d, (x,))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_ppermute_dtypes(dtype, mesh1d):
    x = make_data(dtype, (N, 7, 3), seed=zlib.crc32(dtype.encode()))
    compare_with_lax(lambda m: lambda v: (m.ppermute(v, "x", PERMS["ring_forward"]),
                                          m.ppermute(v, "x", PERMS["partial"])), mesh1d, (x,))


@pytest.mark.parametrize("shape", [(), (0,), (1,), (1001,), (3, 5, 7), (100003,)], ids=str)
def test_ppermute_shapes(shape, mesh1d):
    x = make_data("int32", (N,) + shape, seed=6)
    compare_with_lax(lambda m: lambda v: m.ppermute(v, "x", PERMS["pairs"]), mesh1d, (x,))


@pytest.mark.parametrize("axes", ["a", "b", ("a", "b"), ("b", "a")], ids=str)
def test_ppermute_2d_mesh(axes):
    """One axis of a 2-D mesh (a permutation in every group along the other axis) and axis tuples
    (ranks numbered over both axes, as lax numbers them)."""
    m24 = mesh((2, 4), ("a", "b"))
    size = {"a": 2, "b": 4}
    n = size[axes] if isinstance(axes, str) else 8
    perm = [(i, (i + 1) % n) for i in range(n)] + ([(0, 0)] if n == 1 else [])
    x = make_data("int64", (2, 4, 6), seed=7)
    make = lambda m: lambda v: m.ppermute(v, axes, perm)  # noqa: E731
    try:
        jax.block_until_ready(per_device(make(lax), m24)(x))
    except RuntimeError as e:  # jax 0.11 refuses axis names out of the mesh's order
        with pytest.raises(RuntimeError, match=re.escape(str(e).splitlines()[0][:60])):
            jax.block_until_ready(per_device(make(flx), m24)(x))
        return
    compare_with_lax(make, m24, (x,))


def test_ppermute_rejects_duplicates_like_lax(mesh1d):
    for mod in (lax, flx):
        f = jax.jit(jax.shard_map(lambda v: mod.ppermute(v, "x", [(0, 1), (2, 1)]), mesh=mesh1d,
                                  in_specs=P("x"), out_specs=P("x")))
        with pytest.raises(ValueError, match="sources and destinations must be unique"):
            f(np.zeros(N, np.float32))


A2A = [(rank, split, concat, tiled) for rank in (1, 2, 3)
       for split, concat in itertools.product(range(rank), range(rank)) for tiled in (True, False)]


@pytest.mark.parametrize("rank,split,concat,tiled", A2A, ids=[f"r{r}-s{s}-c{c}-{'t' if t else 'u'}"
                                                             for r, s, c, t in A2A])
def test_all_to_all_axes(rank, split, concat, tiled, mesh1d):
    dims = [3, 5, 2][:rank]
    dims[split] = 2 * N if tiled else N  # tiled: divisible by the group; untiled: the group size
    x = make_data("float32", (N, *dims), seed=zlib.crc32(f"{rank}{split}{concat}{tiled}".encode()))
    compare_with_lax(lambda m: lambda v: m.all_to_all(v, "x", split, concat, tiled=tiled),
                     mesh1d, (x,))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_all_to_all_dtypes(dtype, mesh1d):
    x = make_data(dtype, (N, N * 3, 5), seed=zlib.crc32(dtype.encode()))
    compare_with_lax(lambda m: lambda v: (m.all_to_all(v, "x", 0, 0, tiled=True),
                                          m.all_to_all(v, "x", 0, 1, tiled=True)), mesh1d, (x,))


def test_all_to_all_groups_and_2d(mesh1d):
    x = make_data("int32", (N, 4, 6), seed=8)
    compare_with_lax(lambda m: lambda v: m.all_to_all(v, "x", 0, 1, tiled=True,
                                                      axis_index_groups=[[0, 2, 4, 6], [1, 3, 5, 7]]),
                     mesh1d, (x,), check_vma=False)
    m24 = mesh((2, 4), ("a", "b"))
    y = make_data("float64", (2, 4, 8, 4), seed=9)
    compare_with_lax(lambda m: lambda v: (m.all_to_all(v, "b", 0, 1, tiled=True),
                                          m.all_to_all(v, ("a", "b"), 0, 0, tiled=True),
                                          m.all_to_all(v, "a", 1, 0, tiled=True)), m24, (y,))


def _grad_of(mod, kind):
    mesh1 = jax.sharding.Mesh(np.array(jax.devices()), ("x",))

    def body(v):
        if kind == "ppermute":
            y = mod.ppermute(jnp.sin(v), "x", PERMS["partial"])
        else:
            y = mod.all_to_all(jnp.sin(v).reshape(N, -1), "x", 0, 1, tiled=True)
        return jnp.sum(y * y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))

    f = jax.shard_map(lambda v: mod.psum(body(v), "x"), mesh=mesh1, in_specs=P("x"), out_specs=P())
    return jax.jit(jax.grad(f))


@pytest.mark.parametrize("kind", ["ppermute", "all_to_all"])
def test_grad(kind):
    x = make_data("float64", (N * N * 2,), seed=10)
    want = host(_grad_of(lax, kind)(x))
    got_fn = _grad_of(flx, kind)
    np.testing.assert_allclose(host(got_fn(x)), want, rtol=1e-12, atol=1e-12)
    text = got_fn.lower(x).compile().as_text()
    assert f'custom_call_target="flexlink_{kind}"' in text  # the transpose runs on FlexLink too


@pytest.mark.parametrize("kind", ["ppermute", "all_to_all"])
def test_vmap(kind, mesh1d):
    """vmap inside the body (batched operands) and a vmapped axis among the collective's axes."""
    x = make_data("int32", (N, 3, N, 2), seed=11)
    if kind == "ppermute":
        make = lambda m: lambda v: (
            jax.vmap(lambda u: m.ppermute(u, "x", PERMS["ring_forward"]))(v),
            jax.vmap(lambda u: (m.ppermute(u, "x", PERMS["pairs"]),
                                m.ppermute(u, "v", [(0, 1), (1, 2), (2, 0)])), axis_name="v")(v))
    else:
        make = lambda m: lambda v: jax.vmap(lambda u: m.all_to_all(u, "x", 0, 1, tiled=True))(v)
    compare_with_lax(make, mesh1d, (x,), check_vma=False)


def test_replacement_routes_both(mesh1d):
    def make():
        return jax.jit(jax.shard_map(
            lambda v: (lax.ppermute(v, "x", PERMS["ring_forward"]),
                       lax.all_to_all(v, "x", 0, 0, tiled=True)),
            mesh=mesh1d, in_specs=P("x"), out_specs=P("x")))
    x = make_data("float32", (N * N * 4,), seed=12)
    want = host(make()(x))
    with flx.replace_collectives():
        f = make()
        got = host(f(x))
        report = flx.collectives(f, x)
    assert_tree_equal(got, want)
    assert sorted((c.kind, c.runner) for c in report) == [("all_to_all", "flexlink"),
                                                         ("ppermute", "flexlink")]


def test_pytree_of_13_mixed_leaves_is_one_call(mesh1d):
    """A psum of a 13-leaf pytree with float32, bfloat16, int32 and bool leaves of different shapes
    gives lax's result and compiles to one FlexLink custom call (with 13 operands)."""
    rng = np.random.default_rng(13)
    leaves = []
    for i in range(13):
        dtype = ["float32", "bfloat16", "int32", "bool"][i % 4]
        leaves.append(make_data(dtype, (N, 1 + i, 3 if i % 2 else 1), seed=100 + i))
    tree = {"w": leaves[:6], "b": tuple(leaves[6:12]), "step": leaves[12]}
    got, want = compare_with_lax(lambda m: lambda t: m.psum(t, "x"), mesh1d, (tree,),
                                 sum_like=True)
    f = jax.jit(jax.shard_map(lambda t: flx.psum(t, "x"), mesh=mesh1d, in_specs=P("x"),
                              out_specs=P()))
    local = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), tree)
    text = f.lower(local).compile().as_text()
    calls = re.findall(r"custom_call_target=\"flexlink_all_reduce\"", text)
    assert len(calls) == 1, f"{len(calls)} FlexLink calls for one pytree psum"
    report = flx.collectives(f, local)
    assert [c.operands for c in report] == [13]
    assert set(report[0].dtypes) == {"float32", "bfloat16", "int32"}  # lax's psum makes bool int32


# ---- in place: a donated operand (or an intermediate) is the result's buffer -------------------

def _entry(text):
    """The compiled module's entry computation (its instructions, one per line)."""
    return text[text.index("\nENTRY "):].split("\n}\n")[0].splitlines()


def _in_place_program(mod, body, mesh_, donate):
    return jax.jit(jax.shard_map(body(mod), mesh=mesh_, in_specs=P("x"), out_specs=P("x")),
                   donate_argnums=0 if donate else ())


IN_PLACE_CASES = {
    **{f"ppermute-{p}": (lambda m, p=p: lambda v: m.ppermute(v, "x", PERMS[p]), (N * 3001,), "int32")
       for p in ("identity", "ring_forward", "ring_backward", "pairs", "partial")},
    "ppermute-2d-bf16": (lambda m: lambda v: m.ppermute(v, "x", PERMS["ring_forward"]), (N * 7, 129), "bfloat16"),
    **{f"all_to_all-axis{a}": (lambda m, a=a: lambda v: m.all_to_all(v, "x", a, a, tiled=True),
                               (N * 8, 2 * N, N), "float32") for a in (0, 1, 2)},
    "all_to_all-big": (lambda m: lambda v: m.all_to_all(v, "x", 0, 0, tiled=True), (N * N * 40001,), "uint8"),
}


@pytest.mark.parametrize("case", sorted(IN_PLACE_CASES))
def test_donated_operand_is_the_result(case, mesh1d):
    """Donated (the bench's in-place rows, a training step's buffers): the custom call's result
    aliases its operand, and the compiled program copies nothing — no `copy` of the result into
    the donated buffer after the call, as XLA adds when the result is a fresh buffer. The result is
    lax's, bitwise."""
    make, shape, dtype = IN_PLACE_CASES[case]
    x = make_data(dtype, shape, seed=zlib.crc32(case.encode()))
    sharding = jax.sharding.NamedSharding(mesh1d, P("x"))
    want = host(_in_place_program(lax, make, mesh1d, donate=False)(jax.device_put(x, sharding)))
    f = _in_place_program(flx, make, mesh1d, donate=True)
    text = f.lower(jax.device_put(x, sharding)).compile().as_text()
    entry = _entry(text)
    call, = [line for line in entry if "custom_call_target=\"flexlink_" in line]
    assert "output_to_operand_aliasing={{0}: (0, {})}" in call, call
    assert not [line for line in entry if " copy(" in line or "copy_fusion" in line], "\n".join(entry)
    donated = jax.device_put(x, sharding)
    got = host(f(donated))
    assert donated.is_deleted()
    assert_tree_equal(got, want, case)


def _operand_aliasing(line):
    """A custom call's operands (but the token) and whether its result i aliases operand i."""
    operands = re.search(r"custom-call\(([^)]*)\)", line).group(1).split(", ")[:-1]
    aliased = {int(i) for i in re.findall(r"\{(\d+)\}: \(\1, \{\}\)", line)}
    return [(name, i in aliased) for i, name in enumerate(operands)]


@pytest.mark.parametrize("kind", ["ppermute", "all_to_all"])
def test_in_place_rule_is_all_reduce_s(kind, mesh1d):
    """Aliased under all_reduce's rule: an intermediate operand too, a parameter that is not donated
    not (XLA would copy it first); a transposed all_to_all operand is a fresh intermediate."""
    if kind == "ppermute":
        body = lambda m: lambda v: (m.ppermute(v, "x", PERMS["ring_forward"]),
                                    m.ppermute(v * 2, "x", PERMS["pairs"]))
    else:
        body = lambda m: lambda v: (m.all_to_all(v, "x", 0, 0, tiled=True),
                                    m.all_to_all(v * 2, "x", 0, 0, tiled=True),
                                    m.all_to_all(v, "x", 0, 1, tiled=True))
    x = make_data("float32", (N * N * 4, N), seed=14)
    want = host(_in_place_program(lax, body, mesh1d, donate=False)(x))
    f = _in_place_program(flx, body, mesh1d, donate=False)
    assert_tree_equal(host(f(x)), want, kind)
    text = f.lower(x).compile().as_text()
    operands = [o for line in _entry(text) if f"custom_call_target=\"flexlink_{kind}\"" in line
                for o in _operand_aliasing(line)]
    assert len(operands) == (2 if kind == "ppermute" else 3), operands
    assert all(aliased == (name != "%param.1") for name, aliased in operands), operands


EXCHANGES = {
    "ppermute": (lambda m: lambda v: m.ppermute(v, "x", PERMS["ring_backward"]), (N * 20011,)),
    "all_to_all": (lambda m: lambda v: m.all_to_all(v, "x", 0, 0, tiled=True), (N * N * 2503,)),
}


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("kind", sorted(EXCHANGES))
def test_every_dtype_in_place_and_out_of_place(kind, dtype, mesh1d):
    """Every dtype, donated (in place: the call aliases its operand) and not: bitwise lax's result.
    Per-device sizes above the shm link's staging size, so the in-place path runs its chunks."""
    make, shape = EXCHANGES[kind]
    x = make_data(dtype, shape, seed=zlib.crc32((kind + dtype).encode()))
    sharding = jax.sharding.NamedSharding(mesh1d, P("x"))
    want = np.asarray(host(_in_place_program(lax, make, mesh1d, donate=False)(jax.device_put(x, sharding))))
    for donate in (True, False):
        f = _in_place_program(flx, make, mesh1d, donate=donate)
        call, = [line for line in _entry(f.lower(jax.device_put(x, sharding)).compile().as_text())
                 if "custom_call_target=\"flexlink_" in line]
        assert ("output_to_operand_aliasing" in call) == donate, call
        got = np.asarray(host(f(jax.device_put(x, sharding))))
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{kind} {dtype} donate={donate}"


@pytest.mark.parametrize("links", ["tcp", "shm;tcp"])
def test_donated_over_tcp_and_split(links, mesh1d):
    """In place over tcp alone and split 60/40 over shm and tcp (each link's range runs its own
    in-place scheme): lax's result, bitwise, the result aliasing the donated operand."""
    from jax_flexlink import _flexlink
    saved = _flexlink.autotune_min_bytes()
    flx.configure(links=links, autotune_min_bytes=0)
    _flexlink.set_record_splits(True)
    _flexlink.take_split_records()
    try:
        for kind, (make, shape) in sorted(EXCHANGES.items()):
            x = make_data("int32", shape, seed=zlib.crc32((kind + links).encode()))
            if ";" in links:
                nbytes = x.nbytes // N  # nccl-tests bytes of both: the per-rank buffer
                _flexlink.set_shares(kind, 1 << (nbytes.bit_length() - 1), [0.6, 0.4], pinned=True)
            before = _flexlink.stats()["links"].get("tcp", {}).get("calls", 0)
            sharding = jax.sharding.NamedSharding(mesh1d, P("x"))
            want = np.asarray(host(_in_place_program(lax, make, mesh1d, donate=False)(jax.device_put(x, sharding))))
            f = _in_place_program(flx, make, mesh1d, donate=True)
            got = np.asarray(host(f(jax.device_put(x, sharding))))
            assert got.tobytes() == want.tobytes(), f"{kind} over {links}"
            assert _flexlink.stats()["links"]["tcp"]["calls"] > before, "tcp carried part of the call"
            if ";" in links:
                records = _flexlink.take_split_records()
                assert len(records) == N and all(
                    [e > b for b, e in r["ranges"]] == [True, True] for r in records), records
    finally:
        _flexlink.set_record_splits(False)
        flx.configure(links="shm", autotune_min_bytes=saved)
