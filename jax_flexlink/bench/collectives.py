"""What each benchmarked collective is: its size convention, bus-bandwidth factor, data types and ops.

Pure Python (numpy for dtypes only): no jax import, so the CLI can parse flags before jax starts.

Size conventions follow nccl-tests: a row's `bytes` is the larger of the per-rank send and receive
buffers, i.e. the per-rank buffer for AllReduce, SendRecv (ppermute) and AlltoAll, the gathered output for
AllGather and the per-rank input for ReduceScatter; `count` is what nccl-tests prints (its `paramcount`):
AllReduce and SendRecv the whole buffer, AllGather its input, ReduceScatter its output, AlltoAll one
peer's block (the buffer holds n of them; nccl-tests' src/alltoall.cu: paramcount = count/nranks).
"""

from __future__ import annotations

import dataclasses

import numpy as np

try:  # jax depends on ml_dtypes; importing it does not start jax.
    import ml_dtypes
    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - jax always brings ml_dtypes
    _BF16 = None

# nccl-tests type names first, then aliases.
DTYPES: dict[str, np.dtype] = {
    "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16), "uint16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32), "uint32": np.dtype(np.uint32),
    "int64": np.dtype(np.int64), "uint64": np.dtype(np.uint64),
    "half": np.dtype(np.float16), "float": np.dtype(np.float32), "double": np.dtype(np.float64),
}
if _BF16 is not None:
    DTYPES["bfloat16"] = _BF16
DTYPE_ALIASES = {
    "char": "int8", "int": "int32", "uint": "uint32",
    "float16": "half", "fp16": "half", "float32": "float", "fp32": "float",
    "float64": "double", "fp64": "double", "bf16": "bfloat16",
}
# `-d all` runs these (nccl-tests' list, in its order).
ALL_DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
              "bfloat16"]

OPS = ["sum", "prod", "max", "min"]


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str            # CLI name: all_reduce, all_gather, reduce_scatter, ppermute, all_to_all
    title: str           # nccl-tests name: AllReduce, ..., SendRecv, AlltoAll
    has_op: bool         # whether a reduction op applies
    busbw_formula: str   # the factor busbw_factor computes, as the table's preamble prints it

    def busbw_factor(self, nranks: int) -> float:
        """nccl-tests: AllReduce 2(n-1)/n; AllGather, ReduceScatter, AlltoAll (n-1)/n; SendRecv 1."""
        if nranks <= 0:
            raise ValueError("nranks must be positive")
        if self.name == "all_reduce":
            return 2.0 * (nranks - 1) / nranks
        if self.name == "ppermute":
            return 1.0
        return (nranks - 1) / nranks

    def counts(self, nbytes: int, itemsize: int, nranks: int) -> tuple[int, int, int]:
        """(count, in_elems, out_elems) per rank for a requested size, truncated as nccl-tests does."""
        if self.name in ("all_reduce", "ppermute"):
            count = nbytes // itemsize
            return count, count, count
        count = nbytes // itemsize // nranks
        if self.name == "all_gather":
            return count, count, count * nranks
        if self.name == "all_to_all":                # count: one peer's block; the buffer has n
            return count, count * nranks, count * nranks
        return count, count * nranks, count          # reduce_scatter

    def actual_bytes(self, count: int, itemsize: int, nranks: int) -> int:
        """The size a row reports: max(send, receive) bytes per rank."""
        if self.name in ("all_reduce", "ppermute"):
            return count * itemsize
        return count * itemsize * nranks


COLLECTIVES: dict[str, Collective] = {c.name: c for c in [
    Collective("all_reduce", "AllReduce", True, "2(n-1)/n"),
    Collective("all_gather", "AllGather", False, "(n-1)/n"),
    Collective("reduce_scatter", "ReduceScatter", True, "(n-1)/n"),
    Collective("ppermute", "SendRecv", False, "1"),
    Collective("all_to_all", "AlltoAll", False, "(n-1)/n"),
]}
COLLECTIVE_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather",
                      "reducescatter": "reduce_scatter", "psum": "all_reduce",
                      "psum_scatter": "reduce_scatter", "sendrecv": "ppermute",
                      "alltoall": "all_to_all"}


def ring_perm(nranks: int) -> list[tuple[int, int]]:
    """The benchmark's ppermute: a ring shift by +1, rank i sends to i+1 (nccl-tests' SendRecv)."""
    return [(i, (i + 1) % nranks) for i in range(nranks)]


def busbw_legend(names) -> str:
    """'2(n-1)/n (AllReduce), (n-1)/n (AllGather, ReduceScatter)' for the given collectives."""
    by_formula: dict[str, list[str]] = {}
    for name in names:
        c = COLLECTIVES[name]
        by_formula.setdefault(c.busbw_formula, []).append(c.title)
    return ", ".join(f"{f} ({', '.join(titles)})" for f, titles in by_formula.items())
DEFAULT_COLLECTIVES = ["all_reduce", "all_gather"]


def _split(text: str) -> list[str]:
    return [t.strip().lower().replace("-", "_") for t in text.split(",") if t.strip()]


def parse_collectives(text: str) -> list[str]:
    out = []
    for t in _split(text):
        if t == "all":
            out.extend(COLLECTIVES)
            continue
        t = COLLECTIVE_ALIASES.get(t.replace("_", ""), t)
        if t not in COLLECTIVES:
            raise ValueError(f"unknown collective {t!r}; choose from {', '.join(COLLECTIVES)} or all")
        out.append(t)
    return list(dict.fromkeys(out))


def parse_dtypes(text: str) -> list[str]:
    out = []
    for t in _split(text):
        if t == "all":
            out.extend(d for d in ALL_DTYPES if d in DTYPES)
            continue
        t = DTYPE_ALIASES.get(t, t)
        if t not in DTYPES:
            raise ValueError(f"unknown datatype {t!r}; choose from {', '.join(DTYPES)} "
                             f"(aliases: {', '.join(DTYPE_ALIASES)}) or all")
        out.append(t)
    return list(dict.fromkeys(out))


def parse_ops(text: str) -> list[str]:
    out = []
    for t in _split(text):
        if t == "all":
            out.extend(OPS)
            continue
        if t not in OPS:
            raise ValueError(f"unknown op {t!r}; choose from {', '.join(OPS)} or all")
        out.append(t)
    return list(dict.fromkeys(out))
