"""jax_flexlink.collectives(): what a compiled program's collectives are and who runs them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding

import jax_flexlink as flx
from jax_flexlink._src.coverage import parse_hlo
from helpers import N

P = jax.sharding.PartitionSpec


@pytest.fixture(autouse=True)
def _replacement_off_after():
    yield
    flx.replace_collectives(False)


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()), ("x",))


def _shard_map_program(mod):
    def body(v):
        return (mod.psum(v, "x"), mod.all_gather(v.astype(jnp.int16), "x", tiled=True),
                mod.psum_scatter(v, "x", tiled=True))
    return jax.shard_map(body, mesh=_mesh(), in_specs=P("x"), out_specs=(P(), P("x"), P("x")))


def _kinds(report, runner):
    return sorted(c.kind for c in report if c.runner == runner)


def test_shard_map_program():
    x = np.ones((N * 16, 4), np.float32)  # 16 x 4 float32 per device = 256 bytes
    native = flx.collectives(_shard_map_program(lax), x)
    explicit = flx.collectives(_shard_map_program(flx), x)
    with flx.replace_collectives():
        replaced = flx.collectives(jax.jit(_shard_map_program(lax)), x)  # jitted or not
    assert _kinds(native, "xla") == ["all_gather", "all_reduce", "reduce_scatter"]
    assert _kinds(native, "flexlink") == []
    for report in (explicit, replaced):
        assert _kinds(report, "flexlink") == ["all_gather", "all_reduce", "reduce_scatter"]
        assert _kinds(report, "xla") == []
        by_kind = {c.kind: c for c in report}
        assert by_kind["all_reduce"].bytes == 256 and by_kind["all_reduce"].dtypes == ("float32",)
        assert by_kind["all_gather"].bytes == 128 * N  # the gathered int16 output
        assert by_kind["reduce_scatter"].bytes == 256  # nccl-tests: the input
        assert all(c.group_size == N for c in report)
        assert "psum" in by_kind["all_reduce"].source
    assert "flexlink" in str(replaced) and "all_gather" in str(replaced)


def test_jit_with_shardings_stays_xla():
    """Collectives XLA's partitioner inserts (no shard_map) are XLA's, replacement or not."""
    mesh = _mesh()
    x = jax.device_put(np.ones((N * 8, 8), np.float32), NamedSharding(mesh, P("x")))
    f = jax.jit(lambda v: jnp.sum(v, axis=0), out_shardings=NamedSharding(mesh, P()))
    with flx.replace_collectives():
        report = flx.collectives(f, x)
    assert report and all(c.runner == "xla" and c.compiler_inserted for c in report), str(report)
    assert "partitioner" in str(report)


def test_mixed_program_with_reasons():
    """A shard_map's collectives run on FlexLink, a dtype the engine lacks is left to XLA with the
    reason, the compiler's own all-reduce stays XLA's."""
    mesh = _mesh()
    x = jax.device_put(np.ones((N * 8, 8), np.float32), NamedSharding(mesh, P("x")))

    def f(v):
        a, b = jax.shard_map(lambda u: (lax.psum(u, "x"), lax.pmax(u.astype(jnp.float8_e4m3fn), "x")),
                             mesh=mesh, in_specs=P("x"), out_specs=(P(), P()))(v)
        return a, b, jnp.sum(v * 2, axis=0)

    with flx.replace_collectives():
        report = flx.collectives(f, x)
    flex = [c for c in report if c.runner == "flexlink"]
    assert [c.kind for c in flex] == ["all_reduce"] and flex[0].dtypes == ("float32",)
    fallback = [c for c in report if c.reason]
    assert len(fallback) == 1 and "float8_e4m3fn" in fallback[0].reason, str(report)
    assert any(c.compiler_inserted for c in report), str(report)


def test_parse_hlo_forms():
    """Replica-group notations XLA prints, async starts, tuples."""
    text = "\n".join([
        '  %a = f32[4,2]{1,0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add',
        '  %b = (bf16[8]{0}, f32[2]{0}) all-reduce(%p, %q), replica_groups=[2,4]<=[8], to_apply=%add',
        "  %c = f32[16]{0} all-gather(%p), replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}",
        '  %d = (f32[4]{0}, f32[4]{0}) collective-permute-start(%p), source_target_pairs={{0,1},{1,2},{2,0}}',
        '  ROOT %e = f32[2]{0} reduce-scatter(%p), replica_groups={{0,1,2,3}}, dimensions={0}',
        '  %f = f32[3]{0} add(%p, %q)',
    ])
    got = [(c.kind, c.bytes, c.group_size, c.operands) for c in parse_hlo(text)]
    assert got == [("all_reduce", 32, 2, 1), ("all_reduce", 24, 4, 2), ("all_gather", 64, 4, 1),
                   ("ppermute", 16, 3, 1), ("reduce_scatter", 32, 4, 1)]
