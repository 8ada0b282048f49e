"""Turns a collective's axis names (and axis_index_groups) into groups of global device ids.

lax computes groups as partition indices into `mesh.devices.flat` (in its rank order); at run time
partition i runs on device `mesh.devices.flat[i]`, and the FFI handler knows only its device
(`DeviceOrdinal` = global device id on CPU). So the groups are translated to device ids here, at
lowering time, where the mesh is known; a device's rank is its position in its group.
"""
from __future__ import annotations

import numpy as np

from jax_flexlink._src import compat
from jax_flexlink._src.collective import NotLowerable


def device_groups(axis_context, axis_names, axis_index_groups, api_name: str,
                  group_size: int | None = None):
  """Returns (flat device ids of all groups, size of each group) as int64 arrays, lax's groups in
  lax's rank order.

  `group_size`: the size every group must have (gather and scatter layouts depend on it). Raises
  NotLowerable where the devices behind the partitions are unknown.
  """
  partitions = partition_groups(axis_context, axis_names, axis_index_groups, api_name)
  flat, sizes = to_device_ids(axis_context, partitions)
  if group_size is not None and np.any(sizes != group_size):
    raise ValueError(f"{api_name}: every group must have axis_size={group_size} members, "
                     f"got group sizes {sizes.tolist()}")
  return flat, sizes


def to_device_ids(axis_context, partitions):
  """Groups of partition indices -> (flat device ids, group sizes) as int64 arrays."""
  devices = compat.partition_devices(axis_context)
  if devices is None:
    raise NotLowerable(
        "the devices of this computation are not known where it is lowered (an abstract mesh "
        "with no device assignment), and FlexLink groups devices by id")
  device_ids = np.array([d.id for d in devices], dtype=np.int64)
  flat = np.concatenate([device_ids[list(g)] for g in partitions]).astype(np.int64)
  sizes = np.array([len(g) for g in partitions], dtype=np.int64)
  return flat, sizes


def partition_groups(axis_context, axis_names, axis_index_groups, api_name: str):
  """lax's groups of partition indices (into `mesh.devices.flat`), checked to cover the mesh."""
  mesh_size = int(np.prod(list(axis_context.mesh.shape.values()), dtype=np.int64))
  groups = compat.replica_groups(axis_context, tuple(axis_names), axis_index_groups)
  _check_partition(groups, mesh_size, axis_index_groups, api_name)
  return groups


def _check_partition(partition_groups, mesh_size: int, axis_index_groups, api_name: str) -> None:
  """Every device of the mesh in exactly one group (XLA only notices a gap when verifying HLO)."""
  members = sorted(p for g in partition_groups for p in g)
  if members != list(range(mesh_size)):
    raise ValueError(
        f"{api_name}: axis_index_groups must cover all indices exactly once, got "
        f"axis_index_groups={axis_index_groups}.")
