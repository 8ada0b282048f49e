// ppermute and all_to_all on the shm link: pure data movement, each rank pulling into its own output
// (so every output is written by one thread, and its pages are faulted by their owner's writes).
// Read N, write N per rank, the minimum; a final barrier in the channel keeps the sources alive.
#include "xla_ffi/links/shm_copy.h"
#include "xla_ffi/links/shm_ops.h"

namespace flexlink::shm {

void Permute(const PartView& v, int source, UnitRange range, bool stream) {
  if (range.empty()) return;
  const size_t w = v.width();
  char* out = v.out() + range.begin * w;
  if (source < 0) return ZeroOut(out, range.size() * w, stream);
  CopyOut(out, v.sources[source] + range.begin * w, range.size() * w, stream);
}

void AllToAll(const PartView& v, UnitRange range, bool stream) {
  if (range.empty()) return;
  const size_t n = static_cast<size_t>(v.n), w = v.width(), inner = v.part.inner, rank = static_cast<size_t>(v.rank);
  // Block j of this rank's output is block `rank` of rank j's input. Starting at our own rank spreads
  // the ranks' reads over different sources.
  for (size_t step = 0; step < n; ++step) {
    const size_t j = (rank + step) % n;
    CopyUnits(Rows{v.out() + j * inner * w, n * inner}, ConstRows{v.sources[j] + rank * inner * w, n * inner},
              inner, w, range, stream);
  }
}

}  // namespace flexlink::shm
