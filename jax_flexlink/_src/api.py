"""The public collectives: lax's own functions, with their collective binds routed to FlexLink.

Running lax's functions (rather than re-implementing them) is what keeps the semantics identical:
argument validation and its error messages, pytrees, Python scalars, bool -> int32 for psum, constant
folding of `psum(1, axis)`, canonical axis_index_groups, and the check_vma choice between psum and
psum_invariant.
"""
from __future__ import annotations

from jax import lax

from jax_flexlink._src import compat
from jax_flexlink._src import routing


def _check_axis_names(axis_name, api_name: str) -> None:
  """lax's unbound-axis NameError, raised before lax's own code, which under shard_map with
  check_vma=True trips an internal AssertionError first (jax 0.10.2)."""
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  bound = compat.bound_axis_sizes()
  for name in names:
    if not isinstance(name, int) and name not in bound:
      raise NameError(f"Found an unbound axis name: {name}. To fix this, please call "
                      f"{api_name} under `jax.shard_map`.")


def psum(x, axis_name, *, axis_index_groups=None):
  """`jax.lax.psum` over FlexLink: all-reduce sum of `x` (a pytree) over `axis_name`."""
  _check_axis_names(axis_name, "psum")
  with routing.explicit_scope():
    return lax.psum(x, axis_name, axis_index_groups=axis_index_groups)


def pmean(x, axis_name, *, axis_index_groups=None):
  """`jax.lax.pmean` over FlexLink."""
  _check_axis_names(axis_name, "pmean")
  with routing.explicit_scope():
    return lax.pmean(x, axis_name, axis_index_groups=axis_index_groups)


def pmax(x, axis_name, *, axis_index_groups=None):
  """`jax.lax.pmax` over FlexLink."""
  _check_axis_names(axis_name, "pmax")
  with routing.explicit_scope():
    return lax.pmax(x, axis_name, axis_index_groups=axis_index_groups)


def pmin(x, axis_name, *, axis_index_groups=None):
  """`jax.lax.pmin` over FlexLink."""
  _check_axis_names(axis_name, "pmin")
  with routing.explicit_scope():
    return lax.pmin(x, axis_name, axis_index_groups=axis_index_groups)


def all_gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False):
  """`jax.lax.all_gather` over FlexLink."""
  _check_axis_names(axis_name, "all_gather")
  with routing.explicit_scope():
    return lax.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                          tiled=tiled)


def psum_scatter(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False):
  """`jax.lax.psum_scatter` over FlexLink."""
  _check_axis_names(axis_name, "psum_scatter")
  with routing.explicit_scope():
    return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                            axis_index_groups=axis_index_groups, tiled=tiled)


def ppermute(x, axis_name, perm):
  """`jax.lax.ppermute` over FlexLink: rank `d` receives rank `s`'s `x` for each `(s, d)` in `perm`
  (ranks that receive nothing get zeros)."""
  _check_axis_names(axis_name, "ppermute")
  with routing.explicit_scope():
    return lax.ppermute(x, axis_name, perm)


def all_to_all(x, axis_name, split_axis, concat_axis, *, axis_index_groups=None, tiled=False):
  """`jax.lax.all_to_all` over FlexLink."""
  _check_axis_names(axis_name, "all_to_all")
  with routing.explicit_scope():
    return lax.all_to_all(x, axis_name, split_axis, concat_axis,
                          axis_index_groups=axis_index_groups, tiled=tiled)
