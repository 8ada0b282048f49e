// The engine's shutdown (GpuEngine::Shutdown): the order matters.
//   1. close: every later call is refused (Run checks after counting itself in, so none slips past),
//      and its peers inside the engine are told at once (TellRefused);
//   2. the host: calls already inside Run return (a rank waiting for a peer process's rank returns
//      when that rank arrives, when its process closes its ranks at its own step 2, or at the
//      arrival's deadline, which is why the whole shutdown has one); then this process's ranks of
//      every group across processes are closed in the segment, so that the other processes'
//      waits for them fail at once, naming the shutdown (xproc::ProcessGroup::Close);
//   3. the devices: every group's streams idle and events complete (gpu_release.cc), with the
//      watchdog still running, so a hung range breaks its group and its streams drain;
//   4. each drained group released under its own lock, which its watchdog tick and stats()'s
//      poll try (skipping the group while it is held), so nothing polls an event being destroyed
//      and nothing waits behind a release; not under the engine's lock;
//   5. once every group is released: the watchdog stopped and joined, then the device's shared
//      pools. A group kept keeps the watchdog too, so that a later shutdown can release it.
// ReleaseEarlierLinks, with the door open, retires the groups of earlier link sets once no rank is
// inside them (instead of steps 1 and 2: a late call lowered for such a set gets a new group), then
// runs steps 3 and 4 for them.
#include <algorithm>
#include <chrono>
#include <functional>
#include <string_view>
#include <thread>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/deadline.h"
#include "xla_ffi/core/rendezvous.h"
#include "xla_ffi/cuda/gpu_engine.h"
#include "xla_ffi/cuda/gpu_executor.h"
#include "xla_ffi/cuda/gpu_xproc.h"

namespace flexlink::gpu {
namespace {

using Clock = SteadyClock;

// One group of either kind, as the shutdown sees it.
struct Held {
  std::string name;
  std::function<bool(std::string*)> drained;
  std::function<Status(double)> release;
  std::function<bool()> released;
  std::vector<int> devices;  // this process's CUDA devices of the group
};

std::vector<int> LocalDevices(const std::vector<int>& devices) {
  std::vector<int> out;
  for (int d : devices)
    if (d >= 0 && std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  return out;
}

}  // namespace

bool GpuEngine::HasGroups() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!groups_.empty() || !retired_.empty()) return true;
  }
  return !GpuXprocGroupsOf(*this).empty();
}

void GpuEngine::TellRefused(const CollectiveArgs& args, std::string_view reason) {
  // Never an error of its own: the refusal is the caller's answer, and a call that could not have
  // run anyway (bad groups) has nobody waiting for it.
  try {
    std::span<const int64_t> members;
    int rank = 0;
    if (!ResolveGroup(args.groups, args.group_sizes, args.device, args.label, &members, &rank).ok() ||
        members.size() < 2)
      return;
    std::shared_ptr<const GpuLinkSet> links;
    if (!LinksAt(args.links_version, args.label, &links).ok()) return;
    if (GpuXprocGroup* x = FindGpuXprocGroup(*this, members, args.links_version, CurrentLinks().get())) {
      x->CloseRank(rank);
      return;
    }
    // In this process only calls inside the engine can wait for this one: with none but itself,
    // every later one is refused too.
    if (active_.load(std::memory_order_seq_cst) <= 1) return;
    // Peers admitted before the door closed may be at the group's very first call, with the group
    // not made yet: made here as they would (no set-up), so that their Join finds the call refused.
    // Made or not, the shutdown lists it only once they have left (its step 2).
    GpuExecutor* group = nullptr;
    if (!FindOrMakeGroup(links, members, args.label, /*enter=*/false, &group).ok()) return;
    group->comm().Join(rank, args.run_id, args.label)->Refuse(rank, reason, StatusCode::kFailedPrecondition);
  } catch (const std::exception&) {
  }
}

namespace {

std::string NameOf(const std::vector<int64_t>& ids, GpuExecutor* g) {
  return "GPU group " + FormatIds(ids) + " (links " + g->links_spec() + ")";
}

Held HeldOf(const std::vector<int64_t>& ids, GpuExecutor* g, std::string why) {
  return {NameOf(ids, g),
          [g](std::string* b) { return g->Drained(b); },
          [g, why = std::move(why)](double t) { return g->Release(t, why); },
          [g] { return g->released(); },
          LocalDevices(g->group().devices)};
}

// Steps 3 and 4 for `targets`, against `deadline`: polls until each is drained (or released), then
// releases the drained ones, except those sharing a device with a group still busy: one of the
// targets, or one of `others` (groups left running, whose devices count as busy while they are).
// Returns whether every target is released; a kept one's line ends with `retry` (who tries again).
bool ReleaseDrained(const std::vector<Held>& targets, const std::vector<Held>& others,
                    Clock::time_point deadline, double timeout_s, std::string_view retry,
                    ShutdownReport* report) {
  // The devices: polled, never waited on (a hung stream must not hold the caller past its deadline).
  for (int polls = 0;; ++polls) {
    bool all = true;
    for (const Held& g : targets)
      if (!g.released() && !g.drained(nullptr)) all = false;
    if (all || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::microseconds(polls < 100 ? 200 : 2000));
  }

  // Not under the engine's lock: a release may wait on its device (cudaFree and cudaFreeHost may
  // synchronise it), and the watchdog takes that lock at every tick; each group's own lock keeps
  // its tick and stats() away from what is being destroyed. A drained group that shares a device
  // with a group still running is kept too: its frees would wait for that group's hung work.
  std::vector<char> kept(targets.size(), 0);
  std::vector<int> busy_devices;
  for (size_t i = 0; i < targets.size(); ++i) {
    std::string what;
    if (targets[i].released() || targets[i].drained(&what)) continue;
    kept[i] = 1;
    report->kept.push_back(targets[i].name + ": not released: " + what + " still busy after " +
                           FormatSeconds(timeout_s) +
                           " s (a range that never completes: a hung link, or a peer's device that never reached the "
                           "call); it keeps its resources, and " + std::string(retry));
    busy_devices.insert(busy_devices.end(), targets[i].devices.begin(), targets[i].devices.end());
  }
  for (const Held& g : others)
    if (!g.released() && !g.drained(nullptr)) busy_devices.insert(busy_devices.end(), g.devices.begin(), g.devices.end());
  for (size_t i = 0; i < targets.size(); ++i) {
    const Held& g = targets[i];
    if (kept[i] || g.released()) continue;
    auto shared = std::find_first_of(g.devices.begin(), g.devices.end(), busy_devices.begin(), busy_devices.end());
    if (shared != g.devices.end()) {
      kept[i] = 1;
      report->kept.push_back(g.name + ": not released: it shares device " + std::to_string(*shared) +
                             " with a group still running, whose work its frees would wait for; " + std::string(retry));
      continue;
    }
    Status s = g.release(std::max(1.0, SecondsLeft(deadline)));
    if (s.ok()) report->released.push_back(g.name);
    else report->errors.push_back(g.name + ": " + s.message());
  }
  for (char k : kept)
    if (k) return false;
  return true;
}

}  // namespace

bool GpuEngine::WaitNoCallInside(std::chrono::steady_clock::time_point deadline) {
  for (int polls = 0; active_.load(std::memory_order_seq_cst) > 0; ++polls) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(polls < 100 ? 200 : 2000));
  }
  return true;
}

ShutdownReport GpuEngine::Shutdown(double timeout_s) {
  std::lock_guard<std::mutex> once(shutdown_mu_);
  ShutdownReport report;
  report.again = shutdown_ran_;
  shutdown_ran_ = true;
  closed_.store(true, std::memory_order_seq_cst);
  // Clamped as the engine's other deadlines are: a huge one would overflow the clock's count.
  timeout_s = std::min(std::max(0.0, timeout_s), 1e6);
  const auto deadline = DeadlineAfter(timeout_s);

  auto collect = [&] {
    std::vector<Held> groups;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [key, ex] : groups_) groups.push_back(HeldOf(key.second, ex.get(), "the engine was shut down"));
      for (auto& [ids, ex] : retired_)
        if (!ex->released()) groups.push_back(HeldOf(ids, ex.get(), "the engine was shut down"));
    }
    for (GpuXprocGroup* g : GpuXprocGroupsOf(*this))
      groups.push_back({"GPU group " + FormatIds(g->group().ids) + " across processes (links " + g->links_spec() + ")",
                        [g](std::string* b) { return g->Drained(b); }, [g](double t) { return g->Release(t); },
                        [g] { return g->released(); }, LocalDevices(g->group().devices)});
    return groups;
  };
  if (!WaitNoCallInside(deadline)) {
    const int inside = active_.load();
    for (const Held& g : collect())
      if (!g.released())
        report.kept.push_back(g.name + ": not released: " + std::to_string(inside) + " call(s) still inside FlexLink on "
                              "the host after " + FormatSeconds(timeout_s) + " s (a rank waiting for a peer that never came?)");
    return report;
  }

  // Every call that could make a group has returned: the list is complete, and no local rank
  // arrives anywhere again, which the other processes' waits for these ranks now learn at once.
  std::vector<Held> groups = collect();
  for (GpuXprocGroup* g : GpuXprocGroupsOf(*this)) g->Close();
  // The watchdog runs on while a group is kept: a hung range still breaks its group and frees its
  // streams, so that a later shutdown can release it.
  if (ReleaseDrained(groups, {}, deadline, timeout_s, "a later shutdown tries again", &report)) {
    StopWatchdog();
    Status s = api_.ReleaseShared();
    if (!s.ok()) report.errors.push_back("the devices' shared resources (stage 1's scratch pools): " + s.message());
  }
  return report;
}

ShutdownReport GpuEngine::ReleaseEarlierLinks(double timeout_s) {
  std::lock_guard<std::mutex> once(shutdown_mu_);
  ShutdownReport report;
  if (closed_.load(std::memory_order_seq_cst)) return report;  // the shutdown owns every group now
  timeout_s = std::min(std::max(0.0, timeout_s), 1e6);
  const auto deadline = DeadlineAfter(timeout_s);
  constexpr std::string_view kRetry = "the next release of the earlier links' groups, or the shutdown, tries again";
  const uint64_t current = CurrentLinks()->version;
  // Retired under mu_, where no call enters a listed group (FindOrMakeGroup), and taken out of the
  // list: a call that comes later for its set makes a new group. One with a rank inside is polled
  // until the deadline: the rank may be waiting at the arrival for a peer still enqueuing.
  for (int polls = 0;; ++polls) {
    int retired = 0, busy = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      RetireEarlier(
          groups_, [&](const auto& key) { return key.first < current; }, [](GpuExecutor&) { return false; },
          [&](auto it) { retired_.emplace_back(it->first.second, std::move(it->second)); }, &retired, &busy);
    }
    if (busy == 0 || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::microseconds(polls < 100 ? 200 : 2000));
  }
  // The groups left running (the current set's, earlier ones with a rank inside, those across
  // processes) may run calls meanwhile: only their ledgers are asked (Idle).
  std::vector<Held> earlier, others;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, ex] : groups_) {
      GpuExecutor* g = ex.get();
      if (key.first != current)
        report.kept.push_back(NameOf(key.second, g) + ": not released: " + std::to_string(g->entry.Inside()) +
                              " rank(s) still inside a call of it on the host after " + FormatSeconds(timeout_s) +
                              " s (a rank waiting for a peer that never came?); " + std::string(kRetry));
      others.push_back({"", [g](std::string* b) { return g->Idle(b); }, nullptr, [] { return false; },
                        LocalDevices(g->group().devices)});
    }
    for (auto& [ids, ex] : retired_)
      if (!ex->released())
        earlier.push_back(HeldOf(ids, ex.get(), "its links were replaced (configure_links) and it was released"));
  }
  for (GpuXprocGroup* g : GpuXprocGroupsOf(*this))
    others.push_back({"", [g](std::string* b) { return g->Idle(b); }, nullptr, [] { return false; },
                      LocalDevices(g->group().devices)});
  (void)ReleaseDrained(earlier, others, deadline, timeout_s, kRetry, &report);
  return report;
}

}  // namespace flexlink::gpu
