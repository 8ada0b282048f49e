"""Replacement of jax.lax collectives by FlexLink's custom calls: context manager, plain call,
JAX config option, absl flag, environment variable. Checked on the compiled HLO text and by
results.

jit caches its lowering at the first call, so every mode builds fresh functions."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_flexlink as flx
from helpers import (N, assert_tree_close, assert_tree_equal, grad_case, host, make_data,
                     run_python)

P = jax.sharding.PartitionSpec
NATIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter)\b")
FLEX = {"all_reduce": 'custom_call_target="flexlink_all_reduce"',
        "all_gather": 'custom_call_target="flexlink_all_gather"',
        "reduce_scatter": 'custom_call_target="flexlink_reduce_scatter"'}


@pytest.fixture(autouse=True)
def _replacement_off_after():
    yield
    flx.replace_collectives(False)
    jax.config.update("jax_flexlink_replace_collectives", False)


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()), ("x",))


def _programs():
    """Fresh jitted programs made of jax.lax collectives, one per binding path:
    shard_map check_vma=True (psum_invariant_p), check_vma=False (psum_p), pmap."""
    mesh = _mesh()

    def body(v):  # psum, pmean (through psum), pmax, pmin, all_gather, psum_scatter
        return (lax.psum(v, "x"), lax.pmean(v, "x"), lax.pmax(v, "x"), lax.pmin(v, "x"),
                lax.all_gather(v, "x", tiled=True), lax.psum_scatter(v, "x", tiled=True))

    outs = (P(), P(), P(), P(), P("x"), P("x"))
    x = make_data("float32", (N * 16,), seed=80)
    xp = make_data("float32", (N, 16), seed=80)
    return {
        "shard_map_vma": (jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=outs,
                                                check_vma=True)), x),
        "shard_map_novma": (jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"),
                                                  out_specs=outs, check_vma=False)), x),
        "pmap": (jax.pmap(lambda v: (lax.psum(v, "i"), lax.pmean(v, "i"), lax.pmax(v, "i"),
                                     lax.pmin(v, "i"), lax.all_gather(v, "i", tiled=True),
                                     lax.psum_scatter(v, "i", tiled=True)), axis_name="i"), xp),
    }


def _hlo(fn, x):
    return fn.lower(x).compile().as_text()


def _assert_replaced(text, where):
    native = sorted(set(NATIVE.findall(text)))
    assert not native, f"{where}: native collectives left in the compiled HLO: {native}"
    for kind, target in FLEX.items():
        assert target in text, f"{where}: no {target} in the compiled HLO"


def _assert_native(text, where):
    assert "flexlink_" not in text, f"{where}: FlexLink custom call although replacement is off"
    for op in ("all-reduce", "all-gather", "reduce-scatter"):
        assert re.search(rf"\b{op}\b", text), f"{where}: native {op} missing"


def _check_all(replaced):
    for name, (fn, x) in _programs().items():
        text = _hlo(fn, x)
        (_assert_replaced if replaced else _assert_native)(text, name)


def _results(progs):
    return {name: host(fn(x)) for name, (fn, x) in progs.items()}


def _assert_results_equal(got, want, progs):
    for name in want:
        g, w = got[name], want[name]
        # psum, pmean, psum_scatter are float sums (indices 0, 1, 5); the rest are exact.
        ref = host(progs[name][0](np.abs(progs[name][1])))
        assert_tree_close([g[0], g[1], g[5]], [w[0], w[1], w[5]], [ref[0], ref[1], ref[5]], N)
        assert_tree_equal(g[2:5], w[2:5])


def test_off_by_default():
    _check_all(replaced=False)


def test_context_manager():
    native_progs = _programs()
    want = _results(native_progs)
    with flx.replace_collectives():
        _check_all(replaced=True)
        progs = _programs()
        got = _results(progs)
    _assert_results_equal(got, want, native_progs)
    _check_all(replaced=False)


def test_context_manager_nested_disable():
    with flx.replace_collectives():
        with flx.replace_collectives(False):
            _check_all(replaced=False)
        _check_all(replaced=True)
    _check_all(replaced=False)


def test_context_manager_restores_on_error():
    with pytest.raises(KeyError):
        with flx.replace_collectives():
            raise KeyError("boom")
    _check_all(replaced=False)


def test_plain_call():
    flx.replace_collectives()
    try:
        _check_all(replaced=True)
    finally:
        flx.replace_collectives(False)
    _check_all(replaced=False)


def test_config_option():
    jax.config.update("jax_flexlink_replace_collectives", True)
    try:
        _check_all(replaced=True)
    finally:
        jax.config.update("jax_flexlink_replace_collectives", False)
    _check_all(replaced=False)


def test_flexlink_api_always_uses_custom_calls():
    mesh = _mesh()
    x = make_data("float32", (N * 16,), seed=81)
    for check_vma in (True, False):
        f = jax.jit(jax.shard_map(
            lambda v: (flx.psum(v, "x"), flx.all_gather(v, "x"),
                       flx.psum_scatter(v, "x", tiled=True)),
            mesh=mesh, in_specs=P("x"), out_specs=(P(), P("x"), P("x")), check_vma=check_vma))
        _assert_replaced(_hlo(f, x), f"check_vma={check_vma}")


def test_replacement_outside_shard_map_untouched():
    """Collectives XLA inserts for sharded jit (no shard_map) stay native under replacement."""
    mesh = _mesh()
    x = jax.device_put(make_data("float32", (N * 16,), seed=82),
                       jax.sharding.NamedSharding(mesh, P("x")))
    with flx.replace_collectives():
        f = jax.jit(lambda v: jnp.sum(v), out_shardings=jax.sharding.NamedSharding(mesh, P()))
        text = f.lower(x).compile().as_text()
        got = float(f(x))
    assert "flexlink_" not in text
    np.testing.assert_allclose(got, float(np.sum(np.asarray(x, np.float64))), rtol=1e-5)


_SUBPROCESS_CHECK = """
    import re, sys
    import numpy as np, jax
    from jax import lax
    {setup}
    P = jax.sharding.PartitionSpec
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    def make():
        return jax.jit(jax.shard_map(
            lambda v: (lax.psum(v, "x"), lax.all_gather(v, "x", tiled=True),
                       lax.psum_scatter(v, "x", tiled=True)),
            mesh=mesh, in_specs=P("x"), out_specs=(P(), P("x"), P("x"))))
    x = np.arange(8 * 16, dtype=np.int32) * 7 - 300
    f = make()
    text = f.lower(x).compile().as_text()
    got = [np.asarray(a) for a in f(x)]
    flx.replace_collectives(False)
    jax.config.update("jax_flexlink_replace_collectives", False)
    g = make()
    native_text = g.lower(x).compile().as_text()
    want = [np.asarray(a) for a in g(x)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    print("REPLACED" if ("flexlink_all_reduce" in text and "flexlink_all_gather" in text
                         and "flexlink_reduce_scatter" in text
                         and not re.search(r"\\b(all-reduce|all-gather|reduce-scatter)\\b", text))
          else "NATIVE")
    print("OFF_OK" if "flexlink_" not in native_text else "OFF_BAD")
"""


@pytest.mark.parametrize("value,expected", [("1", "REPLACED"), ("0", "NATIVE")])
def test_environment_variable(value, expected):
    res = run_python(_SUBPROCESS_CHECK.format(setup="import jax_flexlink as flx"),
                     env_extra={"FLEXLINK_REPLACE_COLLECTIVES": value})
    assert res.returncode == 0, res.stderr[-4000:]
    lines = res.stdout.split()
    assert expected in lines and "OFF_OK" in lines, res.stdout


def test_absl_flag():
    pytest.importorskip("absl")
    setup = ("import jax_flexlink as flx\n"
             "    sys.argv = [sys.argv[0], '--jax_flexlink_replace_collectives']\n"
             "    jax.config.parse_flags_with_absl()")
    res = run_python(_SUBPROCESS_CHECK.format(setup=setup))
    assert res.returncode == 0, res.stderr[-4000:]
    assert "REPLACED" in res.stdout.split() and "OFF_OK" in res.stdout.split(), res.stdout


def test_replaces_invariant_all_gather():
    """lax.all_gather(..., to="invarying") binds the invariant variant of all_gather_p."""
    mesh = _mesh()
    x = make_data("int32", (N * 4,), seed=83)

    def make():
        return jax.jit(jax.shard_map(lambda v: lax.all_gather(v, "x", to="invarying"), mesh=mesh,
                                     in_specs=P("x"), out_specs=P()))
    native = make()
    want = np.asarray(native(x))
    with flx.replace_collectives():
        f = make()
        text = _hlo(f, x)
        got = np.asarray(f(x))
    assert FLEX["all_gather"] in text and not NATIVE.findall(text), text[-2000:]
    assert np.array_equal(got, want)


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
def test_grad_and_vmap_under_replacement(remat):
    """Replaced lax collectives keep lax's autodiff (psum_invariant <-> pvary, all_gather <->
    psum_scatter) and batching."""
    x = make_data("float64", (N * 4,), seed=84)
    w = make_data("float64", (N * 4,), seed=85)
    want = host(grad_case(lax, True, remat)(x, w))
    with flx.replace_collectives():
        f = grad_case(lax, True, remat)
        text = f.lower(x, w).compile().as_text()
        got = host(f(x, w))
    assert "flexlink_all_reduce" in text and not NATIVE.findall(text)
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w_, rtol=1e-9, atol=1e-9)

    xb = make_data("float32", (3, N * 8), seed=86)
    mesh = _mesh()

    def make_vmapped():
        sm = jax.shard_map(lambda a: (lax.psum(a, "x"), lax.all_gather(a, "x", tiled=True)),
                           mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        return jax.jit(jax.vmap(sm))
    want_v = host(make_vmapped()(xb))
    with flx.replace_collectives():
        got_v = host(make_vmapped()(xb))
    assert_tree_equal(got_v[1], want_v[1])
    np.testing.assert_allclose(got_v[0], want_v[0], rtol=1e-5, atol=1e-5)


def test_replacement_in_pmap_with_uneven_groups():
    groups = [[0], [5, 1, 2], [3, 4, 6, 7]]
    x = make_data("int32", (N, 6), seed=87)

    def make():
        return jax.pmap(lambda v: (lax.psum(v, "i", axis_index_groups=groups),
                                   lax.pmax(v, "i", axis_index_groups=groups)), axis_name="i")
    want = host(make()(x))
    with flx.replace_collectives():
        f = make()
        text = f.lower(x).compile().as_text()
        got = host(f(x))
    assert FLEX["all_reduce"] in text and not NATIVE.findall(text)
    assert_tree_equal(got, want)


def test_replacement_leaves_dtypes_it_cannot_handle_to_lax():
    """lax accepts float8 collectives; FlexLink's engine has no float8, so replacement must leave
    them native (and still replace the float32 one next to it)."""
    mesh = _mesh()
    x = make_data("float32", (N * 8,), seed=88)

    def make():
        return jax.jit(jax.shard_map(
            lambda v: (lax.psum(v.astype(jnp.float8_e4m3fn), "x"), lax.psum(v, "x")),
            mesh=mesh, in_specs=P("x"), out_specs=P()))
    want = host(make()(x))
    with flx.replace_collectives():
        f = make()
        text = f.lower(x).compile().as_text()
        got = host(f(x))
    assert FLEX["all_reduce"] in text
    assert len(re.findall(r"\ball-reduce\b", text)) >= 1
    assert_tree_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-3)
