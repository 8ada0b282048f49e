"""Pytrees, grad (also through jax.checkpoint), vmap (also of a named axis), scan, cond, pmap,
donation, many independent collectives in one body, and lowering once."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_flexlink as flx
from helpers import (N, abs64, assert_tree_close, assert_tree_equal, compare_with_lax, grad_case,
                     host, make_data, per_device, run_python)

P = jax.sharding.PartitionSpec


def test_pytrees(mesh1d):
    f = make_data("float32", (N, 16, 2), seed=30)
    i = make_data("int16", (N, 16), seed=31)
    b = make_data("bool", (N, 8), seed=32)
    c = make_data("complex64", (N, 8), seed=33)
    args = ({"f": f, "pair": (i, b)}, [c, f])
    for check_vma in (True, False):
        compare_with_lax(
            lambda m: lambda d, l: {
                "psum": m.psum(d, "x"),                 # dict with a tuple, bool inside
                "pmax": m.pmax({"i": d["pair"][0], "b": d["pair"][1]}, "x"),
                "pmin": m.pmin([d["f"], d["pair"][0]], "x"),
                "ag": m.all_gather(l, "x"),
                "ag_tiled": m.all_gather(d, "x", tiled=True),
                "ps": m.psum_scatter((d["pair"][0], l[0]), "x", tiled=True),
            },
            mesh1d, args, check_vma=check_vma, sum_like=False)
        compare_with_lax(
            lambda m: lambda d, l: (m.psum(l, "x"), m.pmean(d["f"], "x"),
                                    m.psum_scatter(l, "x", tiled=True)),
            mesh1d, args, check_vma=check_vma, sum_like=True)


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_grad(check_vma, remat):
    x = make_data("float64", (N * 4,), seed=34)
    w = make_data("float64", (N * 4,), seed=35)
    want = host(grad_case(lax, check_vma, remat)(x, w))
    got = host(grad_case(flx, check_vma, remat)(x, w))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w_, rtol=1e-9, atol=1e-9)


def test_grad_of_checkpointed_collectives_jaxpr_is_effect_free(mesh1d):
    """grad(jax.checkpoint(f)) must trace (an FFI side effect would break partial eval of remat)."""
    x = make_data("float32", (N * 2,), seed=36)
    f = jax.shard_map(jax.checkpoint(lambda v: jnp.sum(flx.psum(v * v, "x")) * v), mesh=mesh1d,
                      in_specs=P("x"), out_specs=P("x"))
    g = jax.grad(lambda v: jnp.sum(f(v)))
    ref = jax.grad(lambda v: jnp.sum(jax.shard_map(
        jax.checkpoint(lambda u: jnp.sum(lax.psum(u * u, "x")) * u), mesh=mesh1d,
        in_specs=P("x"), out_specs=P("x"))(v)))
    np.testing.assert_allclose(np.asarray(jax.jit(g)(x)), np.asarray(jax.jit(ref)(x)), rtol=1e-5)


def test_vmap_outside_shard_map(mesh1d):
    """vmap of a shard_map'ed function: the batch dimension rides along each collective."""
    x = make_data("float32", (5, N * 8), seed=37)
    i = make_data("int32", (5, N * 8), seed=38)
    for check_vma in (True, False):
        def make(m):
            sm = jax.shard_map(
                lambda a, b: (m.psum(a, "x"), m.all_gather(b, "x", tiled=True),
                              m.psum_scatter(b, "x", tiled=True), m.pmax(b, "x")),
                mesh=mesh1d, in_specs=(P("x"), P("x")), out_specs=P("x"),
                check_vma=check_vma)
            return jax.jit(jax.vmap(sm, in_axes=(0, 0)))
        want, got = host(make(lax)(x, i)), host(make(flx)(x, i))
        assert_tree_equal(got[1:], want[1:])
        ref = host(make(lax)(abs64(x), i))
        assert_tree_close(got[:1], want[:1], ref[:1], N)


def test_vmap_inside_body_unnamed(mesh1d):
    x = make_data("float32", (N, 3, 8), seed=39)
    compare_with_lax(
        lambda m: lambda v: jax.vmap(lambda u: (m.psum(u, "x"), m.all_gather(u, "x"),
                                                m.psum_scatter(u, "x", tiled=True)), in_axes=0,
                                     out_axes=1)(v),
        mesh1d, (x,), sum_like=True)


def test_vmap_named_axis_inside_shard_map(mesh1d):
    """A vmapped axis among the collective's axes is reduced/gathered locally (lax's batching
    rule)."""
    x = make_data("int32", (N, 4, 6), seed=40)
    compare_with_lax(
        lambda m: lambda v: jax.vmap(
            lambda u: (m.psum(u, ("x", "v")), m.psum(u, ("v", "x")), m.pmax(u, "v"),
                       m.all_gather(u, "v"), m.pmin(u, "x"), m.all_gather(u, "x", tiled=True)),
            axis_name="v")(v),
        mesh1d, (x,), check_vma=False)


def test_vmap_named_axis_alone():
    """Collectives over a vmap axis name with no mesh at all."""
    x = make_data("float32", (4, 6, 8), seed=41)
    i = make_data("int32", (4, 6, 8), seed=42)

    def make(m):
        return jax.jit(jax.vmap(lambda a, b: (m.psum(b, "v"), m.pmax(a, "v"), m.all_gather(b, "v"),
                                              m.psum_scatter(b, "v", scatter_dimension=1,
                                                             tiled=True)),
                                axis_name="v"))
    assert_tree_equal(host(make(flx)(x, i)), host(make(lax)(x, i)))


def test_scan_and_cond(mesh1d):
    x = make_data("float32", (N, 16), seed=43)
    i = make_data("int32", (N, 16), seed=44)

    def make_body(m):
        def body(a, b):
            def step(carry, k):
                s = m.psum(carry * 0.5 + k, "x")
                g = m.all_gather(carry[:2], "x", tiled=True)
                return s / N + jnp.sum(g), m.pmax(b + k, "x")
            carry, ys = lax.scan(step, a, jnp.arange(3, dtype=a.dtype))
            pred = m.psum(jnp.sum(b % 2), "x") > 4 * N
            c = lax.cond(pred, lambda z: m.pmax(z, "x"), lambda z: m.pmin(z, "x"), b)
            c2 = lax.cond(jnp.logical_not(pred), lambda z: m.psum(z, "x"),
                          lambda z: m.psum(m.psum_scatter(jnp.tile(z, N), "x", tiled=True), "x"),
                          b)
            return carry, ys, c, c2
        return body

    for check_vma in (True, False):
        want_fn = per_device(make_body(lax), mesh1d, check_vma=check_vma)
        got_fn = per_device(make_body(flx), mesh1d, check_vma=check_vma)
        want, got = host(want_fn(x, i)), host(got_fn(x, i))
        assert_tree_equal(got[1:], want[1:])
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)


PMAP_OPS = {
    "psum": (lambda m: lambda v: m.psum(v, "i"), True),
    "pmean": (lambda m: lambda v: m.pmean(v, "i"), True),
    "pmax": (lambda m: lambda v: m.pmax(v, "i"), False),
    "pmin": (lambda m: lambda v: m.pmin(v, "i"), False),
    "all_gather": (lambda m: lambda v: m.all_gather(v, "i"), False),
    "all_gather_tiled": (lambda m: lambda v: m.all_gather(v, "i", tiled=True, axis=1), False),
    "psum_scatter": (lambda m: lambda v: m.psum_scatter(v, "i", tiled=True), True),
    "pytree": (lambda m: lambda v: m.psum({"a": v, "b": (v.astype(jnp.int32),)}, "i"), True),
}


@pytest.mark.parametrize("op", list(PMAP_OPS))
def test_pmap(op):
    make_body, sum_like = PMAP_OPS[op]
    for dtype in ("float32", "int64"):
        x = make_data(dtype, (N, 16, 3), seed=45)
        want_fn = jax.pmap(make_body(lax), axis_name="i")
        got_fn = jax.pmap(make_body(flx), axis_name="i")
        want, got = host(want_fn(x)), host(got_fn(x))
        if sum_like and dtype == "float32":
            assert_tree_close(got, want, host(want_fn(abs64(x).astype(np.float32))), N)
        else:
            assert_tree_equal(got, want)


def test_pmap_of_devices_reversed():
    x = make_data("int32", (N, 4), seed=46)
    devs = jax.devices()[::-1]
    want = jax.pmap(lambda v: lax.all_gather(v, "i"), axis_name="i", devices=devs)(x)
    got = jax.pmap(lambda v: flx.all_gather(v, "i"), axis_name="i", devices=devs)(x)
    assert_tree_equal(host(got), host(want))


@pytest.mark.parametrize("mib", [1, 8])
def test_donation_in_place(mib, mesh1d):
    """jit(..., donate_argnums=0): the in-place path gives lax's result, call after call, and the
    donated input is consumed exactly as with lax."""
    elems = mib * 2**20 // 4
    body = lambda m: lambda v: m.psum(v, "x")  # noqa: E731
    want_fn = jax.jit(jax.shard_map(body(lax), mesh=mesh1d, in_specs=P("x"), out_specs=P("x")))
    got_fn = jax.jit(jax.shard_map(body(flx), mesh=mesh1d, in_specs=P("x"), out_specs=P("x")),
                     donate_argnums=0)
    lax_donated = jax.jit(jax.shard_map(body(lax), mesh=mesh1d, in_specs=P("x"),
                                        out_specs=P("x")), donate_argnums=0)
    sharding = jax.sharding.NamedSharding(mesh1d, P("x"))
    for rep in range(3):
        xi = make_data("int32", (N * elems,), seed=47 + rep)
        want = np.asarray(want_fn(jax.device_put(xi, sharding)))
        a = jax.device_put(xi, sharding)
        got = np.asarray(got_fn(a))
        b = jax.device_put(xi, sharding)
        lax_donated(b).block_until_ready()
        assert a.is_deleted() == b.is_deleted()
        assert np.array_equal(got, want), f"call {rep}: {int((got != want).sum())} elements differ"
    # A chain of donated calls: the output of one in-place call is the next one's donated input.
    xi = make_data("int32", (N * elems,), seed=50)
    a = jax.device_put(xi, sharding)
    w = jax.device_put(xi, sharding)
    for _ in range(3):
        a = got_fn(a)
        w = want_fn(w)
    assert np.array_equal(np.asarray(a), np.asarray(w))


def test_32_independent_collectives_in_one_body():
    """32 independent FlexLink collectives in one program: no deadlock (XLA:CPU reorders independent
    custom calls per device unless they are ordered) and every result right. In a subprocess, so a
    deadlock fails this test instead of hanging the suite."""
    res = run_python("""
        import numpy as np, jax, jax.numpy as jnp
        from jax import lax
        import jax_flexlink as flx
        flx.configure(timeout_s=30)
        P = jax.sharding.PartitionSpec
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
        def make(m):
            def body(v, w):
                outs = []
                for k in range(32):
                    kind = k % 4
                    if kind == 0:
                        outs.append(m.psum(v + k, "x"))
                    elif kind == 1:
                        outs.append(m.all_gather(w * k, "x", tiled=True))
                    elif kind == 2:
                        outs.append(m.psum_scatter(v - k, "x", tiled=True))
                    else:
                        outs.append(m.pmax(w - k, "x"))
                return [o[None] for o in outs]
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        rng = np.random.default_rng(0)
        want_fn, got_fn = make(lax), make(flx)
        for rep in range(5):
            v = rng.integers(-1000, 1000, size=(8 * 64,), dtype=np.int32)
            w = rng.integers(-1000, 1000, size=(8 * 16,), dtype=np.int64)
            want = [np.asarray(a) for a in want_fn(v, w)]
            got = [np.asarray(a) for a in got_fn(v, w)]
            assert len(got) == 32
            for k, (g, e) in enumerate(zip(got, want)):
                assert g.dtype == e.dtype and g.shape == e.shape, (k, g.shape, e.shape)
                assert np.array_equal(g, e), f"collective {k} wrong in run {rep}"
        print("OK")
    """, timeout=240)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-3000:] + res.stderr[-5000:]


def test_lowers_once(mesh1d):
    """A jitted program with FlexLink collectives is traced and lowered once, then only executed."""
    events = []

    def listener(name, duration, **kwargs):
        if name == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            events.append(name)

    traces = []

    def body(v):
        traces.append(1)
        return (flx.psum(v, "x"), flx.all_gather(v, "x"), flx.psum_scatter(v, "x", tiled=True),
                flx.pmax(v, "x"))

    f = jax.jit(jax.shard_map(body, mesh=mesh1d, in_specs=P("x"),
                              out_specs=(P(), P("x"), P("x"), P())))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        results = []
        for k in range(4):
            x = make_data("int32", (N * 8,), seed=60 + k)
            results.append((x, host(f(x))))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(traces) == 1, f"traced {len(traces)} times"
    assert len(events) == 1, f"lowered {len(events)} times"
    assert f._cache_size() == 1
    ref = jax.jit(jax.shard_map(lambda v: (lax.psum(v, "x"), lax.all_gather(v, "x"),
                                           lax.psum_scatter(v, "x", tiled=True), lax.pmax(v, "x")),
                                mesh=mesh1d, in_specs=P("x"), out_specs=(P(), P("x"), P("x"), P())))
    for x, got in results:  # every call, not only the first, gives the right result
        assert_tree_equal(got, host(ref(x)))


def test_lowers_once_pmap():
    traces = []

    def body(v):
        traces.append(1)
        return flx.psum(v, "i")

    f = jax.pmap(body, axis_name="i")
    ref = jax.pmap(lambda v: lax.psum(v, "i"), axis_name="i")
    for k in range(3):
        x = make_data("int32", (N, 5), seed=70 + k)
        assert_tree_equal(host(f(x)), host(ref(x)))
    assert len(traces) == 1


def test_later_programs_run_after_a_failed_collective():
    """A collective that fails at run time (here: a deadline of 1 us) must not poison the process:
    with the deadline restored, a new program runs and is right. (An ordered effect's runtime token
    would otherwise carry the first error into every later FlexLink call.)"""
    res = run_python("""
        import numpy as np, jax
        from jax import lax
        import jax_flexlink as flx
        P = jax.sharding.PartitionSpec
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
        def make(m, k):
            return jax.jit(jax.shard_map(lambda v: m.psum(v * k, "x"), mesh=mesh,
                                         in_specs=P("x"), out_specs=P()))
        x = np.arange(8 * 2**18, dtype=np.int32)
        f = make(flx, 1)
        f(x).block_until_ready()
        flx.configure(timeout_s=1e-6)
        failures = 0
        for _ in range(20):
            try:
                f(x).block_until_ready()
            except Exception as e:
                failures += 1
        flx.configure(timeout_s=60)
        print("FAILURES", failures)
        assert failures, "no call hit the 1 us deadline; the test needs one that does"
        got = np.asarray(make(flx, 3)(x))
        want = np.asarray(make(lax, 3)(x))
        assert np.array_equal(got, want)
        print("RECOVERED")
    """, timeout=240)
    assert res.returncode == 0 and "RECOVERED" in res.stdout, (
        res.stdout[-2000:] + res.stderr[-3000:])


def test_pmax_pmin_are_not_differentiable_like_lax(mesh1d):
    """lax has no derivative for pmax/pmin; FlexLink must raise the same error, not differentiate
    them as if they were linear."""
    x = jnp.arange(8.0)
    for op in ("pmax", "pmin"):
        f = lambda m: jax.shard_map(lambda a: getattr(m, op)(a, "x"), mesh=mesh1d, in_specs=P("x"),
                                    out_specs=P(), check_vma=False)
        for m in (lax, flx):
            with pytest.raises(NotImplementedError, match=f"Differentiation rule for '{op}'"):
                jax.grad(lambda v: f(m)(v).sum())(x)
