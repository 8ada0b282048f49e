#include "xla_ffi/xproc/registry.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <utility>

#include "xla_ffi/core/call.h"
#include "xla_ffi/xproc/process_group.h"

namespace flexlink::xproc {
namespace {

struct Registry {
  std::mutex mu;
  std::vector<std::unique_ptr<ProcessGroup>> groups;  // never erased: device threads cache pointers
  std::atomic<uint64_t> generation{0};                // bumped per registration
};

Registry& Reg() {
  static auto* r = new Registry();
  return *r;
}

bool Same(std::span<const int64_t> a, std::span<const int64_t> b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

Status Register(std::unique_ptr<ProcessGroup> g) {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (const auto& other : reg.groups)
    if (Same(other->devices(), g->devices()))
      return Status::InvalidArgument("flexlink: cross-process group " + FormatIds(g->devices()) +
                                     " is already registered in this process (segment " + other->name() + ")");
  reg.groups.push_back(std::move(g));
  reg.generation.fetch_add(1, std::memory_order_release);
  return Status::Ok();
}

Status CheckNotRegistered(std::span<const int64_t> devices) {
  if (FindProcessGroup(devices))
    return Status::InvalidArgument("flexlink: cross-process group " + FormatIds(devices) +
                                   " is already registered in this process");
  return Status::Ok();
}

}  // namespace

Status CreateProcessGroup(std::span<const int64_t> devices, std::span<const int64_t> local_devices,
                          size_t slot_bytes, int processes, std::string* name) {
  FLEXLINK_RETURN_IF_ERROR(CheckNotRegistered(devices));
  std::unique_ptr<ProcessGroup> g;
  FLEXLINK_RETURN_IF_ERROR(ProcessGroup::Create(devices, local_devices, slot_bytes, processes, &g));
  const std::string made = g->name();
  Status s = Register(std::move(g));
  if (!s.ok()) {
    (void)UnlinkProcessSegment(made);
    return s;
  }
  *name = made;
  return Status::Ok();
}

Status AttachProcessGroup(const std::string& name, std::span<const int64_t> devices,
                          std::span<const int64_t> local_devices) {
  FLEXLINK_RETURN_IF_ERROR(CheckNotRegistered(devices));
  std::unique_ptr<ProcessGroup> g;
  FLEXLINK_RETURN_IF_ERROR(ProcessGroup::Attach(name, devices, local_devices, &g));
  return Register(std::move(g));
}

Status UnlinkProcessSegment(const std::string& name) { return Segment::Unlink(name); }

ProcessGroup* FindProcessGroup(std::span<const int64_t> devices) {
  Registry& reg = Reg();
  const uint64_t generation = reg.generation.load(std::memory_order_acquire);
  if (generation == 0) return nullptr;  // the common case: no cross-process group at all
  // Misses are cached too (most groups are in-process), until a registration makes them stale.
  thread_local uint64_t seen = 0;
  thread_local std::vector<std::pair<std::vector<int64_t>, ProcessGroup*>> cache;
  if (seen != generation) {
    cache.clear();
    seen = generation;
  }
  for (const auto& [ids, g] : cache)
    if (Same(ids, devices)) return g;
  ProcessGroup* found = nullptr;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    for (const auto& g : reg.groups)
      if (Same(g->devices(), devices)) found = g.get();
  }
  cache.emplace_back(std::vector<int64_t>(devices.begin(), devices.end()), found);
  return found;
}

std::vector<ProcessGroupInfo> ProcessGroups() {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::vector<ProcessGroupInfo> out;
  for (const auto& g : reg.groups) {
    int first = 0;
    while (first < g->size() && !g->is_local(first)) ++first;
    out.push_back({g->name(), g->devices(), g->local_devices(), g->slot_bytes(), g->calls(), g->broken(),
                   g->direct_from(first, Kind::kAllGather), g->direct_from(first, Kind::kAllReduce),
                   g->direct_refusal(first, Kind::kAllGather), g->direct_refusal(first, Kind::kAllReduce)});
  }
  return out;
}

}  // namespace flexlink::xproc
