"""FlexLink for JAX: collectives that split their bytes across every link of a machine.

Drop-ins for jax.lax's collectives inside jax.shard_map and jax.pmap (same signatures, typing, vmap
and autodiff), lowered to XLA FFI custom calls; or, with `replace_collectives()`, the plain jax.lax
collectives of an existing program lowered the same way.
"""
from jax_flexlink._src import native as _native

_native.register_targets()

# Importing the collective modules defines their primitives and routes lax's binds to them;
# importing combine hooks shard_map's lowering (token chains, merged calls).
from jax_flexlink._src import all_gather as _all_gather  # noqa: E402,F401
from jax_flexlink._src import all_reduce as _all_reduce  # noqa: E402,F401
from jax_flexlink._src import all_to_all as _all_to_all  # noqa: E402,F401
from jax_flexlink._src import combine as _combine  # noqa: E402,F401
from jax_flexlink._src import ppermute as _ppermute  # noqa: E402,F401
from jax_flexlink._src import reduce_scatter as _reduce_scatter  # noqa: E402,F401
from jax_flexlink._src.api import (  # noqa: E402
    all_gather, all_to_all, pmax, pmean, pmin, ppermute, psum, psum_scatter)
from jax_flexlink._src.coverage import Collective, CollectiveReport, collectives  # noqa: E402
from jax_flexlink._src.diagnose import Report as DiagnosisReport, diagnose  # noqa: E402
from jax_flexlink._src.replace import replace_collectives, replacing_collectives  # noqa: E402
from jax_flexlink._src.runtime import configure, faults, inject_faults, links, reset_stats, stats  # noqa: E402
from jax_flexlink._src.runtime import load_cached_model as _runtime_load_cached_model  # noqa: E402
from jax_flexlink._src.shutdown import shutdown  # noqa: E402
from jax_flexlink._src.tune import tune  # noqa: E402

_runtime_load_cached_model()

__version__ = "0.1.0"

__all__ = [
    "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute", "all_to_all",
    "replace_collectives", "replacing_collectives", "collectives", "Collective", "CollectiveReport", "configure", "links", "tune", "inject_faults", "faults", "stats", "reset_stats", "shutdown",
    "diagnose", "DiagnosisReport",
    "__version__",
]
