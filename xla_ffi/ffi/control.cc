// The multi-path control surface of jax_flexlink._flexlink: link selection, plans and shares, link
// rates of emulated links, debug logging, split records. Python wraps these in jax_flexlink.configure,
// stats() and the tests' hooks.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/map.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/engine.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/faults.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/link_set.h"
#include "xla_ffi/core/stragglers.h"
#include "xla_ffi/ffi/control.h"
#include "xla_ffi/ffi/py_values.h"
#include "xla_ffi/links/emulated.h"
#include "xla_ffi/plan/cost_model.h"
#include "xla_ffi/plan/tuning_cache.h"
#include "xla_ffi/xproc/xproc_executor.h"

namespace nb = nanobind;

namespace flexlink {
namespace {

using py::Check;
using py::KindOf;

nb::list Plans() {
  nb::list out;
  for (const PlanSnapshot& p : SnapshotPlans()) out.append(py::PlanDict(p));
  return out;
}

void SetLinkRate(const std::string& name, double gbps, double latency_us) {
  auto set = CurrentLinkSet();
  auto* link = dynamic_cast<EmulatedLink*>(set->Find(name));
  if (!link) throw nb::value_error(("set_link_rate: no emulated link named '" + name + "' in " + set->spec).c_str());
  if (!(gbps > 0) || latency_us < 0) throw nb::value_error("set_link_rate: gbps must be > 0, latency_us >= 0");
  link->SetRate(gbps, latency_us);
}

// LoadTuning, and when found installs the whole entry (fits and measured thresholds) as the model.
nb::dict InstallCached(const std::string& path, int ranks) {
  plan::TuneRecord rec;
  std::string warning;
  const bool found = plan::LoadTuning(path, {plan::HostName(), CurrentLinkSet()->spec, ranks}, &rec, &warning);
  if (found) Check(InstallModel(rec.model));
  plan::MarkReported(warning);  // Python warns with it; the engine's own reads do not repeat it
  nb::dict out;
  out["fits"] = found ? nb::object(py::FitsOf(rec.model)) : nb::none();
  out["max_bytes"] = rec.max_bytes;
  out["warning"] = warning;
  out["host"] = plan::HostName();
  return out;
}

// stats()["stragglers"] (docs/diagnose.md): one entry per rank of every group that completed a
// call (or lost one to an absent rank).
nb::list Stragglers() {
  nb::list out;
  for (const StragglerGroup& g : SnapshotStragglers()) {
    const std::string group = FormatIds(g.devices);  // the form of health, failovers and errors
    for (const StragglerRank& r : g.ranks) {
      nb::dict lateness;
      lateness["p50"] = r.p50_s;
      lateness["p90"] = r.p90_s;
      lateness["max"] = r.max_s;
      nb::dict d;
      d["group"] = group;
      d["rank"] = r.rank;
      d["device"] = r.device;
      d["calls"] = r.calls;
      d["last"] = r.last;
      d["expected_last"] = r.expected_last;
      d["lateness_s"] = lateness;
      d["flagged"] = r.flagged;
      d["significant"] = r.significant;
      d["p_value"] = r.p_value;
      d["absent"] = r.absent;
      out.append(d);
    }
  }
  return out;
}

// What keys and guards this machine's tuning cache entries (tests write entries with it).
nb::dict CacheIdentity() {
  nb::dict out;
  out["host"] = plan::HostName();
  out["fingerprint"] = plan::HostFingerprint();
  out["engine"] = plan::kEngineRevision;
  out["version"] = plan::kCacheFormatVersion;
  out["oldest_readable_version"] = plan::kOldestReadableCacheFormat;
  out["max_file_bytes"] = plan::kMaxCacheFileBytes;
  return out;
}

}  // namespace

void DefineControl(nb::module_& m) {
  m.def(
      "configure_links",
      [](const std::string& spec) {
        Check(ConfigureLinks(spec));
        (void)ReleaseEarlierGroups();
        (void)xproc::ReleaseEarlierXprocEntries();
      },
      nb::arg("spec"),
      "Selects the links (FLEXLINK_LINKS syntax) for programs lowered from now on; calls already "
      "lowered keep the set they were lowered with. Releases the idle groups of earlier sets.");
  m.def(
      "release_earlier_groups",
      [] {
        const ReleasedGroups r = ReleaseEarlierGroups();
        const ReleasedGroups x = xproc::ReleaseEarlierXprocEntries();
        nb::dict out;
        out["released"] = r.released;
        out["kept"] = r.kept;
        out["released_across_processes"] = x.released;
        out["kept_across_processes"] = x.kept;
        return out;
      },
      "Releases the idle groups of earlier link sets, in this process and this process's part of those "
      "across processes (configure_links does it too): {'released': n, 'kept': busy ones, "
      "'released_across_processes': n, 'kept_across_processes': busy ones}.");
  m.def("links_version", [] { return CurrentLinkSet()->version; },
        "The current link set's version (each configure_links makes a new one): every call carries the "
        "version it was lowered with (attribute links_version), and all of its ranks run on that set.");
  m.def("links", [] { return CurrentLinkSet()->names(); }, "Names of the current links, primary first.");
  m.def("links_spec", [] { return CurrentLinkSet()->spec; }, "The current link spec, canonical form.");
  m.def("plans", &Plans, "Every plan of the current link set: collective, bucket, shares, mode, group.");
  m.def(
      "set_shares",
      [](const std::string& kind, uint64_t bucket_bytes, std::vector<double> shares, bool pinned) {
        Check(SetShares(KindOf(kind), bucket_bytes, std::move(shares), pinned));
      },
      nb::arg("collective"), nb::arg("bucket_bytes"), nb::arg("shares"), nb::arg("pinned") = true);
  m.def("set_link_rate", &SetLinkRate, nb::arg("name"), nb::arg("gbps"), nb::arg("latency_us") = 0.0,
        "Changes an emulated link's pace while running.");
  m.def("set_debug_level", &SetDebugLevel, nb::arg("level"));
  m.def("tune_cache_path", [](const std::string& configured, const std::string& home) {
    return plan::ResolveCachePath(configured, home);
  }, nb::arg("configured"), nb::arg("home"));
  m.def("install_cached", &InstallCached, nb::arg("path"), nb::arg("ranks"),
        "Installs the tuning cache entry (fits, measured split thresholds) of this host, the current "
        "links and `ranks`, if there is one: {fits or None, max_bytes, warning, host}.");
  m.def("tune_cache_identity", &CacheIdentity,
        "{host, fingerprint, engine, version, max_file_bytes}: what an entry of this machine carries.");
  m.def("set_autotune_min_bytes", &SetAutotune, nb::arg("bytes"),
        "Stage 1 runs on a group's first call of a kind of at least this many bytes that has no "
        "fits (0: never).");
  m.def("autotune_min_bytes", &AutotuneMinBytes);
  m.def("set_tune_max_bytes", &SetTuneMax, nb::arg("bytes"), "Largest size stage 1 profiles in the engine.");
  m.def("tune_max_bytes", &TuneMaxBytes);
  m.def("set_tune_use_cache", &SetTuneUseCache, nb::arg("on"));
  m.def("tune_use_cache", &TuneUseCache);
  m.def("forget_model", [](const std::string& kind) { ForgetModel(KindOf(kind)); }, nb::arg("collective"),
        "Forgets a collective's stage-1 fits everywhere: its next large call runs stage 1 again.");
  m.def("group_fits", [](const std::vector<int64_t>& devices) -> nb::object {
    auto model = GroupModel(devices);
    return model ? nb::object(py::GroupModelDict(*model)) : nb::none();
  }, nb::arg("devices"), "The stage-1 model of one group: {fits: {collective: [(alpha, beta)]}, split_min_bytes, "
        "profiled_bytes}.");
  m.def("set_tune_cache_path", &SetTuneCachePath, nb::arg("path"), "The tuning cache the engine reads and writes.");
  m.def("inject_faults", [](const std::string& spec) { Check(SetFaults(spec)); }, nb::arg("spec"),
        "Sets the injected faults (FLEXLINK_FAULTS syntax, docs/faults.md); \"\" clears them.");
  m.def("faults", [] {
    auto f = CurrentFaults();
    return f ? f->text : std::string();
  }, "The injected faults' text (\"\" when none).");
  // Health thresholds and link deadlines by name (docs/faults.md; core/health.h, shared with the
  // CUDA module); unknown keys and bad values are a ValueError.
  m.def("set_health_option", [](const std::string& key, double value) { Check(SetHealthOption(key, value)); },
        nb::arg("key"), nb::arg("value"));
  m.def("health_options", &HealthOptionValues);
  m.def("stragglers", &Stragglers,
        "Per group and rank: calls, how often it arrived last, its lateness (p50/p90/max s), flagged, "
        "significant, p_value, absent (docs/diagnose.md).");
  m.def("tune_cache_file", &TuneCachePath, "The tuning cache set by set_tune_cache_path (empty: none set).");
  m.def("set_record_splits", &SetRecordSplits, nb::arg("on"));
  m.def("take_split_records", [] { return py::SplitRecordList(TakeSplitRecords()); },
        "Per-rank ranges of the calls since the last take.");
}

}  // namespace flexlink
