// Small loopback-socket helpers for the tcp link: listeners bound to 127.0.0.1 only, non-blocking
// connects, and the token handshake that keeps anything outside the job out. Every wait takes a
// deadline and blocks in poll() (never spins: device threads outnumber cores).
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "xla_ffi/core/status.h"

namespace flexlink::net {

using Clock = std::chrono::steady_clock;

// A deadline `seconds` from now, clamped so an "infinite" timeout cannot overflow the clock.
Clock::time_point DeadlineIn(double seconds);
// Milliseconds left until `deadline` for poll(): >= 0, rounded up so we never wake early and spin.
int PollMillis(Clock::time_point deadline);

// A non-blocking, close-on-exec TCP listener on 127.0.0.1, port chosen by the kernel.
Status Listen(int* fd, uint16_t* port);

// The first bytes a ring's rank `from` sends to rank `to` (the tcp link, in one process and across
// processes): the ring's 16-byte random token, then both ranks, so that a connection is taken only
// from the expected neighbour of the expected ring.
inline constexpr size_t kRingTokenBytes = 16;
std::vector<uint8_t> RingHello(std::span<const uint8_t> token, int from, int to);

// Connects to 127.0.0.1:`port` (non-blocking connect, bounded by `deadline`), sets TCP_NODELAY and
// large buffers, and writes `hello` as the connection's first bytes. The fd is left non-blocking.
Status ConnectHello(uint16_t port, std::span<const uint8_t> hello, Clock::time_point deadline, int* fd);

// Accepts on `listen_fd` until a connection presents exactly `hello` as its first bytes. Connections
// that present anything else are closed at the first wrong byte; silent ones are watched concurrently
// (one cannot stall the accept) and closed when the accept ends. `*rejected` counts the closed ones.
// The accepted fd is non-blocking with TCP_NODELAY and large buffers.
Status AcceptHello(int listen_fd, std::span<const uint8_t> hello, Clock::time_point deadline, int* fd,
                   int* rejected = nullptr);

// TCP_NODELAY (each pipeline chunk goes out at once) and large kernel buffers, so that a ring of
// threads sharing two cores keeps data in flight while the receiver is descheduled.
void TuneSocket(int fd);

// "connect: Connection refused" style text of errno.
std::string ErrnoText(const char* what);

}  // namespace flexlink::net
