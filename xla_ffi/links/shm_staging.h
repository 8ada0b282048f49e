// Staging memory of the shm link's small-call path: each rank copies all of its call's inputs into
// its region of a per-call buffer before arriving, so that after the arrival nobody reads a peer's
// buffers and the arrival is the call's only rendezvous (docs/engine.md, "The shm link").
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace flexlink::shm {

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

}  // namespace flexlink::shm
