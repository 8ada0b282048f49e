#include "xla_ffi/core/pages.h"

#include <cstdint>
#include <ctime>
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
// this VM: some processes get huge pages the hypervisor must back again (prefaults at ~0.35 GB/s of
// thread CPU time instead of ~7 GB/s); HugePageGovernor (pages.h) backs off when that happens.
constexpr size_t kHugeMinBytes = size_t{4} << 20;
// Below this the output is written before faults could matter (and staged calls never touch peers').
constexpr size_t kPrefaultMinBytes = size_t{64} << 10;
constexpr uintptr_t kPage = 4096;

void AdviseHugePages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// Whether every page of [p, p + bytes) is resident. A recycled buffer usually is; a fresh mapping is
// not; and a chunk from a glibc arena whose heap was trimmed (MADV_DONTNEED on its free middle) keeps
// its first and last pages but lost the ones between: at 16 MiB per rank through XLA that was
// 4000+ faults per call behind resident ends, so the ends alone do not tell. One mincore over the
// range (a byte per page in a thread_local vector) costs a page-table walk, ~1 us per MiB.
bool AllResident(void* p, size_t bytes) {
#if defined(__linux__)
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~(kPage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes + kPage - 1) & ~(kPage - 1);
  thread_local std::vector<unsigned char> vec;
  vec.resize((end - first) / kPage);
  if (mincore(reinterpret_cast<void*>(first), end - first, vec.data()) != 0) return false;
  for (unsigned char v : vec) {
    if (!(v & 1)) return false;
  }
  return true;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

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

double ThreadCpuSeconds() {
#if defined(__linux__)
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
#else
  return 0;
#endif
}

HugePageGovernor g_huge_pages;  // one per process: the hypervisor's state is the whole VM's

}  // namespace

bool HugePageGovernor::Allow() {
  int b = backoff_.load(std::memory_order_relaxed);
  while (b > 0 && !backoff_.compare_exchange_weak(b, b - 1, std::memory_order_relaxed)) {
  }
  return b <= 0;
}

void HugePageGovernor::Record(size_t bytes, double cpu_seconds) {
  if (cpu_seconds > 0 && static_cast<double>(bytes) / cpu_seconds < kSlowBytesPerSecond)
    backoff_.store(kBackoffOutputs, std::memory_order_relaxed);
}

void PrepareOutput(void* out, size_t bytes, bool aliases_input) {
  if (aliases_input) return;  // the input's pages are in place already
  if (bytes < kPrefaultMinBytes || AllResident(out, bytes)) return;
  const bool huge = bytes >= kHugeMinBytes && HugePageOutputs() && g_huge_pages.Allow();
  if (huge) AdviseHugePages(out, bytes);
  const double t0 = huge ? ThreadCpuSeconds() : 0;
  // MADV_POPULATE_WRITE also makes the partial pages at the ends resident.
  if (!(PopulateOutputs() && PopulateWrite(out, bytes))) {
    // One store per page; volatile so it is not elided. The value does not matter (see header).
    volatile char* p = static_cast<char*>(out);
    const size_t first = (kPage - reinterpret_cast<uintptr_t>(out) % kPage) % kPage;
    for (size_t i = first; i < bytes; i += kPage) p[i] = 0;
  }
  if (huge) g_huge_pages.Record(bytes, ThreadCpuSeconds() - t0);
}

}  // namespace flexlink
