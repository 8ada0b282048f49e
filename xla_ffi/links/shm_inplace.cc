#include "xla_ffi/links/shm_inplace.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "xla_ffi/links/shm_copy.h"

namespace flexlink::shm {
namespace {

// Per rank and chunk, all blocks together, and how many chunks a rank reads ahead of the one it
// writes (docs/engine.md, "In place", for the measurements behind both).
constexpr size_t kChunkBytes = size_t{256} << 10;
constexpr size_t kSlots = 2;

// This thread's bounce buffer (device threads and link workers each have one). Value-initialised
// when it grows, so its pages are touched once, not on every call.
char* Bounce(size_t bytes) {
  thread_local std::vector<char> buffer;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

}  // namespace

bool InPlaceAnywhere(const CallContext& ctx, size_t part) {
  for (int k = 0; k < ctx.size(); ++k) {
    const Part& p = ctx.desc(k).parts[part];
    if (p.in == p.out) return true;
  }
  return false;
}

void InputReaders(const CallDesc& desc, int n, int rank, std::vector<int>* readers) {
  readers->clear();
  if (desc.kind == Kind::kPpermute) {
    const int d = desc.DestinationOf(rank);
    if (d >= 0 && d != rank) readers->push_back(d);
    return;
  }
  for (int k = 0; k < n; ++k)
    if (k != rank) readers->push_back(k);
}

Status ExchangeInPlace(CallContext& ctx, int rank, int lane, const CallDesc& desc, const PartView& v,
                       size_t part_index, UnitRange range, std::span<const int> readers, bool stream,
                       std::string_view link, uint64_t* announced) {
  if (range.empty()) return Status::Ok();
  const bool a2a = desc.kind == Kind::kAllToAll;
  const size_t n = static_cast<size_t>(v.n), w = v.width(), inner = v.part.inner, me = static_cast<size_t>(rank);
  const size_t unit_bytes = a2a ? n * w : w;
  // Chunks of whole cache lines of every block where the size allows.
  size_t chunk = std::max<size_t>(1, kChunkBytes / unit_bytes);
  if (chunk > kCacheLine / w) chunk = chunk / (kCacheLine / w) * (kCacheLine / w);
  const size_t chunks = (range.size() + chunk - 1) / chunk;
  const bool own = v.part.in == v.part.out;
  const int source = a2a ? -1 : desc.sources[rank];
  char* const out = v.out();
  char* const bounce = own ? Bounce(kSlots * chunk * unit_bytes) : nullptr;
  auto units_of = [&](size_t c) {
    return UnitRange{range.begin + c * chunk, std::min(range.end, range.begin + (c + 1) * chunk)};
  };
  auto slot = [&](size_t c) { return bounce + (c % kSlots) * chunk * unit_bytes; };

  // What this rank's output needs of chunk c, from its sources: into the bounce buffer when the
  // output is the input, else straight into the output.
  auto read = [&](size_t c) {
    const UnitRange u = units_of(c);
    if (!own) return a2a ? AllToAll(v, u, stream) : Permute(v, source, u, stream);
    char* s = slot(c);
    if (!a2a) {
      if (source >= 0 && source != rank) std::memcpy(s, v.sources[source] + u.begin * w, u.size() * w);
      return;
    }
    for (size_t step = 1; step < n; ++step) {  // starting past our own rank, as the pull does
      const size_t j = (me + step) % n;
      CopyUnits(Rows{s + j * chunk * w, inner, u.begin}, ConstRows{v.sources[j] + me * inner * w, n * inner}, inner,
                w, u, /*stream=*/false);
    }
  };
  // Chunk c of the own buffer from the bounce buffer, once its readers are past it.
  const std::string what = std::string("read its part of this rank's buffer for the in-place ") +
                           std::string(Name(desc.kind)) + " (part " + std::to_string(part_index) + ", units [" +
                           std::to_string(range.begin) + ", " + std::to_string(range.end) + "))";
  auto write = [&](size_t c) -> Status {
    FLEXLINK_RETURN_IF_ERROR(ctx.WaitProgress(rank, lane, readers, *announced + c + 1, what, link));
    const UnitRange u = units_of(c);
    const char* s = slot(c);
    if (!a2a) {
      if (source < 0) std::memset(out + u.begin * w, 0, u.size() * w);
      else if (source != rank) std::memcpy(out + u.begin * w, s, u.size() * w);
      return Status::Ok();
    }
    for (size_t j = 0; j < n; ++j)
      if (j != me)
        CopyUnits(Rows{out + j * inner * w, n * inner}, ConstRows{s + j * chunk * w, inner, u.begin}, inner, w, u,
                  /*stream=*/false);
    return Status::Ok();
  };

  for (size_t c = 0; c < chunks + kSlots - 1; ++c) {
    if (c < chunks) {
      read(c);
      ctx.Advance(rank, lane);
    }
    if (own && c + 1 >= kSlots) FLEXLINK_RETURN_IF_ERROR(write(c + 1 - kSlots));
  }
  *announced += chunks;
  return Status::Ok();
}

}  // namespace flexlink::shm
