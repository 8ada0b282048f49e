#include "xla_ffi/xproc/process_group.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/deadline.h"
#include "xla_ffi/core/pages.h"
#include "xla_ffi/core/spin.h"
#include "xla_ffi/xproc/fingerprint.h"
#include "xla_ffi/xproc/futex.h"
#include "xla_ffi/xproc/steps.h"

namespace flexlink::xproc {
namespace {

constexpr size_t kMinSlotBytes = size_t{64} << 10;
constexpr size_t kMaxDataBytes = size_t{256} << 20;
// A waiter yields a few times before it sleeps (a peer in the middle of a copy is usually done within
// microseconds), or polls for the group's spin where its ranks have cores (SetSpin), then sleeps on
// the futex in slices so that it notices an abort or a dead peer.
constexpr int kYields = 8;
constexpr auto kSlice = std::chrono::milliseconds(20);

using Clock = std::chrono::steady_clock;

std::string Ids(std::span<const int64_t> ids) { return FormatIds(ids); }

Status CheckMembers(std::span<const int64_t> devices, std::span<const int64_t> local, std::vector<char>* local_rank) {
  const std::string what = "flexlink: cross-process group " + Ids(devices) + ": ";
  if (devices.empty()) return Status::InvalidArgument(what + "devices must not be empty");
  FLEXLINK_RETURN_IF_ERROR(CheckDistinct(devices, "cross-process group"));
  local_rank->assign(devices.size(), 0);
  for (int64_t d : local) {
    auto it = std::find(devices.begin(), devices.end(), d);
    if (it == devices.end())
      return Status::InvalidArgument(what + "local device " + std::to_string(d) + " is not in the group");
    char& mark = (*local_rank)[it - devices.begin()];
    if (mark) return Status::InvalidArgument(what + "local device " + std::to_string(d) + " is named twice");
    mark = 1;
  }
  return Status::Ok();
}

}  // namespace

bool ProcessGone(int32_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && (line[paren + 2] == 'Z' || line[paren + 2] == 'X');
}

std::chrono::nanoseconds AwayPoll() {
  const int64_t us = SpinMicros();
  return us == kAutoSpin ? std::chrono::nanoseconds(kAwayPoll) : std::chrono::microseconds(us);
}

Status ChooseSlotBytes(size_t n, size_t requested, size_t* slot_bytes) {
  if (n == 0) return Status::InvalidArgument("flexlink: cross-process group: no ranks");
  const size_t most = kMaxDataBytes / (2 * (n + 1)) / 4096 * 4096;
  if (most < kMinSlotBytes)
    return Status::InvalidArgument("flexlink: cross-process group of " + std::to_string(n) +
                                   " ranks: too many for a 256 MiB segment with 64 KiB slots");
  size_t want = requested ? requested : XprocSlotBytesOr(kCpuSlotBytes);
  want = std::clamp(want, kMinSlotBytes, most);
  *slot_bytes = want / 4096 * 4096;
  return Status::Ok();
}

ProcessGroup::ProcessGroup(std::unique_ptr<Segment> segment, std::span<const int64_t> devices,
                           std::span<const int64_t> local_devices)
    : segment_(std::move(segment)),
      header_(reinterpret_cast<Header*>(segment_->data())),
      devices_(devices.begin(), devices.end()),
      local_(local_devices.begin(), local_devices.end()),
      calls_(new std::atomic<uint64_t>[devices.size()]),
      stragglers_(devices),
      direct_state_(new std::atomic<uint32_t>[devices.size()]),
      direct_from_(new std::atomic<uint64_t>[devices.size()]),
      direct_reduce_from_(new std::atomic<uint64_t>[devices.size()]),
      direct_refusal_(devices.size()),
      direct_reduce_refusal_(devices.size()) {
  ranks_ = reinterpret_cast<RankBlock*>(segment_->data() + header_->ranks_offset);
  times_ = reinterpret_cast<TimesSlot*>(segment_->data() + header_->times_offset);
  profile_ = reinterpret_cast<ProfileTimes*>(segment_->data() + header_->profile_offset);
  data_ = segment_->data() + header_->data_offset;
  results_ = segment_->data() + header_->results_offset;
  for (size_t r = 0; r < devices_.size(); ++r) {
    calls_[r].store(0);
    direct_state_[r].store(kDirectUnknown);
    direct_from_[r].store(UINT64_MAX);
    direct_reduce_from_[r].store(UINT64_MAX);
  }
}

Status ProcessGroup::Create(std::span<const int64_t> devices, std::span<const int64_t> local_devices,
                            size_t slot_bytes, int processes, std::unique_ptr<ProcessGroup>* out) {
  std::vector<char> local_rank;
  FLEXLINK_RETURN_IF_ERROR(CheckMembers(devices, local_devices, &local_rank));
  const uint32_t n = static_cast<uint32_t>(devices.size());
  if (processes != 0 && (processes < 2 || processes > static_cast<int>(n)))
    return Status::InvalidArgument("flexlink: cross-process group " + FormatIds(devices) + ": processes must be "
                                   "between 2 and the group's " + std::to_string(n) + " devices (0: not known), got " +
                                   std::to_string(processes));
  size_t slot = 0;
  FLEXLINK_RETURN_IF_ERROR(ChooseSlotBytes(n, slot_bytes, &slot));
  const Layout layout = ComputeLayout(n, slot);
  std::unique_ptr<Segment> segment;
  FLEXLINK_RETURN_IF_ERROR(Segment::Create(layout.total_bytes, &segment));
  // ftruncate zero-fills: counters, pids and the abort word start at 0.
  auto* h = reinterpret_cast<Header*>(segment->data());
  h->version = kLayoutVersion;
  h->n = n;
  h->slot_bytes = slot;
  h->slot_stride = layout.slot_stride;
  h->total_bytes = layout.total_bytes;
  h->devices_offset = layout.devices_offset;
  h->ranks_offset = layout.ranks_offset;
  h->times_offset = layout.times_offset;
  h->profile_offset = layout.profile_offset;
  h->data_offset = layout.data_offset;
  h->results_offset = layout.results_offset;
  h->creator_pid = static_cast<uint32_t>(getpid());
  h->processes = static_cast<uint32_t>(processes);
  std::memcpy(segment->data() + layout.devices_offset, devices.data(), n * sizeof(int64_t));
  auto* ranks = reinterpret_cast<RankBlock*>(segment->data() + layout.ranks_offset);
  for (uint32_t r = 0; r < n; ++r) {
    ranks[r].device = devices[r];
    ranks[r].process_index = -1;
    ranks[r].cpu.store(-1, std::memory_order_relaxed);
  }
  __atomic_store_n(&h->magic, kMagic, __ATOMIC_RELEASE);
  std::unique_ptr<ProcessGroup> g(new ProcessGroup(std::move(segment), devices, local_devices));
  g->local_rank_ = std::move(local_rank);
  Status s = g->Claim();
  if (!s.ok()) {
    (void)Segment::Unlink(g->name());
    return s;
  }
  *out = std::move(g);
  return Status::Ok();
}

Status ProcessGroup::Attach(const std::string& name, std::span<const int64_t> devices,
                            std::span<const int64_t> local_devices, std::unique_ptr<ProcessGroup>* out) {
  std::vector<char> local_rank;
  FLEXLINK_RETURN_IF_ERROR(CheckMembers(devices, local_devices, &local_rank));
  std::unique_ptr<Segment> segment;
  FLEXLINK_RETURN_IF_ERROR(Segment::Attach(name, &segment));
  const std::string what = "flexlink: cross-process segment " + name + ": ";
  if (segment->size() < sizeof(Header))
    return Status::FailedPrecondition(what + "too small (" + std::to_string(segment->size()) + " bytes) for a header");
  const auto* h = reinterpret_cast<const Header*>(segment->data());
  if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != kMagic)
    return Status::FailedPrecondition(what + "not a FlexLink group segment (bad magic), or not initialised yet");
  if (h->version != kLayoutVersion)
    return Status::FailedPrecondition(what + "layout version " + std::to_string(h->version) + ", this build has " +
                                      std::to_string(kLayoutVersion) + " (processes of different builds)");
  if (h->n != devices.size())
    return Status::InvalidArgument(what + "made for " + std::to_string(h->n) + " ranks, attached as a group of " +
                                   std::to_string(devices.size()) + " " + Ids(devices));
  // Offsets are recomputed, not trusted: a header that disagrees with the layout of its own n and
  // slot size is refused before anything is read through them.
  const Layout layout = ComputeLayout(h->n, h->slot_bytes);
  if (h->slot_bytes == 0 || h->slot_bytes % 4096 || layout.total_bytes != h->total_bytes ||
      layout.total_bytes > segment->size() || layout.devices_offset != h->devices_offset ||
      layout.ranks_offset != h->ranks_offset || layout.times_offset != h->times_offset ||
      layout.profile_offset != h->profile_offset ||
      layout.data_offset != h->data_offset ||
      layout.results_offset != h->results_offset ||
      layout.slot_stride != h->slot_stride)
    return Status::FailedPrecondition(what + "header inconsistent with its size");
  std::vector<int64_t> theirs(h->n);
  std::memcpy(theirs.data(), segment->data() + h->devices_offset, h->n * sizeof(int64_t));
  if (!std::equal(theirs.begin(), theirs.end(), devices.begin(), devices.end()))
    return Status::InvalidArgument(what + "made for devices " + Ids(theirs) + ", attached as " + Ids(devices) +
                                   " (every process must name the group's devices in the same rank order)");
  std::unique_ptr<ProcessGroup> g(new ProcessGroup(std::move(segment), devices, local_devices));
  g->local_rank_ = std::move(local_rank);
  FLEXLINK_RETURN_IF_ERROR(g->Claim());
  *out = std::move(g);
  return Status::Ok();
}

Status ProcessGroup::Claim() {
  const int32_t me = static_cast<int32_t>(getpid());
  for (size_t r = 0; r < devices_.size(); ++r) {
    if (!local_rank_[r]) continue;
    int32_t expected = 0;
    if (ranks_[r].pid.compare_exchange_strong(expected, me) || expected == me) continue;
    for (size_t q = 0; q < r; ++q)  // leave the segment as we found it
      if (local_rank_[q]) ranks_[q].pid.store(0);
    return Status::InvalidArgument("flexlink: cross-process segment " + name() + ": rank " + std::to_string(r) +
                                   " (device " + std::to_string(devices_[r]) + ") is already attached by pid " +
                                   std::to_string(expected) + (ProcessGone(expected) ? " (which has exited)" : ""));
  }
  return Status::Ok();
}

uint64_t ProcessGroup::calls() const {
  uint64_t most = 0;
  for (size_t r = 0; r < devices_.size(); ++r) most = std::max(most, calls_[r].load());
  return most;
}

std::optional<std::string> ProcessGroup::broken() const {
  if (!is_broken_.load(std::memory_order_acquire)) {
    if (header_->abort.load(std::memory_order_acquire) != kAbortSet) return std::nullopt;
    const_cast<ProcessGroup*>(this)->SetBroken(AbortReason());
  }
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

std::vector<int> ProcessGroup::Gone(bool closed_too) const {
  // One verdict per process, so that a process exiting during the scan is named with all its ranks
  // (checked rank by rank, its first ranks could pass as alive and its last as gone).
  std::vector<std::pair<int32_t, bool>> verdicts;
  std::vector<int> gone;
  for (int r = 0; r < size(); ++r) {
    if (is_local(r)) continue;
    if (closed_too && Closed(r)) {
      gone.push_back(r);
      continue;
    }
    const int32_t pid = ranks_[r].pid.load(std::memory_order_relaxed);
    auto it = std::find_if(verdicts.begin(), verdicts.end(), [&](const auto& v) { return v.first == pid; });
    if (it == verdicts.end()) it = verdicts.insert(verdicts.end(), {pid, ProcessGone(pid)});
    if (it->second) gone.push_back(r);
  }
  return gone;
}

std::string ProcessGroup::DescribeLeft(const std::vector<int>& ranks) const {
  std::string exited, closed;
  int n_closed = 0;
  std::vector<int32_t> pids;  // of the closed ranks
  for (int r : ranks) {
    const bool shut = Closed(r);
    std::string& to = shut ? closed : exited;
    to += (to.empty() ? "" : ", ") + RankName(r);
    if (!shut) continue;
    ++n_closed;
    const int32_t pid = ranks_[r].pid.load(std::memory_order_relaxed);
    if (std::find(pids.begin(), pids.end(), pid) == pids.end()) pids.push_back(pid);
  }
  std::string s;
  if (!exited.empty()) s = exited + " exited";
  if (!closed.empty())
    s += (s.empty() ? "" : ", and ") + closed + " left at the shutdown of FlexLink's GPU engine in " +
         (pids.size() > 1 ? "their processes" : n_closed > 1 ? "their process" : "its process");
  return s;
}

void ProcessGroup::Close() {
  for (int r = 0; r < size(); ++r)
    if (is_local(r)) Close(r);
}

void ProcessGroup::Close(int rank) {
  if (rank < 0 || rank >= size() || !is_local(rank) || ranks_[rank].closed.exchange(1, std::memory_order_acq_rel))
    return;
  // Waiters sleep on the counter of the rank they wait for, whichever it is.
  for (int r = 0; r < size(); ++r) FutexWakeAll(&ranks_[r].arrived);
}

std::string ProcessGroup::RankName(int rank) const {
  const int32_t pid = ranks_[rank].pid.load(std::memory_order_relaxed);
  return "rank " + std::to_string(rank) + " (device " + std::to_string(devices_[rank]) +
         (pid ? ", pid " + std::to_string(pid) : std::string(", not attached by any process yet")) + ")";
}

void ProcessGroup::SetBroken(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (is_broken_.load(std::memory_order_relaxed)) return;
  broken_ = reason;
  is_broken_.store(true, std::memory_order_release);
}

void ProcessGroup::Fail(int rank, const std::string& message) {
  uint32_t expected = kAbortNone;
  if (header_->abort.compare_exchange_strong(expected, kAbortWriting, std::memory_order_acq_rel)) {
    header_->abort_rank = rank;
    const size_t len = std::min(message.size(), kAbortMessageBytes - 1);
    std::memcpy(header_->abort_message, message.data(), len);
    header_->abort_message[len] = 0;
    header_->abort.store(kAbortSet, std::memory_order_release);
    SetBroken(message);
  }
  for (size_t r = 0; r < devices_.size(); ++r) FutexWakeAll(&ranks_[r].arrived);
}

std::string ProcessGroup::AbortReason() const {
  // Another process wrote these: the rank is range-checked and the message bounded, not trusted.
  const int r = header_->abort_rank;
  const std::string who = r >= 0 && r < size() ? "rank " + std::to_string(r) + " (device " + std::to_string(devices_[r]) + ")"
                                               : std::string("a rank");
  return who + " reported: " + std::string(header_->abort_message, strnlen(header_->abort_message, kAbortMessageBytes));
}

Status ProcessGroup::AbortError(const Where& where) {
  const std::string reason = AbortReason();
  SetBroken(reason);
  return Status::Internal(where() + ": " + reason);
}

Status ProcessGroup::WaitArrived(int rank, uint32_t target, const Where& where, int step_of_call) {
  const double timeout = TimeoutSeconds();
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + ClampedSeconds(timeout);
  // The first look at the peers' processes (a kill() and a read of /proc per missing rank, tens of
  // µs) after one slice: most waits end well before, and a peer that died is found within it.
  Clock::time_point next_liveness = start + kSlice;
  const int n = size();
  auto arrived = [&](int j) {
    return static_cast<int32_t>(ranks_[j].arrived.load(std::memory_order_acquire) - target) >= 0;
  };
  auto missing = [&] {
    std::vector<int> m;
    for (int j = 0; j < n; ++j)
      if (!arrived(j)) m.push_back(j);
    return m;
  };
  auto list = [&](const std::vector<int>& ranks) {
    std::string s;
    for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + RankName(ranks[i]);
    return s;
  };
  SpinBudget spin(spin_);  // the whole wait's spin, over all the ranks it waits for
  Clock::time_point poll_until{};  // the whole wait's away-poll likewise, from its first poll
  for (int k = 1; k <= n; ++k) {
    const int j = (rank + k) % n;  // own rank last: it has arrived already
    if (spin.Until([&] { return arrived(j); })) continue;
    for (int yields = 0;; ++yields) {
      const uint32_t seen = ranks_[j].arrived.load(std::memory_order_acquire);
      if (static_cast<int32_t>(seen - target) >= 0) break;
      if (spin_.count() <= 0 && yields < kYields) {
        sched_yield();
        continue;
      }
      if (header_->abort.load(std::memory_order_acquire) == kAbortSet) return AbortError(where);
      const Clock::time_point now = Clock::now();
      // Close() wakes this wait: a closed rank is looked at now, not at the next liveness tick.
      if (Closed(j)) next_liveness = std::min(next_liveness, now);
      if (now >= next_liveness) {
        next_liveness = now + kSlice;
        std::vector<int> gone;
        bool closed = false, all_closed = true;
        // Its arrival is read again after its process is seen gone or closed: this thread may have
        // been descheduled since missing() long enough for the rank to arrive, go on and exit (a
        // peer killed right after enqueuing its call, on a loaded machine), and that is no failure.
        for (int m : missing()) {
          const bool shut = Closed(m);
          if ((shut || ProcessGone(ranks_[m].pid.load(std::memory_order_relaxed))) && !arrived(m)) {
            gone.push_back(m);
            closed = closed || shut;
            all_closed = all_closed && shut;
          }
        }
        // Only closed ranks: a refusal, as the in-process engine's (CallContext::Refuse); an exit
        // is the group's failure.
        if (!gone.empty())
          return Status(all_closed ? StatusCode::kFailedPrecondition : StatusCode::kInternal,
                        where() + ": " + DescribeLeft(gone) + " before arriving at step " +
                                  std::to_string(step_of_call) + " of the call (" +
                                  (closed ? "a process whose GPU engine was shut down, by jax_flexlink.shutdown() or "
                                            "at its exit, takes no more calls"
                                          : "its process ended") +
                                  "; the group is broken, later calls on it fail at once)");
      }
      if (now >= deadline) {
        return Status::DeadlineExceeded(
            where() + ": timed out after " + FormatSeconds(timeout) + " s waiting for " + list(missing()) + " to arrive at step " +
            std::to_string(step_of_call) +
            " of the call (a device that never issues the matching collective, or issues collectives in a "
            "different order; the deadline is jax_flexlink's FLEXLINK_TIMEOUT_S / set_timeout)");
      }
      // A non-spinning group's rank whose awaited peer last arrived from another CPU polls for it,
      // yielding this CPU at each poll to whatever else wants it, for up to away_poll_ per wait:
      // the peer is then most likely running there, mid-call, and a futex sleep and wake-up costs
      // tens of µs on a VM (docs/xproc.md, "Waits, liveness, abort"). A peer that last ran on this
      // CPU needs it: sleep at once. The liveness, abort and deadline checks above run every poll.
      if (spin_.count() <= 0 && away_poll_.count() > 0) {
        if (poll_until == Clock::time_point{}) poll_until = now + away_poll_;
        if (now < poll_until && ranks_[j].cpu.load(std::memory_order_relaxed) != sched_getcpu()) {
          sched_yield();
          continue;
        }
      }
      // Counted as a sleeper before the futex re-checks the counter: either the arriving rank sees
      // the count and wakes it, or the futex sees the new value and does not sleep (Barrier).
      ranks_[j].sleepers.fetch_add(1, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      FutexWait(&ranks_[j].arrived, seen, std::min<Clock::duration>(kSlice, deadline - now));
      ranks_[j].sleepers.fetch_sub(1, std::memory_order_relaxed);
    }
  }
  return Status::Ok();
}

// XLA hands collectives fresh output buffers, and first-touching them costs more than the copy at
// large sizes (core/pages.h). Done while peers may still be staging, after this rank arrived: huge
// pages advised where outputs are big, then a locked `or 0` per page, which leaves the bytes as they
// are (a mismatched call still touches no output's contents). Each rank faults its own outputs; the
// in-process engine's sharing between ranks would need a per-call object shared by local ranks.
static void FaultInOutputs(const CallDesc& desc, int n) {
  thread_local std::vector<OutputRegion> regions;
  regions.clear();
  for (const Part& p : desc.parts)
    if (p.units) regions.push_back({p.out, desc.out_count(p, n) * p.width(), p.out == p.in});
  OutputFaults faults(1);
  if (faults.Publish(0, regions)) faults.Help(0);
  faults.Withdraw(0);
}

Status ProcessGroup::Barrier(int rank, uint32_t* step, const Where& where, int step_of_call, bool fault_outputs,
                             const CallDesc& desc) {
  RankBlock& mine = ranks_[rank];
  // `fault_outputs` marks the call's arrival (its first barrier): its time goes with it.
  const int parity = (*step + 1) & 1;
  if (fault_outputs)
    mine.arrived_ns[parity].store(std::chrono::steady_clock::now().time_since_epoch().count(),
                                  std::memory_order_relaxed);
  mine.cpu.store(sched_getcpu(), std::memory_order_relaxed);  // a hint for waiters: relaxed
  // Release: peers that see the new count see what this rank wrote for the barrier.
  mine.arrived.store(++*step, std::memory_order_release);
  // The wake is a system call: only when a peer sleeps on the counter (WaitArrived's fence pairs
  // with this one, so a sleeper that counted itself after this load sees the new value instead).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (mine.sleepers.load(std::memory_order_relaxed) > 0) FutexWakeAll(&mine.arrived);
  if (fault_outputs) FaultInOutputs(desc, size());
  Status s = WaitArrived(rank, *step, where, step_of_call);
  if (s.ok() && fault_outputs && rank == 0) RecordArrivalOrder(parity);
  if (!s.ok() && (s.code() != StatusCode::kInternal || header_->abort.load() != kAbortSet)) Fail(rank, s.message());
  return s;
}

void ProcessGroup::RecordArrivalOrder(int parity) {
  // n loads of lines WaitArrived has just read (each rank's counter shares its block's line).
  const int n = size();
  int last = 0;
  int64_t latest = std::numeric_limits<int64_t>::min(), previous = std::numeric_limits<int64_t>::min();
  for (int j = 0; j < n; ++j) {
    const int64_t t = ranks_[j].arrived_ns[parity].load(std::memory_order_relaxed);
    if (t > latest) {
      previous = latest;
      latest = t;
      last = j;
    } else if (t > previous) {
      previous = t;
    }
  }
  if (n > 1) stragglers_.RecordLast(last, static_cast<uint64_t>(std::max<int64_t>(0, latest - previous)));
}

std::string ProcessGroup::WhereText(std::string_view label, int64_t run_id, uint64_t call,
                                    const std::string& described) const {
  return ErrorPrefix(label) + described + " on group " + Ids(devices_) + " (link shm across processes, run " +
         std::to_string(run_id) + ", call " + std::to_string(call) + " on this group)";
}

Status ProcessGroup::CheckFingerprints(int buffer, std::string_view label, int64_t run_id, uint64_t call) const {
  // Every rank compares the same fingerprints, so all reach the same verdict at the same step and
  // the group stays in step after a mismatch (no rank touched an output).
  const int n = size();
  for (int j = 1; j < n; ++j) {
    if (SameFingerprint(Slot(buffer, 0), Slot(buffer, j))) continue;
    // Described from rank 0's side, so that every rank's message is the same.
    return Status::InvalidArgument(
        WhereText(label, run_id, call, DescribeFingerprint(Slot(buffer, 0))) + ": ranks disagree on the call: rank 0 (device " +
        std::to_string(devices_[0]) + ") has " + DescribeFingerprint(Slot(buffer, 0)) + ", rank " +
        std::to_string(j) + " (device " + std::to_string(devices_[j]) + ") has " +
        DescribeFingerprint(Slot(buffer, j)) +
        " (every device must call the collective with the same operands: number, shapes and dtypes, and "
        "the same reduction or pairs)");
  }
  return Status::Ok();
}

Status ProcessGroup::CheckSlotFits(const CallDesc& desc, const Where& where) const {
  const size_t slot = header_->slot_bytes;
  for (size_t i = 0; i < desc.parts.size(); ++i)
    if (StagedBytesPerUnit(desc, desc.parts[i], size()) > slot)
      return Status::InvalidArgument(where() + ": a unit of operand " + std::to_string(i) + " needs more than the " +
                                     std::to_string(slot) + "-byte slot");
  return Status::Ok();
}

Status ProcessGroup::Steps(int rank, const CallDesc& desc, StepCursor& cursor, const Where& where, bool first,
                           std::string_view label, int64_t run_id, uint64_t call) {
  const int n = size();
  thread_local std::vector<StepPiece> pieces;
  thread_local std::vector<const char*> slots;
  slots.resize(n);
  // Every rank makes the same choice from the same description.
  const bool two_phase = desc.kind == Kind::kAllReduce && n >= 3 && desc.InputBytes(n) >= XprocTwoPhaseBytes();
  // Only this rank's thread writes its counter, so its value is the number of barriers this rank has
  // entered. What is written for barrier k lives in buffer k & 1 (slots, results): it is read only
  // between barrier k and k + 1, and rewritten only for barrier k + 2, by a rank that passed k + 1,
  // i.e. after every rank arrived at k + 1 and so finished reading it.
  uint32_t step = ranks_[rank].arrived.load(std::memory_order_relaxed);
  for (int step_of_call = 0; cursor.Next(&pieces); ++step_of_call) {
    const int buffer = step & 1;
    char* own = Slot(buffer, rank);
    const bool check = first && step_of_call == 0;
    if (check) WriteFingerprint(desc, own);
    for (const StepPiece& piece : pieces) Stage(desc, n, rank, piece, own + kFingerprintBytes);
    FLEXLINK_RETURN_IF_ERROR(Barrier(rank, &step, where, step_of_call, check, desc));
    for (int j = 0; j < n; ++j) slots[j] = Slot(buffer, j) + kFingerprintBytes;
    if (check) FLEXLINK_RETURN_IF_ERROR(CheckFingerprints(buffer, label, run_id, call));
    if (!two_phase) {
      for (const StepPiece& piece : pieces) Compute(desc, n, rank, piece, slots.data());
      continue;
    }
    char* result = Result(step & 1);
    for (const StepPiece& piece : pieces) ReduceSlice(desc, n, rank, piece, slots.data(), result);
    FLEXLINK_RETURN_IF_ERROR(Barrier(rank, &step, where, step_of_call, false, desc));
    for (const StepPiece& piece : pieces) CopyResult(desc, n, piece, result);
  }
  return Status::Ok();
}

Status ProcessGroup::Run(int rank, const CallDesc& desc, std::string_view label, int64_t run_id) {
  const uint64_t call = calls_[rank].fetch_add(1, std::memory_order_relaxed) + 1;
  // Built only for a message: the label, the call, the group, the link, run and call number.
  const Where where = [&] { return WhereText(label, run_id, call, desc.Describe()); };
  if (auto reason = broken())
    return Status::FailedPrecondition(where() + ": the cross-process group is broken: " + *reason);
  FLEXLINK_RETURN_IF_ERROR(CheckSlotFits(desc, where));
  switch (UseDirect(rank, desc)) {
    case Direct::kGather:
      return RunDirectGather(rank, desc, where, label, run_id, call);
    case Direct::kReduce:
      return RunDirectReduce(rank, desc, where, label, run_id, call);
    case Direct::kNo:
      break;
  }
  StepCursor cursor(desc, size(), header_->slot_bytes);
  FLEXLINK_RETURN_IF_ERROR(Steps(rank, desc, cursor, where, true, label, run_id, call));
  // Every rank's first successful call here (a failed one fails on every rank alike) agrees once.
  if (direct_state_[rank].load(std::memory_order_relaxed) == kDirectUnknown) return AgreeDirect(rank, desc, where);
  return Status::Ok();
}

Status ProcessGroup::Arrive(int rank, const CallDesc& desc, std::string_view label, int64_t run_id) {
  const uint64_t call = calls_[rank].fetch_add(1, std::memory_order_relaxed) + 1;
  const Where where = [&] { return WhereText(label, run_id, call, desc.Describe()); };
  if (auto reason = broken())
    return Status::FailedPrecondition(where() + ": the cross-process group is broken: " + *reason);
  // Checked before the barrier, from the description alone: every rank reaches the same verdict.
  FLEXLINK_RETURN_IF_ERROR(CheckSlotFits(desc, where));
  uint32_t step = ranks_[rank].arrived.load(std::memory_order_relaxed);
  const int buffer = step & 1;
  WriteFingerprint(desc, Slot(buffer, rank));
  FLEXLINK_RETURN_IF_ERROR(Barrier(rank, &step, where, 0, true, desc));
  return CheckFingerprints(buffer, label, run_id, call);
}

Status ProcessGroup::RunPieces(int rank, const CallDesc& desc, std::span<const Piece> pieces, std::string_view label,
                               int64_t run_id) {
  const uint64_t call = calls_[rank].load(std::memory_order_relaxed);
  const Where where = [&] { return WhereText(label, run_id, call, desc.Describe()); };
  StepCursor cursor(desc, size(), header_->slot_bytes, pieces);
  return Steps(rank, desc, cursor, where, false, label, run_id, call);
}

Status ProcessGroup::Sync(int rank, const CallDesc& desc, std::string_view label, int64_t run_id) {
  const uint64_t call = calls_[rank].load(std::memory_order_relaxed);
  const Where where = [&] { return WhereText(label, run_id, call, desc.Describe()) + " (failover agreement)"; };
  uint32_t step = ranks_[rank].arrived.load(std::memory_order_relaxed);
  return Barrier(rank, &step, where, 0, false, desc);
}

// The GPU engine's hooks (process_group.h): the same barrier, fingerprint check, liveness and abort,
// with a message that names the GPU group's link instead of the segment's shm.
Status ProcessGroup::ArriveWithoutData(int rank, const CallDesc& desc, std::string_view label, int64_t run_id,
                                       std::string_view link) {
  const uint64_t call = calls_[rank].fetch_add(1, std::memory_order_relaxed) + 1;
  const Where where = [&] {
    return ErrorPrefix(label) + desc.Describe() + " on group " + Ids(devices_) + " (" + std::string(link) +
           ", run " + std::to_string(run_id) + ", call " + std::to_string(call) + " on this group)";
  };
  if (auto reason = broken())
    return Status::FailedPrecondition(where() + ": the cross-process group is broken: " + *reason);
  uint32_t step = ranks_[rank].arrived.load(std::memory_order_relaxed);
  const int buffer = step & 1;
  WriteFingerprint(desc, Slot(buffer, rank));
  FLEXLINK_RETURN_IF_ERROR(Barrier(rank, &step, where, 0, false, desc));
  return CheckFingerprints(buffer, label, run_id, call);
}

Status ProcessGroup::SyncWithoutData(int rank, const CallDesc& desc, std::string_view label, int64_t run_id,
                                     std::string_view link, std::string_view what) {
  const uint64_t call = calls_[rank].load(std::memory_order_relaxed);
  const Where where = [&] {
    return ErrorPrefix(label) + desc.Describe() + " on group " + Ids(devices_) + " (" + std::string(link) +
           ", run " + std::to_string(run_id) + ", call " + std::to_string(call) + " on this group; " +
           std::string(what) + ")";
  };
  if (auto reason = broken())
    return Status::FailedPrecondition(where() + ": the cross-process group is broken: " + *reason);
  uint32_t step = ranks_[rank].arrived.load(std::memory_order_relaxed);
  return Barrier(rank, &step, where, 0, false, desc);
}

}  // namespace flexlink::xproc
