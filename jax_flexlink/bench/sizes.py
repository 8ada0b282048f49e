"""Byte sizes with K/M/G suffixes and the nccl-tests size sweep."""

from __future__ import annotations

import re

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parses '4K', '64M', '1G', '512', '1.5M', '4KiB', '4KB' into bytes (binary multiples, as nccl-tests).

    Raises ValueError with the offending text on anything else (negative, empty, unknown suffix,
    fractional byte counts).
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(
            f"bad size {text!r}: expected a number with an optional K, M or G suffix (e.g. 4K, 64M, 1G)")
    number, suffix = m.group(1), m.group(2).upper()
    mult = _SUFFIX[suffix]
    if "." in number:
        value = float(number) * mult
        if value != int(value):
            raise ValueError(f"bad size {text!r}: not a whole number of bytes")
        return int(value)
    return int(number) * mult


def format_size(nbytes: int) -> str:
    """4096 -> '4K', 67108864 -> '64M', 1000 -> '1000' (exact binary multiples only)."""
    for suffix in ("G", "M", "K"):
        mult = _SUFFIX[suffix]
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{suffix}"
    return str(nbytes)


def size_sweep(minbytes: int, maxbytes: int, stepfactor: float | None = None,
               stepbytes: int | None = None) -> list[int]:
    """The sizes nccl-tests visits: multiply by stepfactor when it is > 1, else add stepbytes.

    minbytes..maxbytes inclusive. With neither step given the factor is 2.
    """
    if minbytes < 0 or maxbytes < 0:
        raise ValueError("sizes must not be negative")
    if maxbytes < minbytes:
        raise ValueError(f"maxbytes ({maxbytes}) is smaller than minbytes ({minbytes})")
    if stepfactor is None and stepbytes is None:
        stepfactor = 2
    sizes = []
    size = minbytes
    if stepfactor is not None and stepfactor > 1:
        if minbytes == 0:
            raise ValueError("minbytes must be > 0 with a step factor")
        while size <= maxbytes:
            sizes.append(size)
            nxt = int(size * stepfactor)
            size = nxt if nxt > size else size + 1
    else:
        if stepfactor is not None and stepbytes is None:
            raise ValueError(f"stepfactor must be > 1 (got {stepfactor}); or give --stepbytes")
        if not stepbytes or stepbytes <= 0:
            if minbytes == maxbytes:
                return [minbytes]
            raise ValueError("stepbytes must be > 0")
        while size <= maxbytes:
            sizes.append(size)
            size += stepbytes
    return sizes
