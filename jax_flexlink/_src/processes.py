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

GPU groups (lowering for "cuda", with the CUDA module built): the same exchange, plus one NCCL unique
id per nccl link that the leader's module makes and publishes next to the segment name
(`flexlink/gpuxproc/<hash>/nccl_ids`); the CUDA engine runs the group's host rendezvous and plan
through the segment and its bytes through NCCL communicators made at the first call
(xla_ffi/cuda/gpu_xproc.h). Without the module, or with no GPU link that can span processes,
`route` raises NotLowerable with the reason and lax's collective stays.
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
# (platform, group devices) -> segment name (unlinked or not)
_prepared: dict[tuple[str, tuple[int, ...], str], str] = {}  # (platform, group, _links_key) -> segment
_created_unlinked: dict[str, bool] = {}  # segments this process created -> unlinked yet
# (group, tcp link) -> connections its listeners refused for a missing or wrong token
_refused: dict[tuple, int] = {}


device_process = hosts.device_process  # the job's one device map (hosts.py)


def process_count(devices) -> int:
  """How many processes own `devices`."""
  return len({device_process(int(d)) for d in devices})


def spans_processes(devices) -> bool:
  return process_count(devices) > 1


def prepare(groups, group_sizes, platforms) -> None:
  """Makes every group of a call's table that spans processes and has a rank in this process ready
  for the engine (raises NotLowerable where FlexLink cannot run such a group)."""
  if tuple(platforms) == ("cuda",):
    from jax_flexlink._src import native  # noqa: PLC0415
    cuda = native.cuda_module()
    if cuda is not None and hasattr(cuda, "set_device_ids"):
      # Every GPU group, single-process jobs' too: XLA's handlers get the CUDA ordinal, groups hold
      # global ids, and the two differ across processes and where jax hides GPUs.
      _set_device_ids(cuda)
  if jax.process_count() == 1:
    return
  offset = 0
  for size in (int(s) for s in group_sizes):
    group = tuple(int(d) for d in groups[offset:offset + size])
    offset += size
    if not spans_processes(group) or any((p, group, _links_key(p)) in _prepared for p in platforms):
      continue
    me = jax.process_index()
    if all(device_process(d) != me for d in group):
      continue  # this process runs none of its ranks
    if len(set(hosts.hosts_of([hosts.device_object(d) for d in group]))) > 1:  # hierarchical.py splits such groups before this
      raise NotLowerable(
          f"the group of devices {list(group)} spans hosts, and a FlexLink group runs inside one "
          "host (groups across hosts run hierarchically, docs/multihost.md)")
    platform = route(group, platforms)  # raises NotLowerable with the reason where none runs it
    with _lock:
      key = (platform, group, _links_key(platform))
      if key not in _prepared:
        _prepared[key] = (_set_up if platform == "cpu" else _set_up_gpu)(group, me)


def _links_key(platform: str) -> str:
  """What a group's set-up depends on besides its devices: for a GPU group, the CUDA module's links
  (its NCCL identities are per nccl link, so links configured later need a set-up of their own, which
  the next lowering does; programs lowered before keep the group they had, xla_ffi/cuda/gpu_xproc.h).
  A CPU group's segment serves any links (tcp rings connected later are left out with the reason)."""
  if platform != "cuda":
    return ""
  from jax_flexlink._src import native  # noqa: PLC0415
  module = native.cuda_module()
  return module.links_spec() if module is not None else ""


def gpu_reason(module) -> str | None:
  """Why FlexLink's CUDA module cannot run GPU groups across processes, or None when it can."""
  if module is None:
    return ("this build has no CUDA module (FLEXLINK_CUDA=ON builds it: `pip install -e . -C "
            "cmake.define.FLEXLINK_CUDA=ON`)")
  if not hasattr(module, "gpu_xproc_create"):
    return "this build's CUDA module predates GPU groups across processes; rebuild it"
  links = module.gpu_xproc_links()
  if not links["links"]:
    why = "; ".join(f"{name}: {reason}" for name, reason in links["left_out"])
    return (f"none of the configured GPU links {list(module.links())} can span processes (nccl and "
            f"one pcie link can: {why})")
  return None


def route(group, platforms) -> str:
  """The platform whose engine runs a group spanning processes ("cpu", or "cuda" with the CUDA
  module's cross-process groups); raises NotLowerable with the reason where none can, so lowering
  keeps lax's collective (replacement) or names the reason (explicit API)."""
  platforms = tuple(platforms)
  if platforms == ("cpu",) or (platforms and all(p == "cpu" for p in platforms)):
    return "cpu"
  if platforms == ("cuda",):
    from jax_flexlink._src import native  # noqa: PLC0415
    reason = gpu_reason(native.cuda_module())
    if reason is None:
      return "cuda"
    raise NotLowerable(f"the group of devices {list(group)} spans processes, and FlexLink cannot run "
                       f"it on GPU: {reason} (docs/multiprocess.md)")
  raise NotLowerable(
      f"the group of devices {list(group)} spans processes, and FlexLink sets such groups up for one "
      f"platform at a time, cpu or cuda (lowered for {list(platforms)}; docs/multiprocess.md)")


def _key(kind: str, group) -> str:
  return f"flexlink/{kind}/" + hashlib.sha256(",".join(map(str, group)).encode()).hexdigest()[:32]


_NCCL_ID_BYTES = 128  # ncclUniqueId (NCCL_UNIQUE_ID_BYTES)
_ids_set = []         # the CUDA module got this process's ordinal -> global id map


def _set_device_ids(module) -> None:
  """Tells the CUDA module the global id of each local CUDA ordinal: XLA's handlers get the
  ordinal, groups hold jax's global ids (xla_ffi/cuda/device_ids.h)."""
  if _ids_set:
    return
  try:
    # The GPU backend's devices whatever the default backend is (JAX_PLATFORMS=cpu,cuda makes it cpu).
    gpus = jax.local_devices(backend="gpu")
  except RuntimeError:
    return  # no GPU backend here (lowering for another machine): nothing to map yet
  ids = device_id_map([d for d in gpus if d.platform == "gpu"])
  if not ids:
    return
  module.set_device_ids(ids)
  _ids_set.append(True)


def device_id_map(devices) -> list[int]:
  """[global id of CUDA ordinal 0, of 1, ...], -1 where an ordinal is none of `devices`.

  XLA's DeviceOrdinal is the StreamExecutor's ordinal, jax's `local_hardware_id`: CUDA's numbering,
  kept when jax shows a process only some GPUs (`jax_cuda_visible_devices`, or
  `jax.distributed.initialize(local_device_ids=...)`, which cluster auto-detection sets to one GPU per
  process), so a process given GPU 3 alone runs it as ordinal 3; jax's ids are its own numbering."""
  ordinals = [getattr(d, "local_hardware_id", None) for d in devices]
  if any(o is None for o in ordinals):  # no hardware id: the devices' local order is CUDA's
    ordinals = list(range(len(devices)))
  if len(set(ordinals)) != len(ordinals) or any(o < 0 for o in ordinals):
    raise ValueError(f"GPU devices {[d.id for d in devices]} have CUDA ordinals {ordinals}: not one each")
  ids = [-1] * (max(ordinals) + 1 if ordinals else 0)
  for d, o in zip(devices, ordinals):
    ids[o] = d.id
  return ids


def _set_up_gpu(group: tuple[int, ...], me: int) -> str:
  """A GPU group across processes (xla_ffi/cuda/gpu_xproc.h): the leader process (rank 0's) creates
  the group's segment and one NCCL unique id per nccl link and publishes both; the others read
  them (bounded gets) and attach; the last to map the segment unlinks its name, as on CPU. The
  communicators themselves are made at the group's first call (ncclCommInitRank for every local
  rank inside one ncclGroupStart/End), where no rank of the group has anything in flight."""
  from jax_flexlink._src import native  # noqa: PLC0415
  client = compat.distributed_client()
  if client is None:
    raise NotLowerable(
        f"the group of devices {list(group)} spans processes, and FlexLink sets such groups up "
        "through jax.distributed's key-value store; call jax.distributed.initialize() first")
  round_ = _gpu_rounds.get(group, 0)  # prepare() holds _lock
  _gpu_rounds[group] = round_ + 1
  return exchange_gpu_ids(client, native.cuda_module(), group, me,
                          [d for d in group if device_process(d) == me], device_process(group[0]),
                          process_count(group), round_)


_gpu_rounds: dict[tuple, int] = {}  # group -> its GPU set-ups so far in this process


def exchange_gpu_ids(client, module, group, me, local, creator, processes, round_=0) -> str:
  """The key-value exchange of a GPU group's segment name and NCCL unique ids (separate from
  jax so that a test can drive it with a stand-in store and module). `processes`: how many
  processes own the group's devices (the tuning cache's key). `round_`: the group's earlier set-ups
  in this process (links configured since each): every process sets a group up the same number of
  times, as all lower the same programs after the same configure calls, so each round has keys of
  its own in the store."""
  _set_device_ids(module)
  key = _key("gpuxproc", group) + (f"/{round_}" if round_ else "")
  timeout_ms = hosts.kv_timeout_ms()
  if me == creator:
    name, ids = module.gpu_xproc_create(list(group), local, processes)
    _created_unlinked[name] = False
    client.key_value_set(f"{key}/name", name)
    client.key_value_set_bytes(f"{key}/nccl_ids", b"".join(bytes(i) for i in ids))
  else:
    name = hosts.kv_get(client, f"{key}/name",
                        f"process {creator} did not publish the segment of the GPU group of devices "
                        f"{list(group)}", timeout_ms=timeout_ms)
    blob = hosts.kv_get(client, f"{key}/nccl_ids",
                        f"process {creator} did not publish the NCCL unique ids of the GPU group of "
                        f"devices {list(group)}", as_bytes=True, timeout_ms=timeout_ms)
    if len(blob) % _NCCL_ID_BYTES:
      raise RuntimeError(f"jax_flexlink: the NCCL unique ids of the GPU group of devices {list(group)} "
                         f"are {len(blob)} bytes, not a multiple of {_NCCL_ID_BYTES}")
    ids = [blob[i:i + _NCCL_ID_BYTES] for i in range(0, len(blob), _NCCL_ID_BYTES)]
    module.gpu_xproc_attach(name, ids, list(group), local)
  if client.key_value_increment(f"{key}/mapped", len(local)) == len(group):
    _unlink(name, module.gpu_xproc_unlink)
  return name


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
  key = _key("xproc", group)
  creator = device_process(group[0])
  if me == creator:
    name = module.xproc_create(list(group), local, 0, process_count(group))
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


def _unlink(name: str, unlink=None) -> None:
  from jax_flexlink._src import native  # noqa: PLC0415
  (unlink or native._flexlink.xproc_unlink)(name)
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
  """The cross-process groups this process has set up, as the engines report them (GPU groups
  with "platform": "cuda")."""
  from jax_flexlink._src import native  # noqa: PLC0415
  module = native._flexlink
  out = list(module.xproc_groups()) if hasattr(module, "xproc_groups") else []
  cuda = native.cuda_module()
  if cuda is not None and hasattr(cuda, "gpu_xproc_groups"):
    out += [dict(g, platform="cuda") for g in cuda.gpu_xproc_groups()]
  return out
