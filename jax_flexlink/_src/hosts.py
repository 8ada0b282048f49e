"""The host of every device: what decides whether a FlexLink group stays inside one machine.

A process's host identity is `FLEXLINK_HOST_ID` if set (so one machine can play several hosts in
tests), else its hostname plus the kernel's boot id (two containers with one hostname on different
machines still differ). A device's host is its process's identity (`device.process_index`); in a
multi-process job every process publishes its identity in jax.distributed's key-value store under
`flexlink/host/<process_index>` and reads all the others' once (blocking gets bounded by the live
deadline, `runtime.timeout_s()`), cached for the process's lifetime.

This module also keeps the job's one map of global device ids to their process and device object
(`device_process`, `device_object`, `process_devices`), and the one bounded blocking get of the
key-value store (`kv_get`) that every exchange at lowering uses (host identities here; segment
names, tcp tokens and ports, NCCL unique ids in processes.py), so that a missing process is
reported the same way everywhere.

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
from jax_flexlink._src.collective import NotLowerable
from jax_flexlink._src.config import ENV

_KEY = "flexlink/host/{}"
_lock = threading.Lock()
_device_process: dict[int, int] = {}    # global device id -> process index
_device_object: dict[int, object] = {}  # global device id -> jax Device
_exchanged: dict = {}            # id(kv client) -> {process_index: identity}
_emulated_override: list = []    # stack of emulated_hosts(H) settings, innermost last


def _load_devices() -> None:
  # The default backend's devices and the CPU ones (a GPU job lowers host-device programs too).
  for platform in (None, "cpu"):
    try:
      devices = jax.devices(platform) if platform else jax.devices()
    except RuntimeError:
      continue
    for d in devices:
      _device_process.setdefault(d.id, d.process_index)
      _device_object.setdefault(d.id, d)


def device_process(device_id: int) -> int:
  """The process index of a global device id (jax.devices() of the default backend and CPU)."""
  if device_id not in _device_process:
    _load_devices()
  try:
    return _device_process[device_id]
  except KeyError:
    raise NotLowerable(f"device {device_id} is not one of this job's devices") from None


def device_object(device_id: int):
  """The jax Device of a global device id."""
  device_process(device_id)
  return _device_object[device_id]


def process_devices() -> dict[int, list[int]]:
  """{process index: its global device ids of the default backend, ascending}."""
  out: dict[int, list[int]] = {}
  for d in jax.devices():
    _device_process.setdefault(d.id, d.process_index)
    _device_object.setdefault(d.id, d)
    out.setdefault(d.process_index, []).append(d.id)
  return {p: sorted(ids) for p, ids in out.items()}


def kv_timeout_ms() -> int:
  """The live deadline (set_timeout / FLEXLINK_TIMEOUT_S) in the store's milliseconds."""
  from jax_flexlink._src import runtime  # noqa: PLC0415 - runtime loads the native module
  return max(1, int(runtime.timeout_s() * 1000))


def kv_get(client, key: str, what: str, *, as_bytes: bool = False, timeout_ms: int | None = None):
  """A blocking get of `key` bounded by the live deadline; a RuntimeError that says what was
  missing (`what`: "process 1 did not publish ...") and why that usually happens."""
  timeout_ms = kv_timeout_ms() if timeout_ms is None else timeout_ms
  get = client.blocking_key_value_get_bytes if as_bytes else client.blocking_key_value_get
  try:
    return get(key, timeout_ms)
  except Exception as e:  # the store's own error type differs between jax versions
    raise RuntimeError(
        f"jax_flexlink: {what} ({key}) within {timeout_ms / 1000:g} s (the deadline, "
        f"FLEXLINK_TIMEOUT_S / set_timeout); every process of the job must lower the same "
        f"collectives in the same order: {e}") from None


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
      known = {me: process_identity()}
      for p in range(jax.process_count()):
        if p != me:
          known[p] = kv_get(client, _KEY.format(p), f"process {p} did not publish its host identity")
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
    for p, ids in process_devices().items():
      if len(ids) % emulated:
        raise ValueError(
            f"FLEXLINK_EMULATED_HOSTS={emulated}: process {p}'s {len(ids)} devices do not split "
            "evenly into that many hosts")
      per_host = len(ids) // emulated
      for i, device_id in enumerate(ids):
        local_rank[device_id] = i // per_host
  out = []
  for d in devices:
    base = identities.get(d.process_index)
    if base is None:
      raise RuntimeError(f"jax_flexlink: no host identity known for process {d.process_index}")
    out.append(f"{base}#emulated{local_rank[d.id]}" if emulated > 1 else base)
  return out
