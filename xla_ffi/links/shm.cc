#include "xla_ffi/links/shm.h"

#include <cstring>
#include <string>
#include <vector>

#include "xla_ffi/core/config.h"
#include "xla_ffi/links/shm_copy.h"
#include "xla_ffi/links/shm_inplace.h"
#include "xla_ffi/links/shm_ops.h"

namespace flexlink {
namespace {

using shm::PartView;

// Per-rank pointer arrays of one part. thread_local: no allocation per call once a device thread has
// seen its largest group.
std::vector<const char*>& SourceTable(size_t n) {
  thread_local std::vector<const char*> v;
  v.resize(n);
  return v;
}

std::vector<char*>& OutputTable(size_t n) {
  thread_local std::vector<char*> v;
  v.resize(n);
  return v;
}

// Where each part's input sits in a rank's staging region: one after another, 64-byte aligned (the
// same on every rank, since the parts' shapes are). Returns the bytes the region needs.
size_t StagingLayout(const CallDesc& desc, int n, std::vector<size_t>* offsets) {
  offsets->resize(desc.parts.size());
  size_t end = 0;
  for (size_t i = 0; i < desc.parts.size(); ++i) {
    const Part& p = desc.parts[i];
    end = (end + shm::kCacheLine - 1) / shm::kCacheLine * shm::kCacheLine;
    (*offsets)[i] = end;
    end += desc.in_count(p, n) * p.width();
  }
  return end;
}

// Whether this rank writes its output of `part` with streaming stores (a separate, large output).
bool StreamOwn(const CallDesc& desc, const Part& part, int n) {
  return shm::StreamSeparate(part.in, part.out, desc.out_count(part, n) * part.width());
}

// One part, staged: this rank's whole output from the staging regions.
void RunStagedPart(const CallDesc& desc, const Part& part, int n, int rank, std::span<const char* const> sources) {
  const PartView v{part, n, rank, sources, {}};
  const UnitRange all{0, part.units};
  switch (desc.kind) {
    case Kind::kAllReduce:
      return shm::AllReduceStaged(v, desc.op, all);
    case Kind::kAllGather:
      return shm::GatherPull(v, all, StreamOwn(desc, part, n));
    case Kind::kReduceScatter:
      return shm::ReduceScatter(v, desc.op, all);
    case Kind::kPpermute:
      return shm::Permute(v, desc.sources[rank], all, StreamOwn(desc, part, n));
    case Kind::kAllToAll:
      return shm::AllToAll(v, all, StreamOwn(desc, part, n));
  }
}

std::string_view PhaseName(Kind kind) {
  switch (kind) {
    case Kind::kAllReduce: return "reduce-broadcast";
    case Kind::kAllGather: return "all-gather";
    case Kind::kReduceScatter: return "reduce-scatter";
    case Kind::kPpermute: return "ppermute";
    case Kind::kAllToAll: return "all-to-all";
  }
  return "shm";
}

}  // namespace

Status ShmChannel::RunAlone(CallContext& ctx, int rank, const CallDesc& desc) {
  const int n = ctx.size();
  thread_local std::vector<size_t> offsets;
  const size_t in_bytes = StagingLayout(desc, n, &offsets);
  // The first rank fixes the staging size for the call, so all ranks take the same path even if the
  // setting changes meanwhile (and if their sizes differ, Arrive fails them all before any reads).
  shm::StagingBuffer* staging =
      ctx.Scratch<shm::StagingBuffer>([&] { return staging_pool_.Acquire(ShmStagingBytes()); });
  if (in_bytes > staging->region_bytes()) return Channel::RunAlone(ctx, rank, desc);
  for (size_t i = 0; i < desc.parts.size(); ++i) {
    const Part& p = desc.parts[i];
    std::memcpy(staging->region(rank) + offsets[i], p.in, desc.in_count(p, n) * p.width());
  }
  FLEXLINK_RETURN_IF_ERROR(ctx.Arrive(rank, desc, link_name()));
  auto& sources = SourceTable(n);
  for (size_t i = 0; i < desc.parts.size(); ++i) {
    if (desc.parts[i].units == 0) continue;
    for (int k = 0; k < n; ++k) sources[k] = staging->region(k) + offsets[i];
    RunStagedPart(desc, desc.parts[i], n, rank, sources);
  }
  return Status::Ok();
}

Status ShmChannel::Run(CallContext& ctx, int rank, int lane, std::span<const Piece> pieces) {
  const int n = ctx.size();
  const CallDesc& me = ctx.desc(rank);
  auto& sources = SourceTable(n);
  auto& outputs = OutputTable(n);
  // Pieces of parts that run in place on some rank go through shm_inplace.h; `barrier`: some other
  // piece ran (or none at all), and the final barrier is needed as before.
  bool in_place = false, barrier = pieces.empty();
  uint64_t announced = 0;
  thread_local std::vector<int> readers;
  for (const Piece& piece : pieces) {
    const Part& part = me.parts[piece.part];
    for (int k = 0; k < n; ++k) {
      const Part& peer = ctx.desc(k).parts[piece.part];
      sources[k] = static_cast<const char*>(peer.in);
      outputs[k] = static_cast<char*>(peer.out);
    }
    const PartView v{part, n, rank, sources, outputs};
    const bool exchange = me.kind == Kind::kPpermute || me.kind == Kind::kAllToAll;
    if (exchange && shm::InPlaceAnywhere(ctx, piece.part)) {
      if (!in_place) {
        in_place = true;
        announced = ctx.progress(rank, lane);
        shm::InputReaders(me, n, rank, &readers);
      }
      FLEXLINK_RETURN_IF_ERROR(shm::ExchangeInPlace(ctx, rank, lane, me, v, piece.part, piece.units, readers,
                                                    StreamOwn(me, part, n), link_name(), &announced));
      continue;
    }
    barrier = true;
    switch (me.kind) {
      case Kind::kAllReduce:
        shm::AllReduceDirect(v, me.op, piece.units);
        break;
      case Kind::kAllGather:
        if (part.units * n * part.width() < shm::kPullGatherBytes)
          shm::GatherPull(v, piece.units, /*stream=*/false);
        else
          shm::GatherPush(v, piece.units);
        break;
      case Kind::kReduceScatter:
        shm::ReduceScatter(v, me.op, piece.units);
        break;
      case Kind::kPpermute:
        shm::Permute(v, me.sources[rank], piece.units, StreamOwn(me, part, n));
        break;
      case Kind::kAllToAll:
        shm::AllToAll(v, piece.units, StreamOwn(me, part, n));
        break;
    }
  }
  // Peers may read this rank's inputs and write its outputs until they are done with their pieces.
  if (barrier) return ctx.Barrier(rank, lane, PhaseName(me.kind), link_name());
  // Only in-place exchange pieces: nobody writes a peer's buffer, and once the ranks that read this
  // rank's input have announced every chunk, nobody reads it any more.
  return ctx.WaitProgress(rank, lane, readers, announced,
                          "finish reading this rank's input of the " + std::string(PhaseName(me.kind)),
                          link_name());
}

}  // namespace flexlink
