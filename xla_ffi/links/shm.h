// The shm link: ranks of one process exchange buffer pointers at the rendezvous and work directly on
// each other's buffers.
//
// Calls above the staging size:
//   all_reduce      reduce-scatter with direct broadcast. Rank r owns slice r of the range: block by
//                   block it reduces slice r across all ranks' inputs into its own output (rank order
//                   0..n-1, cache-blocked) and copies the block, still in cache, into every other
//                   rank's output; then a final barrier keeps buffers alive while peers use them. Only
//                   rank r ever touches slice r of any buffer, so in place is safe with no barrier
//                   between reading and writing, and memory traffic per rank is the minimum: read N,
//                   write N.
//   all_gather      each rank copies its own block into every rank's output (a cache-sized chunk at
//                   a time, so its input is read once), then a final barrier.
//   reduce_scatter  rank r reduces block r across ranks into its output, barrier.
// First-touch page faults of fresh outputs spread over the device threads (all_reduce / all_gather:
// each rank writes its slice / block of every output; reduce_scatter: each rank its own output).
//
// Small calls: each rank copies its input into a per-call staging buffer (pooled per communicator and
// pre-touched), arrives, and computes its entire output from the staging buffer. The arrival is the
// only rendezvous: after it nobody reads a peer's buffers, and the staging buffer goes back to the
// pool when the last rank leaves the call.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/links/link.h"

namespace flexlink {

// n regions of `region_bytes`, 64-byte aligned, touched once at allocation.
class StagingBuffer {
 public:
  StagingBuffer(int n, size_t region_bytes);
  ~StagingBuffer();
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  size_t region_bytes() const { return region_bytes_; }
  char* region(int rank) const { return data_ + static_cast<size_t>(rank) * stride_; }

 private:
  size_t region_bytes_, stride_;
  char* data_;
};

class StagingPool {
 public:
  explicit StagingPool(int n) : n_(n) {}
  // A buffer with n regions of `region_bytes`; it returns to the pool when the last reference dies.
  // The pool keeps a few free buffers (their pages stay touched); beyond that the oldest is freed.
  std::shared_ptr<StagingBuffer> Acquire(size_t region_bytes);

 private:
  void Release(StagingBuffer* buffer);
  const int n_;
  std::mutex mu_;
  std::vector<std::unique_ptr<StagingBuffer>> free_;
};

class ShmChannel final : public Channel {
 public:
  ShmChannel(int n, std::string name) : name_(std::move(name)), staging_pool_(n) {}
  std::string_view link_name() const override { return name_; }
  Status Run(CallContext& ctx, int rank, int lane, UnitRange range) override;
  Status RunAlone(CallContext& ctx, int rank, const CallDesc& desc) override;

 private:
  const std::string name_;
  StagingPool staging_pool_;
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
