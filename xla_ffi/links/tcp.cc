#include "xla_ffi/links/tcp.h"

#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/reduce.h"
#include "xla_ffi/links/socket.h"
#include "xla_ffi/links/tcp_run.h"

namespace flexlink {

bool TcpChannel::MakeAbortFd() {
  abort_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (abort_fd_ >= 0) return true;
  Break(Status::Internal("tcp: " + net::ErrnoText("eventfd")));
  return false;
}

TcpChannel::TcpChannel(std::string name, std::span<const int64_t> devices, std::span<const int> local_ranks,
                       std::span<const RankFds> fds, Status error, std::span<const uint8_t> token)
    : name_(std::move(name)), devices_(devices.begin(), devices.end()), ranks_(devices.size()),
      local_(devices.size(), 0), token_(token.begin(), token.end()) {
  const int n = static_cast<int>(devices.size());
  for (size_t i = 0; i < local_ranks.size(); ++i) {
    const int r = local_ranks[i];
    if (r < 0 || r >= n || local_[r]) {  // the factory checks this; never index out of the group
      if (i < fds.size()) {
        if (fds[i].send_fd >= 0) close(fds[i].send_fd);
        if (fds[i].recv_fd >= 0) close(fds[i].recv_fd);
      }
      if (error.ok())
        error = Status::InvalidArgument("tcp: local rank " + std::to_string(r) + " is not a rank of the group or repeats");
      continue;
    }
    local_[r] = 1;
    if (i < fds.size()) ranks_[r].send_fd = fds[i].send_fd, ranks_[r].recv_fd = fds[i].recv_fd;
  }
  all_local_ = std::all_of(local_.begin(), local_.end(), [](char c) { return c != 0; });
  if (!MakeAbortFd()) return;
  if (!error.ok()) Break(std::move(error));
}

TcpChannel::TcpChannel(std::string name, std::span<const int64_t> devices)
    : name_(std::move(name)), devices_(devices.begin(), devices.end()), ranks_(devices.size()),
      local_(devices.size(), 1) {
  if (!MakeAbortFd()) return;
  if (devices_.size() < 2) return;  // a group of one never runs a range (the engine copies)
  Status s = ConnectRing();
  if (!s.ok()) Break(std::move(s));
}

Status TcpChannel::ConnectRing() {
  const int n = static_cast<int>(devices_.size());
  // The token makes the hello unguessable for anything outside this process (getrandom: the
  // kernel's CSPRNG; 16 bytes never block or come back short once the pool is initialised). A new
  // one per connection: a stale connection of a broken ring can never pass as the new one's.
  uint8_t token[16];
  if (getrandom(token, sizeof token, 0) != static_cast<ssize_t>(sizeof token))
    return Status::Internal("tcp: " + net::ErrnoText("getrandom"));
  std::vector<int> listeners(n, -1);
  std::vector<uint16_t> ports(n);
  const auto deadline = net::DeadlineIn(TimeoutSeconds());
  Status s;
  for (int r = 0; r < n && s.ok(); ++r) s = net::Listen(&listeners[r], &ports[r]);
  for (int r = 0; r < n && s.ok(); ++r) {
    const int to = (r + 1) % n;
    const std::vector<uint8_t> hello = net::RingHello(token, r, to);
    s = net::ConnectHello(ports[to], hello, deadline, &ranks_[r].send_fd);
    if (s.ok()) s = net::AcceptHello(listeners[to], hello, deadline, &ranks_[to].recv_fd);
  }
  for (int fd : listeners)
    if (fd >= 0) close(fd);
  if (!s.ok())
    return Status(s.code(), "flexlink: tcp link \"" + name_ + "\" on group " + FormatIds(devices_) +
                                ": connecting the ring failed: " + s.message());
  return Status::Ok();
}

Status TcpChannel::Reconnect(uint64_t seen) {
  std::lock_guard<std::mutex> lock(reconnect_mu_);
  if (generation_.load(std::memory_order_acquire) != seen) return health();  // another rank did it
  {
    std::lock_guard<std::mutex> l(mu_);
    if (first_error_.ok()) return Status::Ok();
  }
  // Every rank of the call is past the rendezvous and none is inside a run of this channel (the
  // failed call's ranks all returned before this call could arrive), so the ring can be rebuilt
  // from this thread, as the constructor built it.
  for (RankState& r : ranks_) {
    for (int* fd : {&r.send_fd, &r.recv_fd})
      if (*fd >= 0) close(*fd), *fd = -1;
    r.runs.store(0);
  }
  Status s = ConnectRing();
  if (!s.ok()) {
    // Still broken, with the new reason; the next probe tries again.
    std::lock_guard<std::mutex> l(mu_);
    first_error_ = Status(s.code(), s.message() + " (reconnecting after: " + first_error_.message() + ")");
    generation_.fetch_add(1, std::memory_order_acq_rel);
    return first_error_;
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    ClearBreakLocked();
    reconnects_.fetch_add(1);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  return Status::Ok();
}

void TcpChannel::ClearBreakLocked() {
  first_error_ = Status::Ok();
  uint64_t count = 0;
  if (read(abort_fd_, &count, sizeof count) < 0) { /* not readable: nothing was written */ }
  broken_.store(false, std::memory_order_release);
}

TcpChannel::~TcpChannel() {
  for (RankState& r : ranks_)
    for (int fd : {r.send_fd, r.recv_fd, r.listen_fd})
      if (fd >= 0) close(fd);
  if (abort_fd_ >= 0) close(abort_fd_);
}

Status TcpChannel::ListenAgain(int rank, uint16_t* port) {
  if (rank < 0 || rank >= static_cast<int>(devices_.size()) || !local_[rank] || token_.size() != net::kRingTokenBytes)
    return Status::InvalidArgument("flexlink: tcp link \"" + name_ + "\" on group " + FormatIds(devices_) +
                                   ": rank " + std::to_string(rank) + " cannot reconnect here");
  {
    // The first local rank clears the failure: no local rank is inside a run (the executor calls
    // this before any link of the call runs, and every earlier call's runs have returned).
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_error_.ok()) ClearBreakLocked();
  }
  RankState& r = ranks_[rank];
  for (int* fd : {&r.send_fd, &r.recv_fd, &r.listen_fd})
    if (*fd >= 0) close(*fd), *fd = -1;
  r.runs.store(0);
  Status s = net::Listen(&r.listen_fd, port);
  if (!s.ok()) Break(Status(s.code(), "flexlink: tcp link \"" + name_ + "\" on group " + FormatIds(devices_) +
                                          ": reconnecting: " + s.message()));
  return s.ok() ? s : health();
}

Status TcpChannel::ConnectAgain(int rank, std::span<const uint16_t> ports,
                                std::chrono::steady_clock::time_point deadline) {
  const int n = static_cast<int>(devices_.size());
  RankState& r = ranks_[rank];
  const std::string where = "flexlink: tcp link \"" + name_ + "\" across processes on group " + FormatIds(devices_) +
                            ": reconnecting " + RankName(rank) + ": ";
  Status s;
  if (ports.size() != static_cast<size_t>(n) || r.listen_fd < 0) s = Status::Internal(where + "no listener or ports");
  const int to = (rank + 1) % n, from = (rank + n - 1) % n;
  if (s.ok()) {
    // Connect first (the successor's backlog holds it), then accept: no process waits for another.
    s = net::ConnectHello(ports[to], net::RingHello(token_, rank, to), deadline, &r.send_fd);
    if (!s.ok()) s = Status(s.code(), where + "connecting to " + RankName(to) + ": " + s.message());
  }
  if (s.ok()) {
    s = net::AcceptHello(r.listen_fd, net::RingHello(token_, from, rank), deadline, &r.recv_fd);
    if (!s.ok()) s = Status(s.code(), where + "accepting " + RankName(from) + ": " + s.message());
  }
  if (r.listen_fd >= 0) close(r.listen_fd), r.listen_fd = -1;
  if (!s.ok()) {
    Break(s);
    return s;
  }
  reconnects_.fetch_add(1);
  return Status::Ok();
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
    // shutdown, not close: local ranks may still be inside poll() on these fds (the destructor
    // closes them). Peers in other processes then read EOF and break in turn, around the ring.
    if (!all_local_)
      for (RankState& r : ranks_)
        for (int fd : {r.send_fd, r.recv_fd})
          if (fd >= 0) shutdown(fd, SHUT_RDWR);
  }
}

std::string TcpChannel::RankName(int rank) const {
  return "rank " + std::to_string(rank) + " (device " + std::to_string(devices_[rank]) +
         (local_[rank] ? ")" : ", another process)");
}

std::string TcpChannel::Where(const CallDesc& d, const Piece& piece, std::string_view label) const {
  std::string s = ErrorPrefix(label) + d.Describe() + " on group " + FormatIds(devices_) + " (link " + name_;
  if (d.parts.size() > 1) s += ", operand " + std::to_string(piece.part);
  return s + ", units [" + std::to_string(piece.units.begin) + ", " + std::to_string(piece.units.end) + "))";
}

Status TcpChannel::Run(CallContext& ctx, int rank, int lane, std::span<const Piece> pieces) {
  // The lane's own deadline bounds the sockets' waits (a stall fails over like a hung shm range). An
  // abort of the lane needs nothing here: a tcp lane is aborted only after one of its ranks failed,
  // which broke the channel, and that wakes every rank's poll() (abort eventfd).
  TcpLimits limits;
  limits.deadline = ctx.LaneDeadlineFor(lane, &limits.budget_s);
  limits.label = ctx.label();
  // A ring broken by an earlier call (a stall past its deadline, a peer's error) is rebuilt by the
  // first of this call's ranks to get here; the executor gives a broken link a range again only to
  // probe it (or as a one-link group's next call), so that is where it is re-admitted.
  if (all_local_ && broken_.load(std::memory_order_acquire)) {
    const uint64_t seen = generation_.load(std::memory_order_acquire);
    if (broken_.load(std::memory_order_acquire)) FLEXLINK_RETURN_IF_ERROR(Reconnect(seen));
  }
  return RunPieces(ctx.desc(rank), ctx.size(), rank, pieces, limits);
}

Status TcpChannel::RunPieces(const CallDesc& d, int n, int rank, std::span<const Piece> pieces,
                             const TcpLimits& limits) {
  // Checked here because across processes nothing else stands between a caller and the ring: a bad
  // rank or piece must be an error, never an out-of-range index.
  if (n != static_cast<int>(devices_.size()) || rank < 0 || rank >= n || !local_[rank])
    return Status::InvalidArgument("flexlink: tcp link \"" + name_ + "\" on group " + FormatIds(devices_) +
                                   ": rank " + std::to_string(rank) + " of a group of " + std::to_string(n) +
                                   " is not a rank of this process");
  if (d.kind == Kind::kAllReduce || d.kind == Kind::kReduceScatter)
    for (const Part& p : d.parts) FLEXLINK_RETURN_IF_ERROR(CheckReduction(p.dtype, d.op));
  if (d.kind == Kind::kPpermute &&
      (d.sources.size() != static_cast<size_t>(n) ||
       std::any_of(d.sources.begin(), d.sources.end(), [n](int32_t s) { return s < -1 || s >= n; })))
    return Status::InvalidArgument("flexlink: tcp link \"" + name_ + "\": ppermute needs a source per rank");
  for (const Piece& piece : pieces)
    if (piece.part >= d.parts.size() || piece.units.begin > piece.units.end ||
        piece.units.end > d.parts[piece.part].units)
      return Status::InvalidArgument("flexlink: tcp link \"" + name_ + "\": piece outside the call's parts");
  // No barrier at the end: this rank touched only its own buffers, and its sends were copied into
  // the kernel before Pump returned, so peers never need them after we return. Pieces run one after
  // another, each a stream run with its own header: every rank runs the same pieces in order.
  for (const Piece& piece : pieces) {
    if (broken_.load()) return health();
    if (piece.units.empty()) continue;
    const Part& p = d.parts[piece.part];
    if (n == 1) {  // no ring: every kind is the identity, and the range is contiguous in both
      std::memmove(static_cast<char*>(p.out) + piece.units.begin * p.width(),
                   static_cast<const char*>(p.in) + piece.units.begin * p.width(), piece.units.size() * p.width());
      continue;
    }
    try {
      TcpRun run(*this, d, n, rank, piece, limits);
      FLEXLINK_RETURN_IF_ERROR(run.Go());
    } catch (const std::bad_alloc&) {
      // Scratch for forwarded blocks can be large (all_to_all: ~n²/2 blocks of the range). Breaking
      // the channel wakes the peers now instead of at the deadline.
      Break(Status::Internal(Where(d, piece) + ": out of memory for this rank's scratch"));
      return health();
    }
  }
  return Status::Ok();
}

Status TcpLink::FromSpec(const plan::LinkSpec& spec, std::unique_ptr<Link>* out) {
  FLEXLINK_RETURN_IF_ERROR(plan::CheckParamKeys(spec, {}));
  *out = std::make_unique<TcpLink>(spec.name.empty() ? "tcp" : spec.name);
  return Status::Ok();
}

}  // namespace flexlink
