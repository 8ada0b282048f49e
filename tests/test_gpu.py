"""Checks that need a GPU (marker `gpu`: skipped without one, with the reason). On a GPU machine:
`JAX_PLATFORMS=cpu,cuda python -m pytest -m gpu` (benchmarks/gpu_check.sh runs them); the suite's
own default, JAX_PLATFORMS=cpu, leaves CUDA out and skips them saying so.

What they expect of the CUDA module (issue 12), so they run unchanged once it is built:
- a build with FLEXLINK_CUDA=ON lowers FlexLink's collectives for "cuda" (detected by lowering one:
  without the module the explicit API raises the error naming the build option);
- `jax_flexlink.configure(links=...)` takes the link kinds `nccl` and `pcie` for GPU collectives.
Without the module they check what issue 12 promises for that build: explicit calls raise the
build-option error, replacement leaves GPU collectives to lax.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import helpers
import jax_flexlink as flx
from jax_flexlink import _flexlink, topology

pytestmark = pytest.mark.gpu

BUILD_OPTION = "FLEXLINK_CUDA=ON"


def _mesh(devices):
    return Mesh(np.array(list(devices)), ("x",))


def _psum_program(mod, mesh):
    return jax.jit(jax.shard_map(lambda v: mod.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))


@pytest.fixture(scope="module")
def cuda_built(gpus):
    """Whether this build lowers FlexLink's collectives for CUDA."""
    x = np.zeros(len(gpus), np.float32)
    try:
        _psum_program(flx, _mesh(gpus)).lower(x)
    except NotImplementedError as e:
        if BUILD_OPTION in str(e):
            return False
        raise
    return True


@pytest.fixture(scope="module")
def two_gpus(gpus):
    if len(gpus) < 2:
        pytest.skip(f"needs 2 or more GPUs, this machine has {len(gpus)}")
    return gpus


@pytest.fixture(scope="module")
def flexlink_on_gpus(cuda_built):
    if not cuda_built:
        pytest.skip(f"this jax_flexlink was built without the CUDA module ({BUILD_OPTION})")


def test_topology_sees_jax_gpus(gpus):
    topo = topology.discover()
    assert topo.nvml.available, topo.nvml.error
    assert len(topo.gpus) >= len(gpus), (topo.gpus, gpus)
    names = [g.name for g in topo.gpus]
    for d in gpus:
        assert any(d.device_kind in n or n in d.device_kind for n in names), (d.device_kind, names)
    for g in topo.gpus:
        assert g.memory_bytes and g.pcie.gen and g.pcie.width and g.pci_bus_id, g
    nominal = topology.nominal_links(topo)
    assert "pcie" in nominal and (len(topo.gpus) < 2 or "nccl" in nominal), nominal
    assert topology.loads(topology.dumps(topo)) == topo


def test_lax_collectives_on_the_gpus(gpus):
    """The machine's own baseline: XLA's collectives across every GPU."""
    n = len(gpus)
    x = np.arange(n * 4, dtype=np.float32)
    out = jax.jit(jax.shard_map(lambda v: lax.psum(v, "x"), mesh=_mesh(gpus), in_specs=P("x"),
                                out_specs=P()))(x)
    np.testing.assert_array_equal(np.asarray(out), x.reshape(n, 4).sum(0))


def test_a_build_without_the_cuda_module(gpus, cuda_built):
    if cuda_built:
        pytest.skip("this build has the CUDA module")
    mesh = _mesh(gpus)
    x = np.arange(len(gpus) * 4, dtype=np.float32)
    with pytest.raises(NotImplementedError, match=BUILD_OPTION):
        _psum_program(flx, mesh)(x)
    with flx.replace_collectives():
        f = _psum_program(lax, mesh)
        np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(_psum_program(lax, mesh)(x)))
        report = flx.collectives(f, x)
    assert [c.runner for c in report] == ["xla"] and BUILD_OPTION in report[0].reason


def test_one_gpu_is_nothing_to_do(gpus, flexlink_on_gpus):
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(_psum_program(flx, _mesh(gpus[:1]))(x)), x)


def test_one_gpu_through_the_links(gpus, flexlink_on_gpus):
    """What one GPU can run of the links inside jax: the CUDA module told to send 1-rank groups
    through them (set_single_rank_through_links, tests only; normally a copy on XLA's stream), every
    collective in three dtypes through nccl (a 1-rank NCCL communicator), pcie and nccl;pcie pinned
    at 50/50, equal to lax's, every link moved bytes (counted from CUDA events read back), and the
    shutdown released the group (ncclCommFinalize/Destroy)."""
    program = """
        import jax, jax.numpy as jnp, numpy as np
        from jax import lax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        import jax_flexlink as flx
        from jax_flexlink._src import native
        cuda = native.cuda_module()
        cuda.set_single_rank_through_links(True)
        gpu = jax.devices("gpu")[:1]  # JAX_PLATFORMS=cpu,cuda (gpu_check.sh) keeps cpu the default backend
        mesh = Mesh(np.array(gpu), ("x",))
        bodies = [lambda m: lambda v: m.psum(v, "x"), lambda m: lambda v: m.pmax(v, "x"),
                  lambda m: lambda v: m.all_gather(v, "x", tiled=True),
                  lambda m: lambda v: m.psum_scatter(v, "x", tiled=True),
                  lambda m: lambda v: m.ppermute(v, "x", [(0, 0)]),
                  lambda m: lambda v: m.all_to_all(v, "x", 0, 0, tiled=True)]
        for links in ("nccl", "pcie", "nccl;pcie"):
            flx.configure(links=links, autotune_min_bytes=0)
            flx.reset_stats()
            if ";" in links:  # pinned halves in every size bucket: the balancer might leave a link out
                for kind in ("all_reduce", "all_gather", "reduce_scatter", "ppermute", "all_to_all"):
                    for b in range(10, 24):
                        cuda.set_shares(kind, 1 << b, [0.5, 0.5], True)
            for dtype in (jnp.float32, jnp.bfloat16, jnp.int32):
                x = jax.device_put(jnp.arange(4096 * 3, dtype=jnp.float32).astype(dtype), NamedSharding(mesh, P("x")))
                for body in bodies:
                    make = lambda mod: jax.jit(jax.shard_map(body(mod), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
                    np.testing.assert_array_equal(np.asarray(make(flx)(x)), np.asarray(make(lax)(x)))
            jax.effects_barrier()
            moved = {name: s["bytes"] for name, s in flx.stats()["links"].items() if name in links.split(";")}
            assert len(moved) == len(links.split(";")) and all(moved.values()), (links, flx.stats()["links"])
            print(links, moved, flush=True)
        report = flx.shutdown(30)  # new links released the earlier ones' groups: one left
        assert len(report["released"]) == 1 and not report["kept"] and not report["errors"], report
        print("ok")
    """
    result = helpers.run_python(program, timeout=150)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (result.stdout, result.stderr)


# Every collective against lax across all GPUs, through each link alone and split over both -----------

CASES = {
    "psum": (lambda m: lambda v: m.psum(v, "x"), True),
    "pmax": (lambda m: lambda v: m.pmax(v, "x"), False),
    "pmin": (lambda m: lambda v: m.pmin(v, "x"), False),
    "all_gather": (lambda m: lambda v: m.all_gather(v, "x", tiled=True), False),
    "psum_scatter": (lambda m: lambda v: m.psum_scatter(v, "x", tiled=True), True),
    "ppermute": (None, False),
    "all_to_all": (lambda m: lambda v: m.all_to_all(v, "x", 0, 0, tiled=True), False),
}
DTYPES = ["float32", "bfloat16", "float16", "float64", "int32", "uint8"]


def _body(case, n):
    if case == "ppermute":
        perm = [(i, (i + 1) % n) for i in range(n)]
        return lambda m: lambda v: m.ppermute(v, "x", perm)
    return CASES[case][0]


@pytest.fixture(params=["nccl", "pcie", "nccl;pcie"])
def links(request):
    """The links FlexLink uses; split over both from the first call (no stage-1 threshold)."""
    saved_links, saved_min = _flexlink.links_spec(), _flexlink.autotune_min_bytes()
    flx.configure(links=request.param, autotune_min_bytes=0 if ";" in request.param else None)
    flx.reset_stats()
    yield request.param
    flx.configure(links=saved_links, autotune_min_bytes=saved_min)


def _check(case, dtype, per_rank, gpus):
    n = len(gpus)
    make, sum_like = _body(case, n), CASES[case][1]
    x = helpers.make_data(dtype, (n, n * per_rank), seed=len(case))
    helpers.compare_with_lax(make, _mesh(gpus), (x,), sum_like=sum_like, n=n)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_each_collective_through_each_link(two_gpus, flexlink_on_gpus, links, case, dtype):
    _check(case, dtype, 32771, two_gpus)  # ~1 MiB per rank of float32 on 8 GPUs; odd sizes per rank
    if ";" in links:
        moved = {name: s["bytes"] for name, s in flx.stats()["links"].items()}
        assert all(moved.get(k, 0) > 0 for k in ("nccl", "pcie")), moved


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_split_over_both_links(two_gpus, flexlink_on_gpus, case, dtype):
    saved_links, saved_min = _flexlink.links_spec(), _flexlink.autotune_min_bytes()
    flx.configure(links="nccl;pcie", autotune_min_bytes=0)
    try:
        _check(case, dtype, 32771, two_gpus)
        _check(case, dtype, 125, two_gpus)  # small and not a multiple of 64 bytes
    finally:
        flx.configure(links=saved_links, autotune_min_bytes=saved_min)


def test_stage1_then_stage2_on_the_gpus(two_gpus, flexlink_on_gpus):
    """Stage 1 as a default configuration runs it (autotune on, which every test above turns off to
    test the links' ranges): the first large psum profiles nccl and pcie on the GPUs, later calls read
    the phases' CUDA events once complete, the fits are installed and stage 2 plans from them; every
    result equals lax's meanwhile (int32: exact whatever the order). Then tune() for all_gather."""
    from jax_flexlink._src import native
    module = native.cuda_module()
    saved = (module.links_spec(), module.autotune_min_bytes(), module.tune_max_bytes(), module.tune_use_cache())
    n, mesh, ids = len(two_gpus), _mesh(two_gpus), [d.id for d in two_gpus]
    flx_fn = helpers.per_device(lambda v: flx.psum(v, "x"), mesh)
    x = helpers.make_data("int32", (n, 1 << 20), seed=7)  # 4 MiB per GPU
    want = np.asarray(helpers.per_device(lambda v: lax.psum(v, "x"), mesh)(x))
    try:
        flx.configure(links="nccl;pcie", autotune_min_bytes="1M", tune_max_bytes="4M")
        module.set_tune_use_cache(False)
        module.forget_model("all_reduce")
        model, calls = None, 0
        while calls < 60 and not (model and "all_reduce" in model["fits"]):
            np.testing.assert_array_equal(np.asarray(flx_fn(x)), want, err_msg=f"call {calls + 1}")
            calls += 1
            model = module.group_fits(ids)
        assert model and "all_reduce" in model["fits"], (calls, model)
        fits = model["fits"]["all_reduce"]
        assert len(fits) == 2 and all(alpha >= 0 and beta > 0 for alpha, beta in fits), fits
        for i in range(8):
            np.testing.assert_array_equal(np.asarray(flx_fn(x)), want, err_msg=f"stage 2, call {i + 1}")
        plans = [p for p in flx.stats()["plans"] if p["collective"] == "all_reduce"]
        assert plans and all(p["mode"] != "profile" for p in plans), plans
        tuned = flx.tune(collectives="all_gather", max_bytes="4M", devices=two_gpus, use_cache=False)
        assert len(tuned["fits"]["all_gather"]) == 2, tuned
        _check("all_gather", "int32", 1 << 18, two_gpus)
    finally:
        flx.configure(links=saved[0], autotune_min_bytes=saved[1], tune_max_bytes=saved[2])
        module.set_tune_use_cache(saved[3])


def test_flexlink_runs_the_gpu_collectives(two_gpus, flexlink_on_gpus):
    mesh = _mesh(two_gpus)
    x = jnp.arange(len(two_gpus) * 1024, dtype=jnp.float32)
    report = flx.collectives(_psum_program(flx, mesh), x)
    assert [c.runner for c in report] == ["flexlink"], report
    with flx.replace_collectives():
        report = flx.collectives(_psum_program(lax, mesh), x)
    assert [c.runner for c in report] == ["flexlink"], report


def test_shutdown_releases_the_groups(two_gpus, flexlink_on_gpus):
    """jax_flexlink.shutdown() after FlexLink ran on the GPUs (nccl and pcie): the group released
    (NCCL's finalize and destroy of real communicators), a later call refused, a program lowered
    afterwards on lax; and a process that never calls it exits through the exit handler silently.
    In fresh interpreters: the shutdown is for good."""
    program = """
        import atexit, sys
        def exit_check():  # registered before jax and jax_flexlink: runs after their exit handlers
            from jax_flexlink._src import native
            print("exit-check", native.cuda_module().is_shut_down(), native.cuda_module().has_groups(), flush=True)
        atexit.register(exit_check)
        import jax, jax.numpy as jnp, numpy as np
        from jax import lax
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_flexlink as flx
        gpus = jax.devices("gpu")  # JAX_PLATFORMS=cpu,cuda (gpu_check.sh) keeps cpu the default backend
        mesh = Mesh(np.array(gpus), ("x",))
        make = lambda mod: jax.jit(jax.shard_map(lambda v: mod.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
        flx.configure(links="nccl;pcie", autotune_min_bytes=0)
        x = jax.device_put(jnp.arange(len(gpus) * (1 << 18), dtype=jnp.float32), jax.sharding.NamedSharding(mesh, P("x")))
        f = make(flx)
        np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(make(lax)(x)))
        if sys.argv[-1] != "at-exit":
            report = flx.shutdown(30)
            assert report["engine"] == "cuda" and len(report["released"]) == 1 and not report["kept"] \
                and not report["errors"], report
            try:
                np.asarray(f(x))
            except Exception as e:
                assert "was shut down" in str(e), e
            else:
                raise AssertionError("a FlexLink call ran after the shutdown")
            with flx.replace_collectives():
                text = make(lax).lower(x).as_text()
            assert "flexlink_all_reduce" not in text, text
        print("ok")
    """
    for mode in ("explicit", "at-exit"):
        result = helpers.run_python(program.replace("sys.argv[-1]", repr(mode)), timeout=100)
        assert result.returncode == 0 and "ok\nexit-check True True" in result.stdout, (mode, result.stdout, result.stderr)
        assert "flexlink: warning: at exit" not in result.stderr, (mode, result.stderr)


def test_new_links_release_the_earlier_groups(two_gpus, flexlink_on_gpus):
    """New GPU links release the groups of the earlier ones (GpuEngine::ReleaseEarlierLinks): NCCL's
    finalize and destroy of real communicators while the engine stays open; the calls on the new
    links right; the shutdown then releases only the current links' group. In a fresh interpreter,
    so that no other test's groups are in the reports."""
    program = """
        import warnings
        import jax, jax.numpy as jnp, numpy as np
        from jax import lax
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_flexlink as flx
        from jax_flexlink._src import native, runtime
        cuda = native.cuda_module()
        gpus = jax.devices("gpu")  # JAX_PLATFORMS=cpu,cuda (gpu_check.sh) keeps cpu the default backend
        mesh = Mesh(np.array(gpus), ("x",))
        make = lambda mod: jax.jit(jax.shard_map(lambda v: mod.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
        x = jax.device_put(jnp.arange(len(gpus) * (1 << 18), dtype=jnp.int32), jax.sharding.NamedSharding(mesh, P("x")))
        want = np.asarray(make(lax)(x))
        flx.configure(links="nccl", autotune_min_bytes=0)
        np.testing.assert_array_equal(np.asarray(make(flx)(x)), want)
        cuda.configure_links("nccl;pcie")  # the module's own: configure() would release at once
        report = runtime.release_earlier_gpu_groups(cuda)
        released = lambda r: [line.split(" (links ")[1] for line in r["released"]]
        assert released(report) == ["nccl)"] and not report["kept"] and not report["errors"], report
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(make(flx)(x)), want)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            flx.configure(links="nccl")  # releases the nccl;pcie group, with nothing to warn about
        np.testing.assert_array_equal(np.asarray(make(flx)(x)), want)
        assert runtime.release_earlier_gpu_groups(cuda)["released"] == []
        report = flx.shutdown(30)
        assert released(report) == ["nccl)"] and not report["kept"] and not report["errors"], report
        print("ok")
    """
    result = helpers.run_python(program, timeout=100)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (result.stdout, result.stderr)


def test_gpus_jax_was_shown_only_some_of(two_gpus, flexlink_on_gpus):
    """jax shown every GPU but the first (jax_cuda_visible_devices, as jax.distributed's
    local_device_ids sets it): XLA runs them as CUDA ordinals 1.. while jax numbers them from 0
    (docs/cuda.md, "Device ids"). The CUDA module's map follows local_hardware_id, and every
    collective through nccl;pcie matches lax (with 2 GPUs, one GPU: the one-device path)."""
    program = """
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_cuda_visible_devices", SHOWN)  # before any backend starts
        from jax import lax
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_flexlink as flx
        from jax_flexlink._src import native
        gpus = jax.devices("gpu")  # JAX_PLATFORMS=cpu,cuda (gpu_check.sh) keeps cpu the default backend
        assert gpus and min(d.local_hardware_id for d in gpus) >= 1, [(d.id, d.local_hardware_id) for d in gpus]
        mesh = Mesh(np.array(gpus), ("x",))
        flx.configure(links="nccl;pcie", autotune_min_bytes=0)
        n = len(gpus)
        x = jax.device_put(jnp.arange(n * n * 1024, dtype=jnp.float32), jax.sharding.NamedSharding(mesh, P("x")))
        for body in (lambda m: lambda v: m.psum(v, "x"), lambda m: lambda v: m.all_gather(v, "x", tiled=True),
                     lambda m: lambda v: m.psum_scatter(v, "x", tiled=True),
                     lambda m: lambda v: m.ppermute(v, "x", [(i, (i + 1) % n) for i in range(n)])):
            make = lambda mod: jax.jit(jax.shard_map(body(mod), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
            np.testing.assert_array_equal(np.asarray(make(flx)(x)), np.asarray(make(lax)(x)))
        ids = native.cuda_module().device_ids()
        assert all(ids[d.local_hardware_id] == d.id for d in gpus) and ids[0] == -1, (ids, gpus)
        print("ok")
    """
    shown = ",".join(str(i) for i in range(1, len(two_gpus)))
    result = helpers.run_python(program.replace("SHOWN", repr(shown)), timeout=100)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (result.stdout, result.stderr)


def test_configure_links_while_gpu_calls_are_queued(two_gpus, flexlink_on_gpus):
    """Calls dispatched before configure(links=...) (jax dispatches asynchronously) run on the GPU
    links they were lowered with on every rank, whatever is current when each rank's device thread
    gets to them, and the release of the earlier groups that configure runs never strands one: a
    call of an earlier set that comes after its group was released gets a new group of that set
    (GpuEngine::GetGroup; gpu_sim_test TestQueuedCallsAcrossLinkChange). In a fresh interpreter."""
    program = """
        import warnings
        import jax, jax.numpy as jnp, numpy as np
        from jax import lax
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_flexlink as flx
        gpus = jax.devices("gpu")  # JAX_PLATFORMS=cpu,cuda (gpu_check.sh) keeps cpu the default backend
        mesh = Mesh(np.array(gpus), ("x",))
        make = lambda mod: jax.jit(jax.shard_map(lambda v: mod.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
        x = jax.device_put(jnp.arange(len(gpus) * (1 << 20), dtype=jnp.int32) % 1000,
                           jax.sharding.NamedSharding(mesh, P("x")))
        want = np.asarray(make(lax)(x))
        flx.configure(links="nccl", autotune_min_bytes=0, timeout_s=30)
        f = make(flx)
        outs = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(12):
                outs.append(f(x))
                flx.configure(links="nccl;pcie" if i % 2 == 0 else "nccl")
            for y in outs:
                np.testing.assert_array_equal(np.asarray(y), want)
        print("warnings", [str(w.message) for w in caught if "not released" in str(w.message)])
        report = flx.shutdown(30)
        assert not report["kept"] and not report["errors"], report
        print("ok")
    """
    result = helpers.run_python(program, timeout=200)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (result.stdout, result.stderr)


# Floating max/min with NaN: NCCL's semantics on both links, as native lax on the GPU -------------------
#
# XLA:GPU's all-reduce with max/min is ncclMax/ncclMin, whose kernels use fmaxf/fmax/__hmax: a NaN
# operand is dropped, the result is NaN only where every rank's is. FlexLink's GPU engine gives the
# same on the nccl link (NCCL itself) and the pcie link (its own kernels, xla_ffi/cuda/elementwise.h),
# so the result does not depend on the split. (On CPU, lax and FlexLink propagate NaN instead.) The
# sign of a zero max/min is not part of the contract: values are compared, +0 == -0.


def _nan_rows(dtype, n, m, seed):
    """n ranks' rows of m values: in each 16 columns, NaN on one rank, on all but one, on every rank,
    on every other rank, beside +-inf and +-0; ordinary values in the rest."""
    x = helpers.make_data("float64", (n, m), seed=seed)
    k = np.arange(m) % 16
    x[0, k == 0] = np.nan                                    # one rank
    x[: n - 1, k == 1] = np.nan                              # all but the last
    x[:, k == 2] = np.nan                                    # every rank
    x[1::2, k == 3] = np.nan                                 # every other rank
    x[0, k == 4], x[n - 1, k == 4] = np.inf, np.nan          # +inf beside a NaN
    x[:, k == 5] = -np.inf
    x[n - 1, k == 5] = np.nan                                # -inf everywhere but one NaN
    x[:, k == 6] = 0.0
    x[0, k == 6] = -0.0                                      # zeros of both signs
    x[:, k == 7] = -0.0
    x[n - 1, k == 7] = np.nan                                # -0 beside a NaN
    x[0, k == 8], x[n - 1, k == 8] = np.inf, -np.inf         # both infinities
    return x.astype(jnp.dtype(dtype))


@pytest.mark.parametrize("op", ["pmax", "pmin"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_pmax_pmin_with_nans_match_lax(two_gpus, flexlink_on_gpus, links, op, dtype):
    n, mesh = len(two_gpus), _mesh(two_gpus)
    make = CASES[op][0]
    lax_fn = helpers.per_device(make(lax), mesh)
    flx_fn = helpers.per_device(make(flx), mesh)
    nan_max = np.fmax if op == "pmax" else np.fmin   # IEEE maxNum/minNum: NaN only if both are NaN
    for m in (32771, 125):  # several chunks, odd per rank; and small, not a multiple of 64 bytes
        x = _nan_rows(dtype, n, m, seed=m)
        want = np.asarray(lax_fn(x))
        got = np.asarray(flx_fn(x))
        what = f"{op} {dtype} {m} per rank over {links}"
        # NaN positions equal, values equal (+0 == -0): FlexLink against native lax on the GPUs.
        helpers.assert_leaf_equal(got, want, what)
        # The contract itself (and what lax on a GPU should give): NaN only where every rank is NaN.
        ref = np.broadcast_to(nan_max.reduce(x.astype(np.float64), axis=0), (n, m))
        helpers.assert_leaf_equal(got.astype(np.float64), ref, what + ", against numpy's fmax/fmin")
        assert np.isnan(got.astype(np.float64)[:, 2::16]).all() and not np.isnan(got.astype(np.float64)[:, 0::16]).any()
    if ";" in links:
        moved = {name: s["bytes"] for name, s in flx.stats()["links"].items()}
        assert all(moved.get(k, 0) > 0 for k in ("nccl", "pcie")), moved
