"""The host of every device: what decides whether a FlexLink group stays inside one machine.

A process's host identity is `FLEXLINK_HOST_ID` if set (so one machine can play several hosts in
tests), else its hostname plus the kernel's boot id (two containers with one hostname on different
machines still differ). A device's host is its process's identity (`device.process_index`); in a
multi-process job every process publishes its identity in jax.distributed's key-value store under
`flexlink/host/<process_index>` and reads all the others' once (blocking gets, FLEXLINK_TIMEOUT_S),
cached for the process's lifetime.

Testbed: `FLEXLINK_EMULATED_HOSTS=H` (or `emulated_hosts(H)` in a test) splits each process's
devices, in device-id order, into H hosts of consecutive devices, so the hierarchical path
(hierarchical.py) runs, and can be measured, in one process with host devices. Like the emulated
links it models a machine, it does not make one: every byte still moves in this process.
"""
from __future__ import annotations

import contextlib
import functools
import socket
import threading

import jax

from jax_flexlink._src import compat
from jax_flexlink._src.config import ENV

_KEY = "flexlink/host/{}"
_lock = threading.Lock()
_exchanged: dict = {}            # id(kv client) -> {process_index: identity}
_emulated_override: list = []    # stack of emulated_hosts(H) settings, innermost last


@functools.cache  # read at every collective's lowering; neither changes while the process runs
def process_identity() -> str:
  """This process's host identity (module docstring)."""
  if ENV.host_id:
    return ENV.host_id
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot = f.read().strip()
  except OSError:  # not Linux: the hostname alone
    boot = ""
  return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def _process_identities() -> dict:
  """{process_index: host identity} of every process of the job."""
  client = compat.distributed_client()
  if client is None or jax.process_count() == 1:
    return {jax.process_index(): process_identity()}
  with _lock:
    known = _exchanged.get(id(client))
    if known is None:
      me = jax.process_index()
      client.key_value_set(_KEY.format(me), process_identity())
      timeout_ms = int(ENV.timeout_s * 1000)
      known = {me: process_identity()}
      for p in range(jax.process_count()):
        if p != me:
          try:
            known[p] = client.blocking_key_value_get(_KEY.format(p), timeout_ms)
          except Exception as e:  # the store's own error type differs between jax versions
            raise RuntimeError(
                f"jax_flexlink: process {p} did not publish its host identity "
                f"({_KEY.format(p)}) within FLEXLINK_TIMEOUT_S={ENV.timeout_s:g} s; every process "
                f"of the job must lower the same collectives ({e})") from e
      _exchanged[id(client)] = known
    return known


@contextlib.contextmanager
def emulated_hosts(count: int):
  """Testbed: this process's devices play `count` hosts inside the block (FLEXLINK_EMULATED_HOSTS
  for a whole run). Programs must be lowered inside the block to see it."""
  if int(count) < 1:
    raise ValueError(f"emulated_hosts({count!r}): expected a number of hosts >= 1")
  _emulated_override.append(int(count))
  try:
    yield
  finally:
    _emulated_override.pop()


def emulated_host_count() -> int:
  return _emulated_override[-1] if _emulated_override else ENV.emulated_hosts


def hosts_of(devices) -> list[str]:
  """The host identity of each device, in order."""
  identities = _process_identities()
  emulated = emulated_host_count()
  local_rank = {}
  if emulated > 1:
    per_process: dict = {}
    for d in jax.devices():
      per_process.setdefault(d.process_index, []).append(d.id)
    for p, ids in per_process.items():
      if len(ids) % emulated:
        raise ValueError(
            f"FLEXLINK_EMULATED_HOSTS={emulated}: process {p}'s {len(ids)} devices do not split "
            "evenly into that many hosts")
      per_host = len(ids) // emulated
      for i, device_id in enumerate(sorted(ids)):
        local_rank[device_id] = i // per_host
  out = []
  for d in devices:
    base = identities.get(d.process_index)
    if base is None:
      raise RuntimeError(f"jax_flexlink: no host identity known for process {d.process_index}")
    out.append(f"{base}#emulated{local_rank[d.id]}" if emulated > 1 else base)
  return out
