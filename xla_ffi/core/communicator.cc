#include "xla_ffi/core/communicator.h"

#include <algorithm>

#include "xla_ffi/core/spin.h"
#include "xla_ffi/links/link.h"

namespace flexlink {
namespace {

// Runs a rank remembers call counters for. Launches of one executable are serialised per device, so
// a rank never returns to a run this many launches old.
constexpr size_t kRunsRemembered = 16;
// Abandoned calls are kept so that a late rank fails at once; beyond this many, the oldest go.
constexpr size_t kMaxAbandoned = 256;

}  // namespace

int LanesFor(size_t links) {
  // One lane per link; with several, the executor's failover lanes (L - 1 rounds of one lane per
  // failed link) and its agreement lane (core/executor.cc, FailoverLane / AgreeLane).
  return links <= 1 ? 1 : static_cast<int>(links * links + 1);
}

Communicator::Communicator(std::vector<int64_t> devices)
    : devices_(std::move(devices)), stragglers_(devices_), next_seq_(devices_.size()) {}

Communicator::~Communicator() {
  // Calls (and their scratch, which links hand out) must go before the links.
  open_.clear();
}

void Communicator::AddChannel(std::unique_ptr<Channel> channel) { channels_.push_back(std::move(channel)); }

uint64_t Communicator::NextSeq(int rank, int64_t run_id) {
  auto& runs = next_seq_[rank];
  for (auto& [run, next] : runs)
    if (run == run_id) return next++;
  if (runs.size() >= kRunsRemembered)
    runs.erase(std::min_element(runs.begin(), runs.end()));  // RunIds grow: the smallest is oldest
  runs.emplace_back(run_id, 1);
  return 0;
}

std::shared_ptr<CallContext> Communicator::Join(int rank, int64_t run_id, std::string_view label) {
  const std::unique_lock<std::mutex> lock = LockSpinning(mu_, spin_);  // every rank, at once
  const Key key(run_id, NextSeq(rank, run_id));
  auto it = open_.find(key);
  if (it != open_.end()) return it->second;
  auto call = std::make_shared<CallContext>(this, key.first, key.second, std::string(label),
                                            LanesFor(channels_.size()));
  open_.emplace(key, call);
  if (open_.size() > kMaxAbandoned) PruneAbandoned();
  return call;
}

void Communicator::Retire(int64_t run_id, uint64_t seq) {
  const std::unique_lock<std::mutex> lock = LockSpinning(mu_, spin_);
  open_.erase(Key(run_id, seq));
}

void Communicator::PruneAbandoned() {
  // Called with mu_ held. Only abandoned calls are dropped; live ones still have ranks waiting.
  size_t excess = open_.size() - kMaxAbandoned / 2;
  for (auto it = open_.begin(); it != open_.end() && excess > 0;) {
    bool abandoned;
    {
      std::lock_guard<std::mutex> call_lock(it->second->mu_);
      abandoned = it->second->abandoned_;
    }
    if (abandoned) {
      it = open_.erase(it);
      --excess;
    } else {
      ++it;
    }
  }
}

}  // namespace flexlink
