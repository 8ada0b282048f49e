"""Shared helpers: test data per dtype, a per-device shard_map harness, lax-vs-FlexLink comparison.

Every expected value in this suite is what ``jax.lax`` computes for the same input, so a test is
written once as ``lambda m: lambda v: m.psum(v, "x")`` and run with ``m = jax.lax`` (the reference)
and ``m = jax_flexlink``.
"""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_flexlink as flx

N = 8  # host devices

INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]
COMPLEX_DTYPES = ["complex64", "complex128"]
ALL_DTYPES = ["bool"] + INT_DTYPES + FLOAT_DTYPES + COMPLEX_DTYPES


def mesh(shape, names, devices=None):
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.array(devices).reshape(shape), names)


def make_data(dtype, shape, seed=0):
    """Random data that exercises the dtype: the full integer range (so sums wrap), floats over four
    decades of magnitude and both signs (so the summation order shows), random bools."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    shape = tuple(shape)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if jnp.issubdtype(dt, jnp.integer):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if jnp.issubdtype(dt, jnp.complexfloating):
        part = jnp.finfo(dt).dtype
        re = make_data(part, shape, seed + 1).astype(np.float64)
        im = make_data(part, shape, seed + 2).astype(np.float64)
        return (re + 1j * im).astype(dt)
    mag = 10.0 ** rng.uniform(-2, 2, size=shape)
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    return (sign * mag).astype(dt)


def per_device(body, mesh_, *, check_vma=True, static_out=None):
    """jit(shard_map) that feeds device ``idx`` the slice ``X[idx]`` of a global array of shape
    ``(*mesh.shape, *local)`` and returns every device's result stacked the same way, so the
    comparison sees each device's copy (also of 0-d results). Works on pytrees of arguments."""
    nd = len(mesh_.axis_names)
    spec = P(*mesh_.axis_names)

    def wrapped(*args):
        local = jax.tree.map(lambda a: a.reshape(a.shape[nd:]), args)
        out = body(*local)
        return jax.tree.map(lambda o: jnp.reshape(o, (1,) * nd + jnp.shape(o)), out)

    return jax.jit(
        jax.shard_map(wrapped, mesh=mesh_, in_specs=spec, out_specs=spec, check_vma=check_vma)
    )


def host(tree):
    return jax.tree.map(np.asarray, tree)


def abs64(x):
    x = np.asarray(x)
    if x.dtype == np.bool_:
        return x.astype(np.float64)
    return np.abs(x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)).astype(np.float64)


def _is_inexact(dt):
    return jnp.issubdtype(dt, jnp.inexact)


def assert_leaf_equal(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != lax's {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != lax's {want.shape}"
    if got.dtype == np.bool_ or jnp.issubdtype(got.dtype, jnp.integer):
        bad = got != want
    else:  # -0.0 == 0.0 and NaN == NaN for max/min/gather of floats
        g, w = got.astype(np.complex128), want.astype(np.complex128)
        bad = (g != w) & ~(np.isnan(g) & np.isnan(w))
    if bad.any():
        idx = np.argwhere(bad)[:5].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ from lax, first at {idx}: "
            f"got {got[bad][:5]} want {want[bad][:5]}"
        )


def assert_leaf_close(got, want, ref_abs, n, what=""):
    """Floats of a sum: |got - want| <= n * eps * sum_i |x_i| (elementwise), the bound two different
    summation orders of n terms satisfy (also with float16/bfloat16 accumulated in float32)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != lax's {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != lax's {want.shape}"
    if not _is_inexact(got.dtype):
        return assert_leaf_equal(got, want, what)
    fin = jnp.finfo(got.dtype)
    eps, tiny = float(fin.eps), float(fin.tiny)
    cplx = np.iscomplexobj(got)
    g = got.astype(np.complex128 if cplx else np.float64)
    w = want.astype(np.complex128 if cplx else np.float64)
    tol = n * eps * np.asarray(ref_abs, np.float64) * (2.0 if cplx else 1.0) + n * tiny
    err = np.abs(g - w)
    bad = ~(err <= tol)
    if bad.any():
        idx = np.argwhere(bad)[:5].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements outside the summation-order "
            f"tolerance, first at {idx}: got {got[bad][:5]} want {want[bad][:5]} tol {tol[bad][:5]}"
        )


def assert_tree_equal(got, want, what=""):
    gl, gt = jax.tree.flatten(got)
    wl, wt = jax.tree.flatten(want)
    assert gt == wt, f"{what}: pytree structure {gt} != lax's {wt}"
    for i, (g, w) in enumerate(zip(gl, wl)):
        assert_leaf_equal(g, w, f"{what}[leaf {i}]")


def assert_tree_close(got, want, ref_abs, n, what=""):
    gl, gt = jax.tree.flatten(got)
    wl, wt = jax.tree.flatten(want)
    rl = jax.tree.leaves(ref_abs)
    assert gt == wt, f"{what}: pytree structure {gt} != lax's {wt}"
    for i, (g, w, r) in enumerate(zip(gl, wl, rl)):
        assert_leaf_close(g, w, r, n, f"{what}[leaf {i}]")


def assert_bitwise_same(a, b, what="run-to-run"):
    al, bl = jax.tree.leaves(a), jax.tree.leaves(b)
    for i, (x, y) in enumerate(zip(al, bl)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes(), f"{what}: leaf {i} not bitwise identical"


def weak_types(tree):
    return [getattr(leaf, "weak_type", None) for leaf in jax.tree.leaves(tree)]


def compare_with_lax(make_body, mesh_, args, *, check_vma=True, sum_like=False, n=N, reps=2):
    """Runs ``make_body(jax.lax)`` and ``make_body(jax_flexlink)`` under the per-device harness and
    asserts FlexLink equals lax (bitwise, or within the summation-order tolerance for sums of
    floats) and is bitwise identical from run to run. Returns (got, want)."""
    want_fn = per_device(make_body(lax), mesh_, check_vma=check_vma)
    got_fn = per_device(make_body(flx), mesh_, check_vma=check_vma)
    want = host(want_fn(*args))
    runs = [host(got_fn(*args)) for _ in range(reps)]
    got = runs[0]
    for other in runs[1:]:
        assert_bitwise_same(got, other)
    if sum_like and any(_is_inexact(np.asarray(leaf).dtype) for leaf in jax.tree.leaves(want)):
        ref_abs = host(want_fn(*jax.tree.map(abs64, args)))
        assert_tree_close(got, want, ref_abs, n)
    else:
        assert_tree_equal(got, want)
    return got, want


def run_python(code, env_extra=None, timeout=240, env_remove=()):
    """Runs ``code`` in a fresh interpreter (same venv) with 8 host devices; returns the result."""
    env = dict(os.environ)
    for name in ("FLEXLINK_REPLACE_COLLECTIVES",) + tuple(env_remove):
        env.pop(name, None)
    env.update(env_extra or {})
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env, cwd=here, capture_output=True, text=True, timeout=timeout,
    )


def grad_case(m, check_vma, remat):
    """jit(value_and_grad) of a loss through a shard_map using collectives of module ``m``."""
    mesh_ = jax.sharding.Mesh(np.array(jax.devices()), ("x",))

    def body(x, w):
        def inner(x, w):
            s = m.psum(x * w, "x")
            g = m.all_gather(jnp.sin(x), "x", tiled=True)
            r = m.psum_scatter(jnp.cos(g) * 2.0, "x", tiled=True)
            mean = m.pmean(x * x, "x")
            return jnp.sum(s * s) + jnp.sum(r * x) + jnp.sum(mean * w)
        if remat:
            inner = jax.checkpoint(inner)
        return m.psum(inner(x, w), "x") if check_vma else inner(x, w)[None]

    sm = jax.shard_map(body, mesh=mesh_, in_specs=(P("x"), P("x")),
                       out_specs=P() if check_vma else P("x"), check_vma=check_vma)

    def loss(x, w):
        return jnp.sum(sm(x, w))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
