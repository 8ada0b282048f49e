#include "xla_ffi/core/pages.h"

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "xla_ffi/core/config.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace flexlink {
namespace {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
// Below this a buffer holds at most one whole huge page; not worth a system call. Which outputs get
// huge pages was measured three ways through XLA (docs/engine.md, "Output pages"): every output of
// 4 MiB+ that is not fully resident (this), only nearly fresh mappings, only 32 MiB+ (always fresh
// mmaps). This one gave the fastest typical call in full benchmark runs (lowest median speedup per
// run 1.05-1.10 in three runs, but 0.41 in a fourth; the others 0.53-1.07 and 0.82-1.02). Its cost on
// this VM: some huge pages must be backed by the hypervisor again (~6 ms per 2 MiB instead of ~0.2);
// shared faulting (OutputFaults) spreads those over all ranks, and with it a governor that turned
// huge pages off for a while after a slow output only cost speed (docs/engine.md).
constexpr size_t kHugeMinBytes = size_t{4} << 20;
// Below this the output is written before faults could matter (and staged calls never touch peers').
constexpr size_t kPrefaultMinBytes = size_t{64} << 10;
constexpr uintptr_t kPage = 4096;

// Which 4 KiB pages of [p, p + bytes) are resident. A recycled buffer usually is whole; a fresh
// mapping has none; and a chunk from a glibc arena whose heap was trimmed (MADV_DONTNEED on its free
// middle) keeps its first and last pages but lost the ones between: at 16 MiB per rank through XLA
// that was 4000+ faults per call behind resident ends, so the ends alone do not tell. One mincore
// over the range (a byte per page in a thread_local vector) costs a page-table walk, ~1 us per MiB.
class Residency {
 public:
  Residency(void* p, size_t bytes) {
    first_ = reinterpret_cast<uintptr_t>(p) & ~(kPage - 1);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes + kPage - 1) & ~(kPage - 1);
    thread_local std::vector<unsigned char> vec;
    vec.resize((end - first_) / kPage);
    map_ = &vec;
#if defined(__linux__)
    known_ = mincore(reinterpret_cast<void*>(first_), end - first_, vec.data()) == 0;
#endif
  }
  // Pages of [a, b) (inside the range) that are not resident; all of them when mincore failed.
  size_t Missing(uintptr_t a, uintptr_t b) const {
    if (a >= b) return 0;
    const size_t i0 = (a - first_) / kPage, i1 = (b - 1 - first_) / kPage + 1;
    if (!known_) return i1 - i0;
    size_t missing = 0;
    for (size_t i = i0; i < i1; ++i) missing += !((*map_)[i] & 1);
    return missing;
  }

 private:
  uintptr_t first_ = 0;
  const std::vector<unsigned char>* map_ = nullptr;
  bool known_ = false;
};

// Faults in [p, p + bytes) in one system call (Linux 5.14+): the kernel allocates and zeroes the pages
// in a loop instead of taking one fault exception per 4 KiB page. False where unsupported.
bool PopulateWrite(void* p, size_t bytes) {
#if defined(__linux__)
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE, also where libc headers predate it
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kPage - 1) & ~(kPage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kPage - 1);
  if (end <= begin) return false;
  return madvise(reinterpret_cast<void*>(begin), end - begin, kPopulateWrite) == 0;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

}  // namespace

struct OutputFaults::Slot {
  uintptr_t blocks_begin = 0;  // 2 MiB-aligned
  size_t blocks = 0;
  bool huge = false;
  std::atomic<bool> published{false};
  std::atomic<size_t> next{0};  // the next unclaimed block
  std::atomic<int> active{0};   // helpers between claiming and finishing a block

  // Published, with blocks nobody has claimed yet.
  bool Open() const {
    return published.load(std::memory_order_acquire) && next.load(std::memory_order_relaxed) < blocks;
  }
};

namespace {
constexpr size_t kWithdrawn = SIZE_MAX / 2;  // `next` past every block, far from overflow

// Faults the page at `a` in for writing without changing its bytes (see OutputFaults).
inline void TouchPage(uintptr_t a) {
  __atomic_fetch_or(reinterpret_cast<char*>(a), char{0}, __ATOMIC_RELAXED);
}

void TouchRange(uintptr_t begin, uintptr_t end) {
  if (begin >= end) return;
  TouchPage(begin);  // a partial first page
  for (uintptr_t a = (begin + kPage) & ~(kPage - 1); a < end; a += kPage) TouchPage(a);
}

// Makes the 2 MiB-aligned huge page at `region` resident as one huge page, copying the few small
// pages already there (MADV_COLLAPSE, Linux 6.1+; it preserves every byte, also of neighbours that
// share the huge page, as khugepaged does). False where it is unsupported or fails.
bool Collapse(uintptr_t region) {
#if defined(__linux__)
  constexpr int kCollapse = 25;  // MADV_COLLAPSE, also where libc headers predate it
  return madvise(reinterpret_cast<void*>(region), kHugePage, kCollapse) == 0;
#else
  (void)region;
  return false;
#endif
}

// An output's partial huge page at either end, [a, b), by its owner. XLA's outputs start just past a
// 2 MiB boundary (a malloc chunk header before them), so the head is nearly 2 MiB that whole blocks
// miss, in small pages: touching them cost the owner 0.8-7.6 ms per call at 8-16 MiB all_gather
// outputs (512 faults, each rank alone, before its blocks were offered). The huge page cannot be
// faulted in whole, because the chunk header's page already sits in it; one MADV_COLLAPSE makes it a
// huge page (alone: 0.09-0.11 ms vs 0.6-0.9 ms for 511 touches; through XLA median 0.2-0.3 ms, a
// tenth 4-5 ms, as block faults that draw a cold huge page take). All_gather out of place, 10
// alternating pairs of processes, median of the per-run FlexLink medians with vs without: 8 MiB 3.5
// vs 4.3 ms, 16 MiB 7.3 vs 8.6 ms. Below kCollapseMinPages missing pages touching is cheaper. True
// when collapsed.
constexpr size_t kCollapseMinPages = 64;

bool FaultEnd(uintptr_t a, uintptr_t b, size_t missing_pages, bool huge) {
  if (a >= b || missing_pages == 0) return false;
  if (huge && missing_pages >= kCollapseMinPages && Collapse(a & ~(kHugePage - 1))) return true;
  TouchRange(a, b);
  return false;
}
}  // namespace

OutputFaults::OutputFaults(int ranks)
    : n_(ranks),
      ranks_(new RankSlots[static_cast<size_t>(ranks)]),
      faulted_(new std::atomic<size_t>[static_cast<size_t>(ranks)]()),
      collapsed_(new size_t[static_cast<size_t>(ranks)]()) {}
OutputFaults::~OutputFaults() = default;

bool OutputFaults::Publish(int rank, std::span<const OutputRegion> outputs) {
  size_t candidates = 0;
  for (const OutputRegion& r : outputs) candidates += !r.aliases_input && r.bytes >= kPrefaultMinBytes;
  if (candidates == 0) return false;
  RankSlots& mine = ranks_[rank];
  mine.slots.reset(new Slot[candidates]);
  // Counted before they are prepared: helpers may start on the first while the owner prepares the
  // next (each slot opens on its own `published`).
  mine.count.store(candidates, std::memory_order_release);
  bool offered = false;
  size_t i = 0;
  for (const OutputRegion& r : outputs)
    if (!r.aliases_input && r.bytes >= kPrefaultMinBytes) offered |= Prepare(rank, mine.slots[i++], r);
  return offered;
}

bool OutputFaults::Prepare(int rank, Slot& slot, const OutputRegion& region) {
  void* const out = region.out;
  const size_t bytes = region.bytes;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(out), end = begin + bytes;
  const Residency resident(out, bytes);
  if (resident.Missing(begin, end) == 0) return false;
  const uintptr_t blocks_begin = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t blocks_end = std::max(blocks_begin, end & ~(kHugePage - 1));
  slot.blocks_begin = blocks_begin;
  slot.blocks = (blocks_end - blocks_begin) / kHugePage;
  slot.huge = slot.blocks > 0 && bytes >= kHugeMinBytes && HugePageOutputs();
  if (slot.huge) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(reinterpret_cast<void*>(blocks_begin), blocks_end - blocks_begin, MADV_HUGEPAGE);
#endif
  }
  // MADV_POPULATE_WRITE also makes the partial pages at the ends resident.
  if (PopulateOutputs() && PopulateWrite(out, bytes)) return false;
  const uintptr_t head_end = std::min(blocks_begin, end);
  const uintptr_t tail_begin = std::max(blocks_end, head_end);
  if (FaultEnd(begin, head_end, resident.Missing(begin, head_end), slot.huge)) ++collapsed_[rank];
  if (FaultEnd(tail_begin, end, resident.Missing(tail_begin, end), slot.huge)) ++collapsed_[rank];
  if (slot.blocks == 0) return false;
  slot.published.store(true, std::memory_order_release);
  return true;
}

void OutputFaults::FaultBlock(Slot& slot, size_t block) {
  const uintptr_t a = slot.blocks_begin + block * kHugePage;
  if (slot.huge)
    TouchPage(a);  // faults the whole huge page in
  else
    TouchRange(a, a + kHugePage);
}

void OutputFaults::Help(int rank) {
  for (int i = 0; i < n_; ++i) {
    RankSlots& owner = ranks_[(rank + i) % n_];
    const size_t count = owner.count.load(std::memory_order_acquire);
    for (size_t j = 0; j < count; ++j) {
      Slot& slot = owner.slots[j];
      while (slot.Open()) {
        // Registered as active before claiming: Withdraw (seq_cst on both) either sees this helper or
        // makes the claim fail.
        slot.active.fetch_add(1);
        const size_t block = slot.next.fetch_add(1);
        if (block < slot.blocks) {
          FaultBlock(slot, block);
          faulted_[rank].fetch_add(1, std::memory_order_relaxed);
        }
        slot.active.fetch_sub(1);
      }
    }
  }
}

bool OutputFaults::Unclaimed() const {
  for (int r = 0; r < n_; ++r) {
    const size_t count = ranks_[r].count.load(std::memory_order_acquire);
    for (size_t j = 0; j < count; ++j)
      if (ranks_[r].slots[j].Open()) return true;
  }
  return false;
}

void OutputFaults::Withdraw(int rank) {
  RankSlots& mine = ranks_[rank];
  const size_t count = mine.count.load(std::memory_order_relaxed);  // the owner's own store
  for (size_t j = 0; j < count; ++j) {
    Slot& slot = mine.slots[j];
    slot.next.store(kWithdrawn);
    // Bounded by one block's fault; yielding, since the helper may need this core to finish it.
    while (slot.active.load() != 0) std::this_thread::yield();
  }
}

}  // namespace flexlink
