// Two byte streams of one rank for one run of the tcp link: what it sends to the next rank and what it
// receives from the previous one, each a queue of buffers. Pump() moves both with non-blocking
// readv/writev and one poll() until every posted receive is complete and every queued send is out,
// so a rank's send and receive progress together (a ring of ranks on blocking sends would deadlock
// once the kernel buffers fill).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <functional>
#include <vector>

#include "xla_ffi/links/socket.h"

namespace flexlink::net {

class Streams {
 public:
  enum class Result { kOk, kRecvTimeout, kSendTimeout, kAborted, kClosed, kError };

  // `abort_fd` (-1: none) ends the pump with kAborted once it is readable.
  Streams(int send_fd, int recv_fd, int abort_fd, Clock::time_point deadline)
      : send_fd_(send_fd), recv_fd_(recv_fd), abort_fd_(abort_fd), deadline_(deadline) {}

  // Queues `len` bytes at `p` after everything queued before (the buffer must stay valid until Pump
  // returns). May be called from the receive callback.
  void Send(const void* p, size_t len) {
    if (len) send_.push_back({const_cast<void*>(p), len});
  }
  // Posts a destination for the next `len` bytes of the incoming stream; returns its item index.
  size_t Recv(void* p, size_t len) {
    recv_.push_back({p, len});
    return recv_.size() - 1;
  }

  // Runs until done; `on_recv(i)` is called once per receive item i, in order, as soon as it is
  // complete (it may queue sends). Returns kOk, or why it stopped (errno in error_number()).
  Result Pump(const std::function<void(size_t)>& on_recv);

  // Test hook (TcpChannel::StallSendsForTest): queued sends never go out, as if the socket's writes
  // had stopped; the pump still receives and ends at its deadline or abort.
  void HoldSends() { hold_sends_ = true; }
  void SetDeadline(Clock::time_point deadline) { deadline_ = deadline; }

  size_t bytes_received() const { return received_; }
  size_t bytes_expected() const;
  int error_number() const { return errno_; }

 private:
  bool SendSome(Result* r);
  bool RecvSome(Result* r, const std::function<void(size_t)>& on_recv);

  const int send_fd_, recv_fd_, abort_fd_;
  Clock::time_point deadline_;
  std::vector<iovec> send_, recv_;
  size_t send_item_ = 0, send_off_ = 0, recv_item_ = 0, recv_off_ = 0;
  size_t received_ = 0;
  int errno_ = 0;
  bool hold_sends_ = false;
};

}  // namespace flexlink::net
