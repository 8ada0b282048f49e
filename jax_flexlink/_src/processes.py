"""Groups whose devices live in several processes of a `jax.distributed` job on one host.

The engine runs such a group through one POSIX shared-memory segment (xla_ffi/xproc/,
docs/xproc.md). The segment must exist in every member process before the group's first call, and
the only channel the processes share before that is jax.distributed's key-value store, so the set-up
happens here, at lowering time, where every process lowers the same program in the same order:

- the process of the group's rank-0 device creates the segment (0600, a random 128-bit name) and
  publishes its name under a key derived from the group's device ids;
- every other member process reads the name (a blocking get with the configured deadline), maps the
  segment and registers its own ranks;
- every process adds its rank count to a counter in the store; whoever brings it to the group size
  unlinks the name. From then on the segment has no name at all: nothing is left in /dev/shm whether
  the processes exit or are killed, and nobody can open it any more.

Nobody waits for another process except for the name, so two groups whose creators are different
processes cannot wait on each other. Each group is set up once per process.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import threading

import jax

from jax_flexlink._src import compat
from jax_flexlink._src import hosts
from jax_flexlink._src.collective import NotLowerable

_lock = threading.Lock()
_prepared: dict[tuple[int, ...], str] = {}  # group devices -> segment name (unlinked or not)
_created_unlinked: dict[str, bool] = {}  # segments this process created -> unlinked yet
# (group, tcp link) -> connections its listeners refused for a missing or wrong token
_refused: dict[tuple, int] = {}


device_process = hosts.device_process  # the job's one device map (hosts.py)


def spans_processes(devices) -> bool:
  return len({device_process(int(d)) for d in devices}) > 1


def prepare(groups, group_sizes, platforms) -> None:
  """Makes every group of a call's table that spans processes and has a rank in this process ready
  for the engine (raises NotLowerable where FlexLink cannot run such a group)."""
  if jax.process_count() == 1:
    return
  offset = 0
  for size in (int(s) for s in group_sizes):
    group = tuple(int(d) for d in groups[offset:offset + size])
    offset += size
    if group in _prepared or not spans_processes(group):
      continue
    me = jax.process_index()
    if all(device_process(d) != me for d in group):
      continue  # this process runs none of its ranks
    if len(set(hosts.hosts_of([hosts.device_object(d) for d in group]))) > 1:  # hierarchical.py splits such groups before this
      raise NotLowerable(
          f"the group of devices {list(group)} spans hosts, and a FlexLink group runs inside one "
          "host (groups across hosts run hierarchically, docs/multihost.md)")
    if any(p != "cpu" for p in platforms):
      raise NotLowerable(
          f"the group of devices {list(group)} spans processes, and FlexLink runs groups across "
          "processes on CPU only so far (docs/xproc.md)")
    with _lock:
      if group not in _prepared:
        _prepared[group] = _set_up(group, me)


def _set_up(group: tuple[int, ...], me: int) -> str:
  from jax_flexlink._src import native  # noqa: PLC0415 - native imports jax's FFI registration
  client = compat.distributed_client()
  if client is None:
    raise NotLowerable(
        f"the group of devices {list(group)} spans processes, and FlexLink sets such groups up "
        "through jax.distributed's key-value store; call jax.distributed.initialize() first")
  module = native._flexlink
  timeout_ms = hosts.kv_timeout_ms()
  local = [d for d in group if device_process(d) == me]
  key = "flexlink/xproc/" + hashlib.sha256(",".join(map(str, group)).encode()).hexdigest()[:32]
  creator = device_process(group[0])
  if me == creator:
    name = module.xproc_create(list(group), local, 0)
    _created_unlinked[name] = False
    client.key_value_set(f"{key}/name", name)
  else:
    name = hosts.kv_get(client, f"{key}/name",
                        f"process {creator} did not publish the shared-memory segment of the group "
                        f"of devices {list(group)}", timeout_ms=timeout_ms)
    module.xproc_attach(name, list(group), local)
  if client.key_value_increment(f"{key}/mapped", len(local)) == len(group):
    _unlink(name)
  for link in _tcp_links(module):
    _connect_tcp(client, module, f"{key}/tcp/{link}", group, local, me, creator, link, timeout_ms)
  return name


def _tcp_links(module) -> list[str]:
  """The configured links of kind tcp (their rings span processes like the segment does)."""
  from jax_flexlink._src import native  # noqa: PLC0415
  names = list(module.links())
  kinds = native.link_kinds(module.links_spec())
  return [name for name, kind in zip(names, kinds) if kind == "tcp"]


def _connect_tcp(client, module, key, group, local, me, creator, link, timeout_ms) -> None:
  """A tcp ring across the group's processes: every process listens for its ranks and publishes
  the ports; the creator's random token travels the same way; then every rank connects to its
  successor, and each listener takes only the connection that presents the token."""
  ports = module.xproc_tcp_listen(list(group), local, link)
  client.key_value_set(f"{key}/ports/{me}", ",".join(f"{d}:{p}" for d, p in zip(local, ports)))
  if me == creator:
    token = os.urandom(16)
    client.key_value_set_bytes(f"{key}/token", token)
  else:
    token = hosts.kv_get(client, f"{key}/token",
                         f"process {creator} did not publish the token of the {link} ring of the "
                         f"group of devices {list(group)}", as_bytes=True, timeout_ms=timeout_ms)
  port_of = dict(zip(local, ports))
  for process in sorted({device_process(d) for d in group} - {me}):
    text = hosts.kv_get(client, f"{key}/ports/{process}",
                        f"process {process} did not publish its ports of the {link} ring of the "
                        f"group of devices {list(group)}", timeout_ms=timeout_ms)
    port_of.update((int(d), int(p)) for d, p in (item.split(":") for item in text.split(",")))
  _refused[(group, link)] = module.xproc_tcp_connect(list(group), local, [port_of[d] for d in group],
                                                     token, link)


def _unlink(name: str) -> None:
  from jax_flexlink._src import native  # noqa: PLC0415
  native._flexlink.xproc_unlink(name)
  if name in _created_unlinked:
    _created_unlinked[name] = True


@atexit.register
def _unlink_unmapped() -> None:
  """A segment this process created that some member never mapped (its set-up failed) still has
  its name; take it away on a normal exit."""
  for name, unlinked in list(_created_unlinked.items()):
    if not unlinked:
      try:
        _unlink(name)
      except Exception:  # noqa: BLE001 - already gone (the last mapper unlinked it)
        pass


def groups() -> list[dict]:
  """The cross-process groups this process has set up, as the engine reports them."""
  from jax_flexlink._src import native  # noqa: PLC0415
  module = native._flexlink
  return list(module.xproc_groups()) if hasattr(module, "xproc_groups") else []
