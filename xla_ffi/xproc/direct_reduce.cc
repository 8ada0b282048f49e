// Direct all_reduce across processes (docs/xproc.md, "Direct all_reduce"): a reduce-scatter that
// reads the peers' inputs where they are, then an all-gather that reads the reduced slices from
// their owners' outputs. Per rank about (3n - 1)/n · N bytes of memory traffic (where a peer's chunk
// stays in cache between its read and the reduction) instead of the staged (n + 3)·N; nothing passes
// through the segment.
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "xla_ffi/core/reduce.h"
#include "xla_ffi/links/shm_copy.h"
#include "xla_ffi/links/shm_ops.h"
#include "xla_ffi/xproc/peer_read.h"
#include "xla_ffi/xproc/process_group.h"
#include "xla_ffi/xproc/steps.h"

namespace flexlink::xproc {
namespace {

// Bytes of one peer's chunk per read. Larger chunks won at every size measured here: the kernel's
// fixed cost per call (a system call, then pinning the peer's pages 16 at a time) outweighs the
// scratch outgrowing L2 (xproc_test --bench reused, direct, ms per call with 32 KiB / 128 KiB / 1 MiB
// chunks: 2 processes 1 MiB 0.238 / 0.209 / 0.167, 16 MiB 5.60 / 4.81 / 3.90; 4 processes 1 MiB
// 0.585 / 0.540 / 0.461).
constexpr size_t kChunkBytes = size_t{1} << 20;

}  // namespace

Status ProcessGroup::RunDirectReduce(int rank, const CallDesc& desc, const Where& where, std::string_view label,
                                     int64_t run_id, uint64_t call) {
  const int n = size();
  const int32_t me = static_cast<int32_t>(getpid());
  uint32_t step = 0;
  int buffer = 0;
  FLEXLINK_RETURN_IF_ERROR(ArriveDirect(rank, desc, where, label, run_id, call, &step, &buffer));

  // Phase 1: this rank's slice of every part, over every rank's input in rank order (the order every
  // link reduces in), chunk by chunk. A peer in this process is read in place; another process's
  // chunk is copied into the scratch first.
  thread_local std::vector<char> scratch;
  thread_local std::vector<const void*> srcs;
  scratch.resize(static_cast<size_t>(n) * kChunkBytes + 64);
  srcs.resize(n);
  char* const scratch_base = scratch.data() + (64 - reinterpret_cast<uintptr_t>(scratch.data()) % 64) % 64;
  for (size_t p = 0; p < desc.parts.size(); ++p) {
    const Part& part = desc.parts[p];
    const size_t w = part.width();
    const UnitRange slice = Slice(part.units, n, rank, w);
    if (slice.empty()) continue;
    char* out = static_cast<char*>(part.out);
    const ReduceToKernel reduce = GetReduceToKernel(part.dtype, desc.op);
    // The reduced slice is read next by the peers, not by this rank: streamed past the cache where
    // the output is a buffer of its own (in place, its lines were just read).
    const uint8_t stream = shm::StreamSeparate(part.in, part.out, part.units * w) ? 1 : 0;
    const size_t chunk_units = std::max<size_t>(1, kChunkBytes / w);
    for (size_t begin = slice.begin; begin < slice.end; begin += chunk_units) {
      const size_t units = std::min(chunk_units, slice.end - begin), bytes = units * w;
      for (int j = 0; j < n; ++j) {
        const uint64_t address = PeerAddress(buffer, j, p, false) + begin * w;
        const int32_t pid = ranks_[j].pid.load(std::memory_order_relaxed);
        if (pid == me) {
          srcs[j] = reinterpret_cast<const void*>(address);
          continue;
        }
        char* to = scratch_base + static_cast<size_t>(j) * kChunkBytes;
        const LocalRun run{to, bytes};
        std::string why;
        if (!ReadPeer(pid, address, {&run, 1}, bytes, &why)) return PeerReadFailed(rank, where, j, "input", why);
        srcs[j] = to;
      }
      void* dst = out + begin * w;
      reduce(srcs.data(), n, &dst, 1, units, &stream);
    }
  }
  // Every slice is reduced (and no rank reads an input any more).
  FLEXLINK_RETURN_IF_ERROR(Barrier(rank, &step, where, 1, false, desc));

  // Phase 2: every other rank's slice from its output, starting after this rank (spreads the reads
  // over different owners).
  for (size_t p = 0; p < desc.parts.size(); ++p) {
    const Part& part = desc.parts[p];
    const size_t w = part.width();
    char* out = static_cast<char*>(part.out);
    const bool stream = shm::StreamSeparate(part.in, part.out, part.units * w);
    for (int k = 1; k < n; ++k) {
      const int j = (rank + k) % n;
      const UnitRange slice = Slice(part.units, n, j, w);
      if (slice.empty()) continue;
      const uint64_t address = PeerAddress(buffer, j, p, true) + slice.begin * w;
      const size_t bytes = slice.size() * w;
      const int32_t pid = ranks_[j].pid.load(std::memory_order_relaxed);
      if (pid == me) {
        shm::CopyOut(out + slice.begin * w, reinterpret_cast<const char*>(address), bytes, stream);
        continue;
      }
      const LocalRun run{out + slice.begin * w, bytes};
      std::string why;
      if (!ReadPeer(pid, address, {&run, 1}, bytes, &why)) return PeerReadFailed(rank, where, j, "output", why);
    }
  }
  // Every rank has read every slice: only now may a rank return and XLA reuse its buffers.
  return Barrier(rank, &step, where, 2, false, desc);
}

}  // namespace flexlink::xproc
