#include "xla_ffi/cuda/device_ledger.h"

namespace flexlink::gpu {

Status DeviceLedger::Remember(const Status& made, What what, int device, void* handle) {
  if (!made.ok()) return made;
  std::lock_guard<std::mutex> lock(mu_);
  entries_.push_back({what, device, handle});
  return made;
}

Status DeviceLedger::CreateStream(int device, Stream* stream) {
  Status s = api_.CreateStream(device, stream);
  return Remember(s, What::kStream, device, s.ok() ? *stream : nullptr);
}

Status DeviceLedger::CreateEvent(int device, bool timing, Event* event) {
  Status s = api_.CreateEvent(device, timing, event);
  return Remember(s, What::kEvent, device, s.ok() ? *event : nullptr);
}

Status DeviceLedger::AllocDevice(int device, size_t bytes, void** ptr) {
  Status s = api_.AllocDevice(device, bytes, ptr);
  return Remember(s, What::kDevice, device, s.ok() ? *ptr : nullptr);
}

Status DeviceLedger::AllocPinnedHost(size_t bytes, void** ptr) {
  Status s = api_.AllocPinnedHost(bytes, ptr);
  return Remember(s, What::kPinned, -1, s.ok() ? *ptr : nullptr);
}

Status DeviceLedger::RegisterHost(void* ptr, size_t bytes) {
  Status s = api_.RegisterHost(ptr, bytes);
  return Remember(s, What::kRegistered, -1, ptr);
}

bool DeviceLedger::Drained(std::string* busy) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Entry& e : entries_) {
    if (e.what != What::kStream && e.what != What::kEvent) continue;
    std::string error;
    const Poll p = e.what == What::kStream ? api_.QueryStream(e.handle, &error) : api_.Query(e.handle, &error);
    if (p == Poll::kPending) {
      if (busy) *busy = std::string(e.what == What::kStream ? "a stream" : "an event") + " on device " + std::to_string(e.device);
      return false;
    }
  }
  return true;
}

Status DeviceLedger::Release() {
  std::vector<Entry> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries.swap(entries_);
  }
  // Events before streams (an event is recorded on a stream), registrations before memory: the
  // reverse of the order they were made in does both, as set-up makes streams before their events.
  Status first;
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    // Its own device current: a free that synchronises a device then waits for this one's work,
    // which drained, not for whichever device the shutdown's thread had current.
    if (it->device >= 0) (void)api_.SetDevice(it->device);
    Status s;
    switch (it->what) {
      case What::kStream: s = api_.DestroyStream(it->handle); break;
      case What::kEvent: s = api_.DestroyEvent(it->handle); break;
      case What::kDevice: s = api_.FreeDevice(it->handle); break;
      case What::kPinned: s = api_.FreePinnedHost(it->handle); break;
      case What::kRegistered: s = api_.UnregisterHost(it->handle); break;
    }
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

size_t DeviceLedger::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

}  // namespace flexlink::gpu
