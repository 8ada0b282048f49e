// The nanobind module jax_flexlink._flexlink_cuda: the CUDA platform's FFI handler capsules and the
// control surface of its engine, under the CPU module's names where they mean the same (ffi/module.cc,
// ffi/control.cc) so that Python applies one configuration to both. Importing it needs no driver,
// no GPU and no NCCL: the CUDA runtime and NCCL are first touched by a handler call or by
// device_count()/nccl_version().
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/faults.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/cuda/gpu_faults.h"
#include "xla_ffi/cuda/gpu_xproc.h"
#include "xla_ffi/xproc/segment.h"
#include "xla_ffi/cuda/runtime/handlers.h"
#include "xla_ffi/cuda/runtime/process.h"
#include "xla_ffi/ffi/py_values.h"
#include "xla_ffi/plan/tuning_cache.h"

namespace nb = nanobind;

namespace flexlink::gpu {
namespace {

using py::Check;
using py::KindOf;

nb::dict Registrations() {
  nb::dict d;
  d["flexlink_all_reduce"] = nb::capsule(reinterpret_cast<void*>(FlexlinkCudaAllReduce));
  d["flexlink_all_gather"] = nb::capsule(reinterpret_cast<void*>(FlexlinkCudaAllGather));
  d["flexlink_reduce_scatter"] = nb::capsule(reinterpret_cast<void*>(FlexlinkCudaReduceScatter));
  d["flexlink_ppermute"] = nb::capsule(reinterpret_cast<void*>(FlexlinkCudaPpermute));
  d["flexlink_all_to_all"] = nb::capsule(reinterpret_cast<void*>(FlexlinkCudaAllToAll));
  return d;
}

// GpuEngine::Shutdown or ReleaseEarlierLinks on the process's engine, without the GIL (the device
// threads' handlers may need it meanwhile); the report as jax_flexlink.shutdown() returns it.
nb::dict Released(ShutdownReport (GpuEngine::*release)(double), double timeout_s) {
  ShutdownReport r;
  {
    nb::gil_scoped_release unlocked;
    r = (ProcessEngine().*release)(timeout_s);
  }
  nb::dict d;
  d["released"] = r.released;
  d["kept"] = r.kept;
  d["errors"] = r.errors;
  d["again"] = r.again;
  return d;
}

nb::dict Stats() {
  ProcessEngine().CurrentLinks();
  ProcessEngine().PollTimings();  // calls whose events completed since their group's last call
  return py::LinkStats();
}

nb::list Plans() {
  nb::list out;
  for (const PlanSnapshot& p : ProcessEngine().SnapshotPlans()) {
    nb::dict d = py::PlanDict(p);
    d["platform"] = "cuda";
    out.append(d);
  }
  return out;
}

nb::list SplitRecords() { return py::SplitRecordList(ProcessEngine().splits().Take()); }

nb::object GroupFits(const std::vector<int64_t>& devices) {
  auto model = ProcessEngine().GroupModel(devices);
  return model ? nb::object(py::GroupModelDict(*model)) : nb::none();
}

void SeedModel(int ranks, const std::map<std::string, std::vector<std::pair<double, double>>>& fits) {
  const std::vector<std::string> names = ProcessEngine().CurrentLinks()->names();
  plan::CostModel seed(names);
  for (const auto& [name, per_link] : fits) {
    const Kind kind = KindOf(name);
    if (per_link.size() != names.size())
      throw nb::value_error(("seed_model: " + name + " has " + std::to_string(per_link.size()) + " fits for " +
                             std::to_string(names.size()) + " links").c_str());
    for (size_t i = 0; i < per_link.size(); ++i) {
      const auto [alpha, beta] = per_link[i];
      if (!(alpha >= 0) || !(beta > 0))
        throw nb::value_error(("seed_model: " + name + " link " + names[i] + ": alpha must be >= 0 and beta > 0").c_str());
      seed.Set(kind, i, {alpha, beta});
    }
  }
  Check(ProcessEngine().SetSeed(ranks, std::move(seed)));
}

}  // namespace
}  // namespace flexlink::gpu

namespace flexlink::gpu {
namespace {

// GPU groups across processes (xla_ffi/cuda/gpu_xproc.h; Python's processes.py drives these at
// lowering, the segment name and the NCCL identities travelling through jax.distributed's store).
void ThrowXproc(const Status& s) {
  if (s.ok()) return;
  if (s.code() == StatusCode::kInvalidArgument) throw nb::value_error(s.message().c_str());
  throw std::runtime_error(s.message());
}

void DefineGpuXproc(nb::module_& m) {
  m.def(
      "set_device_ids",
      [](std::vector<int64_t> ids) {
        if (!ProcessDeviceIds().Set(ids))
          throw nb::value_error(
              "set_device_ids: this process's CUDA ordinals already map to other global ids, or the map names an id "
              "twice or an ordinal past 63");
      },
      nb::arg("global_of_ordinal"),
      "The global (jax) device id of each CUDA ordinal of this process (-1: none of its jax devices): XLA's "
      "handlers get the ordinal, groups hold global ids (xla_ffi/cuda/device_ids.h). Set once; identity until "
      "set.");
  m.def(
      "device_ids", [] { return ProcessDeviceIds().Map(); },
      "The map set_device_ids set, as a list indexed by CUDA ordinal (-1: no jax device); [] until set.");
  m.def(
      "gpu_xproc_links",
      [] {
        const GpuXprocLinks w = GpuXprocLinksOf(*ProcessEngine().CurrentLinks());
        std::vector<std::string> used;
        for (size_t i : w.used) used.emplace_back(ProcessEngine().CurrentLinks()->links[i]->name());
        nb::dict d;
        d["links"] = used;
        d["left_out"] = w.left_out;
        return d;
      },
      "{'links': the current GPU links a group across processes uses (nccl, one pcie), 'left_out': [(link, why)]}.");
  m.def(
      "gpu_xproc_create",
      [](std::vector<int64_t> devices, std::vector<int64_t> local_devices, int processes) {
        std::string name;
        std::vector<CommId> ids;
        Status s;
        {
          nb::gil_scoped_release release;
          s = CreateGpuXprocGroup(ProcessEngine(), devices, local_devices, processes, &name, &ids);
        }
        ThrowXproc(s);
        std::vector<nb::bytes> out;
        for (const CommId& id : ids) out.emplace_back(id.data(), id.size());
        return std::make_tuple(name, out);
      },
      nb::arg("devices"), nb::arg("local_devices"), nb::arg("processes") = 0,
      "Leader process (it runs rank 0): creates the segment of the GPU group `devices` (global ids, rank "
      "order) and one NCCL unique id per nccl link, claims `local_devices`, registers the group; returns "
      "(segment name, [128-byte ids]) for the other processes. `processes`: how many processes own "
      "`devices` (the tuning cache's key; 0: not known, no cache).");
  m.def(
      "gpu_xproc_attach",
      [](const std::string& name, std::vector<nb::bytes> ids, std::vector<int64_t> devices,
         std::vector<int64_t> local_devices) {
        std::vector<CommId> comm_ids;
        for (const nb::bytes& b : ids) {
          if (b.size() != kCommIdBytes)
            throw nb::value_error(("gpu_xproc_attach: an NCCL unique id has " + std::to_string(kCommIdBytes) +
                                   " bytes, got " + std::to_string(b.size())).c_str());
          CommId id;
          std::memcpy(id.data(), b.c_str(), kCommIdBytes);
          comm_ids.push_back(id);
        }
        Status s;
        {
          nb::gil_scoped_release release;
          s = AttachGpuXprocGroup(ProcessEngine(), name, comm_ids, devices, local_devices);
        }
        ThrowXproc(s);
      },
      nb::arg("name"), nb::arg("ids"), nb::arg("devices"), nb::arg("local_devices"),
      "Other member processes: maps the leader's segment `name`, keeps its NCCL ids, claims "
      "`local_devices`, registers the group. The communicators are made at the group's first call.");
  m.def(
      "gpu_xproc_unlink", [](const std::string& name) { ThrowXproc(xproc::Segment::Unlink(name)); },
      nb::arg("name"), "Removes the segment's name once every process mapped it (mappings stay).");
  m.def(
      "gpu_xproc_groups",
      [] {
        nb::list out;
        for (const GpuXprocInfo& g : GpuXprocGroups(ProcessEngine())) {
          nb::dict d;
          d["name"] = g.name;
          d["devices"] = g.devices;
          d["local_devices"] = g.local_devices;
          d["links"] = g.links;
          d["left_out"] = g.left_out;
          d["calls"] = g.calls;
          d["broken"] = g.broken;
          out.append(d);
        }
        return out;
      },
      "Per GPU group across processes: name, devices, local_devices, links, left_out, calls, broken.");
}

}  // namespace
}  // namespace flexlink::gpu

NB_MODULE(_flexlink_cuda, m) {
  using namespace flexlink;
  using namespace flexlink::gpu;
  m.doc() = "FlexLink collectives for XLA:GPU (CUDA FFI handlers and engine control)";
  m.def("registrations", &Registrations,
        "FFI target name -> PyCapsule of the execute-stage XLA_FFI_Handler for platform CUDA (not "
        "command-buffer compatible: per-call host logic).");
  m.def(
      "set_timeout",
      [](double seconds) {
        if (!ValidTimeoutSeconds(seconds)) {
          throw nb::value_error(("set_timeout: seconds must be a finite number in (0, 1e6], got " +
                                 std::to_string(seconds)).c_str());
        }
        SetTimeoutSeconds(seconds);
      },
      nb::arg("seconds"), "Deadline of every host wait in the GPU engine, in seconds.");
  m.def("timeout", &TimeoutSeconds);
  m.def(
      "shutdown",
      [](double timeout_s) { return Released(&GpuEngine::Shutdown, timeout_s); },
      nb::arg("timeout_s"),
      "Ends the GPU engine: later calls are refused; every group whose work completed within timeout_s is "
      "released (NCCL communicators, streams, events, device and pinned memory). {'released': [...], 'kept': "
      "[...], 'errors': [...], 'again': bool} (GpuEngine::Shutdown).");
  m.def("is_shut_down", [] { return ProcessEngine().shut_down(); });
  m.def("has_groups", [] { return ProcessEngine().HasGroups(); }, "Whether the GPU engine made any group.");
  m.def("set_single_rank_through_links", [](bool on) { ProcessEngine().SetSingleRankThroughLinks(on); },
        nb::arg("on"),
        "Tests only: groups of one rank run through the links (NCCL with one rank) instead of a copy on "
        "XLA's stream, so that a machine with one GPU makes NCCL's calls (gpu_engine.h).");
  m.def("set_debug_level", &SetDebugLevel, nb::arg("level"));
  m.def("configure_links", [](const std::string& spec) { Check(ProcessEngine().ConfigureLinks(spec)); },
        nb::arg("spec"), "Selects the GPU links (kinds nccl, pcie; rdma is refused); calls must not be running.");
  m.def(
      "release_earlier_links",
      [](double timeout_s) { return Released(&GpuEngine::ReleaseEarlierLinks, timeout_s); },
      nb::arg("timeout_s"),
      "Releases the groups of the link sets before the current one whose work completed within timeout_s, the "
      "engine left open; {'released': [...], 'kept': [...], 'errors': [...], 'again': False} "
      "(GpuEngine::ReleaseEarlierLinks).");
  m.def("links", [] { return ProcessEngine().CurrentLinks()->names(); });
  m.def("links_spec", [] { return ProcessEngine().CurrentLinks()->spec; });
  m.def("links_version", [] { return ProcessEngine().CurrentLinks()->version; },
        "The current link set's version (each configure_links makes a new one): CUDA calls carry the "
        "version they were lowered with (attribute links_version), which picks a GPU group across "
        "processes set up then.");
  m.def("stats", &Stats, "{'links': {name: {bytes, calls, seconds, healthy, state}}, 'health': [...], "
        "'failovers': {...}}: the calls whose CUDA events "
        "have completed (read now, without waiting; calls still running on the device are not counted yet).");
  m.def("reset_stats", [] {
    ResetLinkStats();
    ResetHealth();
  }, "Zeroes the link counters; every GPU link's health back to healthy; the failover log emptied.");
  m.def("inject_faults", [](const std::string& spec) {
    Check(SetGpuFaults(spec, ProcessEngine().CurrentLinks()->names()));
  }, nb::arg("spec"), "Sets the GPU links' injected faults (FLEXLINK_FAULTS syntax: error, slow and hang; "
     "rank:absent is refused, docs/faults.md); \"\" clears them.");
  // The GPU engine's own health options (this module's copy of core/health's; Python sets both
  // modules alike, native.set_health_option): probes, degraded thresholds, the hang detector's
  // deadlines (link_timeout_s, link_timeout_factor).
  m.def("set_health_option", [](const std::string& key, double value) { Check(SetHealthOption(key, value)); },
        nb::arg("key"), nb::arg("value"));
  m.def("health_options", &HealthOptionValues);
  m.def("faults", [] {
    auto f = CurrentFaults();
    return f ? f->text : std::string();
  }, "The GPU links' injected faults' text (\"\" when none).");
  m.def("plans", &Plans);
  m.def(
      "set_shares",
      [](const std::string& kind, uint64_t bucket_bytes, std::vector<double> shares, bool pinned) {
        Check(ProcessEngine().SetShares(KindOf(kind), bucket_bytes, std::move(shares), pinned));
      },
      nb::arg("collective"), nb::arg("bucket_bytes"), nb::arg("shares"), nb::arg("pinned") = true);
  m.def("set_autotune_min_bytes", [](uint64_t b) { ProcessEngine().SetAutotune(b); }, nb::arg("bytes"));
  m.def("autotune_min_bytes", &AutotuneMinBytes);
  m.def("set_tune_max_bytes", [](uint64_t b) { ProcessEngine().SetTuneMax(b); }, nb::arg("bytes"));
  m.def("tune_max_bytes", &TuneMaxBytes);
  m.def("set_tune_use_cache", &SetTuneUseCache, nb::arg("on"));
  m.def("tune_use_cache", &TuneUseCache);
  m.def("set_tune_cache_path", &SetTuneCachePath, nb::arg("path"));
  m.def("forget_model", [](const std::string& kind) { ProcessEngine().ForgetModel(KindOf(kind)); },
        nb::arg("collective"));
  m.def("group_fits", &GroupFits, nb::arg("devices"));
  m.def(
      "seed_model",
      [](int ranks, const std::map<std::string, std::vector<std::pair<double, double>>>& fits) {
        SeedModel(ranks, fits);
      },
      nb::arg("ranks"), nb::arg("fits"),
      "Nominal fits {collective: [(alpha_s, beta_s_per_byte) per link]} (jax_flexlink.topology."
      "nominal_fits) that plans of groups of `ranks` GPUs start from until stage 1 measures; "
      "forgotten when the links change.");
  m.def("set_record_splits", [](bool on) { ProcessEngine().splits().SetEnabled(on); }, nb::arg("on"));
  m.def("take_split_records", &SplitRecords);
  m.def("set_nccl_library", [](const std::string& path) { ProcessNccl().SetLibrary(path); }, nb::arg("path"),
        "The libnccl.so.2 to load when the process has none loaded yet (Python passes the "
        "nvidia-nccl-cu13 wheel's).");
  m.def("nccl_library", [] { return ProcessNccl().LoadedFrom(); }, "Where NCCL was loaded from ('' before use).");
  m.def("nccl_version", [] { return ProcessNccl().Version(); }, "NCCL's version code (loads NCCL; 0 if none).");
  m.def(
      "device_count",
      [] {
        std::string why;
        const int n = ProcessDevice().DeviceCount(&why);
        return std::make_pair(n, why);
      },
      "(CUDA devices visible, why none) through the CUDA runtime.");
  DefineGpuXproc(m);
}
