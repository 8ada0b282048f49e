#include "xla_ffi/core/link_set.h"

#include <mutex>

#include "xla_ffi/core/health.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/links/emulated.h"
#include "xla_ffi/links/shm.h"
#include "xla_ffi/links/tcp.h"
#include "xla_ffi/plan/link_spec.h"

namespace flexlink {
namespace {

constexpr std::string_view kKnownKinds[] = {"shm", "tcp", "emulated"};

Status MakeLink(const plan::LinkSpec& spec, std::unique_ptr<Link>* out) {
  if (spec.kind == "tcp") return TcpLink::FromSpec(spec, out);
  if (spec.kind == "emulated") return EmulatedLink::FromSpec(spec, out);
  FLEXLINK_RETURN_IF_ERROR(plan::CheckParamKeys(spec, {}));
  *out = std::make_unique<ShmLink>(spec.name);
  return Status::Ok();
}

struct Registry {
  std::mutex mu;
  std::shared_ptr<const LinkSet> current;
  // Every set that was current, by version: a call runs on the set its program was lowered with
  // (LinkSetAt), which may have been replaced since (a call dispatched before configure(links=...)).
  std::map<uint64_t, std::shared_ptr<const LinkSet>> made;
  std::map<std::pair<Kind, uint64_t>, PinnedShares> overrides;
  std::shared_ptr<const plan::CostModel> model;
  uint64_t next_version = 1;
};

Registry& Reg() {
  static auto* reg = new Registry();
  return *reg;
}

Status Build(std::string_view text, uint64_t version, std::shared_ptr<const LinkSet>* out) {
  std::vector<plan::LinkSpec> specs;
  FLEXLINK_RETURN_IF_ERROR(plan::ParseLinkSpecs(
      text, std::vector<std::string>(std::begin(kKnownKinds), std::end(kKnownKinds)), &specs));
  auto set = std::make_shared<LinkSet>();
  set->version = version;
  set->spec = plan::FormatLinkSpecs(specs);
  for (const plan::LinkSpec& spec : specs) {
    std::unique_ptr<Link> link;
    Status s = MakeLink(spec, &link);
    if (!s.ok()) return Status::InvalidArgument("links \"" + std::string(text) + "\": " + s.message());
    set->links.push_back(std::move(link));
  }
  *out = std::move(set);
  return Status::Ok();
}

}  // namespace

std::vector<std::string> LinkSet::names() const {
  std::vector<std::string> out;
  for (const auto& link : links) out.emplace_back(link->name());
  return out;
}

Link* LinkSet::Find(std::string_view name) const {
  for (const auto& link : links)
    if (link->name() == name) return link.get();
  return nullptr;
}

Status ConfigureLinks(std::string_view spec) {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::shared_ptr<const LinkSet> set;
  FLEXLINK_RETURN_IF_ERROR(Build(spec, reg.next_version, &set));
  ++reg.next_version;
  for (const std::string& name : set->names()) MarkLinkHealth(name, true);
  DropHealthBefore(set->version);
  reg.made[set->version] = set;
  reg.current = std::move(set);
  reg.overrides.clear();
  reg.model.reset();
  return Status::Ok();
}

std::shared_ptr<const LinkSet> CurrentLinkSet() {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  if (!reg.current) {
    std::shared_ptr<const LinkSet> set;
    Status s = Build("shm", reg.next_version++, &set);
    if (!s.ok()) return nullptr;  // cannot happen: "shm" always parses
    for (const std::string& name : set->names()) MarkLinkHealth(name, true);
    reg.made[set->version] = set;
    reg.current = std::move(set);
  }
  return reg.current;
}

Status LinkSetAt(uint64_t version, std::shared_ptr<const LinkSet>* out) {
  if (version == 0) {
    *out = CurrentLinkSet();
    return Status::Ok();
  }
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.made.find(version);
  if (it == reg.made.end())
    return Status::InvalidArgument("the program was lowered for link set " + std::to_string(version) +
                                   ", which this process never configured (it has made " +
                                   std::to_string(reg.next_version - 1) +
                                   "); a compiled program runs only in the process that lowered it");
  *out = it->second;
  return Status::Ok();
}

Status SetSharesEverywhere(Kind kind, uint64_t bucket_bytes, std::vector<double> shares, bool pinned) {
  std::shared_ptr<const LinkSet> set = CurrentLinkSet();
  if (shares.size() != set->links.size())
    return Status::InvalidArgument("set_shares: " + std::to_string(shares.size()) +
                                   " shares for " + std::to_string(set->links.size()) + " links");
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.overrides[{kind, bucket_bytes}] = PinnedShares{std::move(shares), pinned};
  return Status::Ok();
}

std::map<std::pair<Kind, uint64_t>, PinnedShares> CurrentShareOverrides() {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  return reg.overrides;
}

void ClearShareOverrides() {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.overrides.clear();
}

void SetCurrentModel(plan::CostModel model) {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.model = std::make_shared<const plan::CostModel>(std::move(model));
}

std::shared_ptr<const plan::CostModel> CurrentModel() {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  return reg.model;
}

}  // namespace flexlink
