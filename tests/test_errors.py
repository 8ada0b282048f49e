"""Errors: FlexLink raises what lax raises for the same input (same exception type, the key
information in the message), before anything runs.

Each case is written once as ``build(m)`` -> a thunk; lax's thunk is traced, lowered and compiled
(lax reports some errors only from XLA's compiler), FlexLink's is only lowered, so its error must
come at trace/lowering time. Where lax's error comes from XLA (``JaxRuntimeError``), FlexLink may
reject the program earlier with any exception that carries the key information."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_flexlink as flx
from helpers import N, make_data, mesh

P = jax.sharding.PartitionSpec
AXIS = "nonexistent_axis"


def _raised(thunk):
    try:
        thunk()
    except Exception as e:  # noqa: BLE001 - the point is to capture it
        return e
    return None


def _sm(body, mesh_, in_specs=P("x"), out_specs=P("x"), check_vma=True):
    return jax.jit(jax.shard_map(body, mesh=mesh_, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma))


def assert_same_error(build, args, *, keys=(), also=()):
    """``build(m)`` returns a jitted function using collectives of module ``m``."""
    lax_exc = _raised(lambda: build(lax).lower(*args).compile())
    assert lax_exc is not None, "lax accepts this program: the test case is wrong"
    flx_exc = _raised(lambda: build(flx).lower(*args))
    assert flx_exc is not None, (
        f"FlexLink accepted (at trace/lowering) what lax rejects with "
        f"{type(lax_exc).__name__}: {str(lax_exc)[:300]}")
    from_xla = isinstance(lax_exc, jax.errors.JaxRuntimeError)
    if isinstance(lax_exc, AssertionError) and also:
        # lax tripped an internal assert before its own check: require the proper error type.
        assert isinstance(flx_exc, tuple(also)), (
            f"FlexLink raised {type(flx_exc).__name__}: {str(flx_exc)[:300]}; expected {also}")
    elif not from_xla:
        allowed = (type(lax_exc),) + tuple(also)
        assert isinstance(flx_exc, allowed), (
            f"FlexLink raised {type(flx_exc).__name__}: {str(flx_exc)[:300]}\n"
            f"lax raises {type(lax_exc).__name__}: {str(lax_exc)[:300]}")
    msg = str(flx_exc)
    for key in keys:
        assert key.lower() in msg.lower(), (
            f"FlexLink's error lacks {key!r}: {type(flx_exc).__name__}: {msg[:500]}\n"
            f"(lax: {type(lax_exc).__name__}: {str(lax_exc)[:300]})")
    return lax_exc, flx_exc


X = make_data("float32", (N * 8,), seed=90)

UNBOUND = {
    "psum": lambda m: lambda v: m.psum(v, AXIS),
    "pmax": lambda m: lambda v: m.pmax(v, AXIS),
    "pmin": lambda m: lambda v: m.pmin(v, AXIS),
    "pmean": lambda m: lambda v: m.pmean(v, AXIS),
    "all_gather": lambda m: lambda v: m.all_gather(v, AXIS),
    "psum_scatter": lambda m: lambda v: m.psum_scatter(v, AXIS, tiled=True),
    "tuple_psum": lambda m: lambda v: m.psum(v, ("x", AXIS)),
}


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("op", list(UNBOUND))
def test_unbound_axis_name(op, check_vma, mesh1d):
    # lax raises NameError ("unbound axis name: ..."); for psum-like ops under check_vma=True lax
    # 0.10.2 trips an internal AssertionError (no message) first: there FlexLink must raise the
    # NameError naming the axis.
    assert_same_error(lambda m: _sm(UNBOUND[op](m), mesh1d, check_vma=check_vma), (X,),
                      keys=(AXIS,), also=(NameError,))


def test_unbound_axis_outside_any_map():
    for op in ("psum", "all_gather", "psum_scatter"):
        assert_same_error(lambda m: jax.jit(UNBOUND[op](m)), (X,), keys=(AXIS,))


def test_unbound_axis_in_pmap():
    assert_same_error(lambda m: jax.pmap(lambda v: m.psum(v, AXIS), axis_name="i"),
                      (X.reshape(N, 8),), keys=(AXIS,))


# -- dtypes --------------------------------------------------------------------------------------

def test_psum_scatter_bool(mesh1d):
    b = make_data("bool", (N * 8,), seed=91)
    assert_same_error(lambda m: _sm(lambda v: m.psum_scatter(v, "x", tiled=True), mesh1d),
                      (b,), keys=("bool",))


@pytest.mark.parametrize("op", ["pmax", "pmin"])
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_max_min_of_complex(op, dtype, mesh1d):
    c = make_data(dtype, (N * 8,), seed=92)
    assert_same_error(lambda m: _sm(lambda v: getattr(m, op)(v, "x"), mesh1d, out_specs=P()),
                      (c,), keys=("complex",))


# -- axis_index_groups ----------------------------------------------------------------------------

BAD_GROUPS = {
    "duplicate": [[0, 1, 2, 3], [4, 5, 6, 6]],
    "overlap": [[0, 1, 2, 3], [3, 4, 5, 6, 7]],
    "negative": [[-1, 0, 1, 2], [3, 4, 5, 6]],
    "out_of_range": [[0, 1, 2, 3], [4, 5, 6, 7, 8]],
    "missing_index": [[0, 1, 2, 3], [4, 5, 6]],
    "too_few": [[0, 1], [2, 3]],
}
GROUP_OPS = {
    "psum": lambda m, g: lambda v: m.psum(v, "x", axis_index_groups=g),
    "pmax": lambda m, g: lambda v: m.pmax(v, "x", axis_index_groups=g),
    "all_gather": lambda m, g: lambda v: m.all_gather(v, "x", axis_index_groups=g),
    "psum_scatter": lambda m, g: lambda v: m.psum_scatter(v, "x", axis_index_groups=g,
                                                          tiled=True),
}


@pytest.mark.parametrize("op", list(GROUP_OPS))
@pytest.mark.parametrize("bad", list(BAD_GROUPS))
def test_bad_axis_index_groups(bad, op, mesh1d):
    groups = BAD_GROUPS[bad]
    # lax: ValueError "axis_index_groups must cover all indices exactly once", IndexError for an
    # index past the axis, and only an XLA verifier error for groups that leave devices out (there
    # FlexLink must say, at trace time, that the groups are wrong).
    keys = () if bad == "out_of_range" else ("group",)
    assert_same_error(lambda m: _sm(GROUP_OPS[op](m, groups), mesh1d, check_vma=False), (X,),
                      keys=keys)


@pytest.mark.parametrize("op", ["all_gather", "psum_scatter"])
def test_uneven_groups_rejected_for_gather_and_scatter(op, mesh1d):
    groups = [[0], [1, 2], [3, 4, 5, 6, 7]]  # fine for psum, not for these (lax: ValueError)
    assert_same_error(lambda m: _sm(GROUP_OPS[op](m, groups), mesh1d, check_vma=False), (X,),
                      keys=("group",))


def test_uneven_groups_rejected_in_pmap():
    groups = [[0], [1, 2], [3, 4, 5, 6, 7]]
    assert_same_error(
        lambda m: jax.pmap(lambda v: m.all_gather(v, "i", axis_index_groups=groups),
                           axis_name="i"), (X.reshape(N, 8),))


@pytest.mark.parametrize("op", ["psum", "pmean"])
def test_psum_groups_with_check_vma(op, mesh1d):
    """lax's psum under check_vma=True (psum_invariant_p) does not implement axis_index_groups
    (NotImplementedError); pmax/pmin/all_gather/psum_scatter do (see test_groups_meshes.py)."""
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert_same_error(lambda m: _sm(lambda v: getattr(m, op)(v, "x", axis_index_groups=groups),
                                    mesh1d, check_vma=True), (X,))


# -- scatter sizes -------------------------------------------------------------------------------

SCATTER = {
    # tiled: the scatter dimension must be divisible by the axis size
    "tiled_not_divisible": (lambda m: lambda v: m.psum_scatter(v[:7], "x", tiled=True), ("7", "8")),
    "tiled_dim1_not_divisible": (
        lambda m: lambda v: m.psum_scatter(v.reshape(2, 4), "x", scatter_dimension=1, tiled=True),
        ("4", "8")),
    # untiled: the scatter dimension must equal the axis size
    "untiled_too_big": (lambda m: lambda v: m.psum_scatter(jnp.tile(v, 2), "x"), ("16", "8")),
    "untiled_too_small": (lambda m: lambda v: m.psum_scatter(v[:4], "x"), ("4", "8")),
    "dimension_out_of_range": (
        lambda m: lambda v: m.psum_scatter(v, "x", scatter_dimension=1, tiled=True), ()),
    "zero_d": (lambda m: lambda v: m.psum_scatter(v[0], "x", tiled=True), ()),
}


@pytest.mark.parametrize("case", list(SCATTER))
def test_wrong_scatter_size(case, mesh1d):
    body, keys = SCATTER[case]
    assert_same_error(lambda m: _sm(body(m), mesh1d), (X,), keys=keys)


def test_wrong_scatter_size_2d_axis_tuple():
    m2 = mesh((2, 4), ("a", "b"))
    x = make_data("float32", (2 * 4, 4 * 3), seed=93)  # local (4, 3); 4 not divisible by 8
    assert_same_error(
        lambda m: _sm(lambda v: m.psum_scatter(v, ("a", "b"), tiled=True), m2,
                      in_specs=P("a", "b"), out_specs=P("a", "b")), (x,), keys=("4", "8"))


def test_all_gather_axis_out_of_bounds(mesh1d):
    assert_same_error(lambda m: _sm(lambda v: m.all_gather(v, "x", axis=2), mesh1d), (X,),
                      keys=("2",))


# -- varying-axes typing under check_vma=True ------------------------------------------------------

OUT_SPECS = {
    # all_gather/psum_scatter results vary over the axis: out_specs P() must be rejected
    "all_gather_P()": (lambda m: lambda v: m.all_gather(v, "x"), P(), None),
    "all_gather_tiled_P()": (lambda m: lambda v: m.all_gather(v, "x", tiled=True), P(), None),
    "psum_scatter_P()": (lambda m: lambda v: m.psum_scatter(v, "x", tiled=True), P(), None),
    # psum over "a" still varies over "b"
    "2d_psum_a_P()": (lambda m: lambda v: m.psum(v, "a"), P(), (2, 4)),
    "2d_pmax_b_P()": (lambda m: lambda v: m.pmax(v, "b"), P(), (2, 4)),
    "2d_all_gather_ab_P()": (lambda m: lambda v: m.all_gather(v, ("a", "b")), P(), (2, 4)),
}


@pytest.mark.parametrize("case", list(OUT_SPECS))
def test_out_specs_disagree_with_varying_axes(case):
    body, out_spec, shape = OUT_SPECS[case]
    if shape is None:
        m_, in_spec, x = mesh((N,), ("x",)), P("x"), X
    else:
        m_, in_spec = mesh(shape, ("a", "b")), P("a", "b")
        x = make_data("float32", (8, 8), seed=94)
    assert_same_error(lambda m: _sm(body(m), m_, in_specs=in_spec, out_specs=out_spec), (x,),
                      keys=("out_specs",))


ACCEPTED = {
    "psum_P()": (lambda m: lambda v: m.psum(v, "x"), P(), None),
    "pmean_P()": (lambda m: lambda v: m.pmean(v, "x"), P(), None),
    "pmin_P()": (lambda m: lambda v: m.pmin(v, "x"), P(), None),
    "2d_psum_ab_P()": (lambda m: lambda v: m.psum(v, ("b", "a")), P(), (2, 4)),
    "2d_psum_a_P(None,b)": (lambda m: lambda v: m.psum(v, "a"), P(None, "b"), (2, 4)),
    "2d_pmax_b_P(a)": (lambda m: lambda v: m.pmax(v, "b"), P("a"), (2, 4)),
    "2d_psum_of_psum_P()": (lambda m: lambda v: m.psum(m.psum(v, "a"), "b"), P(), (2, 4)),
    "invariant_input_psum": (lambda m: lambda v: m.psum(v, "x"), P(), "invariant"),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_out_specs_accepted_like_lax(case):
    """The positive control: what lax's typing accepts, FlexLink accepts with the same result."""
    body, out_spec, shape = ACCEPTED[case]
    in_spec = P("x")
    if shape is None or shape == "invariant":
        m_, x = mesh((N,), ("x",)), X
        if shape == "invariant":
            in_spec = P()
    else:
        m_, in_spec = mesh(shape, ("a", "b")), P("a", "b")
        x = make_data("float32", (8, 8), seed=95)
    want = np.asarray(_sm(body(lax), m_, in_specs=in_spec, out_specs=out_spec)(x))
    got = np.asarray(_sm(body(flx), m_, in_specs=in_spec, out_specs=out_spec)(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_missing_compiled_module_says_why_and_what_to_do():
    """Without its compiled module (the usual cause: `pip install .`, then Python started in the
    repository root imports the source tree), importing jax_flexlink names the directory it came from
    and both ways out, instead of a bare circular-import message."""
    from helpers import run_python
    res = run_python("""
        import importlib.abc, sys
        class NoExtension(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "jax_flexlink._flexlink":
                    raise ImportError("No module named 'jax_flexlink._flexlink'")
                return None
        sys.meta_path.insert(0, NoExtension())
        try:
            import jax_flexlink
        except ImportError as e:
            print("ERROR:", e)
        else:
            print("IMPORTED")
    """, env_remove=("FLEXLINK_MODULE",))  # the package's own module (a sanitizer run sets it)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "ERROR:" in out, out
    assert "compiled module _flexlink is missing" in out, out
    assert "run from another directory or install in place with `pip install -e .`" in out, out
    assert "jax_flexlink" in out.split("imported from ", 1)[1], out
