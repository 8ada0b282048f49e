"""Seeded inputs whose exact collective result is known, for every op and dtype (the `#wrong` check).

As nccl-tests does, inputs are small integers, exactly representable in every dtype, chosen so that every
partial result of any reduction order is exact too: sums stay below the dtype's largest exact integer
(2^8 for bfloat16, 2^11 for half, 2^24 for float, 2^53 for double), products are signed powers of two
within range, max/min are exact anyway. Integer sums and products may wrap; two's-complement wrapping is
independent of the order, so the expected result (computed in the dtype) is exact as well.
"""

from __future__ import annotations

import numpy as np

from .collectives import COLLECTIVES, DTYPES

# Largest integer m such that every integer in [-m, m] is exact in the float dtype.
_EXACT_INT = {"half": 1 << 11, "bfloat16": 1 << 8, "float": 1 << 24, "double": 1 << 53}
# Largest power-of-two exponent the float dtype can hold.
_MAX_EXP = {"half": 15, "bfloat16": 127, "float": 127, "double": 1023}


def _is_float(dtype_name: str) -> bool:
    return dtype_name in _EXACT_INT


def value_range(op: str, dtype_name: str, nranks: int) -> tuple[int, int]:
    """Inclusive integer range [lo, hi] the inputs are drawn from (for prod: magnitudes, see below)."""
    dtype = DTYPES[dtype_name]
    unsigned = dtype.kind == "u"
    if op == "sum":
        k = 16
        if _is_float(dtype_name):
            k = max(1, min(k, _EXACT_INT[dtype_name] // max(nranks, 1)))
    elif op == "prod":
        k = 2 if not _is_float(dtype_name) or nranks <= _MAX_EXP[dtype_name] else 1
    else:  # max / min
        k = 100
    return (1 if op == "prod" else 0, 2 * k) if unsigned else (-k, k)


def make_inputs(op: str, dtype_name: str, nranks: int, elems: int, seed: int = 0) -> np.ndarray:
    """Per-rank inputs, shape (nranks, elems), in the benchmark dtype. Row r is rank r's buffer.

    Deterministic in (seed, rank, op, dtype). For prod the values are +-1, +-2 (1, 2 when unsigned), so
    any product of nranks of them is an exact signed power of two.
    """
    dtype = DTYPES[dtype_name]
    lo, hi = value_range(op, dtype_name, nranks)
    salt = (sorted(DTYPES).index(dtype_name) << 4) | ["sum", "prod", "max", "min"].index(op)
    out = np.empty((nranks, elems), dtype=dtype)
    for r in range(nranks):
        rng = np.random.default_rng([seed, r, salt])
        if op == "prod":
            mag = rng.integers(1, hi + 1, size=elems, dtype=np.int16) if hi > 1 else np.ones(elems, np.int16)
            if dtype.kind != "u":
                mag = np.where(rng.integers(0, 2, size=elems, dtype=np.int8) == 1, -mag, mag)
            vals = mag
        else:
            vals = rng.integers(lo, hi + 1, size=elems, dtype=np.int16)
        out[r] = vals.astype(dtype)
    return out


def _reduce(op: str, inputs: np.ndarray) -> np.ndarray:
    """Reduction over ranks (axis 0), exact: floats accumulated in float64, integers wrap in their dtype."""
    dtype = inputs.dtype
    if op in ("max", "min"):
        fn = np.maximum if op == "max" else np.minimum
        acc = inputs[0].copy()
        for r in range(1, inputs.shape[0]):
            fn(acc, inputs[r], out=acc)
        return acc
    fn = np.add if op == "sum" else np.multiply
    is_float = dtype.kind == "f" or dtype == DTYPES.get("bfloat16")
    acc = inputs[0].astype(np.float64 if is_float else dtype)
    with np.errstate(over="ignore"):
        for r in range(1, inputs.shape[0]):
            fn(acc, inputs[r].astype(acc.dtype, copy=False), out=acc)
    return acc.astype(dtype, copy=False)


def expected_output(collective: str, op: str, inputs: np.ndarray) -> np.ndarray:
    """What every rank must hold after the collective.

    inputs: (nranks, in_elems) as from make_inputs. Returns (1, out_elems) when all ranks get the same
    result (AllReduce, AllGather) and (nranks, out_elems) otherwise (row r is rank r's): ReduceScatter
    (rank r's block of the reduction), ppermute (the benchmark's ring shift by +1, collectives.ring_perm:
    rank r holds rank r-1's buffer) and all_to_all (split_axis = concat_axis = 0, tiled, on the flat
    buffer: rank r's block j is rank j's block r). op is ignored where there is no reduction.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}")
    nranks, elems = inputs.shape
    if collective == "all_reduce":
        return _reduce(op, inputs)[None, :]
    if collective == "all_gather":
        return inputs.reshape(1, nranks * elems)
    if collective == "ppermute":
        return np.roll(inputs, 1, axis=0)  # row r = inputs[(r - 1) % nranks]
    if elems % nranks:
        raise ValueError(f"{collective} input of {elems} elements does not split over {nranks} ranks")
    if collective == "all_to_all":
        blocks = inputs.reshape(nranks, nranks, elems // nranks)    # [source rank, block, element]
        return np.ascontiguousarray(blocks.swapaxes(0, 1)).reshape(nranks, elems)
    return _reduce(op, inputs).reshape(nranks, elems // nranks)


def count_wrong(actual: np.ndarray, expected_row: np.ndarray) -> int:
    """Elements of one rank's output that differ from the expected row (NaN always counts as wrong)."""
    actual = np.asarray(actual).reshape(-1)
    expected_row = np.asarray(expected_row).reshape(-1)
    if actual.shape != expected_row.shape:
        return max(actual.size, expected_row.size)
    return int(np.count_nonzero(actual != expected_row))
