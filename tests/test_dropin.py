"""Replacement never breaks a program lax runs: collectives over vmap axes (alone or mixed with
pmap/shard_map axes), vmap of a shard_map over an Explicit mesh axis (an XLA abort before), checkpoint
policies that select collectives by primitive name, and programs FlexLink cannot lower (left to XLA,
with the reason in the compiled program)."""
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_flexlink as flx
from helpers import N, assert_tree_equal, host, make_data, run_python

P = jax.sharding.PartitionSpec
FLEX_CALL = re.compile(r'custom_call_target="flexlink_\w+"|custom_call @flexlink_\w+')


@pytest.fixture(autouse=True)
def _replacement_off_after():
    yield
    flx.replace_collectives(False)


def _both(make_and_run):
    """(native result, replaced result) of a program built and run twice."""
    want = host(make_and_run())
    with flx.replace_collectives():
        got = host(make_and_run())
    return got, want


_I = make_data("int32", (N, 3, 4), seed=90)

VMAP_CASES = {
    # vmap axes only: no devices, lax computes them locally (eagerly and under jit)
    "vmap_psum": lambda: jax.vmap(lambda v: lax.psum(v, "j"), axis_name="j")(_I),
    "vmap_pmax_jit": lambda: jax.jit(jax.vmap(lambda v: lax.pmax(v, "j"), axis_name="j"))(_I),
    "vmap_vmap_psum_ij": lambda: jax.vmap(jax.vmap(lambda v: lax.psum(v, ("i", "j")), axis_name="j"),
                                          axis_name="i")(_I),
    "vmap_all_gather": lambda: jax.vmap(lambda v: lax.all_gather(v, "j"), axis_name="j")(_I),
    "vmap_grad_psum": lambda: jax.grad(lambda v: jnp.sum(jax.vmap(
        lambda w: lax.psum(w, "j") ** 2, axis_name="j")(v)))(_I.astype(np.float32)),
    # a pmap axis with a vmap axis, either way round, collectives over one or both
    "pmap_vmap_psum_i": lambda: jax.pmap(jax.vmap(lambda v: lax.psum(v, "i"), axis_name="j"),
                                         axis_name="i")(_I),
    "pmap_vmap_psum_j": lambda: jax.pmap(jax.vmap(lambda v: lax.psum(v, "j"), axis_name="j"),
                                         axis_name="i")(_I),
    "pmap_vmap_psum_ij": lambda: jax.pmap(jax.vmap(lambda v: lax.psum(v, ("i", "j")),
                                                   axis_name="j"), axis_name="i")(_I),
    "pmap_vmap_all_gather_i": lambda: jax.pmap(jax.vmap(lambda v: lax.all_gather(v, "i"),
                                                        axis_name="j"), axis_name="i")(_I),
    "vmap_pmap_psum_i": lambda: jax.vmap(jax.pmap(lambda v: lax.psum(v, "i"), axis_name="j"),
                                         axis_name="i")(_I.reshape(2, 4, 12)),
    "vmap_pmap_psum_ij": lambda: jax.vmap(jax.pmap(lambda v: lax.psum(v, ("i", "j")),
                                                   axis_name="j"), axis_name="i")(_I.reshape(2, 4, 12)),
}


@pytest.mark.parametrize("case", sorted(VMAP_CASES))
def test_vmap_axes_under_replacement(case):
    got, want = _both(VMAP_CASES[case])
    assert_tree_equal(got, want, case)


def test_explicit_api_over_vmap_axis_is_lax():
    """flx.psum over an axis with no devices behind it is lax's local reduction, not an error."""
    f = jax.vmap(lambda v: (flx.psum(v, "j"), flx.all_gather(v, "j")), axis_name="j")
    g = jax.vmap(lambda v: (lax.psum(v, "j"), lax.all_gather(v, "j")), axis_name="j")
    assert_tree_equal(host(f(_I)), host(g(_I)))


def test_pmap_vmap_keeps_flexlink_for_the_device_axis():
    f = jax.pmap(jax.vmap(lambda v: lax.psum(v, ("i", "j")), axis_name="j"), axis_name="i")
    with flx.replace_collectives():
        text = f.lower(_I).compile().as_text()
    assert 'custom_call_target="flexlink_all_reduce"' in text
    assert not re.search(r"\ball-reduce\b", text)


def test_vmap_of_shard_map_over_explicit_mesh_axis():
    """jax.vmap of a shard_map over one axis of a 2-D mesh with Explicit axis types: the vmapped
    axis stays sharded over the other mesh axis inside the body (a partially manual region), where a
    custom call used to abort XLA. In a subprocess, so that an abort cannot take the suite down."""
    res = run_python("""
        import numpy as np, jax, jax.numpy as jnp
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        import jax_flexlink as flx
        mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
        with jax.sharding.set_mesh(mesh):
            arr = jax.device_put(jnp.arange(64).reshape(2, 32) * 7 - 3, P("x", "y"))
            def make(mod):
                @jax.shard_map(in_specs=P("y"), out_specs=(P(None), P("y")))
                def f(v):
                    return mod.psum(v, "y"), mod.all_gather(v, "y", tiled=True)
                return f
            want = [np.asarray(a) for a in jax.jit(jax.vmap(make(jax.lax)))(arr)]
            with flx.replace_collectives():
                g = jax.jit(jax.vmap(make(jax.lax)))
                got = [np.asarray(a) for a in g(arr)]
                eager = [np.asarray(a) for a in jax.vmap(make(jax.lax))(arr)]
                text = g.lower(arr).compile().as_text()
            explicit = [np.asarray(a) for a in jax.jit(jax.vmap(make(flx)))(arr)]
            for w, a, b, c in zip(want, got, eager, explicit):
                assert np.array_equal(w, a) and np.array_equal(w, b) and np.array_equal(w, c)
            assert 'custom_call_target="flexlink_all_reduce"' in text, text
            assert 'custom_call_target="flexlink_all_gather"' in text, text
        print("OK")
    """)
    assert res.returncode == 0 and "OK" in res.stdout, (
        f"rc={res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")


def _primitive_names(jaxpr):
    names = []
    for eqn in jaxpr.eqns:
        names.append(str(eqn.primitive))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names.extend(_primitive_names(sub))
    return names


def test_checkpoint_policy_by_primitive_name():
    """The shard_map tutorial's FSDP policy saves everything but all_gather, matching by name.
    Under replacement, FlexLink's primitives carry lax's names, so the policy keeps its meaning: the
    gradient's jaxpr has the same primitives, in the same order, as natively (before, the gathered
    weights were saved instead of gathered again), and the results agree."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("batch",))
    policy = lambda prim, *_, **__: str(prim) != "all_gather"  # noqa: E731

    def predict(params, inputs):
        for w_frag, b_frag in params:
            w = lax.all_gather(w_frag, "batch", tiled=True)
            b = lax.all_gather(b_frag, "batch", tiled=True)
            inputs = jax.nn.relu(jnp.dot(inputs, w) + b)
        return inputs

    def make_loss(policy):
        remat_predict = jax.checkpoint(predict, policy=policy)

        def loss(params, batch):
            def body(p, x):
                return lax.pmean(jnp.mean(remat_predict(p, x) ** 2), "batch")
            return jax.shard_map(body, mesh=mesh, in_specs=(P("batch"), P("batch")),
                                 out_specs=P())(params, batch)
        return loss

    rng = np.random.default_rng(3)
    params = [(rng.standard_normal((8, 8)).astype(np.float32),
               rng.standard_normal((8,)).astype(np.float32)) for _ in range(3)]
    batch = rng.standard_normal((8, 8)).astype(np.float32)
    grad = jax.grad(make_loss(policy))
    native_names = _primitive_names(jax.make_jaxpr(grad)(params, batch).jaxpr)
    save_all = _primitive_names(jax.make_jaxpr(jax.grad(make_loss(lambda *_, **__: True)))(
        params, batch).jaxpr)
    want = host(jax.jit(grad)(params, batch))
    with flx.replace_collectives():
        jaxpr = jax.make_jaxpr(grad)(params, batch)
        got = host(jax.jit(grad)(params, batch))
        text = jax.jit(grad).lower(params, batch).compile().as_text()
    assert _primitive_names(jaxpr.jaxpr) == native_names
    # The policy matters here: saving everything gathers each weight once, this one again for the
    # backward pass.
    assert native_names.count("all_gather") > save_all.count("all_gather") == 6
    assert "flexlink=replace" in str(jaxpr)
    assert 'custom_call_target="flexlink_all_gather"' in text
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_exported_program_keeps_xla_collectives():
    """jax.export serializes a program to run elsewhere, where FlexLink's custom calls (this
    process's devices, this engine) mean nothing and export refuses them: replacement leaves the
    collective to XLA (the reason marks the native op), and the explicit API says why."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))

    def make(mod):
        return jax.jit(jax.shard_map(lambda v: mod.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                                     out_specs=P()))

    x = np.arange(N * 4, dtype=np.float32)
    from jax import export
    with flx.replace_collectives():
        exp = export.export(make(lax))(jax.ShapeDtypeStruct(x.shape, x.dtype))
    text = exp.mlir_module()
    assert "flexlink_fallback" in text and "all_reduce" in text and not FLEX_CALL.search(text)
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("x")))
    np.testing.assert_array_equal(np.asarray(jax.jit(exp.call)(sharded)), np.asarray(make(lax)(x)))
    with pytest.raises(NotImplementedError, match="jax.export serializes"):
        export.export(make(flx))(jax.ShapeDtypeStruct(x.shape, x.dtype))


@pytest.mark.skipif(flx._native.cuda_module() is not None,
                    reason="this build has the CUDA module (test_gpu_lowering_with_the_cuda_module covers it)")
def test_gpu_lowering_without_a_cuda_build():
    """Lowered for CUDA (cross-platform lowering, no GPU needed) by a build without the CUDA
    module: replacement keeps XLA's collective, marked with the reason, and the explicit API names
    the build option."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))

    def make(mod):
        return jax.jit(jax.shard_map(lambda v: (mod.psum(v, "x"), mod.ppermute(v, "x", [(0, 1)])),
                                     mesh=mesh, in_specs=P("x"), out_specs=(P(), P("x"))))

    x = np.arange(N * 2, dtype=np.float32)
    with flx.replace_collectives():
        text = make(lax).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.all_reduce" in text and "stablehlo.collective_permute" in text
    assert text.count("FLEXLINK_CUDA=ON") == 2 and not FLEX_CALL.search(text)
    with pytest.raises(NotImplementedError, match="FLEXLINK_CUDA=ON"):
        make(flx).trace(x).lower(lowering_platforms=("cuda",))


def _cuda_module_path():
    """The CUDA module of a FLEXLINK_CUDA=ON build: FLEXLINK_CUDA_MODULE (CI points it at its CMake
    build), else one built in place by `pip install -e . -C cmake.define.FLEXLINK_CUDA=ON`."""
    import glob
    import os
    import sysconfig
    if os.environ.get("FLEXLINK_CUDA_MODULE"):
        return os.path.abspath(os.environ["FLEXLINK_CUDA_MODULE"])  # the check runs from tests/
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    name = "_flexlink_cuda" + sysconfig.get_config_var("EXT_SUFFIX")  # this Python's build only
    found = sorted(glob.glob(os.path.join(root, "build", "*", name)) +
                   glob.glob(os.path.join(root, "jax_flexlink", name)))
    return found[0] if found else None


def test_gpu_lowering_with_the_cuda_module():
    """With the CUDA module (loaded in a fresh interpreter before jax_flexlink, as an installed one
    would be), lowering for CUDA (no GPU needed) emits FlexLink's custom calls, for the explicit API
    and under replacement; the CPU lowering is unchanged, and GPU link specs go to the CUDA module."""
    import os
    path = _cuda_module_path()
    if not path or not os.path.exists(path):
        pytest.skip("no FLEXLINK_CUDA=ON build here: set FLEXLINK_CUDA_MODULE to its _flexlink_cuda*.so "
                    "(CI does) or build in place with `pip install -e . -C cmake.define.FLEXLINK_CUDA=ON`")
    result = run_python(f"""
        import importlib.util, re, sys
        spec = importlib.util.spec_from_file_location("jax_flexlink._flexlink_cuda", {path!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["jax_flexlink._flexlink_cuda"] = module
        import jax, numpy as np
        from jax import lax
        from jax.sharding import PartitionSpec as P
        import jax_flexlink as flx
        assert flx._native.cuda_module() is module
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
        def make(mod):
            return jax.jit(jax.shard_map(
                lambda v: (mod.psum(v, "x"), mod.ppermute(v, "x", [(0, 1)]),
                           mod.psum_scatter(v, "x", tiled=True)),
                mesh=mesh, in_specs=P("x"), out_specs=(P(), P("x"), P("x"))))
        x = np.arange(128, dtype=np.float32)  # 16 per device: psum_scatter's 8 blocks
        calls = re.compile(r'custom_call_target="(flexlink_\\w+)"|custom_call @(flexlink_\\w+)')
        def targets(text):
            return sorted({{a or b for a, b in calls.findall(text)}})
        for platform in ("cuda", "cpu"):
            text = make(flx).trace(x).lower(lowering_platforms=(platform,)).as_text()
            assert targets(text) == ["flexlink_all_reduce", "flexlink_ppermute", "flexlink_reduce_scatter"], (platform, text)
            with flx.replace_collectives():
                text = make(lax).trace(x).lower(lowering_platforms=(platform,)).as_text()
            assert targets(text) == ["flexlink_all_reduce", "flexlink_ppermute", "flexlink_reduce_scatter"], (platform, text)
            assert "stablehlo.all_reduce" not in text and "FLEXLINK_CUDA=ON" not in text
            # Every call carries its engine's link set at lowering: the GPU engine's on CUDA (it picks
            # a GPU group across processes set up then), the CPU engine's on CPU (all ranks run on it).
            versions = set(re.findall(r"links_version = (\\d+) : i64", text))
            engine = module if platform == "cuda" else flx._native.cpu_module()
            assert versions == {{str(engine.links_version())}}, (platform, versions)
        np.testing.assert_array_equal(np.asarray(make(flx)(x)[0]), np.asarray(make(lax)(x)[0]))  # CPU runs
        if importlib.util.find_spec("nvidia") and importlib.util.find_spec("nvidia.nccl"):
            # NCCL by dlopen, no driver needed: the wheel's, whose path jax_flexlink passed
            assert module.nccl_version() >= 21800, module.nccl_version()
            assert module.nccl_library().endswith("libnccl.so.2"), module.nccl_library()
        assert set(flx.stats()["links"]) == {{"shm"}}, flx.stats()  # GPU links not chosen, never ran
        generation = jax.config.jax_flexlink_links_generation
        flx.configure(links="nccl;pcie")
        assert module.links() == ["nccl", "pcie"] and flx._flexlink.links() == ["shm"], flx._flexlink.links()
        # New GPU links step the jit key (jitted programs lower again, onto the new set's version).
        assert jax.config.jax_flexlink_links_generation == generation + 1
        text = make(flx).trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert set(re.findall(r"links_version = (\\d+) : i64", text)) == {{str(module.links_version())}}, text
        assert set(flx.stats()["links"]) == {{"shm", "nccl", "pcie"}}, flx.stats()
        # Nominal fits (jax_flexlink.topology's) reach the GPU engine as its seed; bad ones are refused.
        module.seed_model(2, {{"all_reduce": [(2e-5, 1 / 300e9), (1e-5, 1 / 30e9)]}})
        for bad, why in (({{"all_reduce": [(2e-5, 1e-11)]}}, "1 fits for 2 links"),
                         ({{"all_reduce": [(2e-5, 0.0), (1e-5, 1e-10)]}}, "beta > 0"),
                         ({{"allreduce": [(2e-5, 1e-11), (1e-5, 1e-10)]}}, "unknown collective")):
            try:
                module.seed_model(2, bad)
            except ValueError as e:
                assert why in str(e), e
            else:
                raise AssertionError(f"seed_model accepted {{bad}}")
        try:
            flx.configure(links="nccl;rdma")
        except ValueError as e:
            assert "not implemented yet" in str(e) and "docs/cuda.md" in str(e), e
        else:
            raise AssertionError("rdma accepted")
        try:
            flx.configure(links="shm;pcie")
        except ValueError as e:
            assert "mix GPU links" in str(e), e
        else:
            raise AssertionError("a mixed spec accepted")
        print("OK")
    """)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr
