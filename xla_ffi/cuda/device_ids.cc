#include "xla_ffi/cuda/device_ids.h"

#include <algorithm>

namespace flexlink::gpu {

bool DeviceIds::Set(std::span<const int64_t> global_of_ordinal) {
  // Trailing "none" entries carry nothing: the same map however long the list.
  size_t n = global_of_ordinal.size();
  while (n > 0 && global_of_ordinal[n - 1] < 0) --n;
  if (n > static_cast<size_t>(kMaxOrdinals)) return false;
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j)
      if (global_of_ordinal[i] >= 0 && global_of_ordinal[i] == global_of_ordinal[j]) return false;
  std::lock_guard<std::mutex> lock(mu_);
  const int have = count_.load(std::memory_order_acquire);
  if (have) {
    if (static_cast<size_t>(have) != n) return false;
    for (size_t i = 0; i < n; ++i)
      if (ids_[i] != std::max<int64_t>(global_of_ordinal[i], kNone)) return false;
    return true;
  }
  if (n == 0) return true;  // no device named: stays unset (identity)
  for (size_t i = 0; i < n; ++i) ids_[i] = std::max<int64_t>(global_of_ordinal[i], kNone);
  count_.store(static_cast<int>(n), std::memory_order_release);
  return true;
}

int64_t DeviceIds::GlobalIdOf(int32_t ordinal) const {
  const int n = count_.load(std::memory_order_acquire);
  if (n == 0) return ordinal;
  return ordinal >= 0 && ordinal < n ? ids_[ordinal] : kNone;
}

int DeviceIds::OrdinalOf(int64_t global_id) const {
  const int n = count_.load(std::memory_order_acquire);
  if (n == 0) return static_cast<int>(global_id);
  if (global_id < 0) return -1;
  for (int i = 0; i < n; ++i)
    if (ids_[i] == global_id) return i;
  return -1;
}

std::vector<int64_t> DeviceIds::Map() const {
  const int n = count_.load(std::memory_order_acquire);
  return std::vector<int64_t>(ids_, ids_ + n);
}

}  // namespace flexlink::gpu
