"""Runtime control of the engine: links, deadlines, statistics."""
from __future__ import annotations

import warnings

import jax

from jax_flexlink import _flexlink
from jax_flexlink._src import gpu_seed
from jax_flexlink._src import native
from jax_flexlink._src.config import ENV, check_timeout, links_generation_option, parse_bytes, parse_profile_bytes


def configure(*, links: str | None = None, timeout_s: float | None = None,
              autotune_min_bytes: int | str | None = None, tune_max_bytes: int | str | None = None,
              link_timeout_s: float | None = None, faults: str | None = None) -> None:
  """Sets engine options for the collectives that run from now on.

  Safe between steps without waiting for them: jax dispatches asynchronously, so calls of the
  previous step may still be queued or running when this returns. Every FlexLink call runs on the
  links its program was lowered with (all of its ranks alike, CPU and GPU), and new links
  make jit and pmap lower programs again at their next call (a counter of link changes is part of
  their cache key, so each jitted function compiles once more); an executable compiled ahead of
  time (`.lower().compile()`) keeps the links it was lowered with. The other options apply to calls
  that start from now on.

  links: which links carry the collectives, in FLEXLINK_LINKS syntax: `kind[:name][@key=value,...]`
    separated by `;`, the first being the primary, e.g. "shm;tcp" or
    "emulated:nvlink@gbps=2.0,latency_us=5;emulated:pcie@gbps=0.6,latency_us=10". Kinds: shm, tcp,
    emulated (a real link, shm by default, paced to `gbps` bus bandwidth and `latency_us` per call).
    GPU links (a build with the CUDA module, docs/cuda.md): nccl (NVLink through NCCL) and pcie
    (pinned host staging), e.g. "nccl;pcie"; a spec names one platform's links, and each platform
    keeps its own (CPU collectives keep theirs when the GPU links change). New GPU links release the
    GPU groups of the earlier ones in this process (their communicators, streams and buffers) once
    their work has completed, waiting for it up to 10 s; one still running then is kept, with a
    warning, until the next configure(links=...) or shutdown().
  timeout_s: the deadline of every wait in a collective, in (0, 1e6] seconds (default:
    FLEXLINK_TIMEOUT_S or 300 s).
  autotune_min_bytes: with several links, the first call of a collective of at least this size
    (nccl-tests bytes; 1M, 64K or a number) that has no stage-1 fits runs stage 1 inside the engine:
    the tuning cache if it has this host, link set and group size, else every link profiled alone and
    the split timed against the best link alone, cached. 0: stage 1 only from tune(); plans start
    from equal shares. Default FLEXLINK_AUTOTUNE_MIN_BYTES or 1 MiB. Smaller calls use the primary
    link alone until stage 1 ran. Groups spanning processes profile across them (no cache).
  tune_max_bytes: the largest size that in-engine stage 1 profiles (default FLEXLINK_TUNE_MAX_BYTES
    or 16 MiB); the fits extrapolate beyond it and stage 2 corrects.
  link_timeout_s: the floor of a link's own deadline for its range (FLEXLINK_LINK_TIMEOUT_S, default
    10 s): a link that takes longer than max(8 x its predicted time, this), at most half of
    timeout_s, counts as hung and its bytes fail over to another link (docs/faults.md).
  faults: fault injection, as inject_faults() (applied after `links`).
  """
  # Every argument is checked before anything changes: a bad one leaves the engine as it was.
  seconds = check_timeout(timeout_s, "timeout_s") if timeout_s is not None else None
  min_bytes = (parse_bytes(autotune_min_bytes, "autotune_min_bytes")
               if autotune_min_bytes is not None else None)
  max_bytes = parse_profile_bytes(tune_max_bytes, "tune_max_bytes") if tune_max_bytes is not None else None
  link_seconds = check_timeout(link_timeout_s, "link_timeout_s") if link_timeout_s is not None else None
  target = native.module_for_links(links) if links is not None else None
  if target is not None:
    target.configure_links(links)  # the engine's own check of the spec, the last that can fail
  for module in native.modules():
    if seconds is not None:
      module.set_timeout(seconds)
    if min_bytes is not None:
      module.set_autotune_min_bytes(min_bytes)
    if max_bytes is not None:
      module.set_tune_max_bytes(max_bytes)
  if link_seconds is not None:
    native.set_health_option("link_timeout_s", link_seconds)
  if target is not None:
    # Programs lowered from now on carry the new set (links_version); the generation is part of jit's
    # and pmap's cache keys, so a jitted program lowers again for it at its next call.
    jax.config.update(links_generation_option.name, links_generation_option.value + 1)
    if target is _flexlink:
      load_cached_model()
    else:
      global _gpu_links_chosen
      _gpu_links_chosen = True
      gpu_seed.seed_from_topology(target)
      release_earlier_gpu_groups(target)
  if faults is not None:
    inject_faults(faults)


# How long configure(links=...) waits for the GPU groups of the links it replaced to complete their
# work on the devices before releasing them; the same as shutdown()'s default.
RELEASE_TIMEOUT_S = 10.0


def release_earlier_gpu_groups(cuda) -> dict:
  """Releases the GPU groups of the link sets configure(links=...) replaced: no call reaches them
  again (a call takes the current links' group), yet each holds NCCL communicators, streams, device
  staging and pinned host memory (GpuEngine::ReleaseEarlierLinks; docs/cuda.md, "Shutdown").
  Waits at most RELEASE_TIMEOUT_S for their work to complete on the devices; a group still busy
  then, or sharing a device with one, is kept with a warning saying why, and the next
  configure(links=...) or shutdown() tries again. Returns the engine's report."""
  report = dict(cuda.release_earlier_links(RELEASE_TIMEOUT_S))
  for line in report["kept"] + report["errors"]:
    warnings.warn(f"jax_flexlink: configure(links=...): {line}", RuntimeWarning, stacklevel=3)
  return report


def inject_faults(spec: str) -> None:
  """Injects link and rank faults into the engine's calls from now on (tests and drills;
  docs/faults.md): the CPU engine's, or the GPU engine's when the spec names GPU links; a spec that
  names no link (rank:absent alone) is both engines'. `spec`, as FLEXLINK_FAULTS, is faults
  separated by `;`:

    NAME:slow@factor=K[,from_call=N]   link NAME K times slower from its N-th call (default 1)
    NAME:error@at_call=N[,sticky=1]    link NAME fails its N-th call (sticky: and every later one)
    NAME:hang@at_call=N                link NAME never completes its N-th call (until its deadline)
    rank:absent@rank=R,at_call=N       rank R of each group never arrives at the group's N-th call

  NAME is a configured link's name (links()). A link's calls are counted per group and rank from 1
  after this call: every range the executor gives it (a failover's re-run and a probe included).
  "" clears every fault. A bad spec is a ValueError naming the bad part and the grammar.
  """
  if not isinstance(spec, str):
    raise ValueError(f"inject_faults: expected a fault spec string, got {type(spec).__name__}")
  native.set_faults(spec)


def faults() -> str:
  """The injected faults' spec ("" when none)."""
  return native.current_faults()


# Whether the tuning cache still has to be read for the current CPU links (see load_cached_model).
_cached_model_pending = False


def load_cached_model() -> None:
  """Stage 1 from the tuning cache, when this link set was tuned before on this host (for a group of
  all devices), so that calls below the autotune size are planned from it too; otherwise the
  engine runs stage 1 on each group's first large call (or tune() does, now).

  Read at the first FlexLink lowering (ensure_cached_model), not here: counting devices starts
  jax's backend, and a multi-process job must call jax.distributed.initialize() before that, after
  importing jax_flexlink (or configuring its links)."""
  global _cached_model_pending
  _cached_model_pending = True


def ensure_cached_model() -> None:
  global _cached_model_pending
  if not _cached_model_pending:
    return
  _cached_model_pending = False
  if len(_flexlink.links()) > 1:
    import jax  # noqa: PLC0415 - the backend exists by now (something is being lowered)
    from jax_flexlink._src import tune  # noqa: PLC0415 - tune imports the public API modules
    tune.load_cached(len(jax.devices()))


def links() -> list[str]:
  """Names of the configured CPU links, primary first."""
  return list(_flexlink.links())


# Whether configure() chose GPU links in this process (then stats() lists them before they ran).
_gpu_links_chosen = False


def gpu_links() -> list[str]:
  """Names of the configured GPU links, primary first ([] in a build without the CUDA module)."""
  cuda = native.cuda_module()
  return [] if cuda is None else list(cuda.links())


def timeout_s() -> float:
  return float(_flexlink.timeout())


def stats() -> dict:
  """What the engine did since start or the last reset_stats().

  {"links": {name: {"bytes", "calls", "seconds", "healthy", "state"}},   # per link of the current set
   "plans": [{"collective", "bucket_bytes", "shares": {name: fraction}, "mode", "group", ...}],
   "offload_fraction": bytes not on the primary link / all bytes,
   "health": [{"group", "link", "state", "since", "since_call", "reason", "expected_bytes_per_s",
               "observed_bytes_per_s", "errors", "failovers", "probes"}],   # per (group, link) that ran
   "failovers": {"count", "recent": [{"group", "collective", "call", "link", "to", "reason", "bytes",
                                      "seconds", "time"}]},   # docs/faults.md
   "stragglers": [{"group", "rank", "device", "calls", "last", "expected_last",
                   "lateness_s": {"p50", "p90", "max"}, "flagged", "p_value", "absent"}]}
  stragglers: per rank of every group that ran a call, who arrived last at the rendezvous and how
  late (docs/diagnose.md has the test behind "flagged").
  """
  per_link, plans, total, offloaded = {}, [], 0, 0
  health, failovers = [], {"count": 0, "recent": []}
  cuda = native.cuda_module()
  # Each platform's current links. The GPU links are listed once they were chosen (configure(),
  # FLEXLINK_LINKS) or have run, so that a CUDA build used on CPU reports what a CPU build does. Their
  # counters hold the calls whose CUDA events have completed.
  for module, names in ((_flexlink, links()), (cuda, gpu_links())):
    if module is None or not names:
      continue
    full = module.stats()
    raw = full["links"]
    if module is cuda and not (_gpu_links_chosen or native.module_for_links(ENV.links) is cuda
                               or any(raw[name]["calls"] for name in names if name in raw)):
      continue
    for name in names:
      if name in raw:
        per_link[name] = raw[name]
        total += raw[name]["bytes"]
        offloaded += raw[name]["bytes"] if name != names[0] else 0
    plans.extend(module.plans())
    health.extend(full.get("health", []))
    if "failovers" in full:
      failovers["count"] += full["failovers"]["count"]
      failovers["recent"].extend(full["failovers"]["recent"])
  out = {"links": per_link, "plans": plans, "offload_fraction": offloaded / total if total else 0.0,
         "health": health, "failovers": failovers}
  out["stragglers"] = stragglers()
  return out


def stragglers() -> list[dict]:
  """stats()["stragglers"]: every native module's groups (a module without the binding has none)."""
  out = []
  for module in native.modules():
    if hasattr(module, "stragglers"):
      out.extend(module.stragglers())
  return out


def reset_stats() -> None:
  for module in native.modules():
    module.reset_stats()
