"""Collectives whose groups span hosts: FlexLink inside each host, XLA's own collective across.

FlexLink never carries inter-host traffic on a transport of its own (DESIGN.md); a group spanning
H hosts with m of its devices on each is decomposed at lowering time (docs/multihost.md):

  all_reduce (psum, pmean, pmax, pmin): flatten, pad to a multiple of m, FlexLink reduce_scatter
    inside each host -> XLA all-reduce across hosts on the 1/m slice (the devices at the same
    position of every host's subgroup) -> FlexLink all_gather inside each host -> unpad, reshape.
  all_gather: XLA all-gather across hosts on the input -> FlexLink all_gather inside each host ->
    the blocks put back into lax's rank order (which may interleave hosts).
  psum_scatter: the blocks put in (position in host, host) order -> FlexLink reduce_scatter inside
    each host -> XLA reduce-scatter across hosts.

Integer sums stay exact (wrapping addition is associative); float sums are reduced in a different
order than a flat reduction, so they match lax's to rounding, not bitwise. ppermute and all_to_all
across hosts, and groups whose hosts hold different numbers of its devices (or whose rank order is
not the same pattern in every group), raise NotLowerable: lax's collective runs the whole call.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from jax import lax
import jax.numpy as jnp

from jax_flexlink._src import collective
from jax_flexlink._src import compat
from jax_flexlink._src import groups as groups_lib
from jax_flexlink._src import hosts
from jax_flexlink._src import native
from jax_flexlink._src.collective import NotLowerable

# Frontend attribute on the XLA collective of a hierarchical call (coverage.py reads it).
CROSS_HOST_ATTRIBUTE = "flexlink_cross_host"
_DECOMPOSED = ("all_reduce", "all_gather", "reduce_scatter")
_REDUCERS = {"sum": lax.reduce_sum, "max": lax.reduce_max, "min": lax.reduce_min}


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the groups of one call sit on hosts: H hosts × m devices per group, the same pattern in
  every group (so one program serves every device)."""
  hosts: int
  per_host: int
  place: tuple              # rank r -> (host j, position k): group[r] is subgroup j's k-th device
  in_host: list             # partition ids of every (group, host) subgroup, ranked by position
  cross_host: list          # partition ids of every (group, position): one per host, host order

  def rank(self, j: int, k: int) -> int:
    return self.place.index((j, k))

  def host_major(self) -> bool:
    """Whether rank r is host r // m's (r % m)-th device (a mesh laid out host by host)."""
    return self.place == tuple(divmod(r, self.per_host) for r in range(len(self.place)))


def layout(partition_groups, host_of_partition) -> Layout | None:
  """The layout of `partition_groups` (lax's, rank order) on hosts; None when every group lies in
  one host (FlexLink runs the call as it is). NotLowerable for layouts that are not regular."""
  if all(len({host_of_partition[p] for p in g}) == 1 for g in partition_groups):
    return None
  pattern, in_host, cross_host = None, [], []
  for g in partition_groups:
    order = list(dict.fromkeys(host_of_partition[p] for p in g))  # hosts by first appearance
    subgroups = [[p for p in g if host_of_partition[p] == h] for h in order]
    sizes = {len(s) for s in subgroups}
    if len(sizes) != 1:
      raise NotLowerable(
          "this group spans hosts holding different numbers of its devices "
          f"({[len(s) for s in subgroups]}); the hierarchical path needs as many on every host, "
          "so lax's collective runs the whole call")
    position = {p: (j, s.index(p)) for j, s in enumerate(subgroups) for p in s}
    place = tuple(position[p] for p in g)
    if pattern is not None and place != pattern:
      raise NotLowerable(
          "the groups of this collective sit on hosts in different patterns (rank -> host, "
          "position), and one program must serve every device; lax's collective runs the whole "
          "call")
    pattern = place
    in_host.extend(subgroups)
    cross_host.extend([s[k] for s in subgroups] for k in range(len(subgroups[0])))
  hosts_ = len({j for j, _ in pattern})
  return Layout(hosts_, len(pattern) // hosts_, pattern, in_host, cross_host)


def lower(ctx, operands, spec: collective.Collective, params):
  """The hierarchical lowering of a call whose groups span hosts, or None where they do not."""
  axis_context = ctx.module_context.axis_context
  devices = compat.partition_devices(axis_context)
  if devices is None:
    return None  # spec.lower says why FlexLink cannot run it
  host_of_partition = hosts.hosts_of(devices)
  if len(set(host_of_partition)) == 1:
    return None
  names = tuple(a for a in spec.axis_names(params) if not isinstance(a, int))
  if not names:
    return None
  partitions = groups_lib.partition_groups(axis_context, names, params.get("axis_index_groups"),
                                           spec.api_name)
  where = layout(partitions, host_of_partition)
  if where is None:
    return None
  if spec.kind not in _DECOMPOSED:
    raise NotLowerable(
        f"{spec.api_name} over axes {names} spans hosts, and FlexLink decomposes only "
        "all_reduce, all_gather and reduce_scatter across hosts; lax's collective runs the call")
  label = (f"{spec.api_name} over axes {names}: hierarchical, {where.hosts} hosts x "
           f"{where.per_host} devices")
  return _LOWER[spec.kind](_Emitter(ctx, where, label), operands, params, spec.reduction(params))


class _Emitter:
  """Emits the legs of one hierarchical call, threading the FlexLink token through them."""

  def __init__(self, ctx, where: Layout, label: str):
    self.ctx, self.where, self.label = ctx, where, label
    self.tokens = ctx.tokens_in
    self.in_host, self.in_host_sizes = groups_lib.to_device_ids(ctx.module_context.axis_context,
                                                                where.in_host)

  def pure(self, fn, x, aval_in, aval_out):
    return compat.lower_pure(self.ctx, fn, x, aval_in, aval_out)

  def flexlink(self, target, xs, avals_in, avals_out, leg, **attrs):
    if self.where.per_host == 1:  # one device per host: the in-host legs would only copy
      return [self.pure(lambda v, shape=tuple(o.shape): jnp.reshape(v, shape), x, i, o)
              for x, i, o in zip(xs, avals_in, avals_out)]
    leg_ctx = self.ctx.replace(tokens_in=self.tokens, tokens_out=None)
    ys = collective.emit_custom_call(
        leg_ctx, target, xs, avals_in=avals_in, avals_out=avals_out, groups=self.in_host,
        group_sizes=self.in_host_sizes, label=f"{self.label}, {leg} inside each host", **attrs)
    self.tokens = leg_ctx.tokens_out
    return ys

  def mark(self, value, what):
    compat.set_frontend_attribute(
        value, CROSS_HOST_ATTRIBUTE,
        f"cross-host leg of a hierarchical FlexLink collective ({self.label}; {what} across "
        "hosts is XLA's)")
    return value

  def done(self, outs):
    self.ctx.set_tokens_out(self.tokens)
    return outs


def _permuted(blocks, order):
  """blocks[order] along axis 0, as static slices concatenated: one copy of runs of consecutive
  blocks (`blocks[np.array(order)]` lowers to a gather, which XLA:CPU runs element by element)."""
  if list(order) == list(range(len(order))):
    return blocks
  runs, start = [], 0
  for i in range(1, len(order) + 1):
    if i == len(order) or order[i] != order[i - 1] + 1:
      runs.append(lax.slice_in_dim(blocks, order[start], order[i - 1] + 1, axis=0))
      start = i
  return jnp.concatenate(runs, axis=0)


def _flat(aval, size):
  return aval.update(shape=(size,))


def _all_reduce(em: _Emitter, operands, params, reduction):
  ctx, m = em.ctx, em.where.per_host
  positional = tuple(a for a in params["axes"] if isinstance(a, int))
  flats, avals, padded = [], [], []
  for x, aval, aval_out in zip(operands, ctx.avals_in, ctx.avals_out):
    if positional:  # reduced locally first, as lax does
      reduced = aval.update(shape=tuple(np.delete(np.array(aval.shape, dtype=np.int64),
                                                  positional)))
      x = em.pure(lambda v: _REDUCERS[reduction](v, positional), x, aval, reduced)
      aval = reduced
    size = int(np.prod(aval.shape, dtype=np.int64))
    full = -(-max(size, 1) // m) * m
    flats.append(em.pure(lambda v, s=size, f=full: jnp.pad(jnp.reshape(v, (s,)), (0, f - s)),
                         x, aval, _flat(aval, full)))
    avals.append(aval)
    padded.append(full)
  slices = em.flexlink(native.REDUCE_SCATTER, flats, [_flat(a, f) for a, f in zip(avals, padded)],
                       [_flat(a, f // m) for a, f in zip(avals, padded)], "reduce_scatter",
                       reduction=reduction, axis=np.int64(0))
  reduced = [em.mark(compat.xla_all_reduce(s, em.where.cross_host, reduction), "all_reduce")
             for s in slices]
  gathered = em.flexlink(native.ALL_GATHER, reduced, [_flat(a, f // m) for a, f in zip(avals, padded)],
                         [_flat(a, f) for a, f in zip(avals, padded)], "all_gather",
                         axis=np.int64(0))
  outs = []
  for g, aval, full, aval_out in zip(gathered, avals, padded, ctx.avals_out):
    size = int(np.prod(aval.shape, dtype=np.int64))
    outs.append(em.pure(lambda v, s=size, shape=aval.shape: jnp.reshape(v[:s], shape), g,
                        _flat(aval, full), aval))
  return em.done(outs)


def _all_gather(em: _Emitter, operands, params, reduction):
  del reduction
  ctx, where = em.ctx, em.where
  hosts_, m, n = where.hosts, where.per_host, where.hosts * where.per_host
  d, tiled = params["all_gather_dimension"], params["tiled"]
  sizes = [int(np.prod(a.shape, dtype=np.int64)) for a in ctx.avals_in]
  # Across hosts first, on the small input (each device receives (H-1)/H of S/m), then inside each
  # host on FlexLink's links: the reverse of psum_scatter's order.
  crossed = []
  for x, a, s in zip(operands, ctx.avals_in, sizes):
    flat = em.pure(lambda v, s=s: jnp.reshape(v, (s,)), x, a, _flat(a, s))
    y = em.mark(compat.xla_all_gather(ctx, flat, _flat(a, hosts_ * s), where.cross_host, 0),
                "all_gather")
    crossed.append(em.pure(lambda v, s=s: jnp.reshape(v, (hosts_, s)), y, _flat(a, hosts_ * s),
                           a.update(shape=(hosts_, s))))
  # Host j's row gathered inside the host along axis 1 gives block j*m + k for host j's k-th
  # device, which is lax's order when ranks are host-major; else along axis 0 (block k*H + j), and
  # the blocks are put into lax's order after.
  host_major = where.host_major()
  local = em.flexlink(native.ALL_GATHER, crossed,
                      [a.update(shape=(hosts_, s)) for a, s in zip(ctx.avals_in, sizes)],
                      [_flat(a, n * s) for a, s in zip(ctx.avals_in, sizes)], "all_gather",
                      axis=np.int64(1 if host_major else 0))
  order = list(range(n)) if host_major else [k * hosts_ + j for j, k in where.place]
  outs = []
  for g, a, s in zip(local, ctx.avals_in, sizes):
    shape = tuple(a.shape)

    def arrange(v, s=s, shape=shape):
      blocks = _permuted(jnp.reshape(v, (n, s)), order)
      out = jnp.moveaxis(jnp.reshape(blocks, (n, *shape)), 0, d)
      if tiled:
        out = jnp.reshape(out, shape[:d] + (n * shape[d],) + shape[d + 1:])
      return out

    outs.append(em.pure(arrange, g, _flat(a, n * s), a.update(shape=_gathered(shape, n, d, tiled))))
  return em.done(outs)


def _gathered(shape, n, d, tiled):
  if tiled:
    return shape[:d] + (n * shape[d],) + shape[d + 1:]
  return shape[:d] + (n,) + shape[d:]


def _reduce_scatter(em: _Emitter, operands, params, reduction):
  ctx, where = em.ctx, em.where
  hosts_, m = where.hosts, where.per_host
  n = hosts_ * m
  d = params["scatter_dimension"]
  # The in-host reduce_scatter hands position k the blocks of every rank at position k (one per
  # host); the cross-host one then hands host j its own. Host-major ranks (rank j*m + k) are that
  # already, viewed as [H, m, F] and scattered along axis 1; other orders are permuted into
  # [m, H, F] (block k*H + j is rank(j, k)'s) and scattered along axis 0.
  host_major = where.host_major()
  order = [where.rank(j, k) for k in range(m) for j in range(hosts_)]
  flats, sizes, views = [], [], []
  for x, a in zip(operands, ctx.avals_in):
    shape = tuple(a.shape)
    size = int(np.prod(shape, dtype=np.int64))
    view = (hosts_, m, size // n) if host_major else (m, hosts_, size // n)

    def arrange(v, shape=shape, size=size, view=view):
      blocks = jnp.reshape(v, shape[:d] + (n, shape[d] // n) + shape[d + 1:])
      blocks = jnp.reshape(jnp.moveaxis(blocks, d, 0), (n, size // n))
      return jnp.reshape(blocks if host_major else _permuted(blocks, order), view)

    flats.append(em.pure(arrange, x, a, a.update(shape=view)))
    sizes.append(size)
    views.append(a.update(shape=view))
  local = em.flexlink(native.REDUCE_SCATTER, flats, views,
                      [_flat(a, s // m) for a, s in zip(ctx.avals_in, sizes)], "reduce_scatter",
                      reduction=reduction, axis=np.int64(1 if host_major else 0))
  outs = []
  for y, a, s, a_out in zip(local, ctx.avals_in, sizes, ctx.avals_out):
    z = em.mark(compat.xla_reduce_scatter(ctx, y, _flat(a, s // n), where.cross_host, 0, reduction),
                "reduce_scatter")
    outs.append(em.pure(lambda v, shape=tuple(a_out.shape): jnp.reshape(v, shape), z,
                        _flat(a, s // n), a.update(shape=tuple(a_out.shape))))
  return em.done(outs)


_LOWER = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter}
