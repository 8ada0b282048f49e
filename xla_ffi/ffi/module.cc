// The nanobind module jax_flexlink._flexlink: FFI handler capsules for registration, the runtime
// control surface (timeout, stats), and engine_run, which drives the exact handler code path on numpy
// arrays so that engine behaviour (deadlines, mismatches) can be tested with threads as devices.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/engine.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/core/stragglers.h"
#include "xla_ffi/ffi/control.h"
#include "xla_ffi/ffi/handlers.h"
#include "xla_ffi/ffi/py_values.h"
#include "xla_ffi/links/tcp_xproc.h"
#include "xla_ffi/xproc/registry.h"
#include "xla_ffi/xproc/xproc_executor.h"

namespace nb = nanobind;

namespace flexlink {
namespace {

using InArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
using OutArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

std::optional<DType> FromDLPack(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  if (t.lanes != 1) return std::nullopt;
  switch (code) {
    case Code::Bool: return DType::kPred;
    case Code::Int:
      return t.bits == 8 ? DType::kS8 : t.bits == 16 ? DType::kS16 : t.bits == 32 ? DType::kS32
             : t.bits == 64 ? std::optional(DType::kS64) : std::nullopt;
    case Code::UInt:
      return t.bits == 8 ? DType::kU8 : t.bits == 16 ? DType::kU16 : t.bits == 32 ? DType::kU32
             : t.bits == 64 ? std::optional(DType::kU64) : std::nullopt;
    case Code::Float:
      return t.bits == 16 ? DType::kF16 : t.bits == 32 ? DType::kF32
             : t.bits == 64 ? std::optional(DType::kF64) : std::nullopt;
    case Code::Bfloat: return t.bits == 16 ? std::optional(DType::kBF16) : std::nullopt;
    case Code::Complex:
      return t.bits == 64 ? DType::kC64 : t.bits == 128 ? std::optional(DType::kC128) : std::nullopt;
    default: return std::nullopt;
  }
}

// A C-contiguous CPU array and its element type. numpy arrays of ml_dtypes types (bfloat16) have a
// buffer format nanobind cannot map, so those are viewed as unsigned ints of the same width and typed
// by their dtype name. No conversion ever happens: a copy of `out` would silently drop the result.
template <class Array>
struct TypedArray {
  nb::object view;  // keeps a temporary view alive
  Array array;
  DType dtype = DType::kF32;
};

template <class Array>
TypedArray<Array> AsArray(nb::handle obj, const char* which, const char* requirement) {
  TypedArray<Array> t;
  if (nb::try_cast(obj, t.array, /*convert=*/false)) {
    auto d = FromDLPack(t.array.dtype());
    if (!d) throw nb::type_error((std::string("engine_run: unsupported dtype of ") + which).c_str());
    t.dtype = *d;
    return t;
  }
  std::optional<DType> d;
  if (nb::hasattr(obj, "dtype") && nb::hasattr(obj, "view"))
    d = ParseDType(nb::cast<std::string>(nb::str(obj.attr("dtype").attr("name"))));
  if (!d)
    throw nb::type_error((std::string("engine_run: ") + which + " must be a " + requirement +
                          " numpy array of a supported dtype").c_str());
  t.view = obj.attr("view")(("uint" + std::to_string(ByteWidth(*d) * 8)).c_str());
  if (!nb::try_cast(t.view, t.array, /*convert=*/false))
    throw nb::type_error((std::string("engine_run: ") + which + " must be a " + requirement +
                          " numpy array").c_str());
  t.dtype = *d;
  return t;
}

// One array or a list/tuple of arrays (the k operands of one call).
std::vector<nb::handle> ArrayList(nb::handle obj) {
  std::vector<nb::handle> items;
  if (nb::isinstance<nb::list>(obj) || nb::isinstance<nb::tuple>(obj)) {
    for (nb::handle h : obj) items.push_back(h);
  } else {
    items.push_back(obj);
  }
  return items;
}

void EngineRun(const std::string& kind, const std::string& op, const std::vector<int64_t>& groups,
               const std::vector<int64_t>& group_sizes, int64_t device, int64_t run_id,
               nb::handle x_obj, nb::handle out_obj, int64_t axis, const std::string& label,
               const std::vector<std::pair<int64_t, int64_t>>& pairs) {
  auto k = ParseKind(kind);
  if (!k)
    throw nb::value_error(("engine_run: unknown kind '" + kind +
                           "' (expected all_reduce, all_gather, reduce_scatter, ppermute or all_to_all)").c_str());
  // The FFI attribute's layout: (source, destination) ranks, flattened.
  std::vector<int64_t> flat_pairs;
  for (const auto& [s, d] : pairs) flat_pairs.insert(flat_pairs.end(), {s, d});
  const std::vector<nb::handle> x_items = ArrayList(x_obj), out_items = ArrayList(out_obj);
  if (x_items.empty() || x_items.size() != out_items.size())
    throw nb::value_error(("engine_run: x and out must be one array each or lists of the same non-zero "
                           "length (got " + std::to_string(x_items.size()) + " and " +
                           std::to_string(out_items.size()) + ")").c_str());
  const size_t count = x_items.size();
  std::vector<TypedArray<InArray>> xs;
  std::vector<TypedArray<OutArray>> outs;
  xs.reserve(count);
  outs.reserve(count);
  std::vector<std::vector<int64_t>> in_dims(count), out_dims(count);
  std::vector<OperandRequest> operands(count);
  for (size_t i = 0; i < count; ++i) {
    // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "literal" + std::string chains.
    std::string which;
    if (count > 1) {
      which = "[";
      which += std::to_string(i);
      which += "]";
    }
    xs.push_back(AsArray<InArray>(x_items[i], ("x" + which).c_str(), "C-contiguous"));
    outs.push_back(AsArray<OutArray>(out_items[i], ("out" + which).c_str(), "writable, C-contiguous"));
    const auto& x = xs.back().array;
    const auto& out = outs.back().array;
    for (size_t d = 0; d < x.ndim(); ++d) in_dims[i].push_back(static_cast<int64_t>(x.shape(d)));
    for (size_t d = 0; d < out.ndim(); ++d) out_dims[i].push_back(static_cast<int64_t>(out.shape(d)));
    OperandRequest& o = operands[i];
    o.in_dtype = xs.back().dtype;
    o.out_dtype = outs.back().dtype;
    o.in_dims = in_dims[i];
    o.out_dims = out_dims[i];
    o.in = x.data();
    o.out = out.data();
  }
  CollectiveArgs args;
  args.groups = groups;
  args.group_sizes = group_sizes;
  args.device = device;
  args.run_id = run_id;
  args.label = label;
  args.request.kind = *k;
  args.request.reduction = op;
  args.request.axis = axis;
  args.request.pairs = flat_pairs;
  args.request.operands = operands;
  Status status;
  {
    nb::gil_scoped_release release;  // other "devices" are Python threads blocked in here too
    status = RunCollective(args);
  }
  if (!status.ok()) throw std::runtime_error(status.message());
}

nb::dict Registrations() {
  nb::dict d;
  d["flexlink_all_reduce"] = nb::capsule(reinterpret_cast<void*>(FlexlinkAllReduce));
  d["flexlink_all_gather"] = nb::capsule(reinterpret_cast<void*>(FlexlinkAllGather));
  d["flexlink_reduce_scatter"] = nb::capsule(reinterpret_cast<void*>(FlexlinkReduceScatter));
  d["flexlink_ppermute"] = nb::capsule(reinterpret_cast<void*>(FlexlinkPpermute));
  d["flexlink_all_to_all"] = nb::capsule(reinterpret_cast<void*>(FlexlinkAllToAll));
  return d;
}

// Cross-process groups (docs/xproc.md): bad arguments are ValueErrors, system failures (shm_open,
// mmap, a refused segment) RuntimeErrors carrying strerror's text.
void ThrowIfError(const Status& s) {
  if (s.ok()) return;
  if (s.code() == StatusCode::kInvalidArgument) throw nb::value_error(s.message().c_str());
  throw std::runtime_error(s.message());
}

std::string XprocCreate(const std::vector<int64_t>& devices, const std::vector<int64_t>& local_devices,
                        int64_t slot_bytes, int processes) {
  if (slot_bytes < 0) throw nb::value_error("xproc_create: slot_bytes must be >= 0 (0: the default)");
  std::string name;
  Status s;
  {
    nb::gil_scoped_release release;
    s = xproc::CreateProcessGroup(devices, local_devices, static_cast<size_t>(slot_bytes), processes, &name);
  }
  ThrowIfError(s);
  return name;
}

void XprocAttach(const std::string& name, const std::vector<int64_t>& devices,
                 const std::vector<int64_t>& local_devices) {
  Status s;
  {
    nb::gil_scoped_release release;
    s = xproc::AttachProcessGroup(name, devices, local_devices);
  }
  ThrowIfError(s);
}

nb::list XprocGroups() {
  nb::list out;
  for (const auto& g : xproc::ProcessGroups()) {
    nb::dict d;
    d["name"] = g.name;
    d["devices"] = g.devices;
    d["local_devices"] = g.local_devices;
    d["slot_bytes"] = g.slot_bytes;
    d["calls"] = g.calls;
    d["broken"] = g.broken ? nb::object(nb::str(g.broken->c_str())) : nb::none();
    // Direct all_gather and all_reduce (docs/xproc.md): from how many input bytes per rank the peers'
    // memory is read directly; None until the group's first call agreed, -1 for never (with the reason).
    auto from = [](const std::optional<uint64_t>& bytes) {
      if (!bytes) return nb::object(nb::none());
      return nb::object(nb::int_(*bytes == UINT64_MAX ? int64_t{-1} : static_cast<int64_t>(*bytes)));
    };
    d["direct_all_gather_from_bytes"] = from(g.direct_from);
    d["direct_all_gather_refusal"] = g.direct_refusal;
    d["direct_all_reduce_from_bytes"] = from(g.direct_reduce_from);
    d["direct_all_reduce_refusal"] = g.direct_reduce_refusal;
    // The links a call of the group is split across under the current link set, the configured
    // links left out (and why), and each cross-process tcp ring's refused connections.
    if (xproc::ProcessGroup* pg = xproc::FindProcessGroup(g.devices)) {
      const xproc::XprocLinks links = xproc::XprocLinksOf(pg);
      d["links"] = links.links;
      nb::list left;
      for (const auto& [name, why] : links.left_out) {
        nb::dict l;
        l["link"] = name;
        l["reason"] = why;
        left.append(l);
      }
      d["left_out"] = left;
      nb::dict refused;
      for (const auto& name : links.links)
        if (int r = CrossProcessTcpRefused(g.devices, name); r >= 0) refused[name.c_str()] = r;
      d["refused_connections"] = refused;
    }
    out.append(d);
  }
  return out;
}

nb::dict Stats() {
  EnsureLinks();
  return py::LinkStats();
}

}  // namespace
}  // namespace flexlink

NB_MODULE(_flexlink, m) {
  using namespace flexlink;
  m.doc() = "FlexLink collectives for XLA:CPU (FFI handlers and engine control)";
  m.def("registrations", &Registrations,
        "FFI target name -> PyCapsule of the execute-stage XLA_FFI_Handler (api_version 1).");
  m.def(
      "set_timeout",
      [](double seconds) {
        if (!ValidTimeoutSeconds(seconds)) {
          throw nb::value_error(("set_timeout: seconds must be a finite number in (0, 1e6], got " +
                                 std::to_string(seconds)).c_str());
        }
        SetTimeoutSeconds(seconds);
      },
      nb::arg("seconds"), "Deadline of every wait in the engine, in seconds.");
  m.def("timeout", &TimeoutSeconds);
  m.def("config_warnings", &ConfigWarnings,
        "Environment values the C++ side ignored (its default used), one sentence each.");
  m.def("parse_byte_count", [](const std::string& text) -> std::optional<uint64_t> {
    uint64_t v = 0;
    return ParseByteCount(text, &v) ? std::optional<uint64_t>(v) : std::nullopt;
  }, nb::arg("text"), "The engine's reading of a FLEXLINK_* byte count, or None (tests compare it with Python's).");
  m.def("engine_run", &EngineRun, nb::arg("kind"), nb::arg("op"), nb::arg("groups"),
        nb::arg("group_sizes"), nb::arg("device"), nb::arg("run_id"), nb::arg("x"),
        nb::arg("out"), nb::arg("axis") = 0, nb::arg("label") = "",
        nb::arg("pairs") = std::vector<std::pair<int64_t, int64_t>>(),
        "Runs one rank's part of a collective exactly as the FFI handler would, on C-contiguous "
        "numpy arrays, with the GIL released: x and out are one array each, or lists of k arrays "
        "(one call of k operands). all_reduce's out may be x (in place). ppermute takes pairs, a "
        "sequence of (source rank, destination rank) within the group. Raises RuntimeError with "
        "the handler's message.");
  m.def("stats", &Stats);
  m.def("reset_stats", [] {
    ResetLinkStats();
    ResetHealth();
    ResetStragglers();
  }, "Zeroes the link counters; every link's health back to healthy; the failover log and the "
     "straggler counters emptied.");
  m.def("set_shm_staging_bytes", &SetShmStagingBytes, nb::arg("bytes"),
        "Per-rank input size up to which the shm link stages inputs (one rendezvous per call).");
  m.def("shm_staging_bytes", &ShmStagingBytes);
  m.def("set_shm_streaming_bytes", &SetShmStreamingSeparateBytes, nb::arg("bytes"),
        "Output size from which shm writes separate outputs with non-temporal stores.");
  m.def("shm_streaming_bytes", &ShmStreamingSeparateBytes);
  m.def("set_huge_page_outputs", &SetHugePageOutputs, nb::arg("on"),
        "Advise transparent huge pages on large outputs before writing them (default on).");
  m.def("huge_page_outputs", &HugePageOutputs);
  m.def("set_populate_outputs", &SetPopulateOutputs, nb::arg("on"),
        "Fault fresh outputs in with one madvise(MADV_POPULATE_WRITE) instead of a store per page "
        "(default off; see docs/engine.md).");
  m.def("populate_outputs", &PopulateOutputs);
  m.def("xproc_create", &XprocCreate, nb::arg("devices"), nb::arg("local_devices"), nb::arg("slot_bytes") = 0,
        nb::arg("processes") = 0,
        "Creates a shared segment for the cross-process group `devices` (global ids in rank order), "
        "claims this process's ranks `local_devices`, registers the group; returns the segment name. "
        "`processes`: how many processes own `devices` (the tuning cache's key; 0: not known, no cache).");
  m.def("xproc_attach", &XprocAttach, nb::arg("name"), nb::arg("devices"), nb::arg("local_devices"),
        "Maps the segment `name` made for `devices`, claims this process's ranks, registers the group.");
  m.def(
      "xproc_unlink", [](const std::string& name) { ThrowIfError(xproc::UnlinkProcessSegment(name)); },
      nb::arg("name"), "Removes the segment's name (mappings stay valid).");
  m.def("xproc_groups", &XprocGroups,
        "Per registered cross-process group: name, devices, local_devices, slot_bytes, calls, broken.");
  DefineControl(m);

  // --- The tcp link across processes (xla_ffi/links/tcp_xproc.h): two phases, the ports and the
  // job's token travel through jax.distributed's key-value store in between (Python glue). Bad
  // arguments raise ValueError, a failed connection RuntimeError (the group is then broken).
  {
    auto raise = [](const Status& s) {
      if (s.code() == StatusCode::kInvalidArgument) throw nb::value_error(s.message().c_str());
      throw std::runtime_error(s.message());
    };
    m.def(
        "xproc_tcp_listen",
        [raise](std::vector<int64_t> devices, std::vector<int64_t> local_devices, std::string link) {
          std::vector<uint16_t> ports;
          const Status s = ListenCrossProcessTcp(devices, local_devices, link, &ports);
          if (!s.ok()) raise(s);
          return std::vector<int>(ports.begin(), ports.end());
        },
        nb::arg("devices"), nb::arg("local_devices"), nb::arg("link") = "tcp",
        "Phase 1 of the cross-process tcp ring of group `devices` (global ids, rank order): one "
        "127.0.0.1 listener per device of `local_devices` (this process's); returns their ports in "
        "the order of local_devices. The listeners wait for xproc_tcp_connect.");
    m.def(
        "xproc_tcp_connect",
        [raise](std::vector<int64_t> devices, std::vector<int64_t> local_devices, std::vector<int64_t> ports,
                nb::bytes token, std::string link) {
          std::vector<uint16_t> p;
          for (int64_t v : ports) {
            if (v < 0 || v > 65535) throw nb::value_error("xproc_tcp_connect: a port must be in [0, 65535]");
            p.push_back(static_cast<uint16_t>(v));
          }
          const std::vector<uint8_t> t(static_cast<const uint8_t*>(token.data()),
                                       static_cast<const uint8_t*>(token.data()) + token.size());
          int refused = 0;
          Status s;
          {
            nb::gil_scoped_release release;  // blocks up to the deadline; other threads may run
            s = ConnectCrossProcessTcp(devices, local_devices, p, t, link, &refused);
          }
          if (!s.ok()) raise(s);
          return refused;
        },
        nb::arg("devices"), nb::arg("local_devices"), nb::arg("ports"), nb::arg("token"),
        nb::arg("link") = "tcp",
        "Phase 2: `ports` are all ranks' ports in rank order, `token` the job's 16 random bytes. Each "
        "local rank connects to its successor and accepts its predecessor, refusing connections "
        "without the token; registers the group's channel and returns the number of refused "
        "connections. Raises RuntimeError naming the group and the rank whose connection failed.");
  }
}
