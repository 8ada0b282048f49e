#include "xla_ffi/cuda/pcie_chunks.h"

#include <algorithm>

namespace flexlink::gpu {

size_t PcieMaxChunkUnits(Kind kind, size_t width, int n, size_t slot_bytes) {
  const size_t nn = static_cast<size_t>(n);
  switch (kind) {
    case Kind::kAllReduce: return nn * (slot_bytes / (nn * nn * width));  // n*n slices of chunk/n
    case Kind::kReduceScatter:
    case Kind::kAllToAll: return slot_bytes / (nn * nn * width);
    case Kind::kAllGather:
    case Kind::kPpermute: return slot_bytes / (nn * width);
  }
  return 0;
}

std::vector<PcieChunk> PcieChunks(const CallDesc& desc, int n, size_t slot_bytes, std::span<const Piece> pieces) {
  std::vector<PcieChunk> out;
  for (const Piece& piece : pieces) {
    const Part& part = desc.parts[piece.part];
    const size_t units = piece.units.size();
    if (units == 0) continue;
    const size_t max_units = PcieMaxChunkUnits(desc.kind, part.width(), n, slot_bytes);
    const size_t min_units = std::max<size_t>(1, kPcieMinChunkBytes / part.width());
    // At least two chunks once the piece holds two minimal ones (copies in both directions overlap).
    const size_t want = std::max(min_units, (units + 1) / 2);
    const size_t step = std::max<size_t>(1, std::min(max_units, want));
    for (size_t b = piece.units.begin; b < piece.units.end; b += step)
      out.push_back({piece.part, b, std::min(step, piece.units.end - b)});
  }
  return out;
}

}  // namespace flexlink::gpu
