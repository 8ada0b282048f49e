#include "xla_ffi/links/tcp.h"

#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/half.h"
#include "xla_ffi/core/reduce.h"
#include "xla_ffi/links/socket.h"
#include "xla_ffi/links/socket_stream.h"

namespace flexlink {
namespace {

// Pipeline chunk: small enough that the n-hop chain fills quickly, large enough that per-chunk
// system calls and wake-ups stay cheap next to the copy.
constexpr size_t kChunkBytes = 256 << 10;
constexpr uint32_t kMagic = 0x544c4646;  // "FFLT"

// First bytes of every run on a stream: which range the sender is running.
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

bool Contiguous(size_t a, size_t b, size_t inner) { return b == a || a / inner == (b - 1) / inner; }

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

}  // namespace

// One rank's part of one piece (a part's unit range): builds the stream items of its collective and
// pumps them.
class TcpRun {
 public:
  TcpRun(TcpChannel& ch, const CallDesc& call, int n, int rank, const Piece& piece)
      : ch_(ch), call_(call), d_(call.parts[piece.part]), n_(n), k_(rank), piece_(piece), range_(piece.units),
        st_(ch.ranks_[rank]), wire_(d_.dtype, call.op),
        io_(st_.send_fd, st_.recv_fd, ch.abort_fd_, net::DeadlineIn(TimeoutSeconds())) {
    cu_ = std::max<size_t>(1, kChunkBytes / wire_.ww);
    m_ = (range_.size() + cu_ - 1) / cu_;
    out_ = static_cast<char*>(d_.out);
    in_ = static_cast<const char*>(d_.in);
  }

  Status Go() {
    header_out_ = Header{kMagic, static_cast<uint32_t>(call_.kind), st_.runs.load(), piece_.part, range_.begin,
                         range_.end};
    st_.runs.fetch_add(1);
    io_.Send(&header_out_, sizeof header_out_);
    io_.Recv(&header_in_, sizeof header_in_);
    switch (call_.kind) {
      case Kind::kAllReduce: AllReduce(); break;
      case Kind::kAllGather: AllGather(); break;
      case Kind::kReduceScatter: ReduceScatter(); break;
    }
    bad_header_ = false;
    const auto r = io_.Pump([&](size_t i) {
      if (i == 0) return CheckHeader();
      if (!bad_header_) handlers_[i - 1]();
    });
    if (bad_header_) return Fail(Status::Internal(BadHeader()));
    return Finish(r);
  }

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

  // Partials 0 -> 1 -> ... -> n-1, then results n-1 -> 0 -> 1 -> ... -> n-2 (see tcp.h).
  void AllReduce() {
    const size_t w = wire_.w, ww = wire_.ww;
    // This rank's wire values, chunk j at j * cu_ * ww (rank 0 needs them only to widen halves).
    char* partial = k_ > 0 || wire_.half() ? Scratch(range_.size() * ww) : nullptr;
    // Captures by value: the receive handlers run after this function returned.
    auto acc = [=, this](size_t j) { return partial + j * cu_ * ww; };
    auto out = [=, this](size_t j) { return out_ + ChunkBegin(j) * w; };
    auto in = [=, this](size_t j) { return in_ + ChunkBegin(j) * w; };
    for (size_t j = 0; j < m_ && k_ == 0; ++j) {
      if (wire_.half()) {
        wire_.Load(acc(j), in(j), ChunkCount(j));
        io_.Send(acc(j), ChunkCount(j) * ww);
      } else {
        io_.Send(in(j), ChunkCount(j) * w);
      }
    }
    for (size_t j = 0; j < m_ && k_ > 0; ++j)
      OnRecv(acc(j), ChunkCount(j) * ww, [=, this] {
        if (k_ < n_ - 1) {
          wire_.Fold(acc(j), in(j), ChunkCount(j), acc(j), /*to_wire=*/true);
          io_.Send(acc(j), ChunkCount(j) * ww);
        } else {
          wire_.Fold(acc(j), in(j), ChunkCount(j), out(j), /*to_wire=*/false);
          io_.Send(out(j), ChunkCount(j) * w);  // the result goes round to rank 0
        }
      });
    for (size_t j = 0; j < m_ && k_ < n_ - 1; ++j)
      OnRecv(out(j), ChunkCount(j) * w, [=, this] {
        if (k_ < n_ - 2) io_.Send(out(j), ChunkCount(j) * w);
      });
  }

  // Ring all-gather of the range of every rank's block: receive block r-1, r-2, ... and forward all
  // but the last. A block's range lands straight in the output when it is contiguous there, else in
  // scratch (packed) and is then copied row piece by row piece.
  void AllGather() {
    const size_t w = d_.width(), bytes = range_.size() * w, inner = d_.inner;
    const bool direct = Contiguous(range_.begin, range_.end, inner);
    char* staged = direct ? nullptr : Scratch((n_ - 1) * bytes);
    auto place = [=, this](size_t c, const char* src, size_t j) {  // packed chunk j of block c -> out
      Pieces(ChunkBegin(j), ChunkBegin(j) + ChunkCount(j), n_, c, inner,
             [&](size_t u, size_t e, size_t cnt) { std::memcpy(out_ + e * w, src + u * w, cnt * w); });
    };
    for (size_t j = 0; j < m_; ++j) {
      io_.Send(in_ + ChunkBegin(j) * w, ChunkCount(j) * w);
      place(k_, in_ + ChunkBegin(j) * w, j);
    }
    for (int s = 0; s < n_ - 1; ++s) {
      const size_t c = static_cast<size_t>((k_ - 1 - s + 2 * n_) % n_);
      for (size_t j = 0; j < m_; ++j) {
        char* dst = nullptr;
        if (direct)
          Pieces(ChunkBegin(j), ChunkBegin(j) + 1, n_, c, inner, [&](size_t, size_t e, size_t) { dst = out_ + e * w; });
        else
          dst = staged + s * bytes + (ChunkBegin(j) - range_.begin) * w;
        OnRecv(dst, ChunkCount(j) * w, [=, this] {
          if (!direct) place(c, dst, j);
          if (s < n_ - 2) io_.Send(dst, ChunkCount(j) * w);
        });
      }
    }
  }

  // Block c's partials travel 0 -> ... -> n-1 (items ordered block by block, so results start early);
  // rank n-1 keeps block n-1 and sends the rest round: n-1 -> 0 -> ... -> c (see tcp.h).
  void ReduceScatter() {
    const size_t w = wire_.w, ww = wire_.ww, inner = d_.inner, nb = n_;
    const size_t units = range_.size();
    const bool direct = !wire_.half() && Contiguous(range_.begin, range_.end, inner);
    char* partial = Scratch(nb * units * ww + (nb - 1) * units * w);
    char* finals = partial + nb * units * ww;  // blocks 0..n-2 of results, storage width
    auto acc = [=, this](size_t c, size_t j) { return partial + (c * units + j * cu_) * ww; };
    auto fin = [=, this](size_t c, size_t j) { return finals + (c * units + j * cu_) * w; };
    auto out = [=, this](size_t j) { return out_ + ChunkBegin(j) * w; };
    // Calls f(wire offset in chunk, own input piece, count) for chunk j of block c.
    auto own = [=, this](size_t c, size_t j, auto f) {
      Pieces(ChunkBegin(j), ChunkBegin(j) + ChunkCount(j), nb, c, inner,
             [&](size_t u, size_t e, size_t cnt) { f(u, in_ + e * w, cnt); });
    };
    for (size_t c = 0; c < nb && k_ == 0; ++c)
      for (size_t j = 0; j < m_; ++j) {
        const char* src = nullptr;
        if (direct) own(c, j, [&](size_t, const char* p, size_t) { src = p; });
        else own(c, j, [&](size_t u, const char* p, size_t cnt) { wire_.Load(acc(c, j) + u * ww, p, cnt); });
        io_.Send(direct ? src : acc(c, j), ChunkCount(j) * ww);
      }
    for (size_t c = 0; c < nb && k_ > 0; ++c)
      for (size_t j = 0; j < m_; ++j)
        OnRecv(acc(c, j), ChunkCount(j) * ww, [=, this] {
          const bool last = k_ == n_ - 1;
          char* dst = !last ? acc(c, j) : (c == nb - 1 ? out(j) : fin(c, j));
          own(c, j, [&](size_t u, const char* p, size_t cnt) {
            wire_.Fold(acc(c, j) + u * ww, p, cnt, dst + u * (last ? w : ww), /*to_wire=*/!last);
          });
          if (!last) io_.Send(acc(c, j), ChunkCount(j) * ww);
          else if (c != nb - 1) io_.Send(fin(c, j), ChunkCount(j) * w);
        });
    // Results of blocks k..n-2 arrive from the previous rank; keep ours, forward the others.
    for (size_t c = static_cast<size_t>(k_); c + 1 < nb; ++c)
      for (size_t j = 0; j < m_; ++j) {
        char* dst = c == static_cast<size_t>(k_) ? out(j) : fin(c, j);
        OnRecv(dst, ChunkCount(j) * w, [=, this] {
          if (c != static_cast<size_t>(k_)) io_.Send(dst, ChunkCount(j) * w);
        });
      }
  }

  void CheckHeader() {
    bad_header_ = std::memcmp(&header_in_, &header_out_, sizeof header_in_) != 0;
    if (bad_header_) ch_.Break(Status::Internal(BadHeader()));  // stops the pump via the abort fd
  }
  std::string BadHeader() const {
    char b[256];
    std::snprintf(b, sizeof b,
                  ": rank %d sent run #%llu part %llu range [%llu, %llu) kind %u while this rank runs #%llu "
                  "part %zu range [%zu, %zu) (every rank must run a channel's ranges in the same order)",
                  (k_ + n_ - 1) % n_, static_cast<unsigned long long>(header_in_.run),
                  static_cast<unsigned long long>(header_in_.part),
                  static_cast<unsigned long long>(header_in_.begin),
                  static_cast<unsigned long long>(header_in_.end), header_in_.kind,
                  static_cast<unsigned long long>(header_out_.run), piece_.part, range_.begin, range_.end);
    return Where() + b;
  }

  Status Finish(net::Streams::Result r) {
    using R = net::Streams::Result;
    const int prev = (k_ + n_ - 1) % n_, next = (k_ + 1) % n_;
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", TimeoutSeconds());
    const std::string got = " (received " + std::to_string(io_.bytes_received()) + " of " +
                            std::to_string(io_.bytes_expected()) + " bytes)";
    switch (r) {
      case R::kOk: return Status::Ok();
      case R::kAborted: return ch_.health();
      case R::kRecvTimeout:
        return Fail(Status::DeadlineExceeded(Where() + ": timed out after " + secs + " s" +
                                             Absent() + " waiting for " + ch_.RankName(prev) + " to send" + got));
      case R::kSendTimeout:
        return Fail(Status::DeadlineExceeded(Where() + ": timed out after " + secs + " s" +
                                             Absent() + " waiting for " + ch_.RankName(next) + " to receive"));
      case R::kClosed:
        return Fail(Status::Internal(Where() + ": connection to a neighbour (" +
                                     ch_.RankName(prev) + " or " + ch_.RankName(next) + ") closed" + got));
      case R::kError:
        errno = io_.error_number();
        return Fail(Status::Internal(Where() + ": " + net::ErrnoText("socket I/O")));
    }
    return Status::Internal("tcp: unknown result");
  }
  // In a ring the neighbour we wait for may itself be waiting; name the ranks that never started
  // this range (", rank 2 (device 102) did not start this range;"), if any.
  std::string Absent() const {
    std::string s;
    int count = 0;
    for (int r = 0; r < n_; ++r)
      if (ch_.ranks_[r].runs.load() <= header_out_.run) {
        s += (count++ ? ", " : ": ") + ch_.RankName(r);
      }
    if (count == 0) return "";
    return s + " did not start this range;";
  }
  Status Fail(Status s) {
    ch_.Break(s);
    return ch_.health();
  }

  std::string Where() const { return ch_.Where(call_, piece_); }

  TcpChannel& ch_;
  const CallDesc& call_;
  const Part& d_;
  const int n_, k_;
  const Piece piece_;
  const UnitRange range_;
  TcpChannel::RankState& st_;
  const Wire wire_;
  net::Streams io_;
  size_t cu_ = 1, m_ = 0;
  char* out_;
  const char* in_;
  Header header_out_, header_in_;
  bool bad_header_ = false;
  std::vector<std::function<void()>> handlers_;  // one per receive item after the header
};

TcpChannel::TcpChannel(std::string name, std::span<const int64_t> devices)
    : name_(std::move(name)), devices_(devices.begin(), devices.end()), ranks_(devices.size()) {
  abort_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  const int n = static_cast<int>(devices.size());
  if (abort_fd_ < 0) {
    Break(Status::Internal("tcp: " + net::ErrnoText("eventfd")));
    return;
  }
  if (n < 2) return;  // a group of one never runs a range (the engine copies)
  // The token makes the hello unguessable for anything outside this process (getrandom: the
  // kernel's CSPRNG; 16 bytes never block or come back short once the pool is initialised).
  uint8_t token[16];
  if (getrandom(token, sizeof token, 0) != static_cast<ssize_t>(sizeof token)) {
    Break(Status::Internal("tcp: " + net::ErrnoText("getrandom")));
    return;
  }
  std::vector<int> listeners(n, -1);
  std::vector<uint16_t> ports(n);
  const auto deadline = net::DeadlineIn(TimeoutSeconds());
  Status s;
  for (int r = 0; r < n && s.ok(); ++r) s = net::Listen(&listeners[r], &ports[r]);
  for (int r = 0; r < n && s.ok(); ++r) {
    const int to = (r + 1) % n;
    uint8_t hello[24];
    const uint32_t ids[2] = {static_cast<uint32_t>(r), static_cast<uint32_t>(to)};
    std::memcpy(hello, token, 16);
    std::memcpy(hello + 16, ids, 8);
    s = net::ConnectHello(ports[to], hello, deadline, &ranks_[r].send_fd);
    if (s.ok()) s = net::AcceptHello(listeners[to], hello, deadline, &ranks_[to].recv_fd);
  }
  for (int fd : listeners)
    if (fd >= 0) close(fd);
  if (!s.ok()) Break(Status(s.code(), "flexlink: tcp link \"" + name_ + "\" on group " + FormatIds(devices_) +
                                          ": connecting the ring failed: " + s.message()));
}

TcpChannel::~TcpChannel() {
  for (RankState& r : ranks_) {
    if (r.send_fd >= 0) close(r.send_fd);
    if (r.recv_fd >= 0) close(r.recv_fd);
  }
  if (abort_fd_ >= 0) close(abort_fd_);
}

Status TcpChannel::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return first_error_;
}

void TcpChannel::Break(Status why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (first_error_.ok()) {
    first_error_ = why;
    broken_.store(true);
    if (abort_fd_ >= 0) {
      const uint64_t one = 1;
      if (write(abort_fd_, &one, sizeof one) < 0) { /* the flag still fails later runs */ }
    }
  }
}

std::string TcpChannel::RankName(int rank) const {
  return "rank " + std::to_string(rank) + " (device " + std::to_string(devices_[rank]) + ")";
}

std::string TcpChannel::Where(const CallDesc& d, const Piece& piece) const {
  std::string s = "flexlink: " + d.Describe() + " on group " + FormatIds(devices_) + " (link " + name_;
  if (d.parts.size() > 1) s += ", operand " + std::to_string(piece.part);
  return s + ", units [" + std::to_string(piece.units.begin) + ", " + std::to_string(piece.units.end) + "))";
}

Status TcpChannel::Run(CallContext& ctx, int rank, int /*lane*/, std::span<const Piece> pieces) {
  // No barrier at the end: this rank touched only its own buffers, and its sends were copied into
  // the kernel before Pump returned, so peers never need them after we return. Pieces run one after
  // another, each a stream run with its own header: every rank runs the same pieces in order.
  const CallDesc& d = ctx.desc(rank);
  for (const Piece& piece : pieces) {
    if (broken_.load()) return health();
    if (piece.units.empty()) continue;
    const Part& p = d.parts[piece.part];
    if (ctx.size() == 1) {  // no ring: every kind is the identity, and the range is contiguous in both
      std::memmove(static_cast<char*>(p.out) + piece.units.begin * p.width(),
                   static_cast<const char*>(p.in) + piece.units.begin * p.width(), piece.units.size() * p.width());
      continue;
    }
    TcpRun run(*this, d, ctx.size(), rank, piece);
    FLEXLINK_RETURN_IF_ERROR(run.Go());
  }
  return Status::Ok();
}

Status TcpLink::FromSpec(const plan::LinkSpec& spec, std::unique_ptr<Link>* out) {
  FLEXLINK_RETURN_IF_ERROR(plan::CheckParamKeys(spec, {}));
  *out = std::make_unique<TcpLink>(spec.name.empty() ? "tcp" : spec.name);
  return Status::Ok();
}

}  // namespace flexlink
