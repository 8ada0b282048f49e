"""The FFI contract of the custom-call targets (docs/interfaces.md), end to end through XLA: a throwaway
primitive whose lowering emits `target(x_1, ..., x_k, token) -> (y_1, ..., y_k, token)` exactly as the
contract says (attributes, output_operand_aliases), run under shard_map on 8 host devices and compared
with lax. This pins the handlers' decoding independently of the Python front end's lowering rules."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_flexlink import _flexlink as fl
from jax_flexlink._src import native
from helpers import make_data

N = 8

native.register_targets()
_prim = core.Primitive("flexlink_ffi_contract_test")
_prim.multiple_results = True


def _abstract(*xs, out_shapes, **_):
    return [core.ShapedArray(s, x.dtype) for x, s in zip(xs, out_shapes)]


def _i64(v):
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), v)


def _lowering(ctx, *xs, target, out_shapes, attrs, aliases, token_last):
    cfg = {}
    for name, value in attrs:
        if isinstance(value, str):
            cfg[name] = ir.StringAttr.get(value)
        elif isinstance(value, tuple):
            cfg[name] = ir.DenseI64ArrayAttr.get(list(value))
        else:
            cfg[name] = _i64(value)
    results = [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out]
    operands = list(xs)
    if token_last:
        operands.append(hlo.create_token())
        results.append(hlo.TokenType.get())
    op = mlir.custom_call(target, result_types=results, operands=operands, backend_config=cfg,
                          api_version=4, has_side_effect=True,
                          operand_output_aliases={i: i for i in aliases} or None)
    return list(op.results[:len(xs)])


_prim.def_abstract_eval(_abstract)
mlir.register_lowering(_prim, _lowering, platform="cpu", cacheable=False)

MESH = Mesh(np.array(jax.devices()), ("x",))
IDS = tuple(int(i) for i in MESH.device_ids.flat)


def per_rank(body, k):
    specs = (P("x"),) * k
    return jax.jit(jax.shard_map(lambda *v: tuple(body(*v)), mesh=MESH, in_specs=specs, out_specs=specs,
                                 check_vma=False))


def call(target, xs_local, out_shapes, aliases=(), token_last=True, **attrs):
    # links_version 0: the link set current when each rank arrives (the lowering says its own).
    attrs = dict(groups=IDS, group_sizes=(N,), links_version=0, label=f"contract {target}", **attrs)
    return _prim.bind(*xs_local, target=target, out_shapes=tuple(out_shapes),
                      attrs=tuple(sorted(attrs.items())), aliases=tuple(aliases), token_last=token_last)


def stacked(specs, seed):
    return [jnp.asarray(make_data(dt, (N * shape[0],) + shape[1:], seed=seed + i))
            for i, (dt, shape) in enumerate(specs)]


LEAVES = [("float32", (64, 33)), ("bfloat16", (7,)), ("int32", (1,)), ("float16", (5, 3)),
          ("float64", (1000,)), ("uint8", (17,)), ("float32", (20001,)), ("complex64", (9,)),
          ("int64", (2, 2)), ("bfloat16", (4099,)), ("float32", (1,)), ("uint16", (129,)),
          ("int8", (31,))]


@pytest.mark.parametrize("aliases", [(), (0, 3, 9)])
def test_all_reduce_of_13_operands(aliases):
    xs = stacked(LEAVES, 10)
    k = len(xs)
    ours = per_rank(lambda *v: call("flexlink_all_reduce", v, [a.shape for a in v], aliases=aliases,
                                    reduction="sum"), k)
    got = ours(*xs)
    for i, x in enumerate(xs):
        blocks = np.split(np.asarray(x), N)
        # The engine's contract: rank order, float16/bfloat16 accumulated in float32 and rounded once.
        acc_type = np.float32 if blocks[0].dtype.name in ("float16", "bfloat16") else blocks[0].dtype
        acc = blocks[0].astype(acc_type)
        for b in blocks[1:]:
            acc = (acc + b.astype(acc_type)).astype(acc_type)
        want = np.concatenate([acc.astype(blocks[0].dtype)] * N)
        assert np.asarray(got[i]).tobytes() == want.tobytes(), f"operand {i} ({blocks[0].dtype})"


def test_all_gather_and_reduce_scatter_of_several_operands():
    specs = [("float32", (2, 37)), ("int32", (1, 5)), ("bfloat16", (3, 1001))]
    xs = stacked(specs, 30)
    gather = per_rank(lambda *v: call("flexlink_all_gather", v, [(a.shape[0] * N,) + a.shape[1:] for a in v],
                                      axis=0), 3)
    lax_gather = per_rank(lambda *v: [jax.lax.all_gather(a, "x", tiled=True) for a in v], 3)
    for got, want in zip(gather(*xs), lax_gather(*xs)):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    ints = [jnp.asarray(make_data("int64", (N * 8 * 3, 5), seed=40)), jnp.asarray(make_data("int32", (N * 8,), seed=41))]
    scatter = per_rank(lambda *v: call("flexlink_reduce_scatter", v, [(a.shape[0] // N,) + a.shape[1:] for a in v],
                                       reduction="sum", axis=0), 2)
    lax_scatter = per_rank(lambda *v: [jax.lax.psum_scatter(a, "x", tiled=True) for a in v], 2)
    for got, want in zip(scatter(*ints), lax_scatter(*ints)):
        assert np.array_equal(np.asarray(got), np.asarray(want))


def test_missing_token_is_a_clear_error():
    x = jnp.ones((N * 4,), jnp.float32)
    f = per_rank(lambda v: call("flexlink_all_reduce", [v, v], [v.shape, v.shape], reduction="sum",
                                token_last=False)[:1], 1)
    with pytest.raises(Exception, match="last operand and the last result must be the ordering token"):
        jax.block_until_ready(f(x))


@pytest.mark.parametrize("perm", [[(i, (i + 1) % N) for i in range(N)], [(0, 5), (5, 0), (3, 3)], []],
                         ids=["shift", "partial", "none"])
def test_ppermute(perm):
    specs = [("float32", (3, 1001)), ("bfloat16", (1,)), ("int64", (5, 2))]
    xs = stacked(specs, 50)
    flat = tuple(r for pair in perm for r in pair)
    ours = per_rank(lambda *v: call("flexlink_ppermute", v, [a.shape for a in v], pairs=flat), 3)
    lax = per_rank(lambda *v: [jax.lax.ppermute(a, "x", perm) for a in v], 3)
    for got, want in zip(ours(*xs), lax(*xs)):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.parametrize("axis", [0, 1])
def test_all_to_all(axis):
    # Per device [2N, 3N]-ish blocks; lax's tiled all_to_all with split_axis == concat_axis == axis
    # is ours about that axis.
    specs = [("float32", (2 * N, 3 * N)), ("int8", (N, N)), ("complex64", (3 * N, N))]
    xs = stacked(specs, 60)
    ours = per_rank(lambda *v: call("flexlink_all_to_all", v, [a.shape for a in v], axis=axis), 3)
    lax = per_rank(lambda *v: [jax.lax.all_to_all(a, "x", axis, axis, tiled=True) for a in v], 3)
    for got, want in zip(ours(*xs), lax(*xs)):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_registrations_list_every_target():
    assert set(fl.registrations()) == {"flexlink_all_reduce", "flexlink_all_gather", "flexlink_reduce_scatter",
                                       "flexlink_ppermute", "flexlink_all_to_all"}
