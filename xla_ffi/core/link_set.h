// The configured links: what FLEXLINK_LINKS / jax_flexlink.configure(links=...) selected, built into
// Link objects. A configuration is immutable once made; configuring again makes a new one with a new
// version, and communicators are per (version, group), so a call never mixes two link sets. A call
// runs on the version its program was lowered with (the FFI attribute `links_version`), never on
// whatever is current when each rank arrives: with jax's asynchronous dispatch a call may still be
// queued or running when configure(links=...) returns, and its ranks must all pick the same set.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/core/types.h"
#include "xla_ffi/links/link.h"
#include "xla_ffi/plan/cost_model.h"

namespace flexlink {

struct PinnedShares {
  std::vector<double> shares;
  bool pinned = true;
};

struct LinkSet {
  uint64_t version = 0;
  std::string spec;  // canonical form (plan::FormatLinkSpecs)
  std::vector<std::unique_ptr<Link>> links;  // links[0] is the primary
  std::vector<std::string> names() const;
  Link* Find(std::string_view name) const;
};

// Parses and builds `spec` (kinds: shm, tcp, emulated) and makes it current. On error the current
// set stays. The default, before any call to ConfigureLinks, is "shm".
Status ConfigureLinks(std::string_view spec);
std::shared_ptr<const LinkSet> CurrentLinkSet();
// The set that had `version` (0: the current one), kept for the process's life; InvalidArgument for a
// version this process never made.
Status LinkSetAt(uint64_t version, std::shared_ptr<const LinkSet>* out);

// Shares set by hand for a (collective, size bucket): every communicator's balancer, present and
// future, of the current link set applies them. Cleared when the links are reconfigured.
Status SetSharesEverywhere(Kind kind, uint64_t bucket_bytes, std::vector<double> shares, bool pinned);
std::map<std::pair<Kind, uint64_t>, PinnedShares> CurrentShareOverrides();
void ClearShareOverrides();

// Stage-1 results (per-link α–β fits) for the current link set: new groups' balancers start from
// them. Cleared when the links are reconfigured.
void SetCurrentModel(plan::CostModel model);
std::shared_ptr<const plan::CostModel> CurrentModel();  // null before any stage 1

}  // namespace flexlink
