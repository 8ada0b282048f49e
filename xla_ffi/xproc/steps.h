// A cross-process call as a sequence of steps, each a set of pieces (part, unit range) whose staged
// bytes fit in one slot, and what a rank does with a piece before the step's barrier (stage its
// input into its own slot) and after it (compute its output from every rank's slot). Every rank cuts
// the same steps from the same description, so slot offsets agree without being exchanged.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "xla_ffi/core/call.h"

namespace flexlink::xproc {

struct StepPiece {
  size_t part = 0;
  UnitRange units;
  size_t offset = 0;  // in the slot, a multiple of 64
};

// Bytes a rank stages per unit: one element, or n for the kinds whose unit gathers a column of n
// blocks (reduce_scatter, all_to_all: the slot holds [n][units] so block b is contiguous).
size_t StagedBytesPerUnit(const CallDesc& desc, const Part& part, int n);

class StepCursor {
 public:
  StepCursor(const CallDesc& desc, int n, size_t slot_bytes) : desc_(desc), n_(n), slot_(slot_bytes) {}
  // Only `pieces` (in their order; each a part's unit range), as a link's range of a split call runs.
  StepCursor(const CallDesc& desc, int n, size_t slot_bytes, std::span<const Piece> pieces)
      : desc_(desc), n_(n), slot_(slot_bytes), only_(pieces), restricted_(true) {}
  // The next step's pieces (several small parts pack into one step); false when the call is done.
  bool Next(std::vector<StepPiece>* pieces);

 private:
  const CallDesc& desc_;
  const int n_;
  const size_t slot_;
  size_t part_ = 0, unit_ = 0;
  std::span<const Piece> only_;
  bool restricted_ = false;
  bool started_ = false;  // restricted: unit_ set to the current piece's begin
};

// Before the barrier: this rank's input units of `piece` into `slot` (its own).
void Stage(const CallDesc& desc, int n, int rank, const StepPiece& piece, char* slot);
// After it: this rank's output units of `piece` from every rank's slot (`slots[j]`, rank order).
void Compute(const CallDesc& desc, int n, int rank, const StepPiece& piece, const char* const* slots);

// Rank `rank`'s slice of `units` units of `width` bytes (of n), starting on cache-line multiples of
// elements; the last ranks' slices may be short or empty.
UnitRange Slice(size_t units, int n, int rank, size_t width);

// all_reduce in two phases (n >= 3, large calls): after the first barrier rank r reduces only its
// slice of each piece over every slot into the shared `result` area (same offsets as the slots);
// after a second barrier every rank copies the whole piece out. Per rank (2 + 1 + 1/n + 2)·N bytes
// of memory traffic instead of (n + 3)·N, for one more barrier per step.
void ReduceSlice(const CallDesc& desc, int n, int rank, const StepPiece& piece, const char* const* slots, char* result);
void CopyResult(const CallDesc& desc, int n, const StepPiece& piece, const char* result);

}  // namespace flexlink::xproc
