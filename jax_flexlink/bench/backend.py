"""The two implementations a row compares: FlexLink and the native jax.lax collective.

Imports jax; only the runner imports this module (after the CLI has set XLA_FLAGS).
Each builder returns the per-shard body for `jax.shard_map` (flat 1-D buffers, mesh axis "x"), or
raises Unsupported with the reason a row is skipped.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
from jax import lax

from . import collectives

AXIS = "x"


class Unsupported(Exception):
    """This (collective, op) has no implementation on this side; the text says why."""


class BenchError(RuntimeError):
    """A setup problem the user must fix (missing feature, bad link spec, too few devices)."""


@dataclasses.dataclass
class FlexLink:
    """The FlexLink side: the jax_flexlink API (or jax.lax when self-testing the harness)."""
    api: types.ModuleType | types.SimpleNamespace
    label: str
    selftest: bool = False

    # --- collectives -----------------------------------------------------------------------------
    def body(self, collective: str, op: str, nranks: int):
        if self.selftest:  # every (collective, op) the native baseline has, so the harness tests them all
            return native_body(collective, op, nranks)[0]
        api = self.api
        if collective == "all_reduce":
            name = {"sum": "psum", "max": "pmax", "min": "pmin", "prod": "pprod"}[op]
            fn = getattr(api, name, None)
            if fn is None:
                raise Unsupported(f"{self.label} has no {name} (product all-reduce); lax has none either")
            return lambda x: fn(x, AXIS)
        if collective == "all_gather":
            return lambda x: api.all_gather(x, AXIS, axis=0, tiled=True)
        if collective in ("ppermute", "all_to_all"):
            fn = getattr(api, collective, None)
            if fn is None:
                raise Unsupported(f"{self.label} has no {collective} (an older jax_flexlink; upgrade it)")
            if collective == "ppermute":
                perm = collectives.ring_perm(nranks)
                return lambda x: fn(x, AXIS, perm)
            return lambda x: fn(x, AXIS, 0, 0, tiled=True)
        if op != "sum":
            raise Unsupported(f"{self.label} has only psum_scatter (sum) for reduce_scatter, as lax")
        return lambda x: api.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)

    # --- runtime control -------------------------------------------------------------------------
    def configure_links(self, spec: str) -> None:
        configure = getattr(self.api, "configure", None)
        if configure is None:
            raise BenchError(
                f"--links needs jax_flexlink.configure(links=...), which this build of {self.label} lacks "
                "(it arrived with the multi-path engine; upgrade jax_flexlink)")
        try:
            configure(links=spec)
        except (ValueError, TypeError, RuntimeError) as e:
            raise BenchError(f"jax_flexlink.configure(links={spec!r}) failed: {e}") from e

    def has_configure(self) -> bool:
        return getattr(self.api, "configure", None) is not None

    def stats(self) -> dict | None:
        fn = getattr(self.api, "stats", None)
        if fn is None:
            return None
        try:
            return fn()
        except Exception:  # stats are informational; never fail a benchmark on them
            return None

    def link_bytes(self) -> dict[str, int] | None:
        s = self.stats()
        if not s or not isinstance(s.get("links"), dict):
            return None
        return {name: int(v.get("bytes", 0)) for name, v in s["links"].items()}

    def version(self) -> str:
        if self.selftest:
            return f"n/a (self-test: jax.lax stands in, jax {jax.__version__})"
        v = getattr(self.api, "__version__", None)
        if v:
            return str(v)
        try:
            from importlib import metadata
            return metadata.version("jax_flexlink")
        except Exception:
            return "unknown"


def load_flexlink(impl: str = "flexlink") -> FlexLink:
    """impl 'flexlink' imports jax_flexlink; 'lax' (harness self-test only) stands jax.lax in for it."""
    if impl == "lax":
        api = types.SimpleNamespace(psum=lax.psum, pmax=lax.pmax, pmin=lax.pmin,
                                    all_gather=lax.all_gather, psum_scatter=lax.psum_scatter,
                                    ppermute=lax.ppermute, all_to_all=lax.all_to_all)
        return FlexLink(api, "jax.lax (harness self-test, not FlexLink)", selftest=True)
    try:
        import jax_flexlink
    except ImportError as e:
        raise BenchError(f"cannot import jax_flexlink ({e}); install it with `pip install -e .`") from e
    missing = [n for n in ("psum", "pmax", "pmin", "all_gather", "psum_scatter") if not hasattr(jax_flexlink, n)]
    if missing:
        raise BenchError(f"jax_flexlink lacks {', '.join(missing)}; is the native module built? "
                         "(`pip install -e .` builds it)")
    return FlexLink(jax_flexlink, "jax_flexlink")


# Native baselines -------------------------------------------------------------------------------------

def _reduce_axis0(op: str, y):
    if op == "prod":
        return jnp.prod(y, axis=0, dtype=y.dtype)
    return {"max": jnp.max, "min": jnp.min, "sum": jnp.sum}[op](y, axis=0).astype(y.dtype)


def native_body(collective: str, op: str, nranks: int):
    """(body, description). lax has no product all-reduce and no max/min/prod reduce-scatter; for those
    the baseline is what a JAX user would write instead, and the description says so."""
    if collective == "all_reduce":
        if op == "prod":
            return (lambda x: _reduce_axis0("prod", lax.all_gather(x, AXIS, axis=0, tiled=False)),
                    "jnp.prod(lax.all_gather(x)) (lax has no product all-reduce)")
        fn = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[op]
        return (lambda x: fn(x, AXIS)), f"lax.{fn.__name__}"
    if collective == "all_gather":
        return (lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True)), "lax.all_gather(tiled=True)"
    if collective == "ppermute":
        perm = collectives.ring_perm(nranks)
        return (lambda x: lax.ppermute(x, AXIS, perm)), "lax.ppermute(ring +1)"
    if collective == "all_to_all":
        return (lambda x: lax.all_to_all(x, AXIS, 0, 0, tiled=True)), "lax.all_to_all(0, 0, tiled=True)"
    if op == "sum":
        return ((lambda x: lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)),
                "lax.psum_scatter(tiled=True)")

    def body(x):
        blocks = lax.all_to_all(x.reshape(nranks, -1), AXIS, 0, 0, tiled=True)
        return _reduce_axis0(op, blocks)
    return body, f"jnp.{op}(lax.all_to_all(x)) (lax has no {op} reduce-scatter)"


def make_mesh(nranks: int, platform: str = "cpu"):
    """A 1-D mesh over the first nranks devices: jax's default devices (host devices), or with
    platform "gpu" jax's GPUs (nranks 0: all of them)."""
    import numpy as np
    from jax.sharding import Mesh
    if platform == "gpu":
        try:
            devices = jax.devices("gpu")
        except RuntimeError as e:
            raise BenchError(f"--scenario gpu: jax sees no GPU ({str(e).splitlines()[0]}); it needs a jax "
                             "with a CUDA plugin on a machine with NVIDIA GPUs, and JAX_PLATFORMS unset or "
                             "naming cuda") from None
        if len(devices) < nranks:
            raise BenchError(f"{nranks} GPUs requested but jax sees {len(devices)}")
        return Mesh(np.array(devices[:nranks or len(devices)]), (AXIS,))
    devices = jax.devices()
    if len(devices) < nranks:
        raise BenchError(f"{nranks} devices requested but jax sees {len(devices)} "
                         f"({devices[0].platform}); use --devices {nranks} (sets "
                         "--xla_force_host_platform_device_count before jax starts)")
    return Mesh(np.array(devices[:nranks]), (AXIS,))


def compile_collective(body, mesh, donate: bool):
    from jax.sharding import PartitionSpec as P
    f = jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    return jax.jit(f, donate_argnums=0 if donate else ())
