"""The public collectives: lax's own functions, with their collective binds routed to FlexLink.

Running lax's functions (rather than re-implementing them) is what keeps the semantics identical:
argument validation and its error messages, pytrees, Python scalars, bool -> int32 for psum, constant
folding of `psum(1, axis)`, canonical axis_index_groups, and the check_vma choice between psum and
psum_invariant.
"""
from __future__ import annotations

from jax import lax

from jax_flexlink._src import routing


def psum(x, axis_name, *, axis_index_groups=None):
  """`jax.lax.psum` over FlexLink: all-reduce sum of `x` (a pytree) over `axis_name`."""
  with routing.explicit_scope():
    return lax.psum(x, axis_name, axis_index_groups=axis_index_groups)


def pmean(x, axis_name, *, axis_index_groups=None):
  """`jax.lax.pmean` over FlexLink."""
  with routing.explicit_scope():
    return lax.pmean(x, axis_name, axis_index_groups=axis_index_groups)


def pmax(x, axis_name, *, axis_index_groups=None):
  """`jax.lax.pmax` over FlexLink."""
  with routing.explicit_scope():
    return lax.pmax(x, axis_name, axis_index_groups=axis_index_groups)


def pmin(x, axis_name, *, axis_index_groups=None):
  """`jax.lax.pmin` over FlexLink."""
  with routing.explicit_scope():
    return lax.pmin(x, axis_name, axis_index_groups=axis_index_groups)


def all_gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False):
  """`jax.lax.all_gather` over FlexLink."""
  with routing.explicit_scope():
    return lax.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                          tiled=tiled)


def psum_scatter(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False):
  """`jax.lax.psum_scatter` over FlexLink."""
  with routing.explicit_scope():
    return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                            axis_index_groups=axis_index_groups, tiled=tiled)
