#include "xla_ffi/core/pages.h"

#include <cstdint>
#include <vector>

#include "xla_ffi/core/config.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace flexlink {
namespace {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
// Below this a buffer holds at most one whole huge page; not worth a system call.
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

enum class Residency { kAll, kSome, kNone };  // kNone: at most 1/64 of the pages (a fresh mapping)

// Which pages of [p, p + bytes) are resident. A recycled buffer usually has all; a fresh mapping none;
// a chunk from a glibc arena whose heap was trimmed (MADV_DONTNEED on its free middle) keeps its
// first and last pages but lost the ones between: at 16 MiB per rank through XLA that was 4000+ faults
// per call behind resident ends, so the ends alone do not tell. One mincore over the range (a byte per
// page in a thread_local vector) costs a page-table walk, ~1 us per MiB.
Residency ResidencyOf(void* p, size_t bytes) {
#if defined(__linux__)
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~(kPage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes + kPage - 1) & ~(kPage - 1);
  thread_local std::vector<unsigned char> vec;
  vec.resize((end - first) / kPage);
  if (mincore(reinterpret_cast<void*>(first), end - first, vec.data()) != 0) return Residency::kNone;
  size_t resident = 0;
  for (unsigned char v : vec) resident += v & 1;
  // malloc's chunk header keeps the first page of even a fresh mapping resident: "none" is "almost none".
  if (resident == vec.size()) return Residency::kAll;
  return resident <= vec.size() / 64 ? Residency::kNone : Residency::kSome;
#else
  (void)p;
  (void)bytes;
  return Residency::kNone;
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

}  // namespace

void PrepareOutput(void* out, size_t bytes, bool aliases_input) {
  if (aliases_input) return;  // the input's pages are in place already
  if (bytes < kPrefaultMinBytes) return;
  const Residency residency = ResidencyOf(out, bytes);
  if (residency == Residency::kAll) return;
  // Huge pages only for a (nearly) fresh mapping: glibc maps large chunks afresh and frees them whole.
  // A partly resident chunk sits in a malloc arena whose free parts glibc trims with MADV_DONTNEED,
  // splitting huge pages that then fault back in. Through XLA, out of place, 16 MiB, mean per call over
  // 4-6 processes x 30 calls (native 21-25 ms): all_reduce 27.8 ms advising every non-resident output,
  // 19.2 ms never, 23.1 ms with this rule (median 11-14 ms); fresh 32-64 MiB outputs gain most
  // (all_reduce mean 52 vs 98 ms at 32 MiB, 100 vs 163 ms at 64 MiB). docs/engine.md.
  if (residency == Residency::kNone && bytes >= kHugeMinBytes && HugePageOutputs()) AdviseHugePages(out, bytes);
  if (PopulateOutputs() && PopulateWrite(out, bytes)) return;  // the partial pages at the ends: resident now too
  // One store per page; volatile so it is not elided. The value does not matter (see header).
  volatile char* p = static_cast<char*>(out);
  const size_t first = (kPage - reinterpret_cast<uintptr_t>(out) % kPage) % kPage;
  for (size_t i = first; i < bytes; i += kPage) p[i] = 0;
}

}  // namespace flexlink
