"""Merging the independent FlexLink calls of a shard_map body into one call per collective and group.

lax binds a collective once per pytree leaf, and autodiff emits one psum per parameter gradient; XLA
merges such all-reduces into one (its all-reduce combiner). FlexLink does the same to a body's jaxpr
just before it is lowered: equations of the same FlexLink primitive with the same parameters (so the
same collective over the same groups) become one equation with all their operands — one custom
call, one rendezvous, one plan over the total bytes — and leaves of different dtypes share it.

An equation joins an open merge while none of its operands depends on an open merge. Effect-free
equations that consume a merge's results (a bias gradient's reduce_sum right after its psum) are
deferred until the merges close, so they do not cut the merge short; a merge closes when a
collective it could have taken depends on it, when an equation with effects needs its results,
at FLEXLINK_COMBINE_BYTES of operands (0 turns merging off), and at the end of the body. Moving a
collective later, and effect-free work after it, changes no result, and every device runs the same
rewritten body, so FlexLink calls stay in one order on all of them.
"""
from __future__ import annotations

import numpy as np

from jax_flexlink._src import collective
from jax_flexlink._src import compat
from jax_flexlink._src.config import ENV


def _key(eqn):
  """What equations must share to merge, or None for an equation that never merges."""
  spec = getattr(eqn.primitive, "flexlink", None)
  if spec is None or any(collective.unsupported_dtype(v.aval, spec.reduction(eqn.params))
                         for v in eqn.invars):
    return None
  try:
    params = tuple(sorted(eqn.params.items()))
    hash(params)
  except TypeError:  # a parameter that cannot be compared safely
    return None
  return eqn.primitive, params, id(eqn.ctx)


def _nbytes(eqn) -> int:
  return sum(int(np.prod(v.aval.shape, dtype=np.int64)) * np.dtype(v.aval.dtype).itemsize
             for v in eqn.invars)


class _Merge:
  def __init__(self, first):
    self.members = [first]
    self.nbytes = _nbytes(first)

  def add(self, eqn):
    self.members.append(eqn)
    self.nbytes += _nbytes(eqn)

  def eqn(self):
    if len(self.members) == 1:
      return self.members[0]
    first = self.members[0]
    return compat.new_eqn(
        [v for e in self.members for v in e.invars],
        [v for e in self.members for v in e.outvars],
        first.primitive, first.params,
        set().union(*(e.effects for e in self.members)), first.source_info, first.ctx)


def merge_collectives(jaxpr):
  """`jaxpr` with its independent FlexLink equations merged (the same object if nothing merged)."""
  limit = ENV.combine_bytes
  if limit <= 0 or sum(_key(e) is not None for e in jaxpr.eqns) < 2:
    return jaxpr
  out = []
  merges: dict = {}   # key -> _Merge, in the order they opened
  deferred = []       # effect-free equations that use what the open merges compute
  pending = set()     # variables the open merges and the deferred equations define

  def close_all():
    out.extend(m.eqn() for m in merges.values())
    out.extend(deferred)
    merges.clear()
    deferred.clear()
    pending.clear()

  for eqn in jaxpr.eqns:
    waits = bool(pending.intersection(compat.vars_of(eqn.invars)))
    key = _key(eqn)
    if key is None:
      if waits and not eqn.effects:
        deferred.append(eqn)
        pending.update(compat.vars_of(eqn.outvars))
        continue
      if waits:
        close_all()
      out.append(eqn)
      continue
    merge = merges.get(key)
    if waits or (merge is not None and merge.nbytes + _nbytes(eqn) > limit):
      close_all()
      merge = None
    if merge is None:
      merges[key] = _Merge(eqn)
    else:
      merge.add(eqn)
    pending.update(compat.vars_of(eqn.outvars))
  close_all()
  if len(out) == len(jaxpr.eqns):
    return jaxpr
  return jaxpr.replace(eqns=out)


compat.wrap_shard_map_lowering(collective.tokens_started_by_shard_map, merge_collectives)
