// The shm link: ranks of one process exchange buffer pointers at the rendezvous and work directly on
// each other's buffers. A call of several parts runs them one after another (its pieces, part by
// part) and ends with one barrier.
//
// Calls above the staging size (the direct path):
//   all_reduce      reduce-scatter with direct broadcast. Rank r owns slice r of each piece: tile by
//                   tile it reduces slice r across all ranks' inputs (rank order 0..n-1) and stores the
//                   result into every rank's output in one pass; then a final barrier keeps buffers
//                   alive while peers use them. Only rank r ever touches slice r of any buffer, so in
//                   place is safe with no barrier between reading and writing, and memory traffic per
//                   rank is the minimum: read N, write N.
//   all_gather      pull (each rank copies every block into its own output) below 4 MiB of output per
//                   rank, push above (each rank copies its own block into every rank's output, a
//                   cache-sized chunk at a time, so its input is read once), then a final barrier.
//   reduce_scatter  rank r reduces block r across ranks into its output, barrier.
//   ppermute        rank d copies its source's input into its own output (zeros without a source),
//                   barrier.
//   all_to_all      rank r copies block r of every rank's input into block j of its own output
//                   (pull: read N, write N), barrier.
//   Both in place (a part whose output is its input on some rank): chunk by chunk through a bounce
//   buffer, each rank overwriting a chunk of its buffer only once the ranks that read it announced
//   that chunk (shm_inplace.h); no barrier then, each rank waits for its own readers instead.
// Separate outputs of 256 KiB and more are written with streaming stores (shm_reduce.cc).
//
// Small calls (the staged path): each rank copies the inputs of all its parts into its region of a
// per-call staging buffer (pooled per communicator and pre-touched), arrives, and computes its entire
// output from the staging buffer. The arrival is the only rendezvous — one for all k parts: after it
// nobody reads a peer's buffers, and the staging buffer goes back to the pool when the last rank
// leaves the call.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "xla_ffi/links/link.h"
#include "xla_ffi/links/shm_staging.h"

namespace flexlink {

class ShmChannel final : public Channel {
 public:
  ShmChannel(int n, std::string name) : name_(std::move(name)), staging_pool_(n) {}
  std::string_view link_name() const override { return name_; }
  Status Run(CallContext& ctx, int rank, int lane, std::span<const Piece> pieces) override;
  Status RunAlone(CallContext& ctx, int rank, const CallDesc& desc) override;

 private:
  const std::string name_;
  shm::StagingPool staging_pool_;
};

class ShmLink final : public Link {
 public:
  explicit ShmLink(std::string name = "shm") : name_(std::move(name)) {}
  std::string_view name() const override { return name_; }
  std::unique_ptr<Channel> Open(std::span<const int64_t> devices) override {
    return std::make_unique<ShmChannel>(static_cast<int>(devices.size()), name_);
  }

 private:
  const std::string name_;
};

}  // namespace flexlink
