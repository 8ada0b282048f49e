// One rank's run of one piece on the tcp link: the header that opens it, the pump, and the failure
// messages. The stream items of each kind are queued by tcp_reduce.cc and tcp_exchange.cc.
#include <poll.h>

#include <cerrno>
#include <cstdio>
#include <string>

#include "xla_ffi/core/config.h"
#include "xla_ffi/links/socket.h"
#include "xla_ffi/links/tcp_run.h"

namespace flexlink {

using tcp::Header;
using tcp::kChunkBytes;
using tcp::kMagic;

namespace {

// The run's deadline: the global one from now, or the lane's if that comes first.
net::Clock::time_point RunDeadline(const TcpLimits& limits, bool* lane_first) {
  const net::Clock::time_point global = net::DeadlineIn(TimeoutSeconds());
  *lane_first = limits.deadline < global;
  return *lane_first ? limits.deadline : global;
}

// Whether the peer of socket `fd` has closed it (its FIN or reset arrived), also behind data not
// read yet: POLLRDHUP is set once the FIN is in, whatever is still queued before it.
bool HungUp(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

}  // namespace

TcpRun::TcpRun(TcpChannel& ch, const CallDesc& call, int n, int rank, const Piece& piece, const TcpLimits& limits)
    : ch_(ch), limits_(limits), call_(call), d_(call.parts[piece.part]), n_(n), k_(rank), piece_(piece), range_(piece.units),
      st_(ch.ranks_[rank]), wire_(d_.dtype, call.op),
      io_(st_.send_fd, st_.recv_fd, ch.abort_fd_, RunDeadline(limits, &lane_first_)) {
  // A real stall for tests: this rank's writes stop (the peers see a silent socket), and like a stuck
  // process it does not give up at the lane's deadline: its peers do, and their hang-up releases it.
  if (ch.stall_rank_.load() == rank && ch.stall_runs_.fetch_sub(1) > 0) {
    io_.HoldSends();
    io_.SetDeadline(net::DeadlineIn(TimeoutSeconds()));
    lane_first_ = false;
  }
  cu_ = std::max<size_t>(1, kChunkBytes / wire_.ww);
  m_ = (range_.size() + cu_ - 1) / cu_;
  out_ = static_cast<char*>(d_.out);
  in_ = static_cast<const char*>(d_.in);
}

Status TcpRun::Go() {
  header_out_ = Header{kMagic, static_cast<uint32_t>(call_.kind), st_.runs.load(), piece_.part, range_.begin,
                       range_.end};
  st_.runs.fetch_add(1);
  io_.Send(&header_out_, sizeof header_out_);
  io_.Recv(&header_in_, sizeof header_in_);
  switch (call_.kind) {
    case Kind::kAllReduce: AllReduce(); break;
    case Kind::kAllGather: AllGather(); break;
    case Kind::kReduceScatter: ReduceScatter(); break;
    case Kind::kPpermute: Ppermute(); break;
    case Kind::kAllToAll: AllToAll(); break;
  }
  bad_header_ = false;
  const auto r = io_.Pump([&](size_t i) {
    if (i == 0) return CheckHeader();
    if (!bad_header_) handlers_[i - 1]();
  });
  if (bad_header_) return Fail(Status::Internal(BadHeader()));
  return Finish(r);
}

void TcpRun::CheckHeader() {
  bad_header_ = std::memcmp(&header_in_, &header_out_, sizeof header_in_) != 0;
  if (bad_header_) ch_.Break(Status::Internal(BadHeader()));  // stops the pump via the abort fd
}

std::string TcpRun::BadHeader() const {
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

Status TcpRun::Finish(net::Streams::Result r) {
  using R = net::Streams::Result;
  const int prev = (k_ + n_ - 1) % n_, next = (k_ + 1) % n_;
  // At the lane's deadline the link missed its own deadline (the call goes on: its range fails
  // over); at the global one the whole call timed out.
  char secs[32];
  std::snprintf(secs, sizeof secs, "%g", lane_first_ ? limits_.budget_s : TimeoutSeconds());
  const std::string timed_out = lane_first_ ? std::string(": link ") + ch_.name_ + " missed its deadline of " + secs +
                                                  " s (the link's own deadline: docs/faults.md, FLEXLINK_LINK_TIMEOUT_S)"
                                            : std::string(": timed out after ") + secs + " s";
  const std::string got = " (received " + std::to_string(io_.bytes_received()) + " of " +
                          std::to_string(io_.bytes_expected()) + " bytes)";
  switch (r) {
    case R::kOk: return Status::Ok();
    case R::kAborted: return ch_.health();
    case R::kRecvTimeout:
      return Fail(Status::DeadlineExceeded(Where() + timed_out + Absent() + " waiting for " + ch_.RankName(prev) +
                                           " to send" + got));
    case R::kSendTimeout:
      return Fail(Status::DeadlineExceeded(Where() + timed_out + Absent() + " waiting for " + ch_.RankName(next) +
                                           " to receive"));
    case R::kClosed:
    case R::kError: {
      // Which side ended: a receive that read EOF leaves errno 0, a send that hit a closed peer
      // EPIPE/ECONNRESET (kClosed), a receive reset by a peer that died with unread data ECONNRESET
      // (kError). Naming the neighbour matters across processes, where a closed socket is how a
      // dead process shows.
      const int e = io_.error_number();
      const bool recv_side = (r == R::kClosed && e == 0) || (r == R::kError && e == ECONNRESET);
      const bool send_side = r == R::kClosed && e != 0;
      if (recv_side || send_side) {
        const int peer = recv_side ? prev : next, other = recv_side ? next : prev;
        // A death travels round the ring as closed sockets, so the side this rank failed on first
        // need not be the dead process's: a predecessor's FIN may wait behind data still unread
        // when a send to the successor fails (seen under ASan). If the other side has closed
        // too, both are named.
        const bool both = other != peer && HungUp(recv_side ? st_.send_fd : st_.recv_fd);
        const bool remote = !ch_.is_local(peer) || (both && !ch_.is_local(other));
        const std::string why = remote ? " (a process exited, or its side of the ring failed)" : "";
        if (both)
          return Fail(Status::Internal(Where() + ": " + ch_.RankName(peer) + " and " + ch_.RankName(other) +
                                       " closed their connections" + why + got));
        return Fail(Status::Internal(Where() + ": " + ch_.RankName(peer) + " closed its connection" +
                                     (remote ? " (its process exited, or its side of the ring failed)" : "") + got));
      }
      errno = e;
      return Fail(Status::Internal(Where() + ": " + net::ErrnoText("socket I/O")));
    }
  }
  return Status::Internal("tcp: unknown result");
}

// In a ring the neighbour we wait for may itself be waiting; name the ranks that never started
// this range (", rank 2 (device 102) did not start this range;"), if any. Only ranks of this process
// have counters here (the others' entries are this process's unused copies); of a remote
// predecessor we know only whether anything of this range arrived from it.
std::string TcpRun::Absent() const {
  std::string s;
  int count = 0;
  for (int r = 0; r < n_; ++r)
    if (ch_.is_local(r) && ch_.ranks_[r].runs.load() <= header_out_.run) {
      s += (count++ ? ", " : ": ") + ch_.RankName(r);
    }
  if (count > 0) s += " did not start this range;";
  const int prev = (k_ + n_ - 1) % n_;
  if (!ch_.is_local(prev) && io_.bytes_received() == 0)
    s += (count ? " " : ": ") + ch_.RankName(prev) + " sent nothing of this range;";
  return s;
}

Status TcpRun::Fail(Status s) {
  ch_.Break(s);
  return ch_.health();
}

}  // namespace flexlink
