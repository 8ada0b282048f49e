#include "xla_ffi/links/shm_staging.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

namespace flexlink::shm {
namespace {

constexpr size_t kLine = 64;
// Enough for the calls in flight on one communicator (usually one or two).
constexpr size_t kPoolKeep = 4;

size_t RoundUp(size_t x, size_t m) { return (x + m - 1) / m * m; }

}  // namespace

StagingBuffer::StagingBuffer(int n, size_t region_bytes)
    : region_bytes_(region_bytes), stride_(RoundUp(std::max<size_t>(region_bytes, 1), kLine)) {
  const size_t total = stride_ * static_cast<size_t>(n);
  data_ = static_cast<char*>(std::aligned_alloc(kLine, total));
  if (data_ == nullptr) throw std::bad_alloc();
  std::memset(data_, 0, total);  // touch every page now, not on the latency-critical path
}

StagingBuffer::~StagingBuffer() { std::free(data_); }

std::shared_ptr<StagingBuffer> StagingPool::Acquire(size_t region_bytes) {
  std::unique_ptr<StagingBuffer> buffer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if ((*it)->region_bytes() == region_bytes) {
        buffer = std::move(*it);
        free_.erase(it);
        break;
      }
  }
  if (!buffer) buffer = std::make_unique<StagingBuffer>(n_, region_bytes);
  return std::shared_ptr<StagingBuffer>(buffer.release(), [this](StagingBuffer* b) { Release(b); });
}

void StagingPool::Release(StagingBuffer* buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.emplace_back(buffer);
  if (free_.size() > kPoolKeep) free_.erase(free_.begin());  // the oldest (likely an unused size)
}

}  // namespace flexlink::shm
