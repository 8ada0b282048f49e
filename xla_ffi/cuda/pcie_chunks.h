// How the pcie link cuts a call into chunks (pure; the same on every rank, since every rank must
// run the same sequence of chunks). A chunk is a unit range of one piece; its data passes through
// one host slot of `slot_bytes`, which holds, per kind:
//   all_reduce  round 0: cells [slice j][producer p] of one slice (chunk/n units) each, n*n cells;
//               round 1: cells [slice j] (the reduced slices), n cells
//   all_gather, ppermute: cells [producer p] of the chunk, n cells
//   reduce_scatter, all_to_all: cells [consumer j][producer p] of the chunk, n*n cells
// so a chunk moves about slot_bytes/n bytes per rank (slot_bytes/n^2 per pair for the last two).
// Pieces of at least two minimal chunks are cut into two or more chunks, so that the device-to-host
// copy of one chunk overlaps the host-to-device copy of the previous one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "xla_ffi/core/call.h"

namespace flexlink::gpu {

inline constexpr size_t kPcieMinChunkBytes = 64 << 10;

struct PcieChunk {
  size_t part = 0;
  size_t begin = 0;  // first unit
  size_t units = 0;
};

// Largest chunk (units) of a part of `width`-byte elements for `kind`: 0 when a slot cannot hold one
// unit per cell (slot_bytes too small for the group).
size_t PcieMaxChunkUnits(Kind kind, size_t width, int n, size_t slot_bytes);

// The chunks of `pieces`, in order (empty pieces have none).
std::vector<PcieChunk> PcieChunks(const CallDesc& desc, int n, size_t slot_bytes, std::span<const Piece> pieces);

// all_reduce's slices of a chunk of `units`: slice j is [j*len, min(units, (j+1)*len)) with
// len = ceil(units / n); the last ones may be shorter or empty.
struct Slices {
  size_t len = 0;  // units of a full slice
  size_t units = 0;
  size_t begin(int j) const { return std::min(units, j * len); }
  size_t size(int j) const { return std::min(units, (j + 1) * len) - begin(j); }
};
inline Slices SlicesOf(size_t units, int n) { return {(units + n - 1) / n, units}; }

}  // namespace flexlink::gpu
