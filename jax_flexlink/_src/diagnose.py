"""jax_flexlink.diagnose(): what the engine's statistics say, in words a person on call can act on.

`build_report(stats, fits=..., config=...)` is a pure function of a stats() dict (schema in
docs/diagnose.md; the "health" and "failovers" keys come from the link-health work and may be absent
in a build without it), the stage-1 fits of each group and the configuration, so the wording is
tested on synthetic dicts. `diagnose()` gathers those from this process and builds the report.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os

HEALTH_NOT_AVAILABLE = "health tracking not available in this build"
# xla_ffi/core/stragglers.h kStragglerMinLatenessS: a rank must cost this much at the median.
STRAGGLER_MIN_LATENESS_S = 50e-6
LIVE_HINT = ("live statistics come from calling jax_flexlink.diagnose() inside the job (this process "
             "ran no collectives)")


def group_key(group) -> str:
  """A group as stats() spells it in "health"/"stragglers": "[0,1,2,3]" (plans give a list)."""
  if isinstance(group, str):
    text = group.strip().strip("[]")
    ids = [int(x) for x in text.replace(" ", "").split(",") if x]
  else:
    ids = [int(x) for x in group]
  return "[" + ",".join(str(i) for i in ids) + "]"


def group_ids(group) -> list[int]:
  return [int(x) for x in group_key(group).strip("[]").split(",") if x]


def group_label(group) -> str:
  """For people: "[0..7]" for a run of consecutive devices, else the list."""
  ids = group_ids(group)
  if len(ids) > 2 and ids == list(range(ids[0], ids[0] + len(ids))):
    return f"[{ids[0]}..{ids[-1]}]"
  return "[" + ",".join(str(i) for i in ids) + "]"


def _gbps(bytes_per_s) -> str:
  return "n/a" if bytes_per_s is None else f"{bytes_per_s / 1e9:.3g} GB/s"


def _bytes(n) -> str:
  n = float(n)
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"


def _secs(s) -> str:
  s = float(s)
  if s < 1e-3:
    return f"{s * 1e6:.0f} us"
  if s < 1:
    return f"{s * 1e3:.1f} ms"
  return f"{s:.2f} s"


def _clock(t) -> str:
  if t is None:
    return "?"
  return datetime.datetime.fromtimestamp(float(t)).strftime("%H:%M:%S")


@dataclasses.dataclass
class LinkReport:
  name: str
  primary: bool
  calls: int
  bytes: int
  seconds: float
  observed_bytes_per_s: float | None
  # {collective: bytes/s the stage-1 fit predicts for this link's calls and bytes}, over the
  # collectives that have plans; empty when no group has fits.
  expected_bytes_per_s: dict
  state: str  # "healthy" | "degraded" | "unhealthy" | "unknown" (no health tracking)
  healthy: bool


@dataclasses.dataclass
class GroupReport:
  group: str  # "[0,1,...]"
  plans: list  # [{"collective", "bucket_bytes", "shares": {link: share}, "mode"}]
  fits: dict  # {collective: {link: {"alpha_s", "beta_s_per_byte", "bytes_per_s"}}}
  health: list  # stats()["health"] entries of this group
  stragglers: list  # stats()["stragglers"] entries of this group


@dataclasses.dataclass
class Report:
  findings: list  # plain sentences, most urgent first
  notes: list  # what the report could not tell (no health tracking, no live statistics)
  links: list  # LinkReport
  groups: list  # GroupReport
  failovers: dict | None  # stats()["failovers"], None without health tracking
  config: dict
  live: bool  # whether the statistics came from collectives this process ran
  time: float

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def to_json(self, indent: int | None = 2) -> str:
    return json.dumps(self.to_dict(), indent=indent, sort_keys=False, default=str)

  def __str__(self) -> str:
    return format_report(self)


def _fits_by_group(fits) -> dict:
  """{group_key: {collective: {link: {...}}}} from {group (any form): group_fits() dict or None}."""
  out = {}
  for group, model in (fits or {}).items():
    if not model:
      continue
    per_kind = {}
    links = model.get("links")
    for kind, per_link in (model.get("fits") or {}).items():
      entry = {}
      for i, fit in enumerate(per_link):
        alpha, beta = (fit["alpha_s"], fit["beta_s_per_byte"]) if isinstance(fit, dict) else fit
        name = links[i] if links and i < len(links) else str(i)
        entry[name] = {"alpha_s": float(alpha), "beta_s_per_byte": float(beta),
                       "bytes_per_s": 1.0 / beta if beta > 0 else None}
      per_kind[kind] = entry
    out[group_key(group)] = per_kind
  return out


def _expected_over(fit: dict, calls: int, nbytes: int) -> float | None:
  # The fit is linear, so the time it predicts for the link's calls, whatever their sizes, is
  # calls * alpha + beta * bytes: exact from the aggregate counters stats() keeps.
  t = calls * fit["alpha_s"] + fit["beta_s_per_byte"] * nbytes
  return nbytes / t if t > 0 and nbytes > 0 else None


def build_report(stats: dict, *, fits: dict | None = None, config: dict | None = None,
                 live: bool = True, now: float | None = None) -> Report:
  """The report of a stats() dict. fits: {group: group_fits(devices) with "links": [names]}."""
  import time  # noqa: PLC0415

  now = time.time() if now is None else now
  links_stats = stats.get("links") or {}
  plans = stats.get("plans") or []
  health = stats.get("health")
  failovers = stats.get("failovers")
  stragglers = stats.get("stragglers") or []
  has_health = health is not None
  health = health or []
  fits_g = _fits_by_group(fits)
  link_names = list(links_stats)
  primary = (config or {}).get("links_list", link_names[:1])[:1]

  # Groups: every group any section names.
  groups: dict[str, GroupReport] = {}

  def group(g) -> GroupReport:
    key = group_key(g)
    if key not in groups:
      groups[key] = GroupReport(key, [], fits_g.get(key, {}), [], [])
    return groups[key]

  for p in plans:
    group(p.get("group", [])).plans.append(
        {"collective": p.get("collective"), "bucket_bytes": p.get("bucket_bytes"),
         "shares": dict(p.get("shares") or {}), "mode": p.get("mode")})
  for key in fits_g:
    group(key)
  for h in health:
    group(h["group"]).health.append(dict(h))
  for s in stragglers:
    group(s["group"]).stragglers.append(dict(s))

  ran_kinds = sorted({p["collective"] for g in groups.values() for p in g.plans if p.get("collective")})

  links = []
  for name, e in links_stats.items():
    calls, nbytes, seconds = int(e.get("calls", 0)), int(e.get("bytes", 0)), float(e.get("seconds", 0.0))
    observed = nbytes / seconds if seconds > 0 and nbytes > 0 else None
    expected = {}
    if calls:
      for g in groups.values():
        for kind in ran_kinds:
          fit = (g.fits.get(kind) or {}).get(name)
          if fit and kind in {p["collective"] for p in g.plans}:
            bw = _expected_over(fit, calls, nbytes)
            if bw is not None:
              expected[kind] = min(bw, expected.get(kind, bw))
    # The health tracker's expectation (stage-1 fit at the sizes it observed), where it has one.
    from_health = [h["expected_bytes_per_s"] for h in health
                   if h.get("link") == name and h.get("expected_bytes_per_s")]
    if from_health:
      expected["health tracker"] = min(from_health)
    state = e.get("state") or ("unknown" if not has_health else "healthy" if e.get("healthy", True)
                               else "unhealthy")
    links.append(LinkReport(name, name in primary, calls, nbytes, seconds, observed, expected, state,
                            bool(e.get("healthy", True))))

  findings, notes = [], []
  recent = (failovers or {}).get("recent") or []

  # 1. Links not healthy, with the evidence and where their bytes went.
  order = {"unhealthy": 0, "degraded": 1}
  for h in sorted(health, key=lambda h: (order.get(h.get("state"), 9), h.get("group"), h.get("link"))):
    if h.get("state") == "healthy":
      continue
    text = (f"link {h['link']} in group {group_label(h['group'])} is {h['state']} since "
            f"{_clock(h.get('since'))} (call {h.get('since_call', '?')}): {h.get('reason') or 'no reason given'}")
    mine = [f for f in recent if f.get("link") == h["link"] and group_key(f.get("group", "")) == group_key(h["group"])]
    count = int(h.get("failovers") or len(mine))
    if count:
      to = sorted({f.get("to") for f in mine if f.get("to")})
      text += (f"; its bytes went to {' and '.join(to) if to else 'the other links'} in {count} failover"
               f"{'s' if count != 1 else ''}")
    if h.get("state") == "degraded":
      if "GB/s" not in (h.get("reason") or "") and h.get("observed_bytes_per_s") and h.get("expected_bytes_per_s"):
        text += f" (observed {_gbps(h['observed_bytes_per_s'])}, expected {_gbps(h['expected_bytes_per_s'])})"
      text += "; stage 2 moves its load to the other links"
    findings.append(text)

  # 2. Failovers of links that are healthy again (re-admitted after a probe) or not in health.
  unhealthy = {(group_key(h["group"]), h["link"]) for h in health if h.get("state") != "healthy"}
  seen = {}
  for f in recent:
    key = (group_key(f.get("group", "")), f.get("link"))
    if key not in unhealthy:
      seen.setdefault(key, []).append(f)
  for (g, link), fs in sorted(seen.items()):
    last = max(fs, key=lambda f: f.get("call", 0))
    findings.append(
        f"link {link} in group {group_label(g)} failed over {len(fs)} time{'s' if len(fs) != 1 else ''} "
        f"(last at call {last.get('call', '?')}, {last.get('collective', '?')}, {_clock(last.get('time'))}: "
        f"{last.get('reason') or 'no reason given'}; its bytes went to {last.get('to', '?')}); it is "
        "not marked unhealthy now")
  if failovers and int(failovers.get("count", 0)) > len(recent):
    notes.append(f"{failovers['count']} failovers in all; the newest {len(recent)} are kept")

  # 3. Stragglers: flagged ranks, then ranks that never arrived.
  for s in sorted(stragglers, key=lambda s: (-int(s.get("last", 0)), s.get("group"))):
    if not s.get("flagged"):
      continue
    late = s.get("lateness_s") or {}
    findings.append(
        f"rank {s['rank']} (device {s['device']}) of group {group_label(s['group'])} arrived last in "
        f"{s['last']} of {s['calls']} calls (expected {s['expected_last']:.3g}), median "
        f"{_secs(late.get('p50', 0))} late (p90 {_secs(late.get('p90', 0))}, max {_secs(late.get('max', 0))}): "
        "the other ranks wait for it at every such call; look at what its device does before the "
        "collective (input pipeline, host work, a slower or busier device)")
  for s in stragglers:
    if int(s.get("absent", 0)):
      findings.append(
          f"rank {s['rank']} (device {s['device']}) of group {group_label(s['group'])} never arrived in "
          f"{s['absent']} call{'s' if int(s['absent']) != 1 else ''} (the others timed out waiting for it)")

  if not has_health:
    # The link-health work judges bandwidth against the fits with its own evidence (a sustained drop
    # over recent calls); the totals here include rendezvous waits and scheduling on a loaded host
    # and are no basis for a verdict on their own, so they are shown, not judged.
    notes.append(HEALTH_NOT_AVAILABLE + " (observed against expected bandwidth is listed per link below, "
                 "not judged)")
  if not live:
    notes.append(LIVE_HINT)
  if not findings and not live:
    findings.append("nothing to judge: this process has run no FlexLink collectives")
  elif not findings:
    calls = sum(l.calls for l in links)
    group_calls = {s["group"]: int(s.get("calls", 0)) for s in stragglers}
    findings.append(
        f"no problems found: {len(links)} link{'s' if len(links) != 1 else ''} "
        f"({', '.join(l.name for l in links) or 'none'}), {calls} link calls, "
        f"{'no failovers' if failovers is not None else 'failovers not tracked'}, no straggler in "
        f"{sum(group_calls.values())} calls over {len(group_calls)} group{'s' if len(group_calls) != 1 else ''}")

  return Report(findings=findings, notes=notes, links=links, groups=list(groups.values()),
                failovers=failovers, config=dict(config or {}), live=live, time=now)


def format_report(r: Report) -> str:
  out = [f"FlexLink diagnosis at {_clock(r.time)} "
         f"({'live statistics of this process' if r.live else 'no live statistics'})", "", "Findings:"]
  out += [f"  - {f}" for f in r.findings]
  if r.notes:
    out += ["", "Notes:"] + [f"  - {n}" for n in r.notes]
  if r.links:
    out += ["", "Links (observed: bytes / seconds the link spent; expected: what the stage-1 fit predicts for "
            "the same calls and bytes):"]
    for l in r.links:
      def ratio(v, l=l):
        return f", observed {l.observed_bytes_per_s / v:.0%} of it" if l.observed_bytes_per_s and v else ""
      exp = "; ".join(f"{_gbps(v)} ({k}{'' if k == 'health tracker' else ' fit'}{ratio(v)})"
                      for k, v in sorted(l.expected_bytes_per_s.items()))
      state = "health unknown" if l.state == "unknown" else l.state
      out.append(f"  {l.name}{' (primary)' if l.primary else ''}: {state}, {l.calls} calls, {_bytes(l.bytes)} "
                 f"in {_secs(l.seconds)}, observed {_gbps(l.observed_bytes_per_s)}, expected "
                 f"{exp or 'no stage-1 fit'}")
  for g in r.groups:
    out += ["", f"Group {group_label(g.group)}:"]
    for p in sorted(g.plans, key=lambda p: (p["collective"] or "", p["bucket_bytes"] or 0)):
      shares = ", ".join(f"{k} {v:.0%}" for k, v in p["shares"].items())
      out.append(f"  plan {p['collective']} from {_bytes(p['bucket_bytes'] or 0)}: {shares} ({p['mode']})")
    for kind, per_link in sorted(g.fits.items()):
      fl = ", ".join(f"{k} {v['alpha_s'] * 1e6:.1f} us + {_gbps(v['bytes_per_s'])}" for k, v in per_link.items())
      out.append(f"  stage-1 fit {kind}: {fl}")
    for h in g.health:
      line = f"  health {h['link']}: {h['state']} since {_clock(h.get('since'))} (call {h.get('since_call', '?')})"
      if h.get("reason"):
        line += f": {h['reason']}"
      line += (f"; observed {_gbps(h.get('observed_bytes_per_s'))}, expected {_gbps(h.get('expected_bytes_per_s'))}"
               f"; errors {h.get('errors', 0)}, failovers {h.get('failovers', 0)}, probes {h.get('probes', 0)}")
      out.append(line)
    if g.stragglers:
      calls = max(int(s.get("calls", 0)) for s in g.stragglers)
      top = max(g.stragglers, key=lambda s: int(s.get("last", 0)))
      flagged = [s for s in g.stragglers if s.get("flagged")]
      late = top.get("lateness_s") or {}
      out.append(f"  arrivals: {calls} calls; {len(flagged) or 'no'} straggler{'s' if len(flagged) != 1 else ''}"
                 f" flagged; most often last: rank {top['rank']} (device {top['device']}), {top['last']} times "
                 f"(expected {top['expected_last']:.3g}), median {_secs(late.get('p50', 0))} late"
                 + (f" (more often than chance, but below the {_secs(STRAGGLER_MIN_LATENESS_S)} that makes a "
                    "straggler: arrival order, not lost time)" if top.get("significant") and not top.get("flagged")
                    else ""))
  if r.failovers is not None:
    recent = r.failovers.get("recent") or []
    out += ["", f"Failovers: {r.failovers.get('count', 0)}"]
    for f in sorted(recent, key=lambda f: -float(f.get("time", 0)))[:10]:
      out.append(f"  {_clock(f.get('time'))} group {group_label(f.get('group', '[]'))} call {f.get('call')} "
                 f"{f.get('collective')}: {f.get('link')} -> {f.get('to')}, {_bytes(f.get('bytes', 0))} in "
                 f"{_secs(f.get('seconds', 0))}: {f.get('reason')}")
  c = r.config
  if c:
    out += ["", "Configuration:"]
    out.append(f"  links: {c.get('links_spec', '?')} (timeout {c.get('timeout_s', '?')} s)")
    out.append(f"  fault injection: {c.get('faults') or 'none'}")
    cache = c.get("tune_cache") or {}
    if cache:
      line = f"  tuning cache {cache.get('path')}: "
      if cache.get("error"):
        line += cache["error"]
      else:
        ents = cache.get("entries") or []
        line += f"{len(ents)} entr{'y' if len(ents) == 1 else 'ies'}"
      out.append(line)
      for e in cache.get("entries") or []:
        across = f" in {e['processes']} processes" if (e.get("processes") or 1) != 1 else ""
        out.append(f"    {e['host']} / {e['links']} / {e['ranks']} ranks{across}, up to {_bytes(e.get('max_bytes') or 0)}: "
                   f"{', '.join(e.get('collectives') or []) or 'no fits'}"
                   f"{' (matches this machine and link set)' if e.get('matches') else ''}")
  return "\n".join(out)


def read_tune_cache(path: str, host: str, links_spec: str, identity: dict | None = None) -> dict:
  """The tuning cache's entries as the report lists them; never raises (a corrupt file is reported).

  `identity`: the engine's tune_cache_identity() ({version, fingerprint, engine}); with it an entry
  matches only if the engine would trust it too (plan/tuning_cache.cc: same file format, host
  fingerprint and engine revision), not merely by host name and link set."""
  info = {"path": path, "host": host, "entries": []}
  if not os.path.exists(path):
    info["error"] = "no file (stage 1 has not been cached on this machine with this path)"
    return info
  try:
    with open(path, encoding="utf-8") as f:
      doc = json.load(f)
    entries = doc.get("entries")
    if not isinstance(entries, list):
      raise ValueError("no 'entries' list")
  except (OSError, ValueError, AttributeError) as e:
    info["error"] = f"unreadable or corrupt ({e}); the engine ignores it and profiles again"
    return info
  canon = links_spec.replace(" ", "")
  for e in entries:
    if not isinstance(e, dict):
      continue
    entry = {"host": str(e.get("host")), "links": str(e.get("links")), "ranks": e.get("ranks"),
             "processes": e.get("processes", 1), "max_bytes": e.get("max_bytes"), "collectives": sorted((e.get("fits") or {}).keys())
             if isinstance(e.get("fits"), dict) else []}
    entry["matches"] = entry["host"] == host and entry["links"].replace(" ", "") == canon
    if identity is not None:
      readable = range(identity.get("oldest_readable_version", identity["version"]), identity["version"] + 1)
      entry["matches"] = entry["matches"] and doc.get("version") in readable and (
          e.get("fingerprint") == identity["fingerprint"] and e.get("engine") == identity["engine"])
    info["entries"].append(entry)
  return info


def gather_config() -> dict:
  """Links, timeout, fault injection and the tuning cache of this process."""
  from jax_flexlink import _flexlink  # noqa: PLC0415
  from jax_flexlink._src import native, tune  # noqa: PLC0415

  spec = _flexlink.links_spec()
  config = {"links_spec": spec, "links_list": list(_flexlink.links()), "timeout_s": float(_flexlink.timeout()),
            "faults": native.current_faults() or None}  # the CPU or the CUDA module's
  identity = _flexlink.tune_cache_identity()
  config["tune_cache"] = read_tune_cache(tune.cache_path(), identity["host"], spec, identity)
  return config


def diagnose() -> Report:
  """A report of this process's FlexLink statistics (stats()), stage-1 fits, plans and configuration.

  str(report) is for people (findings first); report.to_json() / to_dict() for tools."""
  from jax_flexlink import _flexlink  # noqa: PLC0415
  from jax_flexlink._src import runtime  # noqa: PLC0415

  stats = runtime.stats()
  groups = {group_key(p["group"]) for p in stats.get("plans") or []}
  groups |= {group_key(s["group"]) for s in stats.get("stragglers") or []}
  groups |= {group_key(h["group"]) for h in stats.get("health") or []}
  names = list(_flexlink.links())
  fits = {}
  for g in sorted(groups):
    model = _flexlink.group_fits(group_ids(g))
    if model:
      fits[g] = dict(model, links=names)
  live = any(e.get("calls") for e in (stats.get("links") or {}).values()) or bool(stats.get("stragglers"))
  return build_report(stats, fits=fits, config=gather_config(), live=live)
