// What a group's set-up made on its devices (streams, events, device and pinned memory, host
// registrations), made through this ledger so that the engine's shutdown can release all of it
// (GpuEngine::Shutdown): the executors and links keep their handles where they use them, and the
// ledger only remembers what to undo. Set-up runs once per group from one thread; Drained and
// Release run from the shutdown's thread, once no rank is inside a call of the group.
#pragma once

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/cuda/device_api.h"

namespace flexlink::gpu {

class DeviceLedger {
 public:
  explicit DeviceLedger(DeviceApi& api) : api_(api) {}
  DeviceLedger(const DeviceLedger&) = delete;
  DeviceLedger& operator=(const DeviceLedger&) = delete;

  // DeviceApi's, remembered when they succeed.
  Status CreateStream(int device, Stream* stream);
  Status CreateEvent(int device, bool timing, Event* event);
  Status AllocDevice(int device, size_t bytes, void** ptr);
  Status AllocPinnedHost(size_t bytes, void** ptr);
  Status RegisterHost(void* ptr, size_t bytes);

  // Whether nothing made here is still in use on a device: every stream idle and every event's last
  // record completed (a device error counts as completed: nothing more of it will run). Never
  // blocks. Otherwise *busy names the first that is not ("a stream on device 2").
  bool Drained(std::string* busy);
  // Undoes everything, newest first (an event before the stream it was recorded on, a host
  // registration before the memory), even past an error; returns the first. Empty afterwards.
  Status Release();
  size_t size() const;

 private:
  enum class What { kStream, kEvent, kDevice, kPinned, kRegistered };
  struct Entry {
    What what;
    int device;  // -1: host memory
    void* handle;
  };
  Status Remember(const Status& made, What what, int device, void* handle);

  DeviceApi& api_;
  mutable std::mutex mu_;
  std::vector<Entry> entries_;
};

}  // namespace flexlink::gpu
