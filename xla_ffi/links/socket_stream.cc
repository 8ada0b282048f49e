#include "xla_ffi/links/socket_stream.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace flexlink::net {
namespace {

// iovecs per system call: enough to cover several pipeline chunks at once.
constexpr size_t kMaxIov = 64;

// Fills `iov` from `items` starting at (item, off); returns the count.
size_t Gather(const std::vector<iovec>& items, size_t item, size_t off, iovec* iov) {
  size_t k = 0;
  for (size_t i = item; i < items.size() && k < kMaxIov; ++i, ++k) {
    iov[k].iov_base = static_cast<char*>(items[i].iov_base) + (i == item ? off : 0);
    iov[k].iov_len = items[i].iov_len - (i == item ? off : 0);
  }
  return k;
}

// Advances (item, off) over `n` bytes of `items`; returns how many items were completed.
size_t Advance(const std::vector<iovec>& items, size_t* item, size_t* off, size_t n) {
  size_t completed = 0;
  while (n > 0) {
    const size_t take = std::min(n, items[*item].iov_len - *off);
    *off += take;
    n -= take;
    if (*off == items[*item].iov_len) {
      ++*item;
      *off = 0;
      ++completed;
    }
  }
  return completed;
}

}  // namespace

size_t Streams::bytes_expected() const {
  size_t total = 0;
  for (const iovec& v : recv_) total += v.iov_len;
  return total;
}

bool Streams::SendSome(Result* r) {
  if (send_item_ == send_.size() || hold_sends_) return false;
  iovec iov[kMaxIov];
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = Gather(send_, send_item_, send_off_, iov);
  const ssize_t n = sendmsg(send_fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n > 0) {
    Advance(send_, &send_item_, &send_off_, static_cast<size_t>(n));
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  errno_ = errno;
  *r = errno == EPIPE || errno == ECONNRESET ? Result::kClosed : Result::kError;
  return false;
}

bool Streams::RecvSome(Result* r, const std::function<void(size_t)>& on_recv) {
  // Zero-length items complete without bytes (never posted in practice, but harmless).
  while (recv_item_ < recv_.size() && recv_[recv_item_].iov_len == 0) on_recv(recv_item_++);
  if (recv_item_ == recv_.size()) return false;
  iovec iov[kMaxIov];
  const size_t cnt = Gather(recv_, recv_item_, recv_off_, iov);
  const ssize_t n = readv(recv_fd_, iov, static_cast<int>(cnt));
  if (n > 0) {
    received_ += static_cast<size_t>(n);
    const size_t first = recv_item_;
    const size_t done = Advance(recv_, &recv_item_, &recv_off_, static_cast<size_t>(n));
    for (size_t i = first; i < first + done; ++i) on_recv(i);
    return true;
  }
  if (n == 0) {
    *r = Result::kClosed;
    return false;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
  errno_ = errno;
  *r = Result::kError;
  return false;
}

Streams::Result Streams::Pump(const std::function<void(size_t)>& on_recv) {
  for (;;) {
    Result r = Result::kOk;
    // Try both directions before sleeping: the common case has data or room already.
    bool progress = RecvSome(&r, on_recv);
    if (r != Result::kOk) return r;
    progress = SendSome(&r) || progress;
    if (r != Result::kOk) return r;
    const bool sending = send_item_ < send_.size(), receiving = recv_item_ < recv_.size();
    if (!sending && !receiving) return Result::kOk;
    if (progress) continue;
    pollfd fds[3];
    nfds_t k = 0;
    // Held sends are not polled for (the socket is writable: that would spin); a held rank that has
    // nothing left to receive still notices its predecessor hanging up (POLLRDHUP), as a stuck
    // process would be released when its peers give up.
    if (sending && !hold_sends_) fds[k++] = {send_fd_, POLLOUT, 0};
    const bool watch_hangup = hold_sends_ && !receiving;
    if (receiving) fds[k++] = {recv_fd_, POLLIN, 0};
    const nfds_t hangup = k;
    if (watch_hangup) fds[k++] = {recv_fd_, POLLRDHUP, 0};
    if (abort_fd_ >= 0) fds[k++] = {abort_fd_, POLLIN, 0};
    const int p = poll(fds, k, PollMillis(deadline_));
    if (p < 0 && errno != EINTR) {
      errno_ = errno;
      return Result::kError;
    }
    if (p == 0) return receiving ? Result::kRecvTimeout : Result::kSendTimeout;
    if (abort_fd_ >= 0 && (fds[k - 1].revents & POLLIN)) return Result::kAborted;
    if (watch_hangup && (fds[hangup].revents & (POLLRDHUP | POLLHUP | POLLERR))) return Result::kClosed;
  }
}

}  // namespace flexlink::net
