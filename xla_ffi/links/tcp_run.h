// One rank's work on one piece (a part's unit range) of the tcp link: the stream items of its
// collective (what it sends to rank+1, what it receives from rank-1, and what each receive triggers)
// and the pump that moves them. Internal to the tcp link (tcp*.cc); see tcp.h for the algorithms.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/half.h"
#include "xla_ffi/core/reduce.h"
#include "xla_ffi/links/socket_stream.h"
#include "xla_ffi/links/tcp.h"

namespace flexlink {
namespace tcp {

// Pipeline chunk: small enough that the n-hop chain fills quickly, large enough that per-chunk
// system calls and wake-ups stay cheap next to the copy.
inline constexpr size_t kChunkBytes = 256 << 10;
inline constexpr uint32_t kMagic = 0x544c4646;  // "FFLT"

// First bytes of every run on a stream: which piece the sender is running.
struct Header {
  uint32_t magic = kMagic;
  uint32_t kind = 0;
  uint64_t run = 0, part = 0, begin = 0, end = 0;
};

// Calls f(unit offset from a, element offset in the buffer, count) for the row pieces of units
// [a, b) of block `c` in an [outer, nb, inner] buffer (all_reduce: nb = 1, inner = units).
template <class F>
void Pieces(size_t a, size_t b, size_t nb, size_t c, size_t inner, F f) {
  for (size_t u = a; u < b;) {
    const size_t o = u / inner, i = u - o * inner, end = std::min(b, (o + 1) * inner);
    f(u - a, (o * nb + c) * inner + i, end - u);
    u = end;
  }
}

inline bool Contiguous(size_t a, size_t b, size_t inner) { return b == a || a / inner == (b - 1) / inner; }

// How partial values travel: the kernel's accumulator, so that folding one rank at a time gives the
// bits of shm's n-way kernel call. float16/bfloat16 accumulate in float32 and round once at the end.
struct Wire {
  DType dtype;
  ReduceKernel kernel;  // on wire values
  size_t w, ww;         // storage and wire width
  bool half() const { return dtype == DType::kF16 || dtype == DType::kBF16; }

  Wire(DType t, ReduceOp op) : dtype(t), w(ByteWidth(t)) {
    ww = half() ? 4 : w;
    // all_gather has no reduction; its kernel is never called (sum exists for every dtype).
    kernel = GetReduceKernel(half() ? DType::kF32 : t, op);
  }
  // dst (wire) = src (storage)
  void Load(char* dst, const char* src, size_t count) const {
    if (!half()) return void(std::memcpy(dst, src, count * w));
    float* f = reinterpret_cast<float*>(dst);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
    if (dtype == DType::kF16)
      for (size_t i = 0; i < count; ++i) f[i] = HalfToFloat(h[i]);
    else
      for (size_t i = 0; i < count; ++i) f[i] = BFloat16ToFloat(h[i]);
  }
  // dst (storage) = src (wire)
  void Store(char* dst, const char* src, size_t count) const {
    if (!half()) return void(std::memmove(dst, src, count * w));
    const float* f = reinterpret_cast<const float*>(src);
    uint16_t* h = reinterpret_cast<uint16_t*>(dst);
    if (dtype == DType::kF16)
      for (size_t i = 0; i < count; ++i) h[i] = FloatToHalf(f[i]);
    else
      for (size_t i = 0; i < count; ++i) h[i] = FloatToBFloat16(f[i]);
  }
  // out (storage) = acc (wire) op x (storage); `out` may be acc itself (then it stays wire) when
  // `to_wire`. Half inputs are widened through a small thread-local buffer.
  void Fold(char* acc, const char* x, size_t count, char* out, bool to_wire) const {
    const void* srcs[2] = {acc, x};
    if (!half()) return kernel(srcs, 2, out, count);
    thread_local std::vector<float> tmp;
    tmp.resize(count);
    Load(reinterpret_cast<char*>(tmp.data()), x, count);
    srcs[1] = tmp.data();
    kernel(srcs, 2, acc, count);
    if (!to_wire) Store(out, acc, count);
  }
};

}  // namespace tcp

class TcpRun {
 public:
  TcpRun(TcpChannel& ch, const CallDesc& call, int n, int rank, const Piece& piece, const TcpLimits& limits);
  Status Go();

 private:
  size_t ChunkBegin(size_t j) const { return range_.begin + j * cu_; }
  size_t ChunkCount(size_t j) const { return std::min(range_.end, ChunkBegin(j) + cu_) - ChunkBegin(j); }
  char* Scratch(size_t bytes) {
    if (st_.scratch.size() < bytes) st_.scratch.resize(bytes);
    return st_.scratch.data();
  }
  void OnRecv(void* p, size_t len, std::function<void()> then) {
    io_.Recv(p, len);
    handlers_.push_back(std::move(then));
  }

  // The kinds (tcp_reduce.cc, tcp_exchange.cc): each queues this rank's sends and receives.
  void AllReduce();
  void ReduceScatter();
  void AllGather();
  void Ppermute();
  void AllToAll();
  // Ring routing of point-to-point messages (ppermute, all_to_all; tcp_exchange.cc).
  void Route(size_t nb, const std::function<void(int origin, std::vector<int>*)>& destinations);

  void CheckHeader();
  std::string BadHeader() const;
  Status Finish(net::Streams::Result r);
  std::string Absent() const;
  Status Fail(Status s);
  std::string Where() const { return ch_.Where(call_, piece_, limits_.label); }
  // Whether the lane's own deadline, not the global one, bounds this run.
  bool LaneFirst() const { return lane_first_; }

  TcpChannel& ch_;
  const TcpLimits& limits_;
  bool lane_first_ = false;
  const CallDesc& call_;
  const Part& d_;
  const int n_, k_;
  const Piece piece_;
  const UnitRange range_;
  TcpChannel::RankState& st_;
  const tcp::Wire wire_;
  net::Streams io_;
  size_t cu_ = 1, m_ = 0;
  char* out_;
  const char* in_;
  tcp::Header header_out_, header_in_;
  bool bad_header_ = false;
  std::vector<std::function<void()>> handlers_;  // one per receive item after the header
};

}  // namespace flexlink
