"""Loads the C++ extension and registers its FFI handlers with XLA, once per process."""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import jax

from jax_flexlink._src import config
from jax_flexlink._src.config import ENV


def _load_module_from(path: str):
  """The CPU module from FLEXLINK_MODULE (e.g. an ASan build's, docs/sanitizers.md), installed as
  jax_flexlink._flexlink so every later import of it gets this one."""
  if not os.path.isfile(path):
    raise ImportError(f"FLEXLINK_MODULE={path!r}: no such file (expected the path of a _flexlink*.so, "
                      "e.g. build/<dir>/_flexlink.cpython-311-x86_64-linux-gnu.so)")
  spec = importlib.util.spec_from_file_location("jax_flexlink._flexlink", path)
  if spec is None or spec.loader is None:
    raise ImportError(f"FLEXLINK_MODULE={path!r}: not a Python extension module")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # ImportError with the loader's reason (e.g. another Python's build)
  sys.modules[spec.name] = module
  setattr(sys.modules["jax_flexlink"], "_flexlink", module)
  return module


try:
  if ENV.module:
    _flexlink = _load_module_from(ENV.module)
  else:
    from jax_flexlink import _flexlink  # the nanobind module built from xla_ffi/
except ImportError as e:  # the usual cause: Python found the source tree before the installed package
  if ENV.module:
    raise
  raise ImportError(
      "jax_flexlink's compiled module _flexlink is missing next to the jax_flexlink package imported "
      f"from {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}. If that is the repository's source tree (Python puts "
      "the current directory first on its path, so running from the repository root after "
      "`pip install .` imports the sources, which have no compiled module), run from another "
      "directory or install in place with `pip install -e .`; otherwise rebuild with "
      f"`pip install .` ({e})") from e


def _load_cuda_module():
  """The CUDA module, built only with FLEXLINK_CUDA=ON; None when this build has none. A module
  that is there but does not import is an error, not a silent CPU-only build."""
  if importlib.util.find_spec("jax_flexlink._flexlink_cuda") is None:
    return None
  from jax_flexlink import _flexlink_cuda  # noqa: PLC0415 - optional
  return _flexlink_cuda


_flexlink_cuda = _load_cuda_module()

ALL_REDUCE = "flexlink_all_reduce"
ALL_GATHER = "flexlink_all_gather"
REDUCE_SCATTER = "flexlink_reduce_scatter"
PPERMUTE = "flexlink_ppermute"
ALL_TO_ALL = "flexlink_all_to_all"
TARGETS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, PPERMUTE, ALL_TO_ALL)

# Link kinds of each module (plan/link_spec.h names them; xla_ffi/cuda/gpu_link_set.h for CUDA).
GPU_LINK_KINDS = ("nccl", "pcie", "rdma")

_registered = False


def cpu_module():
  """The CPU engine's module (jax_flexlink._flexlink, or FLEXLINK_MODULE's)."""
  return _flexlink


def cuda_module():
  """jax_flexlink._flexlink_cuda, or None in a build without it."""
  return _flexlink_cuda


def modules():
  """The native modules of this build: the CPU one, then the CUDA one if built."""
  return (_flexlink,) if _flexlink_cuda is None else (_flexlink, _flexlink_cuda)


def link_kinds(spec: str) -> list[str]:
  """The link kinds of a FLEXLINK_LINKS spec, e.g. "nccl;pcie@slot_mib=4" -> ["nccl", "pcie"]."""
  if not isinstance(spec, str):
    raise TypeError(f"links must be a string such as 'shm;tcp' (FLEXLINK_LINKS syntax), got {spec!r} "
                    f"of type {type(spec).__name__}")
  if not spec.isprintable():
    raise ValueError(f"links {spec!r}: a link spec has no control characters (e.g. 'shm;tcp')")
  kinds = []
  for item in spec.split(";"):
    item = item.strip()
    if item:
      kinds.append(item.split("@", 1)[0].split(":", 1)[0].strip())
  return kinds


def module_for_links(spec: str):
  """The module whose engine takes these links: GPU kinds go to the CUDA module, the others to the
  CPU module; one spec names the links of one platform."""
  kinds = link_kinds(spec)
  gpu = [k for k in kinds if k in GPU_LINK_KINDS]
  if not gpu:
    return _flexlink
  if len(gpu) != len(kinds):
    raise ValueError(f"links {spec!r} mix GPU links ({', '.join(GPU_LINK_KINDS)}) with CPU links; "
                     "configure each platform's links with its own spec")
  if _flexlink_cuda is None:
    raise ValueError(f"links {spec!r} are GPU links, and this build of jax_flexlink has no CUDA module "
                     "(build it with `pip install -e . -C cmake.define.FLEXLINK_CUDA=ON`)")
  return _flexlink_cuda


def _fault_links(spec: str) -> list[str]:
  """The link names a fault spec names, e.g. "nccl:error@at_call=2;rank:absent@..." -> ["nccl"]."""
  names = []
  for part in spec.split(";"):
    name = part.split(":", 1)[0].strip()
    if part.strip() and name != "rank":
      names.append(name)
  return names


def modules_for_faults(spec: str) -> list:
  """The modules whose engines take these faults: the CUDA module when every link they name is one of
  its current links and not all are CPU links; otherwise the CPU module (whose parser then names a
  link it does not have). A spec naming no link (rank:absent alone, or "") is every module's: both
  engines have groups whose ranks can stay away."""
  names = _fault_links(spec)
  if not names:
    return list(modules())
  if _flexlink_cuda is None or all(n in _flexlink.links() for n in names):
    return [_flexlink]
  gpu = list(_flexlink_cuda.links())
  return [_flexlink_cuda] if all(n in gpu for n in names) else [_flexlink]


def set_faults(spec: str) -> None:
  """Makes `spec` the process's injected faults, in the modules it is for; the other module's faults
  are cleared, so that one spec is current ("" clears both)."""
  targets = modules_for_faults(spec)
  for target in targets:
    target.inject_faults(spec)  # a bad spec raises at the first and the previous faults stay
  for module in modules():
    if all(module is not t for t in targets):
      module.inject_faults("")


def set_health_option(key: str, value: float) -> None:
  """Sets a health option (docs/faults.md, "Health"; _flexlink.set_health_option's keys) in every
  native module: the CPU and GPU engines each keep their own copy, so one setting reaches both. A
  bad key or value raises the engine's ValueError from the CPU module before anything changes."""
  for module in modules():
    module.set_health_option(key, value)


def health_options() -> dict:
  """The health options (the CPU module's; set_health_option keeps the modules' alike)."""
  return dict(_flexlink.health_options())


def current_faults() -> str:
  for module in modules():
    if module.faults():
      return module.faults()
  return ""


def _nccl_wheel_library() -> str:
  """libnccl.so.2 of the nvidia-nccl-cu13 wheel (what jax's CUDA plugin loads), or ""."""
  spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
  for base in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(base, "lib", "libnccl.so.2")
    if os.path.exists(path):
      return path
  return ""


def tune_cache_path() -> str:
  return _flexlink.tune_cache_path(ENV.tune_cache, os.environ.get("HOME", ""))


def register_targets() -> None:
  global _registered
  if _registered:
    return
  targets = _flexlink.registrations()
  missing = set(TARGETS) - set(targets)
  if missing:
    raise ImportError(f"jax_flexlink's native module lacks FFI targets {sorted(missing)}; "
                      "rebuild it (pip install .)")
  for name, capsule in targets.items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  if _flexlink_cuda is not None:
    cuda_targets = _flexlink_cuda.registrations()
    missing = set(TARGETS) - set(cuda_targets)
    if missing:
      raise ImportError(f"jax_flexlink's CUDA module lacks FFI targets {sorted(missing)}; rebuild it "
                        "(pip install -e . -C cmake.define.FLEXLINK_CUDA=ON)")
    for name, capsule in cuda_targets.items():
      jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    _flexlink_cuda.set_nccl_library(_nccl_wheel_library())  # used only if XLA loaded no NCCL
  for module in modules():
    module.set_timeout(ENV.timeout_s)
    module.set_debug_level(ENV.debug_level)
    module.set_autotune_min_bytes(ENV.autotune_min_bytes)
    module.set_tune_max_bytes(ENV.tune_max_bytes)  # the engine profiles at least two sizes anyway
    module.set_tune_cache_path(tune_cache_path())
  for warning in _flexlink.config_warnings():  # values the engine read itself (core/config.h)
    warnings.warn(f"jax_flexlink: ignoring {warning}", stacklevel=2)
  try:
    target = module_for_links(ENV.links)
    target.configure_links(ENV.links)
  except ValueError as e:  # an import-time default: the job runs on shm, and says why
    config.ignored("FLEXLINK_LINKS", ENV.links, f"a link spec such as 'shm;tcp' ({e})", "'shm'")
    target = _flexlink
    target.configure_links("shm")
  if target is _flexlink_cuda:
    from jax_flexlink._src import gpu_seed  # noqa: PLC0415 - topology only where GPU links are chosen
    gpu_seed.seed_from_topology(target)
  if ENV.link_timeout_s is not None:
    set_health_option("link_timeout_s", ENV.link_timeout_s)  # both engines: the GPU hang detector's floor too
  if ENV.faults:  # after the links: a fault must name a configured link
    try:
      set_faults(ENV.faults)
    except ValueError as e:
      raise ValueError(f"FLEXLINK_FAULTS: {e}") from None
  _registered = True
