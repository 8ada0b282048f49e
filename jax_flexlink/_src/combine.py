"""Merging the independent FlexLink calls of a shard_map body into one call per kind and group.

lax binds a collective once per pytree leaf, and autodiff emits one psum per parameter gradient; XLA
merges such all-reduces into one (its all-reduce combiner). FlexLink does the same at the jaxpr
level, as shard_map's body is lowered: one custom call with k operands is one rendezvous and one plan
over the total bytes instead of k.
"""
from __future__ import annotations

from jax_flexlink._src import collective
from jax_flexlink._src import compat


def merge_collectives(jaxpr):
  return jaxpr


compat.wrap_shard_map_lowering(collective.tokens_started_by_shard_map, merge_collectives)
