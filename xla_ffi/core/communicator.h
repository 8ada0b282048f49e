// A communicator is one group of devices (global device ids in rank order) and the links open on it.
// It matches calls across ranks: a rank's k-th call on this group within run R meets every other
// rank's k-th call of run R, so independent calls can never cross as long as every device issues them
// in the same order (the token chain of the custom calls guarantees that).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "xla_ffi/core/rendezvous.h"
#include "xla_ffi/core/stragglers.h"

namespace flexlink {

class Channel;

// Barrier lanes of a call on a communicator with `links` channels.
int LanesFor(size_t links);

class Communicator {
 public:
  explicit Communicator(std::vector<int64_t> devices);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  std::span<const int64_t> devices() const { return devices_; }
  int size() const { return static_cast<int>(devices_.size()); }

  // Links open on this group; added before the communicator is shared, fixed afterwards.
  void AddChannel(std::unique_ptr<Channel> channel);
  size_t num_channels() const { return channels_.size(); }
  Channel& channel(size_t i) const { return *channels_[i]; }

  // How long a rank waiting in a call of this group spins before it sleeps (rendezvous.h), at the
  // call's waits and at the locks every rank takes (spin.h): 0, the CPU engine's (its device threads
  // outnumber the cores), unless the owner sets it before the communicator is shared (the GPU
  // engine: gpu::ArrivalSpin).
  std::chrono::nanoseconds spin() const { return spin_; }
  void SetSpin(std::chrono::nanoseconds spin) { spin_ = spin; }

  // Who arrives last at this group's calls, and how late (core/stragglers.h).
  StragglerTracker& stragglers() { return stragglers_; }

  // The call `rank` makes next in run `run_id` (the rank's own call counter picks the key).
  std::shared_ptr<CallContext> Join(int rank, int64_t run_id, std::string_view label);

 private:
  friend class CallContext;
  using Key = std::pair<int64_t, uint64_t>;  // (run id, call number within the run)
  // All ranks arrived: the map no longer needs the call (the ranks hold it while they work).
  void Retire(int64_t run_id, uint64_t seq);
  uint64_t NextSeq(int rank, int64_t run_id);
  void PruneAbandoned();

  const std::vector<int64_t> devices_;
  StragglerTracker stragglers_;
  std::vector<std::unique_ptr<Channel>> channels_;  // declared before open_: outlives the calls' scratch
  std::chrono::nanoseconds spin_{0};

  std::mutex mu_;
  std::map<Key, std::shared_ptr<CallContext>> open_;  // calls not all ranks reached, incl. abandoned
  // Per rank: (run id, next call number) for the most recent runs; older runs are forgotten.
  std::vector<std::vector<std::pair<int64_t, uint64_t>>> next_seq_;
};

}  // namespace flexlink
