"""By-hand smoke check of the native module (not collected by pytest).

1. engine_run with Python threads as devices: every kind, in place, bool/complex/bfloat16, an error,
   and the deadline error with one rank missing.
2. The FFI handlers end to end: registered with jax.ffi.register_ffi_target and called from a
   throwaway primitive whose lowering emits the custom call with a fresh token (the real front end
   chains tokens), inside shard_map over 8 host devices, compared with lax.

Run:  PYTHONPATH=<cmake build dir> python tests/cpp/ffi_smoke.py
"""
import os
import sys
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import ml_dtypes
import numpy as np

try:
    import _flexlink as fl
except ImportError:
    from jax_flexlink import _flexlink as fl

N = 8
GROUP = list(range(N))
_next_run = [100]


def run_threads(kind, op, xs, outs, axis=0, devices=N, label="smoke"):
    _next_run[0] += 1
    run_id = _next_run[0]
    errs = [None] * N

    def body(d):
        try:
            fl.engine_run(kind, op, GROUP, [N], d, run_id, xs[d], outs[d], axis=axis, label=label)
        except Exception as e:  # noqa: BLE001 - reported below
            errs[d] = e

    threads = [threading.Thread(target=body, args=(d,)) for d in range(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errs


def check_engine_run():
    xs = [np.arange(1000, dtype=np.float32) * (d + 1) for d in range(N)]
    outs = [np.empty_like(x) for x in xs]
    assert run_threads("all_reduce", "sum", xs, outs) == [None] * N
    assert all((o == np.arange(1000, dtype=np.float32) * 36).all() for o in outs)
    assert run_threads("all_reduce", "max", xs, xs) == [None] * N  # in place
    assert all((x == np.arange(1000) * 8).all() for x in xs)
    xs = [np.full((2, 3), d, np.int32) for d in range(N)]
    outs = [np.empty((2, N, 3), np.int32) for _ in range(N)]
    assert run_threads("all_gather", "", xs, outs, axis=1) == [None] * N
    assert all((o[:, k, :] == k).all() for o in outs for k in range(N))
    xs = [np.arange(N * 4, dtype=np.int64) for _ in range(N)]
    outs = [np.empty(4, np.int64) for _ in range(N)]
    assert run_threads("reduce_scatter", "sum", xs, outs) == [None] * N
    assert all((outs[r] == N * np.arange(4 * r, 4 * r + 4)).all() for r in range(N))
    xs = [np.array([d == 3, False, True]) for d in range(N)]
    outs = [np.empty(3, bool) for _ in range(N)]
    assert run_threads("all_reduce", "max", xs, outs) == [None] * N
    assert outs[0].tolist() == [True, False, True]
    xs = [np.full(3, 1 + 1j, np.complex64) for _ in range(N)]
    outs = [np.empty(3, np.complex64) for _ in range(N)]
    assert run_threads("all_reduce", "prod", xs, outs) == [None] * N
    assert (outs[0] == (1 + 1j) ** 8).all()
    xs = [np.full(5, 1.5, ml_dtypes.bfloat16) for _ in range(N)]
    outs = [np.empty(5, ml_dtypes.bfloat16) for _ in range(N)]
    assert run_threads("all_reduce", "sum", xs, outs) == [None] * N
    assert (outs[0].astype(np.float32) == 12).all()
    errs = run_threads("all_reduce", "max", [np.zeros(3, np.complex64)] * N,
                       [np.zeros(3, np.complex64) for _ in range(N)])
    assert all(isinstance(e, RuntimeError) and "complex" in str(e) for e in errs), errs
    saved = fl.timeout()
    fl.set_timeout(0.5)
    start = time.time()
    errs = run_threads("all_reduce", "sum", [np.ones(4, np.float32)] * N,
                       [np.empty(4, np.float32) for _ in range(N)], devices=N - 1,
                       label="psum over axes ('x',)")
    fl.set_timeout(saved)
    msg = str(errs[0])
    assert time.time() - start < 5 and "rank 7 (device 7)" in msg and "psum over axes" in msg, msg
    print("engine_run: ok;", msg[:120], "...")


def check_handlers():
    import jax
    import jax.numpy as jnp
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo
    from jax.sharding import Mesh, PartitionSpec as P

    jax.devices()  # backend first, then registration (see JAX_FACTS.md)
    for name, capsule in fl.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")

    prim = core.Primitive("flexlink_ffi_smoke")

    def abstract(x, *, target, n, **_):
        shape = x.shape
        if target == "flexlink_all_gather":
            shape = (x.shape[0] * n,) + x.shape[1:]
        if target == "flexlink_reduce_scatter":
            shape = (x.shape[0] // n,) + x.shape[1:]
        return core.ShapedArray(shape, x.dtype)

    def lowering(ctx, x, *, target, n, groups, reduction, axis, label):
        (aval_out,) = ctx.avals_out
        cfg = {"groups": ir.DenseI64ArrayAttr.get(list(groups)),
               "group_sizes": ir.DenseI64ArrayAttr.get([len(groups)]),
               "label": ir.StringAttr.get(label)}
        if target != "flexlink_all_gather":
            cfg["reduction"] = ir.StringAttr.get(reduction)
        if target != "flexlink_all_reduce":
            cfg["axis"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), axis)
        op = mlir.custom_call(
            target, result_types=[mlir.aval_to_ir_type(ctx.module_context, aval_out), hlo.TokenType.get()],
            operands=[x, hlo.create_token()], backend_config=cfg, api_version=4, has_side_effect=True)
        return [op.results[0]]

    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, lowering, platform="cpu", cacheable=False)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    ids = tuple(int(i) for i in mesh.device_ids.flat)

    def sm(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))

    def ours(target, reduction="sum", axis=0):
        return sm(lambda b: prim.bind(b, target=target, n=N, groups=ids, reduction=reduction, axis=axis,
                                      label=f"smoke {target}"))

    x = jnp.arange(N * 1024, dtype=jnp.float32)
    assert (ours("flexlink_all_reduce")(x) == sm(lambda b: jax.lax.psum(b, "x"))(x)).all()
    xb = (jnp.arange(N * 100) % 7).astype(jnp.bfloat16)
    assert (ours("flexlink_all_reduce", "max")(xb) == sm(lambda b: jax.lax.pmax(b, "x"))(xb)).all()
    xi = jnp.arange(N * 6, dtype=jnp.int32).reshape(N * 2, 3)
    assert (ours("flexlink_all_gather")(xi) == sm(lambda b: jax.lax.all_gather(b, "x", tiled=True))(xi)).all()
    xr = jnp.arange(N * 16, dtype=jnp.float32)
    assert (ours("flexlink_reduce_scatter")(xr) ==
            sm(lambda b: jax.lax.psum_scatter(b, "x", tiled=True))(xr)).all()
    try:
        ours("flexlink_all_reduce", "max")(jnp.ones(N * 4, jnp.complex64)).block_until_ready()
        raise AssertionError("complex max should fail")
    except Exception as e:  # noqa: BLE001
        assert "complex" in str(e), e
    print("FFI handlers: ok (all_reduce f32/bf16, all_gather int32, reduce_scatter f32, error path)")


if __name__ == "__main__":
    check_engine_run()
    check_handlers()
    sys.exit(0)
