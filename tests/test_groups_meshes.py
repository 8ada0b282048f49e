"""axis_index_groups (shard_map check_vma=False and pmap), 2-D meshes and axis tuples in either
order, permuted and reversed device meshes: rank order and group membership must equal lax's."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_flexlink as flx
from helpers import (N, assert_tree_close, assert_tree_equal, compare_with_lax, host, make_data,
                     mesh, per_device, run_python)

EVEN_GROUPS = {
    "halves": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "strided": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "pairs_permuted": [[7, 0], [1, 6], [5, 2], [3, 4]],
    "quads_permuted": [[6, 1, 3, 4], [0, 7, 2, 5]],
    "singletons": [[i] for i in range(N)],
}
UNEVEN_GROUPS = {
    "1_2_5": [[0], [1, 2], [3, 4, 5, 6, 7]],
    "3_5_permuted": [[5, 1, 3], [0, 2, 7, 6, 4]],
}


def _group_ops(groups, gather_ok):
    def make_body(m):
        def body(f, i):
            out = {
                "psum_f": m.psum(f, "x", axis_index_groups=groups),
                "psum_i": m.psum(i, "x", axis_index_groups=groups),
                "pmax": m.pmax(i, "x", axis_index_groups=groups),
                "pmin": m.pmin(f, "x", axis_index_groups=groups),
                "pmean": m.pmean(f, "x", axis_index_groups=groups),
            }
            if gather_ok:
                out["ag"] = m.all_gather(i, "x", axis_index_groups=groups)
                out["ag_tiled"] = m.all_gather(f, "x", axis_index_groups=groups, tiled=True, axis=1)
                out["ps"] = m.psum_scatter(f, "x", axis_index_groups=groups, tiled=True)
                out["ps_i"] = m.psum_scatter(i[: len(groups[0])], "x", axis_index_groups=groups)
            return out
        return body
    return make_body


def _split(got, want, ref):
    sums = ("psum_f", "pmean", "ps")
    pick = lambda d, keep: {k: v for k, v in d.items() if (k in sums) == keep}  # noqa: E731
    assert sorted(got) == sorted(want)
    assert_tree_equal(pick(got, False), pick(want, False))
    assert_tree_close(pick(got, True), pick(want, True), pick(ref, True), N)


@pytest.mark.parametrize("name", list(EVEN_GROUPS) + list(UNEVEN_GROUPS))
def test_groups_shard_map(name, mesh1d):
    groups = EVEN_GROUPS.get(name) or UNEVEN_GROUPS[name]
    f = make_data("float32", (N, 8, 3), seed=11)
    i = make_data("int32", (N, 8, 3), seed=12)
    make_body = _group_ops(groups, name in EVEN_GROUPS)
    want_fn = per_device(make_body(jax.lax), mesh1d, check_vma=False)
    got_fn = per_device(make_body(flx), mesh1d, check_vma=False)
    want, got = host(want_fn(f, i)), host(got_fn(f, i))
    ref = host(want_fn(np.abs(f), i))
    _split(got, want, ref)


@pytest.mark.parametrize("name", ["strided", "pairs_permuted"])
def test_groups_shard_map_check_vma(name, mesh1d):
    """Under check_vma=True lax supports groups for everything but psum/pmean."""
    groups = EVEN_GROUPS[name]
    f = make_data("float32", (N, 8, 3), seed=22)
    i = make_data("int32", (N, 8, 3), seed=23)
    compare_with_lax(
        lambda m: lambda x, y: (m.pmax(y, "x", axis_index_groups=groups),
                                m.pmin(x, "x", axis_index_groups=groups),
                                m.all_gather(y, "x", axis_index_groups=groups),
                                m.all_gather(x, "x", axis_index_groups=groups, tiled=True),
                                m.psum_scatter(y, "x", axis_index_groups=groups, tiled=True)),
        mesh1d, (f, i), check_vma=True)


@pytest.mark.parametrize("name", ["strided", "pairs_permuted", "1_2_5", "3_5_permuted"])
def test_groups_pmap(name):
    groups = EVEN_GROUPS.get(name) or UNEVEN_GROUPS[name]
    f = make_data("float32", (N, 8, 3), seed=13)
    i = make_data("int64", (N, 8, 3), seed=14)
    make_body = _group_ops(groups, name in EVEN_GROUPS)
    want_fn = jax.pmap(make_body(jax.lax), axis_name="x")
    got_fn = jax.pmap(make_body(flx), axis_name="x")
    want, got = host(want_fn(f, i)), host(got_fn(f, i))
    ref = host(want_fn(np.abs(f), i))
    _split(got, want, ref)


def test_groups_on_2d_mesh_axis_tuple():
    """Groups index the flattened (a, b) axis, in the order the tuple names the axes."""
    m = mesh((2, 4), ("a", "b"))
    f = make_data("float32", (2, 4, 8), seed=15)
    i = make_data("int32", (2, 4, 8), seed=16)
    for axes in [("a", "b"), ("b", "a")]:
        for groups in [[[0, 1, 2, 3], [4, 5, 6, 7]], [[5, 0], [1, 4], [7, 2], [6, 3]]]:
            compare_with_lax(
                lambda m_: lambda x, y: (m_.psum(y, axes, axis_index_groups=groups),
                                         m_.all_gather(y, axes, axis_index_groups=groups),
                                         m_.pmax(x, axes, axis_index_groups=groups)),
                m, (f, i), check_vma=False)


MESHES = {
    "2x4": ((2, 4), None),
    "4x2": ((4, 2), None),
    "8x1": ((8, 1), None),
    "2x4_permuted": ((2, 4), [3, 6, 0, 5, 7, 1, 4, 2]),
}
AXES = ["a", "b", ("a", "b"), ("b", "a")]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("axes", AXES, ids=lambda a: "+".join(a) if isinstance(a, tuple) else a)
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_2d_mesh(mesh_name, axes, check_vma):
    shape, order = MESHES[mesh_name]
    devs = jax.devices() if order is None else [jax.devices()[k] for k in order]
    m = mesh(shape, ("a", "b"), devs)
    f = make_data("float32", shape + (8, 3), seed=17)
    i = make_data("int32", shape + (8, 3), seed=18)

    def make_int_body(mod):
        return lambda x, y: {
            "psum": mod.psum(y, axes), "pmax": mod.pmax(y, axes), "pmin": mod.pmin(y, axes),
            "ag": mod.all_gather(y, axes), "ag_tiled": mod.all_gather(y, axes, tiled=True, axis=1),
            "ps": mod.psum_scatter(y, axes, tiled=True),
        }

    def make_float_body(mod):
        return lambda x, y: {"psum": mod.psum(x, axes), "pmean": mod.pmean(x, axes),
                             "ps": mod.psum_scatter(x, axes, scatter_dimension=0, tiled=True)}

    compare_with_lax(make_int_body, m, (f, i), check_vma=check_vma)
    compare_with_lax(make_float_body, m, (f, i), check_vma=check_vma, sum_like=True)


def test_reversed_device_mesh(reversed_mesh):
    """Rank = position in the mesh, not the device id (partition 0 runs on device 7)."""
    f = make_data("float32", (N, 16, 3), seed=19)
    i = make_data("int32", (N, 16, 3), seed=20)
    for check_vma in (True, False):
        compare_with_lax(
            lambda m: lambda x, y: (m.all_gather(y, "x"), m.all_gather(x, "x", tiled=True),
                                    m.psum_scatter(y, "x", tiled=True), m.pmax(y, "x"),
                                    m.psum(y, "x")),
            reversed_mesh, (f, i), check_vma=check_vma)
        compare_with_lax(
            lambda m: lambda x, y: (m.psum(x, "x"), m.psum_scatter(x, "x", tiled=True)),
            reversed_mesh, (f, i), check_vma=check_vma, sum_like=True)


def test_reversed_2d_mesh_with_groups():
    m = mesh((4, 2), ("a", "b"), jax.devices()[::-1])
    i = make_data("int32", (4, 2, 8), seed=21)
    groups = [[3, 0], [1, 2]]  # over the 4-long axis "a"
    compare_with_lax(
        lambda mod: lambda y: (mod.all_gather(y, "a", axis_index_groups=groups),
                               mod.psum(y, "a", axis_index_groups=[[0], [1, 2, 3]]),
                               mod.psum_scatter(y, "a", axis_index_groups=groups, tiled=True)),
        m, (i,), check_vma=False)


def test_two_meshes_in_one_program():
    """Identical collectives in shard_maps over different meshes of one program (2x4 and 4x2 with
    the same axis names) must each use their own mesh's groups (no shared cached lowering)."""
    m24 = mesh((2, 4), ("a", "b"))
    m42 = mesh((4, 2), ("a", "b"))
    x = make_data("int32", (8, 8), seed=24)

    def make(mod):
        def body(v):
            return mod.all_gather(v, "a", tiled=True), mod.psum(v, "b")

        def prog(v):
            r24 = jax.shard_map(body, mesh=m24, in_specs=P("a", "b"), out_specs=P("a", "b"))(v)
            r42 = jax.shard_map(body, mesh=m42, in_specs=P("a", "b"), out_specs=P("a", "b"))(v)
            return r24, r42
        return jax.jit(prog)

    assert_tree_equal(host(make(flx)(x)), host(make(jax.lax)(x)))


def test_partial_auto_shard_map():
    """shard_map over a subset of the mesh axes (the others left to the compiler), the shape of
    pipeline and expert parallelism: FlexLink runs its collectives in a nested fully manual region
    (docs/jax_notes.md), explicit API and replacement alike, with lax's results, and the compiled
    program holds FlexLink's custom calls. In a subprocess: the failure mode to guard against is an
    XLA CHECK failure that aborts the process."""
    res = run_python("""
        import numpy as np, jax
        from jax import lax
        import jax_flexlink as flx
        from jax.sharding import Mesh, PartitionSpec as P
        m = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
        x = np.arange(256, dtype=np.int32).reshape(32, 8) * 7919 - 1000
        for axis in ("a", "b"):
            spec = P(axis)
            def make(mod):
                def body(v):
                    s = mod.psum(v, axis)
                    return (s, mod.all_gather(v * 3, axis, tiled=True), mod.pmax(s - v, axis),
                            mod.psum_scatter(v, axis, tiled=True))
                return jax.jit(jax.shard_map(body, mesh=m, in_specs=spec,
                                             out_specs=(P(), spec, P(), spec), axis_names={axis}))
            want = [np.asarray(a) for a in make(lax)(x)]
            with flx.replace_collectives():
                replaced = make(lax)
                got_replaced = [np.asarray(a) for a in replaced(x)]
                text = replaced.lower(x).compile().as_text()
            explicit = make(flx)
            got = [np.asarray(a) for a in explicit(x)]
            for g, r, w in zip(got, got_replaced, want):
                assert g.shape == w.shape and np.array_equal(g, w), axis
                assert r.shape == w.shape and np.array_equal(r, w), axis
            for t in (text, explicit.lower(x).compile().as_text()):
                for target in ("all_reduce", "all_gather", "reduce_scatter"):
                    assert f'custom_call_target="flexlink_{target}"' in t, (axis, target)
        print("OK")
    """)
    assert res.returncode == 0 and "OK" in res.stdout, (
        f"rc={res.returncode}\n{res.stdout[-1000:]}\n{_xla_check(res.stderr)}")


def _xla_check(stderr):
    lines = [l for l in stderr.splitlines() if "Check failed" in l or "Error" in l]
    return "\n".join(lines[:5]) or stderr[-3000:]
