// Which jax device a GPU handler runs for. XLA hands a handler its device's CUDA ordinal (FFI's
// DeviceOrdinal is the run options' device ordinal, which PjRt sets to the device's local_device_id:
// in the StreamExecutor GPU client, the executor's ordinal), while a call's groups hold jax's global
// device ids. The two differ in a multi-process job (process 1's first GPU is ordinal 0 but, say, id 8)
// and wherever jax hides GPUs without CUDA_VISIBLE_DEVICES (`jax_cuda_visible_devices`, or
// `jax.distributed.initialize(local_device_ids=...)`, which cluster auto-detection sets to one GPU
// per process): XLA then makes executors only for the visible ordinals and keeps CUDA's numbering
// (xla/service/platform_util.cc), so a process shown GPU 3 alone runs it as ordinal 3 while jax
// numbers its devices from 0. Python sets the map once, from each device's `local_hardware_id`
// (that ordinal), before the first call (docs/cuda.md, "Device ids").
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

namespace flexlink::gpu {

class DeviceIds {
 public:
  static constexpr int kMaxOrdinals = 64;
  static constexpr int64_t kNone = -1;  // in a map: an ordinal that is none of this process's jax devices

  // `global_of_ordinal[o]`: the jax id of CUDA ordinal o, or kNone. Set once: returns false (nothing
  // changed) for a different map once one is set, or for one naming an id twice or an ordinal past
  // kMaxOrdinals. Setting the same map again is a no-op.
  bool Set(std::span<const int64_t> global_of_ordinal);
  bool set() const { return count_.load(std::memory_order_acquire) > 0; }
  // Identity until set; then the ordinal's id, or kNone for an ordinal the map does not name.
  int64_t GlobalIdOf(int32_t ordinal) const;
  // Identity until set; then the id's ordinal, or -1 for an id that is not a device of this process.
  int OrdinalOf(int64_t global_id) const;
  std::vector<int64_t> Map() const;

 private:
  // Written once under mu_ before the release on count_; handlers read after the acquire.
  int64_t ids_[kMaxOrdinals] = {};
  std::atomic<int> count_{0};
  std::mutex mu_;
};

}  // namespace flexlink::gpu
