#include "xla_ffi/core/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "xla_ffi/core/communicator.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/entry_word.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/faults.h"
#include "xla_ffi/core/link_set.h"
#include "xla_ffi/core/pages.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/links/faulty.h"
#include "xla_ffi/links/link.h"
#include "xla_ffi/plan/balancer.h"
#include "xla_ffi/plan/shares.h"
#include "xla_ffi/xproc/process_group.h"
#include "xla_ffi/xproc/registry.h"
#include "xla_ffi/xproc/xproc_executor.h"

namespace flexlink {
namespace {

// A group of devices on one link set: its communicator (channels), the balancer that plans its
// calls and, with more than one link, the executor that splits them.
struct Group {
  std::shared_ptr<const LinkSet> links;  // keeps the Link objects alive as long as the channels
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<plan::Balancer> balancer;
  std::unique_ptr<FaultCounter> calls;  // per rank: the group's calls, for rank:absent (core/faults.h)
  std::unique_ptr<Executor> executor;  // declared last: its workers go before what they use
  // Ranks inside a call of the group, retired once released (ReleaseEarlierGroups).
  EntryWord entry;
};

struct GroupRegistry {
  std::mutex mu;
  // Device threads cache raw pointers, so a Group is never freed: a released one keeps its shell in
  // `released` (its channels, workers and balancer are gone) and a call that still comes for its
  // link set (a program lowered before, CollectiveArgs::links_version) gets a new group.
  std::map<std::pair<uint64_t, std::vector<int64_t>>, std::unique_ptr<Group>> groups;
  std::vector<std::unique_ptr<Group>> released;
};

GroupRegistry& Registry() {
  static auto* reg = new GroupRegistry();
  return *reg;
}

std::unique_ptr<Group> MakeGroup(std::shared_ptr<const LinkSet> links, const std::vector<int64_t>& devices) {
  auto g = std::make_unique<Group>();
  g->comm = std::make_unique<Communicator>(devices);
  // Every channel behind fault injection's wrapper (links/faulty.h): a pass-through without faults.
  for (const auto& link : links->links)
    g->comm->AddChannel(std::make_unique<FaultyChannel>(link->Open(devices), static_cast<int>(devices.size())));
  g->calls = std::make_unique<FaultCounter>(static_cast<int>(devices.size()));
  plan::BalancerOptions options;
  options.profile_from_bytes = AutotuneMinBytes();
  options.profile_max_bytes = TuneMaxBytes();
  g->balancer = std::make_unique<plan::Balancer>(links->names(), options);
  // Stage-1 fits, hand-set shares and health are the current set's; a group made for an earlier
  // set (a call lowered before the links changed) plans from equal shares and is not reported.
  const std::shared_ptr<const LinkSet> now = CurrentLinkSet();
  const bool current = links->version == now->version;
  if (!current) {
    LogInfo("group " + FormatIds(devices) + " runs calls lowered for link set " + std::to_string(links->version) +
            " (" + links->spec + ") while " + std::to_string(now->version) + " (" + now->spec +
            ") is current: an executable compiled before configure(links=...), or a call queued then");
  } else {
    if (auto model = CurrentModel()) (void)g->balancer->SetModel(*model);
    for (const auto& [key, shares] : CurrentShareOverrides())
      (void)g->balancer->SetShares(key.first, key.second, shares.shares, shares.pinned);
  }
  if (links->links.size() > 1) {
    g->executor = std::make_unique<Executor>(g->comm.get(), links->names(), links->spec, g->balancer.get());
    if (current) RegisterGroupHealth(g->executor->health(), links->version);
  }
  g->links = std::move(links);
  return g;
}

// The group of `devices` on link set `version` (0: the current one), entered for one call (the
// caller leaves it with an Entered). Each device thread caches its lookups to avoid the global
// locks per call.
Status GetGroup(std::span<const int64_t> devices, uint64_t version, std::string_view label, Group** out) {
  thread_local std::vector<std::tuple<uint64_t, std::vector<int64_t>, Group*>> cache;
  std::shared_ptr<const LinkSet> links;
  if (version == 0) {
    links = CurrentLinkSet();
    version = links->version;
  }
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    const auto& [v, ids, group] = *it;
    if (v != version || !std::equal(ids.begin(), ids.end(), devices.begin(), devices.end())) continue;
    if (group->entry.Enter()) {
      *out = group;
      return Status::Ok();
    }
    cache.erase(it);  // released: the registry has (or makes) its successor
    break;
  }
  if (!links)
    if (Status s = LinkSetAt(version, &links); !s.ok()) return Status::InvalidArgument(ErrorPrefix(label) + s.message());
  GroupRegistry& reg = Registry();
  std::vector<int64_t> key(devices.begin(), devices.end());
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.groups.find({version, key});
    if (it == reg.groups.end()) {
      FLEXLINK_RETURN_IF_ERROR(CheckDistinct(devices, label));
      it = reg.groups.emplace(std::make_pair(version, key), MakeGroup(links, key)).first;
    }
    *out = it->second.get();
    // Under the registry's lock nothing is released, and a group in the map is never retired.
    (*out)->entry.EnterUnretired();
  }
  cache.emplace_back(version, std::move(key), *out);
  return Status::Ok();
}

}  // namespace

ReleasedGroups ReleaseEarlierGroups() {
  const uint64_t current = CurrentLinkSet()->version;
  ReleasedGroups out;
  // A released group's parts, destroyed after the lock in reverse order: the workers first, the
  // links last (as in Group).
  struct Parts {
    std::shared_ptr<const LinkSet> links;
    std::unique_ptr<Communicator> comm;
    std::unique_ptr<plan::Balancer> balancer;
    std::unique_ptr<FaultCounter> calls;
    std::unique_ptr<Executor> executor;
  };
  std::vector<Parts> gone;
  GroupRegistry& reg = Registry();
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    RetireEarlier(
        reg.groups, [&](const auto& key) { return key.first < current; },
        [](Group& g) { return g.executor && !g.executor->Idle(); },
        [&](auto it) {
          Group& g = *it->second;
          gone.push_back(Parts{std::move(g.links), std::move(g.comm), std::move(g.balancer), std::move(g.calls),
                               std::move(g.executor)});
          reg.released.push_back(std::move(it->second));
        },
        &out.released, &out.kept);
  }
  gone.clear();  // joins the idle workers, closes the channels
  return out;
}

void EnsureLinks() { CurrentLinkSet(); }

Status SetShares(Kind kind, uint64_t bucket_bytes, std::vector<double> shares, bool pinned) {
  // Here, not only in each balancer: groups made later get the stored vector on a device thread.
  FLEXLINK_RETURN_IF_ERROR(plan::NormaliseShares(shares));
  FLEXLINK_RETURN_IF_ERROR(SetSharesEverywhere(kind, bucket_bytes, shares, pinned));
  const uint64_t version = CurrentLinkSet()->version;
  GroupRegistry& reg = Registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, group] : reg.groups)
    if (key.first == version)
      FLEXLINK_RETURN_IF_ERROR(group->balancer->SetShares(kind, bucket_bytes, shares, pinned));
  // Cross-process groups whose links are the whole link set (else the shares do not fit them).
  return xproc::ForEachXprocBalancer([&](plan::Balancer& b) {
    return b.links().size() == shares.size() ? b.SetShares(kind, bucket_bytes, shares, pinned) : Status::Ok();
  });
}

Status InstallModel(plan::CostModel model) {
  std::shared_ptr<const LinkSet> set = CurrentLinkSet();
  if (model.links() != set->names())
    return Status::InvalidArgument("install_model: the model's links do not match the current links " +
                                   set->spec);
  SetCurrentModel(model);
  GroupRegistry& reg = Registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, group] : reg.groups)
    if (key.first == set->version) FLEXLINK_RETURN_IF_ERROR(group->balancer->SetModel(model));
  // The leaders of cross-process groups made already (later ones read CurrentModel) whose links are
  // the model's: their fits feed per-link deadlines and degraded detection there (docs/faults.md).
  return xproc::ForEachXprocBalancer([&](plan::Balancer& b) {
    return b.links() == model.links() ? b.SetModel(model) : Status::Ok();
  });
}

void ForgetModel(Kind kind) {
  if (auto model = CurrentModel()) {
    plan::CostModel m = *model;
    m.ClearKind(kind);
    SetCurrentModel(std::move(m));
  }
  const uint64_t version = CurrentLinkSet()->version;
  GroupRegistry& reg = Registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, group] : reg.groups)
    if (key.first == version) group->balancer->ForgetKind(kind);
  xproc::ForgetXprocKind(kind);
}

std::optional<plan::CostModel> GroupModel(std::span<const int64_t> devices) {
  const uint64_t version = CurrentLinkSet()->version;
  GroupRegistry& reg = Registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.groups.find({version, std::vector<int64_t>(devices.begin(), devices.end())});
  if (it == reg.groups.end()) return xproc::XprocGroupModel(devices);
  return it->second->balancer->Model();
}

void SetTuneMax(uint64_t max_bytes) {
  SetTuneMaxBytes(max_bytes);
  GroupRegistry& reg = Registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, group] : reg.groups) group->balancer->SetProfileMaxBytes(max_bytes);
  (void)xproc::ForEachXprocBalancer([&](plan::Balancer& b) {
    b.SetProfileMaxBytes(max_bytes);
    return Status::Ok();
  });
}

void SetAutotune(uint64_t min_bytes) {
  SetAutotuneMinBytes(min_bytes);
  GroupRegistry& reg = Registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, group] : reg.groups) group->balancer->SetProfileFromBytes(min_bytes);
  (void)xproc::ForEachXprocBalancer([&](plan::Balancer& b) {
    b.SetProfileFromBytes(min_bytes);
    return Status::Ok();
  });
}

std::vector<PlanSnapshot> SnapshotPlans() {
  const uint64_t version = CurrentLinkSet()->version;
  std::vector<PlanSnapshot> out;
  GroupRegistry& reg = Registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& [key, group] : reg.groups) {
    if (key.first != version) continue;
    for (const auto& p : group->balancer->Plans())
      out.push_back(PlanSnapshot{key.second, *p, group->balancer->links()});
  }
  // The cross-process groups this process leads (rank 0 is local): their one plan per call.
  for (PlanSnapshot& p : xproc::SnapshotXprocPlans()) out.push_back(std::move(p));
  return out;
}

namespace {

Status RunCollectiveOrThrow(const CollectiveArgs& args) {
  std::span<const int64_t> members;
  int rank = 0;
  FLEXLINK_RETURN_IF_ERROR(
      ResolveGroup(args.groups, args.group_sizes, args.device, args.label, &members, &rank));
  const int n = static_cast<int>(members.size());
  if (args.request.kind == Kind::kAllToAll) FLEXLINK_RETURN_IF_ERROR(CheckEvenGroups(args.group_sizes, args.label));
  // Reused per device thread: a call's parts are copied once more at the arrival, not here.
  thread_local CallDesc desc;
  FLEXLINK_RETURN_IF_ERROR(DescribeCall(args.request, n, args.label, &desc));
  // Zero-size calls return at once on every rank (all ranks see the same shapes, so none waits).
  if (desc.total_units() == 0) return Status::Ok();
  if (n == 1) {
    // A group of one: the collective is the identity (the [outer, 1, inner] layout is the input's),
    // except a ppermute without the pair (0, 0), whose result is zeros.
    const bool zeros = desc.kind == Kind::kPpermute && desc.sources[0] < 0;
    for (const Part& p : desc.parts)
      if (zeros) std::memset(p.out, 0, p.bytes());
      else if (p.out != p.in) std::memcpy(p.out, p.in, p.bytes());
    return Status::Ok();
  }
  // A group whose ranks live in several processes runs on its shared segment (docs/xproc.md).
  // With several links that span processes (the segment and cross-process tcp rings) the call is
  // split by the leader's plan (xproc/xproc_executor.h); with one, the segment runs it alone.
  if (xproc::ProcessGroup* cross = xproc::FindProcessGroup(members))
    return xproc::RunXprocCall(cross, rank, desc, args.label, args.run_id, args.links_version);
  Group* group = nullptr;
  FLEXLINK_RETURN_IF_ERROR(GetGroup(members, args.links_version, args.label, &group));
  const Entered entered(group->entry);
  Communicator* comm = group->comm.get();
  std::shared_ptr<CallContext> call = comm->Join(rank, args.run_id, args.label);
  if (std::shared_ptr<const FaultSet> faults = CurrentFaults()) {
    const uint64_t c = group->calls->Next(rank, *faults);
    if (faults->AbsentAt(rank, c)) return StayAway(*call, args.label, rank, args.device, c);
  }
  if (group->executor) return group->executor->Run(*call, rank, desc);
  // One link runs the whole call: the ranks fault the outputs in together, starting now, before
  // anyone writes them (core/pages.h). With several links the executor decides.
  Channel& channel = comm->channel(0);
  const auto start = std::chrono::steady_clock::now();
  Status status;
  {
    const OutputPublication published(*call, rank, desc);
    status = channel.RunAlone(*call, rank, desc);
  }
  if (rank == 0 && status.ok()) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    RecordLinkCall(channel.link_name(), desc.InputBytes(n), seconds);
  }
  return status;
}

}  // namespace

Status RunCollective(const CollectiveArgs& args) {
  // No input may abort the process: an allocation that fails (staging, a link's scratch for a huge
  // call) becomes this rank's error. Its peers then fail at the deadline (or at once, where the link
  // breaks itself first, as tcp does), which is the rule for any rank that leaves a call.
  try {
    return RunCollectiveOrThrow(args);
  } catch (const std::bad_alloc&) {
    return Status::Internal(ErrorPrefix(args.label) + std::string(Name(args.request.kind)) +
                            ": out of memory for the engine's buffers of this call");
  } catch (const std::exception& e) {
    return Status::Internal(ErrorPrefix(args.label) + std::string(Name(args.request.kind)) + ": " + e.what());
  }
}

}  // namespace flexlink
