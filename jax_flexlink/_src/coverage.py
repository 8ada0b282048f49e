"""`jax_flexlink.collectives(fn, *args)`: every collective of a compiled program, and who runs it.

Read off the compiled HLO, so it lists what will run: FlexLink's custom calls, the collectives XLA
kept (lax's own where replacement is off or left them to lax — those carry the reason in the
`flexlink_fallback` frontend attribute lowering.py sets), and the ones XLA's partitioner inserted
for a jit with shardings. A collective whose groups span hosts (hierarchical.py) shows as its legs:
FlexLink's custom calls inside each host, and XLA's collective across hosts with the reason
"cross-host leg of a hierarchical FlexLink collective (...)". Sizes follow nccl-tests: the buffer for AllReduce, SendRecv (ppermute) and
AllToAll, the gathered output for AllGather, the input for ReduceScatter; bytes per device.
"""
from __future__ import annotations

import dataclasses
import re

import jax

from jax_flexlink._src.hierarchical import CROSS_HOST_ATTRIBUTE
from jax_flexlink._src.lowering import FALLBACK_ATTRIBUTE

_XLA_KINDS = {
    "all-reduce": "all_reduce", "all-reduce-start": "all_reduce",
    "all-gather": "all_gather", "all-gather-start": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "collective-permute": "ppermute", "collective-permute-start": "ppermute",
    "all-to-all": "all_to_all", "ragged-all-to-all": "all_to_all",
    "collective-broadcast": "broadcast",
}
_LAX_NAMES = ("psum", "pmax", "pmin", "all_gather", "reduce_scatter", "psum_scatter", "ppermute",
              "all_to_all", "pbroadcast", "psum_invariant", "all_gather_invariant", "pmean")

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>\S+) = (?P<shape>.+?) (?P<op>[a-z][a-z-]*)\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[suf]\d+|bf16|c64|c128|f8\w*)\[(?P<dims>[\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
          "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_DTYPE_NAMES = {"pred": "bool", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64",
                "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
                "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
                "c64": "complex64", "c128": "complex128"}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program."""
  kind: str          # all_reduce, all_gather, reduce_scatter, ppermute, all_to_all
  runner: str        # "flexlink" or "xla"
  bytes: int         # per device, nccl-tests convention (module docstring)
  group_size: int    # devices per group (XLA's collective-permute: devices in its pairs)
  operands: int      # arrays moved by this one call (a merged pytree: its leaves)
  dtypes: tuple      # their element types
  name: str          # the HLO instruction
  source: str        # the JAX operation it came from (HLO metadata op_name)
  reason: str = ""   # why XLA runs it, where known

  @property
  def compiler_inserted(self) -> bool:
    """Whether XLA's partitioner inserted it (no lax collective in its source)."""
    last = re.split(r"[/:()]", self.source.rstrip(")"))[-1] if self.source else ""
    return self.runner == "xla" and not self.reason and last not in _LAX_NAMES


class CollectiveReport(list):
  """A list of Collective, printed as a table."""

  def __str__(self):
    if not self:
      return "no collectives"
    rows = [("kind", "runner", "bytes", "group", "operands", "dtypes", "source / reason")]
    for c in self:
      why = c.reason or ("inserted by XLA's partitioner" if c.compiler_inserted else "")
      rows.append((c.kind, c.runner, str(c.bytes), str(c.group_size), str(c.operands),
                   ",".join(sorted(set(c.dtypes))), c.source + (f"  [{why}]" if why else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def collectives(fn, *args, **kwargs) -> CollectiveReport:
  """Compiles `fn` (jitted or not) for `args` and lists every collective of the compiled program:
  its kind, bytes per device, group size, and whether FlexLink or XLA runs it (with the reason XLA
  does, where there is one). Nothing runs."""
  if not callable(fn):  # jax.jit's words; a string has .lower, so test this first
    raise TypeError(f"Expected a callable value, got {fn!r}")
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  return parse_hlo(jitted.lower(*args, **kwargs).compile().as_text())


def _arrays(shape_text):
  return [(m["dtype"], [int(d) for d in m["dims"].split(",") if d])
          for m in _ARRAY.finditer(shape_text)]


def _nbytes(arrays) -> int:
  total = 0
  for dtype, dims in arrays:
    count = 1
    for d in dims:
      count *= d
    total += count * _BYTES.get(dtype, 1)
  return total


def _group_size(rest: str) -> int:
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
  if m:
    return len([v for v in m.group(1).split(",") if v])
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)  # iota form: [groups, size]<=[...]
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)  # named-mesh form
  if m:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    size = 1
    for axis in re.findall(r"'([^']+)'", m.group(2)):
      size *= sizes.get(axis, 1)
    return size
  m = re.search(r"group_sizes = dense<\[?([\d, ]+)\]?>", rest)  # FlexLink's attribute
  if m:
    return int(m.group(1).split(",")[0])
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
  if m:
    return len(set(re.findall(r"\d+", m.group(1))))
  return 0


def _attribute(rest: str, key: str) -> str:
  m = re.search(key + r'="((?:[^"\\]|\\.)*)"', rest)
  return m.group(1).replace("\\'", "'").replace('\\"', '"') if m else ""


def parse_hlo(text: str) -> CollectiveReport:
  """The collectives of a compiled HLO module's text (see collectives())."""
  report = CollectiveReport()
  for line in text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    op, rest = m["op"], m["rest"]
    if op == "custom-call":
      target = _attribute(rest, "custom_call_target")
      if not target.startswith("flexlink_") or target == "flexlink_token_region":
        continue
      kind, runner = target[len("flexlink_"):], "flexlink"
    elif op in _XLA_KINDS:
      kind, runner = _XLA_KINDS[op], "xla"
    else:
      continue
    arrays = [a for a in _arrays(m["shape"])]
    if op.endswith("-start"):  # async: (operands, results, ...) tuples; count the results once
      arrays = arrays[len(arrays) // 2:]
    group = _group_size(rest)
    nbytes = _nbytes(arrays)
    if kind == "reduce_scatter":
      nbytes *= max(group, 1)
    report.append(Collective(
        kind=kind, runner=runner, bytes=nbytes, group_size=group, operands=len(arrays),
        dtypes=tuple(_DTYPE_NAMES.get(d, d) for d, _ in arrays), name=m["name"],
        source=_attribute(rest, "op_name"),
        reason=_attribute(rest, FALLBACK_ATTRIBUTE) or _attribute(rest, CROSS_HOST_ATTRIBUTE)))
  return report
