"""nccl-tests style benchmark of jax_flexlink's collectives against jax.lax: `python -m jax_flexlink.bench`.

Modules: cli (flags, run before jax is imported), sizes (K/M/G sizes, sweeps), collectives (size
conventions, busbw factors, dtypes), data (seeded inputs with exact expected outputs), timing,
table (text output), report (JSON and plot), scenarios, backend (FlexLink and native bodies), runner.
Importing this package does not import jax.
"""

from .cli import main

__all__ = ["main"]
