#include "xla_ffi/xproc/steps.h"

#include <algorithm>
#include <cstring>

#include "xla_ffi/core/reduce.h"
#include "xla_ffi/links/shm_copy.h"
#include "xla_ffi/links/shm_ops.h"
#include "xla_ffi/xproc/layout.h"

namespace flexlink::xproc {

size_t StagedBytesPerUnit(const CallDesc& desc, const Part& part, int n) {
  return part.width() * desc.in_per_unit(n);
}

bool StepCursor::Next(std::vector<StepPiece>* pieces) {
  pieces->clear();
  size_t used = 0;
  // Unrestricted, part_ indexes desc_.parts and a part's units run 0..units; restricted, part_
  // indexes only_ and a piece's units run begin..end.
  const size_t count = restricted_ ? only_.size() : desc_.parts.size();
  while (part_ < count) {
    const size_t part = restricted_ ? only_[part_].part : part_;
    const Part& p = desc_.parts[part];
    const size_t end = restricted_ ? std::min(only_[part_].units.end, p.units) : p.units;
    if (restricted_ && !started_) {
      unit_ = only_[part_].units.begin;
      started_ = true;
    }
    if (unit_ >= end) {  // zero-size parts take no part in the work
      ++part_;
      unit_ = 0;
      started_ = false;
      continue;
    }
    const size_t per_unit = StagedBytesPerUnit(desc_, p, n_);
    const size_t room = used < slot_ ? (slot_ - used) / per_unit : 0;
    if (room == 0) break;  // the slot is full (the caller guarantees one unit fits an empty slot)
    const size_t take = std::min(room, end - unit_);
    pieces->push_back({part, {unit_, unit_ + take}, used});
    used = RoundUp(used + take * per_unit, 64);
    unit_ += take;
  }
  return !pieces->empty();
}

void Stage(const CallDesc& desc, int n, int rank, const StepPiece& piece, char* slot) {
  const Part& p = desc.parts[piece.part];
  const size_t w = p.width(), m = piece.units.size();
  const char* in = static_cast<const char*>(p.in);
  char* dst = slot + piece.offset;
  switch (desc.kind) {
    case Kind::kPpermute:
      if (desc.DestinationOf(rank) < 0) return;  // nobody reads this rank's slot
      [[fallthrough]];
    case Kind::kAllReduce:
    case Kind::kAllGather:
      std::memcpy(dst, in + piece.units.begin * w, m * w);
      return;
    case Kind::kReduceScatter:
    case Kind::kAllToAll:
      // x is [outer, n, inner]; block b of the slot holds x[o, b, i] for the piece's units (o, i).
      for (int b = 0; b < n; ++b)
        shm::CopyUnits(shm::Rows{dst + b * m * w, p.inner, piece.units.begin},
                       shm::ConstRows{in + b * p.inner * w, n * p.inner}, p.inner, w, piece.units, false);
      return;
  }
}

void Compute(const CallDesc& desc, int n, int rank, const StepPiece& piece, const char* const* slots) {
  const Part& p = desc.parts[piece.part];
  const size_t w = p.width(), m = piece.units.size();
  char* out = static_cast<char*>(p.out);
  const size_t out_bytes = desc.out_count(p, n) * w;
  const bool stream = shm::StreamSeparate(p.in, p.out, out_bytes);
  thread_local std::vector<const void*> srcs;
  srcs.resize(n);
  switch (desc.kind) {
    case Kind::kAllReduce:
    case Kind::kReduceScatter: {
      // Fixed rank order 0..n-1 in core/reduce's kernels: bitwise the in-process engine's result.
      const size_t block = desc.kind == Kind::kReduceScatter ? static_cast<size_t>(rank) * m * w : 0;
      for (int j = 0; j < n; ++j) srcs[j] = slots[j] + piece.offset + block;
      void* dst = out + piece.units.begin * w;
      const uint8_t streamed = stream;
      GetReduceToKernel(p.dtype, desc.op)(srcs.data(), n, &dst, 1, m, &streamed);
      return;
    }
    case Kind::kAllGather:
      for (int j = 0; j < n; ++j)
        shm::CopyUnits(shm::Rows{out + j * p.inner * w, n * p.inner},
                       shm::ConstRows{slots[j] + piece.offset, p.inner, piece.units.begin}, p.inner, w,
                       piece.units, stream);
      return;
    case Kind::kPpermute: {
      const int s = desc.sources[rank];
      char* dst = out + piece.units.begin * w;
      if (s < 0) shm::ZeroOut(dst, m * w, stream);
      else shm::CopyOut(dst, slots[s] + piece.offset, m * w, stream);
      return;
    }
    case Kind::kAllToAll:
      for (int j = 0; j < n; ++j)
        shm::CopyUnits(shm::Rows{out + j * p.inner * w, n * p.inner},
                       shm::ConstRows{slots[j] + piece.offset + rank * m * w, p.inner, piece.units.begin},
                       p.inner, w, piece.units, stream);
      return;
  }
}

UnitRange Slice(size_t units, int n, int rank, size_t width) {
  const size_t align = std::max<size_t>(1, 64 / width);
  const size_t chunk = RoundUp((units + n - 1) / n, align);
  const size_t begin = std::min(units, chunk * rank);
  return {begin, std::min(units, begin + chunk)};
}

void ReduceSlice(const CallDesc& desc, int n, int rank, const StepPiece& piece, const char* const* slots, char* result) {
  const Part& p = desc.parts[piece.part];
  const size_t w = p.width();
  const UnitRange s = Slice(piece.units.size(), n, rank, w);
  if (s.empty()) return;
  thread_local std::vector<const void*> srcs;
  srcs.resize(n);
  for (int j = 0; j < n; ++j) srcs[j] = slots[j] + piece.offset + s.begin * w;
  GetReduceKernel(p.dtype, desc.op)(srcs.data(), n, result + piece.offset + s.begin * w, s.size());
}

void CopyResult(const CallDesc& desc, int n, const StepPiece& piece, const char* result) {
  const Part& p = desc.parts[piece.part];
  const size_t w = p.width();
  const bool stream = shm::StreamSeparate(p.in, p.out, desc.out_count(p, n) * w);
  shm::CopyOut(static_cast<char*>(p.out) + piece.units.begin * w, result + piece.offset, piece.units.size() * w,
               stream);
}

}  // namespace flexlink::xproc
