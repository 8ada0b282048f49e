// A group's setup, once, inside its first call's rendezvous: every rank has arrived and none has
// enqueued anything of this group, so NCCL's communicators are made with no peer's collective in
// flight (jax-ml/jax#11637), and nothing that allocates or loads code runs on a later call's path
// (openxla/xla#6825). One rank does it all, for every rank's device; the others wait, with the
// deadline, and all return its verdict. A failed setup fails every later call of the group at once.
#include <algorithm>
#include <chrono>

#include "xla_ffi/core/config.h"
#include "xla_ffi/cuda/gpu_executor.h"

namespace flexlink::gpu {

Status GpuExecutor::EnsureSetup(int rank, std::string_view label) {
  if (setup_.ready()) return Status::Ok();
  const std::string where = "flexlink: setting up group " + FormatIds(group_.ids) + ": ";
  const double timeout = TimeoutSeconds();
  const SetupOnce::Outcome o = setup_.Run(
      [&] {
        DeviceGuard guard(api_);
        return SetupAll();
      },
      timeout, where);
  if (o.timed_out)
    return Status::DeadlineExceeded(ErrorPrefix(label) + "rank " + std::to_string(rank) + " timed out after " +
                                    std::to_string(timeout) + " s waiting for the setup of group " +
                                    FormatIds(group_.ids) + " (NCCL communicators, pinned memory)");
  if (o.ran || o.status.ok()) return o.status;
  return Status(o.status.code(), ErrorPrefix(label) + "the setup of group " + FormatIds(group_.ids) +
                                     " failed: " + o.status.message());
}

Status GpuExecutor::SetupAll() {
  const std::string where = "flexlink: setting up group " + FormatIds(group_.ids) + ": ";
  auto check = [&](Status s) { return s.ok() ? s : Status(s.code(), where + s.message()); };
  std::vector<int> loaded;
  for (int r = 0; r < group_.size(); ++r) {
    const int dev = group_.devices[r];
    Rank& k = ranks_[r];
    FLEXLINK_RETURN_IF_ERROR(check(api_.SetDevice(dev)));
    if (std::find(loaded.begin(), loaded.end(), dev) == loaded.end()) {
      FLEXLINK_RETURN_IF_ERROR(check(api_.PreloadKernels(dev)));
      loaded.push_back(dev);
    }
    k.side.assign(names_.size(), nullptr);
    if (names_.size() > 1)
      for (Stream& s : k.side) FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateStream(dev, &s)));
    FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateStream(dev, &k.profile.stream)));
    FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateEvent(dev, false, &k.profile.fork)));
    FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateEvent(dev, false, &k.profile.join)));
    void* flag = nullptr;
    FLEXLINK_RETURN_IF_ERROR(check(ledger_.AllocPinnedHost(sizeof(uint32_t), &flag)));
    k.hang_flag = static_cast<uint32_t*>(flag);
    *k.hang_flag = 0;  // nothing waits on it yet
    k.slots.resize(kTimingSlots);
    for (Slot& slot : k.slots) {
      FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateEvent(dev, true, &slot.start)));
      FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateEvent(dev, false, &slot.before)));
      slot.stop.assign(names_.size(), nullptr);
      for (Event& e : slot.stop) FLEXLINK_RETURN_IF_ERROR(check(ledger_.CreateEvent(dev, true, &e)));
    }
  }
  for (auto& channel : channels_) FLEXLINK_RETURN_IF_ERROR(channel->Setup());
  return Status::Ok();
}

}  // namespace flexlink::gpu
