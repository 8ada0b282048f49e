// A group's release at the engine's shutdown (GpuEngine::Shutdown), or once its links were replaced
// (GpuEngine::ReleaseEarlierLinks): the reverse of its set-up
// (gpu_setup.cc, GpuXprocGroup::SetupLocal). Only a drained group is released: CUDA lets a stream
// or event be destroyed with work pending, but NCCL's finalize waits for its communicator's
// operations, and memory freed under a copy still running would be a use after free on the device.
// A group that does not drain (a hung range, a peer's device that never came) keeps everything, and
// the shutdown says so.
#include <algorithm>
#include <functional>

#include "xla_ffi/core/deadline.h"
#include "xla_ffi/cuda/gpu_executor.h"
#include "xla_ffi/cuda/gpu_xproc.h"
#include "xla_ffi/cuda/start_board.h"
#include "xla_ffi/xproc/process_group.h"

namespace flexlink::gpu {
namespace {

// Both kinds of group: their own ledger, stage 1's events (`profile_drained`), then each link's.
template <class Channels>
bool GroupDrained(DeviceLedger& ledger, bool profile_drained, Channels& channels, std::string* busy) {
  if (!ledger.Drained(busy)) return false;
  if (!profile_drained) {
    if (busy) *busy = "stage 1's events";
    return false;
  }
  for (auto& channel : channels) {
    std::string what;
    if (!channel->Drained(&what)) {
      if (busy) *busy = "the " + std::string(channel->link_name()) + " link's " + what;
      return false;
    }
  }
  return true;
}

// The links first (their communicators end while the streams they ran on still exist), then stage
// 1's events, then the group's own streams, events and flags. The first error, naming its part.
template <class Channels>
Status ReleaseGroup(DeviceApi& api, DeviceLedger& ledger, Channels& channels, const std::function<Status()>& profile,
                    double timeout_s) {
  DeviceGuard guard(api);
  // One deadline for all the links (a link set may hold several nccl links).
  const auto deadline = DeadlineAfter(timeout_s);
  Status first;
  auto keep = [&](Status s, const std::string& what) {
    if (!s.ok() && first.ok()) first = Status(s.code(), what + ": " + s.message());
  };
  for (auto& channel : channels)
    keep(channel->Release(SecondsLeft(deadline)),
         "the " + std::string(channel->link_name()) + " link");
  keep(profile(), "stage 1's events");
  keep(ledger.Release(), "the group's streams, events and flags");
  return first;
}

}  // namespace

bool GpuExecutor::Drained(std::string* busy) {
  if (released()) return true;
  bool profile = true;
  for (const Rank& k : ranks_) profile = profile && ProfileEventsDrained(api_, k.profile);
  return GroupDrained(ledger_, profile, channels_, busy);
}

bool GpuExecutor::Idle(std::string* busy) { return released() || GroupDrained(ledger_, true, channels_, busy); }

Status GpuExecutor::Release(double timeout_s, std::string_view why) {
  std::lock_guard<std::mutex> held(release_mu_);
  if (released_all_.exchange(true, std::memory_order_acq_rel)) return Status::Ok();
  {
    // Later calls (the engine refuses them first) would find the group broken, not freed handles.
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (broken_.empty()) broken_ = why;
    released_ = true;  // the watchdog's abort has nothing left to do
  }
  return ReleaseGroup(api_, ledger_, channels_, [&] {
    Status first;
    for (Rank& k : ranks_) {
      Status s = DestroyProfileEvents(api_, k.profile);
      if (first.ok()) first = s;
    }
    return first;
  }, timeout_s);
}

// A group across processes: this process's part only. Its peers keep theirs; the next call they
// make finds this process's ranks closed (the shutdown closed them before draining), and their
// arrival names them at once, as after an exit.
void GpuXprocGroup::Close() { segment_->Close(); }
void GpuXprocGroup::CloseRank(int rank) { segment_->Close(rank); }

bool GpuXprocGroup::Drained(std::string* busy) {
  if (released()) return true;
  return GroupDrained(ledger_, profiler_->EventsDrained(), channels_, busy);
}

bool GpuXprocGroup::Idle(std::string* busy) { return released() || GroupDrained(ledger_, true, channels_, busy); }

Status GpuXprocGroup::Release(double timeout_s) {
  std::lock_guard<std::mutex> held(release_mu_);
  if (released_all_.exchange(true, std::memory_order_acq_rel)) return Status::Ok();
  // Drained: this process's devices reached (and finished) every call its ranks arrived at. The
  // watchdog that would have said so for the last ones ticks no more here, and the other processes'
  // hang detectors wait for these words (cuda/start_board.h).
  for (int r : local_) board_->Reach(r, segment_->rank_calls(r));
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    released_ = true;  // the watchdog's abort has nothing left to do
  }
  return ReleaseGroup(api_, ledger_, channels_, [&] { return profiler_->DestroyEvents(); }, timeout_s);
}

}  // namespace flexlink::gpu
