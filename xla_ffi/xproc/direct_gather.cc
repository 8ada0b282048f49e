// Direct all_gather across processes (docs/xproc.md, "Direct all_gather"): each rank copies every
// peer's input straight from the peer's memory into its own output (process_vm_readv), one copy per
// output byte instead of the segment's two (staging, then the copy out). Also the group's agreement
// on reading peers' memory at all, which direct all_reduce (direct_reduce.cc) shares.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "xla_ffi/core/config.h"
#include "xla_ffi/links/shm_copy.h"
#include "xla_ffi/links/shm_ops.h"
#include "xla_ffi/xproc/fingerprint.h"
#include "xla_ffi/xproc/peer_read.h"
#include "xla_ffi/xproc/process_group.h"

namespace flexlink::xproc {
namespace {

// Above this many input bytes per rank the staged path wins again: its copy out writes the output
// with streaming stores, the kernel's copy does not (xproc_test --bench reused, 2 processes, ms per
// call staged / direct: 2 MiB 0.447 / 0.260-0.305, 8 MiB 1.81-1.84 / 1.44-1.81, 16 MiB 3.66-3.70 /
// 4.19-4.53, 64 MiB 14.7-14.8 / 17.4-18.5).
constexpr uint64_t kDirectMaxBytes = uint64_t{8} << 20;

uint32_t ThresholdKib(uint64_t bytes) {
  if (bytes == UINT64_MAX) return UINT32_MAX;
  return static_cast<uint32_t>(std::min<uint64_t>((bytes + 1023) / 1024, UINT32_MAX - 1));
}

}  // namespace

std::optional<uint64_t> ProcessGroup::direct_from(int rank, Kind kind) const {
  const uint32_t state = direct_state_[rank].load(std::memory_order_acquire);
  if (state == kDirectUnknown) return std::nullopt;
  if (state != kDirectYes) return UINT64_MAX;
  return (kind == Kind::kAllReduce ? direct_reduce_from_ : direct_from_)[rank].load(std::memory_order_relaxed);
}

std::string ProcessGroup::direct_refusal(int rank, Kind kind) const {
  // Written by the rank's thread before its state is published (acquire above, release below).
  if (direct_state_[rank].load(std::memory_order_acquire) == kDirectUnknown) return std::string();
  return kind == Kind::kAllReduce ? direct_reduce_refusal_[rank] : direct_refusal_[rank];
}

Status ProcessGroup::AgreeDirect(int rank, const CallDesc& desc, const Where& where) {
  const int n = size();
  const int32_t me = static_cast<int32_t>(getpid());
  // Written for the next barrier into this rank's slot of its parity (Steps' convention).
  uint32_t step = ranks_[rank].arrived.load(std::memory_order_relaxed);
  const uint64_t canary = CanaryAddress();
  std::memcpy(Slot(step & 1, rank) + kFingerprintBytes, &canary, sizeof canary);
  const int buffer = step & 1;
  FLEXLINK_RETURN_IF_ERROR(Barrier(rank, &step, where, 0, false, desc));
  std::string refusal;
  const uint32_t kib = ThresholdKib(XprocDirectBytes()), reduce_kib = ThresholdKib(XprocDirectReduceBytes());
  // A process with both kinds off never reads its peers (not even the canary).
  auto both_off = [this](int j) {
    return "FLEXLINK_XPROC_DIRECT_BYTES and FLEXLINK_XPROC_DIRECT_REDUCE_BYTES are off in " + RankName(j) +
           "'s process";
  };
  if (kib == UINT32_MAX && reduce_kib == UINT32_MAX) refusal = both_off(rank);
  for (int j = 0; j < n && refusal.empty(); ++j) {
    const int32_t pid = ranks_[j].pid.load(std::memory_order_relaxed);
    if (pid == me) continue;  // same address space: plain copies
    uint64_t address = 0;
    std::memcpy(&address, Slot(buffer, j) + kFingerprintBytes, sizeof address);
    std::string why;
    if (!CanReadPeer(pid, address, &why)) refusal = RankName(rank) + " cannot read " + RankName(j) + "'s memory: " + why;
  }
  ranks_[rank].direct_kib = kib;
  ranks_[rank].direct_reduce_kib = reduce_kib;
  ranks_[rank].direct.store(refusal.empty() ? kDirectYes : kDirectNo, std::memory_order_relaxed);
  FLEXLINK_RETURN_IF_ERROR(Barrier(rank, &step, where, 0, false, desc));
  // Every rank takes the same decision from the same rank blocks; the reasons name the first rank
  // that stands in the way, as every rank sees it (this rank's own words where it is that rank).
  std::string cannot;
  for (int j = 0; j < n && cannot.empty(); ++j)
    if (ranks_[j].direct.load(std::memory_order_relaxed) != kDirectYes)
      cannot = j == rank ? refusal
               : ranks_[j].direct_kib == UINT32_MAX && ranks_[j].direct_reduce_kib == UINT32_MAX
                   ? both_off(j)
                   : RankName(j) + " cannot read every peer's memory (its process says why)";
  // A kind some process has off is off for the group (UINT32_MAX KiB: never).
  auto agree = [&](uint32_t RankBlock::*field, const char* variable, std::atomic<uint64_t>* from, std::string* why) {
    uint32_t most = 0;
    for (int j = 0; j < n; ++j) most = std::max(most, ranks_[j].*field);
    *why = cannot;
    for (int j = 0; j < n && why->empty(); ++j)
      if (ranks_[j].*field == UINT32_MAX) *why = std::string(variable) + " is off in " + RankName(j) + "'s process";
    from->store(why->empty() ? uint64_t{most} * 1024 : UINT64_MAX, std::memory_order_relaxed);
  };
  agree(&RankBlock::direct_kib, "FLEXLINK_XPROC_DIRECT_BYTES", &direct_from_[rank], &direct_refusal_[rank]);
  agree(&RankBlock::direct_reduce_kib, "FLEXLINK_XPROC_DIRECT_REDUCE_BYTES", &direct_reduce_from_[rank],
        &direct_reduce_refusal_[rank]);
  direct_state_[rank].store(cannot.empty() ? kDirectYes : kDirectNo, std::memory_order_release);
  return Status::Ok();
}

ProcessGroup::Direct ProcessGroup::UseDirect(int rank, const CallDesc& desc) const {
  if (direct_state_[rank].load(std::memory_order_relaxed) != kDirectYes) return Direct::kNo;
  // Every part's input and output addresses go into the slot after the fingerprint.
  if (desc.parts.size() * 2 * sizeof(uint64_t) > header_->slot_bytes) return Direct::kNo;
  const uint64_t bytes = desc.InputBytes(size());
  switch (desc.kind) {
    case Kind::kAllGather:
      return bytes >= direct_from_[rank].load(std::memory_order_relaxed) && bytes <= kDirectMaxBytes ? Direct::kGather
                                                                                                      : Direct::kNo;
    case Kind::kAllReduce:
      return bytes >= direct_reduce_from_[rank].load(std::memory_order_relaxed) ? Direct::kReduce : Direct::kNo;
    default:
      return Direct::kNo;
  }
}

Status ProcessGroup::PeerReadFailed(int rank, const Where& where, int peer, const std::string& what,
                                    const std::string& why) {
  const std::string message = where() + ": reading " + RankName(peer) + "'s " + what + " directly failed (" + why +
                              "; the group is broken, later calls on it fail at once)";
  Fail(rank, message);
  return Status::Internal(message);
}

Status ProcessGroup::ArriveDirect(int rank, const CallDesc& desc, const Where& where, std::string_view label,
                                  int64_t run_id, uint64_t call, uint32_t* step, int* buffer) {
  *step = ranks_[rank].arrived.load(std::memory_order_relaxed);
  *buffer = *step & 1;
  char* own = Slot(*buffer, rank);
  WriteFingerprint(desc, own);
  for (size_t p = 0; p < desc.parts.size(); ++p) {
    const uint64_t addresses[2] = {reinterpret_cast<uintptr_t>(desc.parts[p].in),
                                   reinterpret_cast<uintptr_t>(desc.parts[p].out)};
    std::memcpy(own + kFingerprintBytes + p * sizeof addresses, addresses, sizeof addresses);
  }
  FLEXLINK_RETURN_IF_ERROR(Barrier(rank, step, where, 0, true, desc));
  return CheckFingerprints(*buffer, label, run_id, call);
}

uint64_t ProcessGroup::PeerAddress(int buffer, int rank, size_t part, bool output) const {
  uint64_t address = 0;
  std::memcpy(&address, Slot(buffer, rank) + kFingerprintBytes + (2 * part + (output ? 1 : 0)) * sizeof address,
              sizeof address);
  return address;
}

Status ProcessGroup::RunDirectGather(int rank, const CallDesc& desc, const Where& where, std::string_view label,
                                     int64_t run_id, uint64_t call) {
  const int n = size();
  const int32_t me = static_cast<int32_t>(getpid());
  uint32_t step = 0;
  int buffer = 0;
  FLEXLINK_RETURN_IF_ERROR(ArriveDirect(rank, desc, where, label, run_id, call, &step, &buffer));
  thread_local std::vector<LocalRun> runs;
  for (size_t p = 0; p < desc.parts.size(); ++p) {
    const Part& part = desc.parts[p];
    if (part.units == 0) continue;
    const size_t w = part.width(), row = part.inner * w;
    char* out = static_cast<char*>(part.out);
    const bool stream = shm::StreamSeparate(part.in, part.out, desc.out_count(part, n) * w);
    // Starting after this rank spreads the ranks' reads over different peers.
    for (int k = 1; k <= n; ++k) {
      const int j = (rank + k) % n;
      const uint64_t address = PeerAddress(buffer, j, p, false);
      const int32_t pid = ranks_[j].pid.load(std::memory_order_relaxed);
      if (pid == me) {  // this process's rank: its input is in this address space
        shm::CopyUnits(shm::Rows{out + j * row, n * part.inner},
                       shm::ConstRows{reinterpret_cast<const char*>(address), part.inner}, part.inner, w,
                       UnitRange{0, part.units}, stream);
        continue;
      }
      // Rank j's block of every row of the [outer, n, inner] output, in the order its input holds them.
      runs.clear();
      for (size_t o = 0; o < part.outer; ++o) runs.push_back({out + (o * n + j) * row, row});
      std::string why;
      if (!ReadPeer(pid, address, runs, part.units * w, &why)) return PeerReadFailed(rank, where, j, "input", why);
    }
  }
  // Every rank has read every input: only now may a rank return and XLA reuse its input.
  return Barrier(rank, &step, where, 1, false, desc);
}

}  // namespace flexlink::xproc
