"""By-hand A/B timing of the FlexLink custom calls against native lax collectives (not collected by
pytest; the real benchmark is `python -m jax_flexlink.bench`). Uses a throwaway primitive that lowers
straight to the custom call, so it measures the engine through XLA without the front end.

  PYTHONPATH=<cmake build dir> python tests/cpp/ffi_bench.py MODE [sizes,...] [staging_bytes|-1] [huge 0|1]

ard: all_reduce with donated input (output aliases input); ar: not donated; ag: all_gather(tiled);
pp: ppermute, a ring shift by one; a2a: all_to_all(tiled, split = concat = axis 0);
leaves: psum of 13 gradient-like leaves (float32 matrices, bfloat16 vectors, an int32 counter), the
size being the float32 bytes of the largest leaf: lax's psum of the pytree vs one FlexLink call of 13
operands vs 13 FlexLink calls (the third column).
Native and FlexLink calls alternate, so both see the same machine load; prints min/median per call.
"""
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jax._src import core
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
try:
    import _flexlink as fl
except ImportError:
    from jax_flexlink import _flexlink as fl
jax.devices()
for name, cap in fl.registrations().items():
    jax.ffi.register_ffi_target(name, cap, platform="cpu")
N = 8
smoke_p = core.Primitive("flexlink_smoke")
smoke_p.multiple_results = True


def abstract(*xs, target, **kw):
    out = []
    for x in xs:
        shape = x.shape
        if target == "flexlink_all_gather": shape = (x.shape[0] * N,) + x.shape[1:]
        if target == "flexlink_reduce_scatter": shape = (x.shape[0] // N,) + x.shape[1:]
        out.append(core.ShapedArray(shape, x.dtype))
    return out


smoke_p.def_abstract_eval(abstract)


def lowering(ctx, *xs, target, attrs, alias, separate=False):
    """One custom call of all operands, or (`separate`) one per operand, chained by the token so that
    every device runs them in the same order (unchained side-effecting calls may be reordered per
    device, which deadlocks)."""
    i64 = ir.IntegerType.get_signless(64)
    cfg = {}
    for k, v in attrs:
        cfg[k] = (ir.StringAttr.get(v) if isinstance(v, str) else ir.DenseI64ArrayAttr.get(list(v))
                  if isinstance(v, tuple) else ir.IntegerAttr.get(i64, v))
    types = [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out]
    groups = [[i] for i in range(len(xs))] if separate else [list(range(len(xs)))]
    token, results = hlo.create_token(), []
    for g in groups:
        op = mlir.custom_call(target, result_types=[types[i] for i in g] + [hlo.TokenType.get()],
                              operands=[xs[i] for i in g] + [token], backend_config=cfg, api_version=4,
                              has_side_effect=True,
                              operand_output_aliases={i: i for i in range(len(g))} if alias else None)
        results += list(op.results[:len(g)])
        token = op.results[len(g)]
    return results


mlir.register_lowering(smoke_p, lowering, platform="cpu", cacheable=False)
mesh = Mesh(np.array(jax.devices()), ("x",))
ids = tuple(int(i) for i in mesh.device_ids.flat)
BASE = (("groups", ids), ("group_sizes", (N,)), ("label", "bench"))


def ours(target, *xs, alias=False, separate=False, **attrs):
    return smoke_p.bind(*xs, target=target, attrs=BASE + tuple(sorted(attrs.items())), alias=alias,
                        separate=separate)


def make(body, donate=False, out_spec=P("x")):
    f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out_spec, check_vma=False)
    return jax.jit(f, donate_argnums=(0,) if donate else ())


kind = sys.argv[1] if len(sys.argv) > 1 else "ar"
sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
if len(sys.argv) > 2: sizes = [int(s) for s in sys.argv[2].split(",")]
if len(sys.argv) > 3 and int(sys.argv[3]) >= 0: fl.set_shm_staging_bytes(int(sys.argv[3]))
if len(sys.argv) > 4: fl.set_huge_page_outputs(bool(int(sys.argv[4])))


def bench(fns, x, iters, donated):
    xs = [x if not donated else jnp.array(x) for _ in fns]
    ts = [[] for _ in fns]
    for j, f in enumerate(fns):
        y = f(xs[j]); jax.block_until_ready(y)
        if donated: xs[j] = y
    for _ in range(iters):
        for j, f in enumerate(fns):
            t0 = time.perf_counter(); y = f(xs[j]); jax.block_until_ready(y); ts[j].append(time.perf_counter() - t0)
            if donated: xs[j] = y
    return [(min(t), float(np.median(t))) for t in ts]


def leaves(b):
    """13 leaves; the largest float32 leaf has b bytes per device, the others are smaller."""
    n = max(1, b // 4)
    shapes = [("float32", (n,)), ("bfloat16", (7,)), ("int32", (1,)), ("float32", (max(1, n // 16), 4)),
              ("bfloat16", (max(1, n // 2),)), ("float32", (33,)), ("float32", (max(1, n // 4),)),
              ("bfloat16", (129,)), ("float32", (3, 5)), ("int32", (17,)), ("float32", (max(1, n // 8),)),
              ("bfloat16", (1000,)), ("float32", (64,))]
    return tuple(jnp.ones((N * s[0],) + s[1:], dt) for dt, s in shapes)


print(f"{kind} {'bytes/dev':>10} {'native min/med ms':>20} {'flex min/med ms':>20} {'ratio(min) ratio(med)':>22}"
      + ("   13 calls min/med ms" if kind == "leaves" else ""))
for b in sizes:
    n = b // 4
    x = jnp.ones((N * n,), jnp.float32)
    iters = 60 if b <= (1 << 20) else 12 if b <= (16 << 20) else 5
    if kind in ("ar", "ard"):
        d = kind == "ard"
        nat = make(lambda v: jax.lax.psum(v, "x"), donate=d)
        fl_ = make(lambda v: ours("flexlink_all_reduce", v, alias=d, reduction="sum")[0], donate=d)
        r = bench([nat, fl_], x, iters, d)
    elif kind == "ag":
        nat = make(lambda v: jax.lax.all_gather(v, "x", tiled=True), out_spec=P())
        fl_ = make(lambda v: ours("flexlink_all_gather", v, axis=0)[0], out_spec=P())
        r = bench([nat, fl_], x, iters, False)
    elif kind == "pp":
        perm = [(i, (i + 1) % N) for i in range(N)]
        nat = make(lambda v: jax.lax.ppermute(v, "x", perm))
        fl_ = make(lambda v: ours("flexlink_ppermute", v, pairs=tuple(r for p in perm for r in p))[0])
        r = bench([nat, fl_], x, iters, False)
    elif kind == "a2a":
        nat = make(lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True))
        fl_ = make(lambda v: ours("flexlink_all_to_all", v, axis=0)[0])
        r = bench([nat, fl_], x, iters, False)
    elif kind == "leaves":
        tree = leaves(b)
        specs = tuple(P("x") for _ in tree)
        def mk(body):
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False))
        nat = mk(lambda t: tuple(jax.lax.psum(t, "x")))
        one = mk(lambda t: tuple(ours("flexlink_all_reduce", *t, reduction="sum")))
        sep = mk(lambda t: tuple(ours("flexlink_all_reduce", *t, reduction="sum", separate=True)))
        r = bench([nat, one, sep], tree, iters, False)
    else:
        raise SystemExit(f"unknown mode {kind}")
    extra = f"   {r[2][0]*1e3:>9.3f}/{r[2][1]*1e3:<9.3f}" if len(r) > 2 else ""
    print(f"{kind} {b:>10} {r[0][0]*1e3:>9.3f}/{r[0][1]*1e3:<9.3f} {r[1][0]*1e3:>9.3f}/{r[1][1]*1e3:<9.3f} "
          f"{r[1][0]/r[0][0]:>10.2f} {r[1][1]/r[0][1]:>10.2f}{extra}", flush=True)
