"""By-hand A/B timing of the FlexLink custom calls against native lax collectives (not collected by
pytest; the real benchmark is `python -m jax_flexlink.bench`). Uses a throwaway primitive that lowers
straight to the custom call, so it measures the engine through XLA without the front end.

  PYTHONPATH=<cmake build dir> python tests/cpp/ffi_bench.py ard|ar|ag [sizes,...] [staging_bytes|-1] [huge 0|1]

ard: all_reduce with donated input (output aliases input); ar: not donated; ag: all_gather(tiled).
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
smoke_p = core.Primitive("flexlink_smoke")
def abstract(x, *, target, n, **kw):
    shape = x.shape
    if target == "flexlink_all_gather": shape = (x.shape[0] * n,) + x.shape[1:]
    if target == "flexlink_reduce_scatter": shape = (x.shape[0] // n,) + x.shape[1:]
    return core.ShapedArray(shape, x.dtype)
smoke_p.def_abstract_eval(abstract)
def lowering(ctx, x, *, target, n, groups, reduction, axis, label, alias):
    aval_out, = ctx.avals_out
    tok = hlo.create_token()
    i64 = ir.IntegerType.get_signless(64)
    cfg = {"groups": ir.DenseI64ArrayAttr.get(list(groups)), "group_sizes": ir.DenseI64ArrayAttr.get([len(groups)]),
           "label": ir.StringAttr.get(label)}
    if target != "flexlink_all_gather": cfg["reduction"] = ir.StringAttr.get(reduction)
    if target != "flexlink_all_reduce": cfg["axis"] = ir.IntegerAttr.get(i64, axis)
    op = mlir.custom_call(target, result_types=[mlir.aval_to_ir_type(ctx.module_context, aval_out), hlo.TokenType.get()],
                          operands=[x, tok], backend_config=cfg, api_version=4, has_side_effect=True,
                          operand_output_aliases={0: 0} if alias else None)
    return [op.results[0]]
mlir.register_lowering(smoke_p, lowering, platform="cpu", cacheable=False)
mesh = Mesh(np.array(jax.devices()), ("x",))
ids = tuple(int(i) for i in mesh.device_ids.flat)
def make(body, donate=False, out_spec=P("x")):
    f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out_spec, check_vma=False)
    return jax.jit(f, donate_argnums=(0,) if donate else ())
import numpy as np
kind = sys.argv[1] if len(sys.argv) > 1 else "ar"
sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
if len(sys.argv) > 2: sizes = [int(s) for s in sys.argv[2].split(",")]
if len(sys.argv) > 3 and int(sys.argv[3]) >= 0: fl.set_shm_staging_bytes(int(sys.argv[3]))
if len(sys.argv) > 4: fl.set_huge_page_outputs(bool(int(sys.argv[4])))
def bench(fns, x, iters, donated):
    xs = [x if not donated else jnp.array(x) for _ in fns]
    ts = [[] for _ in fns]
    for j, f in enumerate(fns):
        y = f(xs[j]); y.block_until_ready()
        if donated: xs[j] = y
    for _ in range(iters):
        for j, f in enumerate(fns):
            t0 = time.perf_counter(); y = f(xs[j]); y.block_until_ready(); ts[j].append(time.perf_counter() - t0)
            if donated: xs[j] = y
    return [(min(t), float(np.median(t))) for t in ts]
print(f"{kind} {'bytes/dev':>10} {'native min/med ms':>20} {'flex min/med ms':>20} {'ratio(min) ratio(med)':>22}")
for b in sizes:
    n = b // 4
    x = jnp.ones((8 * n,), jnp.float32)
    iters = 60 if b <= (1 << 20) else 12 if b <= (16 << 20) else 5
    if kind in ("ar", "ard"):
        d = kind == "ard"
        nat = make(lambda v: jax.lax.psum(v, "x"), donate=d)
        fl_ = make(lambda v: smoke_p.bind(v, target="flexlink_all_reduce", n=8, groups=ids, reduction="sum", axis=0, label="psum", alias=d), donate=d)
        r = bench([nat, fl_], x, iters, d)
    else:
        nat = make(lambda v: jax.lax.all_gather(v, "x", tiled=True), out_spec=P())
        fl_ = make(lambda v: smoke_p.bind(v, target="flexlink_all_gather", n=8, groups=ids, reduction="", axis=0, label="ag", alias=False), out_spec=P())
        r = bench([nat, fl_], x, iters, False)
    print(f"{kind} {b:>10} {r[0][0]*1e3:>9.3f}/{r[0][1]*1e3:<9.3f} {r[1][0]*1e3:>9.3f}/{r[1][1]*1e3:<9.3f} {r[1][0]/r[0][0]:>10.2f} {r[1][1]/r[0][1]:>10.2f}", flush=True)
