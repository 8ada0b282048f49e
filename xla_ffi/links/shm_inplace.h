// ppermute and all_to_all in place on the shm link's direct path: result i in operand i's buffer.
//
// The hazard: rank d's output is its sources' inputs, so a rank may not overwrite a unit of its input
// before every rank that reads that unit has read it (ppermute: its destination; all_to_all: every
// other rank). Units make this local: unit u of any output depends only on unit u of the inputs
// (docs/engine.md, "Units"), so ranges on different links never interfere and each piece is
// handled alone.
//
// The scheme (pairwise progress, chunked): a piece is cut into chunks of ~kChunkBytes per rank. A
// rank reads chunk c of what its output needs (from its sources' buffers) into a private bounce
// buffer, announces it (CallContext::Advance on its lane), and overwrites chunk c of its own buffer
// only once the ranks that read its buffer have announced chunk c (CallContext::WaitProgress) — with
// kSlots bounce slots (chunk c is read before chunk c - kSlots + 1 is written), so a rank rarely waits. Memory traffic per rank stays read N + write N
// (the bounce buffer lives in the cache) and a ppermute rank waits only for its destination.
// No rank can deadlock: announcing chunk c needs only the writes of chunks <= c - kSlots, which need
// only announcements of those chunks. Ranks whose output is a separate buffer (in-place-ness may
// differ per rank) copy straight into it and announce likewise; before a channel's run returns, every
// rank waits until its readers announced all chunks, which keeps its input alive while they read.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "xla_ffi/core/rendezvous.h"
#include "xla_ffi/core/status.h"
#include "xla_ffi/links/shm_ops.h"

namespace flexlink::shm {

// Whether part `part` of ctx's call runs in place on any rank (its output is its input there); the
// same answer on every rank (all see every rank's buffers after the arrival).
bool InPlaceAnywhere(const CallContext& ctx, size_t part);

// The ranks that read this rank's input of a ppermute (its destination, unless itself) or an
// all_to_all (every other rank).
void InputReaders(const CallDesc& desc, int n, int rank, std::vector<int>* readers);

// Runs `range` of the part `v` for `rank` under the scheme above. `*announced` is this rank's
// progress on `lane` (the same on every rank at the same piece) and grows by the piece's chunks.
// `stream`: streaming stores for a separate output (as the out-of-place path).
Status ExchangeInPlace(CallContext& ctx, int rank, int lane, const CallDesc& desc, const PartView& v,
                       size_t part_index, UnitRange range, std::span<const int> readers, bool stream,
                       std::string_view link, uint64_t* announced);

}  // namespace flexlink::shm
