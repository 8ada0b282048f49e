// Direct all_gather across processes (docs/xproc.md, "Direct all_gather"): each rank copies every
// peer's input straight from the peer's memory into its own output (process_vm_readv), one copy per
// output byte instead of the segment's two (staging, then the copy out).
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

uint32_t ThresholdKib() {
  const uint64_t bytes = XprocDirectBytes();
  if (bytes == UINT64_MAX) return UINT32_MAX;
  return static_cast<uint32_t>(std::min<uint64_t>((bytes + 1023) / 1024, UINT32_MAX - 1));
}

}  // namespace

std::optional<uint64_t> ProcessGroup::direct_from(int rank) const {
  const uint32_t state = direct_state_[rank].load(std::memory_order_acquire);
  if (state == kDirectUnknown) return std::nullopt;
  return state == kDirectYes ? direct_from_[rank].load(std::memory_order_relaxed) : UINT64_MAX;
}

std::string ProcessGroup::direct_refusal(int rank) const {
  // Written by the rank's thread before its state is published (acquire above, release below).
  return direct_state_[rank].load(std::memory_order_acquire) == kDirectUnknown ? std::string()
                                                                               : direct_refusal_[rank];
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
  const uint32_t kib = ThresholdKib();
  if (kib == UINT32_MAX) refusal = "FLEXLINK_XPROC_DIRECT_BYTES is off in this process";
  for (int j = 0; j < n && refusal.empty(); ++j) {
    const int32_t pid = ranks_[j].pid.load(std::memory_order_relaxed);
    if (pid == me) continue;  // same address space: plain copies
    uint64_t address = 0;
    std::memcpy(&address, Slot(buffer, j) + kFingerprintBytes, sizeof address);
    std::string why;
    if (!CanReadPeer(pid, address, &why)) refusal = "cannot read " + RankName(j) + "'s memory: " + why;
  }
  direct_refusal_[rank] = refusal;
  ranks_[rank].direct_kib = kib;
  ranks_[rank].direct.store(refusal.empty() ? kDirectYes : kDirectNo, std::memory_order_relaxed);
  FLEXLINK_RETURN_IF_ERROR(Barrier(rank, &step, where, 0, false, desc));
  bool all = true;
  uint32_t most = 0;
  for (int j = 0; j < n; ++j) {
    all = all && ranks_[j].direct.load(std::memory_order_relaxed) == kDirectYes;
    most = std::max(most, ranks_[j].direct_kib);
  }
  direct_from_[rank].store(uint64_t{most} * 1024, std::memory_order_relaxed);
  direct_state_[rank].store(all && most != UINT32_MAX ? kDirectYes : kDirectNo, std::memory_order_release);
  return Status::Ok();
}

bool ProcessGroup::UseDirect(int rank, const CallDesc& desc) const {
  if (desc.kind != Kind::kAllGather || direct_state_[rank].load(std::memory_order_relaxed) != kDirectYes) return false;
  // The input addresses, one per part, go into the slot after the fingerprint.
  if (desc.parts.size() * sizeof(uint64_t) > header_->slot_bytes) return false;
  const uint64_t bytes = desc.InputBytes(size());
  return bytes >= direct_from_[rank].load(std::memory_order_relaxed) && bytes <= kDirectMaxBytes;
}

Status ProcessGroup::RunDirectGather(int rank, const CallDesc& desc, const Where& where, std::string_view label,
                                     int64_t run_id, uint64_t call) {
  const int n = size();
  const int32_t me = static_cast<int32_t>(getpid());
  uint32_t step = ranks_[rank].arrived.load(std::memory_order_relaxed);
  const int buffer = step & 1;
  char* own = Slot(buffer, rank);
  WriteFingerprint(desc, own);
  for (size_t p = 0; p < desc.parts.size(); ++p) {
    const uint64_t address = reinterpret_cast<uintptr_t>(desc.parts[p].in);
    std::memcpy(own + kFingerprintBytes + p * sizeof address, &address, sizeof address);
  }
  FLEXLINK_RETURN_IF_ERROR(Barrier(rank, &step, where, 0, true, desc));
  FLEXLINK_RETURN_IF_ERROR(CheckFingerprints(buffer, label, run_id, call));
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
      uint64_t address = 0;
      std::memcpy(&address, Slot(buffer, j) + kFingerprintBytes + p * sizeof address, sizeof address);
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
      if (!ReadPeer(pid, address, runs, part.units * w, &why)) {
        const std::string message = where() + ": reading " + RankName(j) + "'s input directly failed (" + why +
                                    "; the group is broken, later calls on it fail at once)";
        Fail(rank, message);
        return Status::Internal(message);
      }
    }
  }
  // Every rank has read every input: only now may a rank return and XLA reuse its input.
  return Barrier(rank, &step, where, 1, false, desc);
}

}  // namespace flexlink::xproc
