#include "xla_ffi/core/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "xla_ffi/core/communicator.h"
#include "xla_ffi/core/pages.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/links/link.h"
#include "xla_ffi/links/shm.h"

namespace flexlink {
namespace {

// The links every new communicator opens. One today (shm); the multi-path engine makes this a
// configured list and splits calls across it.
std::vector<std::unique_ptr<Link>>& Links() {
  static auto* links = [] {
    auto* v = new std::vector<std::unique_ptr<Link>>();
    v->push_back(std::make_unique<ShmLink>());
    for (const auto& link : *v) MarkLinkHealth(link->name(), true);
    return v;
  }();
  return *links;
}

Status CheckDistinct(std::span<const int64_t> devices, std::string_view label) {
  std::vector<int64_t> sorted(devices.begin(), devices.end());
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end()) return Status::Ok();
  return Status::InvalidArgument(ErrorPrefix(label) + "group " + FormatIds(devices) +
                                 " names a device more than once");
}

// Communicators live for the whole process (they are few: one per distinct group), so raw pointers
// to them stay valid. Each device thread caches its lookups to avoid the global lock per call.
Status GetCommunicator(std::span<const int64_t> devices, std::string_view label, Communicator** out) {
  thread_local std::vector<std::pair<std::vector<int64_t>, Communicator*>> cache;
  for (const auto& [ids, comm] : cache)
    if (std::equal(ids.begin(), ids.end(), devices.begin(), devices.end())) {
      *out = comm;
      return Status::Ok();
    }
  static std::mutex mu;
  static auto* registry = new std::map<std::vector<int64_t>, std::unique_ptr<Communicator>>();
  std::vector<int64_t> key(devices.begin(), devices.end());
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = registry->find(key);
    if (it == registry->end()) {
      FLEXLINK_RETURN_IF_ERROR(CheckDistinct(devices, label));
      auto comm = std::make_unique<Communicator>(key);
      for (const auto& link : Links()) comm->AddChannel(link->Open(devices));
      it = registry->emplace(key, std::move(comm)).first;
    }
    *out = it->second.get();
  }
  cache.emplace_back(std::move(key), *out);
  return Status::Ok();
}

}  // namespace

void EnsureLinks() { Links(); }

Status RunCollective(const CollectiveArgs& args) {
  std::span<const int64_t> members;
  int rank = 0;
  FLEXLINK_RETURN_IF_ERROR(
      ResolveGroup(args.groups, args.group_sizes, args.device, args.label, &members, &rank));
  const int n = static_cast<int>(members.size());
  CallDesc desc;
  FLEXLINK_RETURN_IF_ERROR(DescribeCall(args.request, n, args.label, &desc));
  // Zero-size calls return at once on every rank (all ranks see the same shapes, so none waits).
  if (desc.units == 0) return Status::Ok();
  if (n == 1) {
    // A group of one: the collective is the identity (the [outer, 1, inner] layout is the input's).
    if (desc.out != desc.in) std::memcpy(desc.out, desc.in, desc.units * desc.width());
    return Status::Ok();
  }
  // Before arriving: nobody writes this rank's output before the arrival (see core/pages.h).
  PrepareOutput(desc.out, desc.out_count(n) * desc.width(), desc.out == desc.in);
  Communicator* comm = nullptr;
  FLEXLINK_RETURN_IF_ERROR(GetCommunicator(members, args.label, &comm));
  std::shared_ptr<CallContext> call = comm->Join(rank, args.run_id, args.label);
  Channel& channel = comm->channel(0);
  const auto start = std::chrono::steady_clock::now();
  Status status = channel.RunAlone(*call, rank, desc);
  if (rank == 0 && status.ok()) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    RecordLinkCall(channel.link_name(), desc.in_count(n) * desc.width(), seconds);
  }
  return status;
}

}  // namespace flexlink
