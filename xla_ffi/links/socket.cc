#include "xla_ffi/links/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "xla_ffi/core/deadline.h"

namespace flexlink::net {
namespace {

// Kernel buffer size asked for (the kernel caps it at net.core.{w,r}mem_max, 4 MiB here).
constexpr int kSocketBufferBytes = 4 << 20;

sockaddr_in Loopback(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

}  // namespace

Clock::time_point DeadlineIn(double seconds) {
  return DeadlineAfter(seconds);
}

int PollMillis(Clock::time_point deadline) {
  const auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

std::string ErrnoText(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

void TuneSocket(int fd) {
  const int one = 1, bytes = kSocketBufferBytes;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
}

Status Listen(int* fd, uint16_t* port) {
  *fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (*fd < 0) return Status::Internal(ErrnoText("socket"));
  // Buffer sizes are inherited by accepted sockets; set them before listen so the window scale fits.
  TuneSocket(*fd);
  sockaddr_in a = Loopback(0);
  socklen_t len = sizeof a;
  if (bind(*fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(*fd, 16) != 0 ||
      getsockname(*fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    Status s = Status::Internal(ErrnoText("bind/listen on 127.0.0.1"));
    close(*fd);
    *fd = -1;
    return s;
  }
  *port = ntohs(a.sin_port);
  return Status::Ok();
}

// Waits for `events` on `fd` until the deadline; false on timeout.
static bool WaitFd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, PollMillis(deadline));
    if (r > 0) return true;
    if (r == 0 || errno != EINTR) return false;
  }
}

Status ConnectHello(uint16_t port, std::span<const uint8_t> hello, Clock::time_point deadline, int* fd) {
  *fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (*fd < 0) return Status::Internal(ErrnoText("socket"));
  TuneSocket(*fd);
  auto fail = [&](Status s) {
    close(*fd);
    *fd = -1;
    return s;
  };
  sockaddr_in a = Loopback(port);
  if (connect(*fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    if (errno != EINPROGRESS) return fail(Status::Internal(ErrnoText("connect to 127.0.0.1")));
    if (!WaitFd(*fd, POLLOUT, deadline)) return fail(Status::DeadlineExceeded("connect timed out"));
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(*fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      errno = err;
      return fail(Status::Internal(ErrnoText("connect to 127.0.0.1")));
    }
  }
  for (size_t done = 0; done < hello.size();) {
    const ssize_t w = send(*fd, hello.data() + done, hello.size() - done, MSG_NOSIGNAL);
    if (w > 0) {
      done += static_cast<size_t>(w);
    } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
      return fail(Status::Internal(ErrnoText("send handshake")));
    } else if (!WaitFd(*fd, POLLOUT, deadline)) {
      return fail(Status::DeadlineExceeded("handshake send timed out"));
    }
  }
  return Status::Ok();
}

Status AcceptHello(int listen_fd, std::span<const uint8_t> hello, Clock::time_point deadline, int* fd,
                   int* rejected) {
  struct Pending {
    int fd;
    size_t got;  // bytes of `hello` matched so far
  };
  std::vector<Pending> pending;
  int dropped = 0;
  auto drop = [&](size_t i) {
    close(pending[i].fd);
    pending.erase(pending.begin() + static_cast<long>(i));
    ++dropped;
  };
  auto finish = [&](int result_fd, Status s) {
    for (const Pending& p : pending) close(p.fd);
    dropped += static_cast<int>(pending.size());
    if (rejected) *rejected = dropped;
    *fd = result_fd;
    return s;
  };
  for (;;) {
    std::vector<pollfd> fds{{listen_fd, POLLIN, 0}};
    for (const Pending& p : pending) fds.push_back({p.fd, POLLIN, 0});
    const int r = poll(fds.data(), fds.size(), PollMillis(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return finish(-1, Status::Internal(ErrnoText("poll")));
    if (r == 0) return finish(-1, Status::DeadlineExceeded("no peer presented the handshake token"));
    // Read pending connections first (indices shift as bad ones are dropped: walk backwards).
    for (size_t i = pending.size(); i-- > 0;) {
      if (fds[i + 1].revents == 0) continue;
      Pending& p = pending[i];
      uint8_t buf[64];
      const size_t want = std::min(sizeof buf, hello.size() - p.got);
      const ssize_t n = recv(p.fd, buf, want, 0);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (n <= 0 || std::memcmp(buf, hello.data() + p.got, static_cast<size_t>(n)) != 0) {
        drop(i);
        continue;
      }
      p.got += static_cast<size_t>(n);
      if (p.got == hello.size()) {
        const int good = p.fd;
        pending.erase(pending.begin() + static_cast<long>(i));
        return finish(good, Status::Ok());
      }
    }
    if (fds[0].revents & POLLIN) {
      const int c = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (c >= 0) {
        TuneSocket(c);
        pending.push_back({c, 0});
      }
    }
  }
}

std::vector<uint8_t> RingHello(std::span<const uint8_t> token, int from, int to) {
  std::vector<uint8_t> h(kRingTokenBytes + 8, 0);
  const uint32_t ids[2] = {static_cast<uint32_t>(from), static_cast<uint32_t>(to)};
  std::memcpy(h.data(), token.data(), std::min(token.size(), kRingTokenBytes));
  std::memcpy(h.data() + kRingTokenBytes, ids, sizeof ids);
  return h;
}

}  // namespace flexlink::net
