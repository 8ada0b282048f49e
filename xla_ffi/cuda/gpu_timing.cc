#include "xla_ffi/cuda/gpu_timing.h"

#include <algorithm>

#include "xla_ffi/core/spin.h"

namespace flexlink::gpu {
namespace {
// Records of calls whose ranks never all came back (a rank failed before enqueuing) are dropped
// oldest first beyond this many.
constexpr size_t kMaxOpen = 1024;
}  // namespace

uint64_t TimingBook::Open(std::shared_ptr<const plan::Plan> plan, uint64_t message_bytes,
                          std::vector<uint64_t> link_bytes, uint64_t call,
                          std::vector<uint64_t> link_message_bytes) {
  const std::unique_lock<std::mutex> lock = LockSpinning(mu_, spin_);
  const uint64_t id = next_++;
  TimingRecord& r = records_[id];
  r.plan = std::move(plan);
  r.message_bytes = message_bytes;
  r.link_seconds.assign(link_bytes.size(), 0.0);
  r.slowed.assign(link_bytes.size(), 0);
  r.link_bytes = std::move(link_bytes);
  r.call = call;
  r.link_message_bytes = std::move(link_message_bytes);
  r.pending = n_;
  while (records_.size() > kMaxOpen) records_.erase(records_.begin());
  return id;
}

std::optional<TimingRecord> TimingBook::Retire(std::map<uint64_t, TimingRecord>::iterator it) {
  if (--it->second.pending > 0) return std::nullopt;
  TimingRecord done = std::move(it->second);
  records_.erase(it);
  if (done.lost) return std::nullopt;
  return done;
}

std::optional<TimingRecord> TimingBook::Add(uint64_t id, const std::vector<double>& link_seconds, double call_seconds) {
  const std::unique_lock<std::mutex> lock = LockSpinning(mu_, spin_);
  auto it = records_.find(id);
  if (it == records_.end()) return std::nullopt;
  TimingRecord& r = it->second;
  for (size_t i = 0; i < r.link_seconds.size() && i < link_seconds.size(); ++i)
    r.link_seconds[i] = std::max(r.link_seconds[i], link_seconds[i]);
  r.call_seconds = std::max(r.call_seconds, call_seconds);
  return Retire(it);
}

void TimingBook::MarkSlowed(uint64_t id, size_t link) {
  const std::unique_lock<std::mutex> lock = LockSpinning(mu_, spin_);
  auto it = records_.find(id);
  if (it != records_.end() && link < it->second.slowed.size()) it->second.slowed[link] = 1;
}

void TimingBook::Lose(uint64_t id) {
  const std::unique_lock<std::mutex> lock = LockSpinning(mu_, spin_);
  auto it = records_.find(id);
  if (it == records_.end()) return;
  it->second.lost = true;
  (void)Retire(it);
}

size_t TimingBook::open_records() const {
  const std::unique_lock<std::mutex> lock = LockSpinning(mu_, spin_);
  return records_.size();
}

}  // namespace flexlink::gpu
