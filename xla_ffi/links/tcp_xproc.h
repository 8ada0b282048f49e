// The tcp link across OS processes on one host (a jax.distributed job): the same ring and the same
// channel code as in one process (tcp.h) — bytes move only through the sockets and a rank reads and
// writes only its own buffers, so nothing else needs to cross the process boundary.
//
// Connecting takes two phases because the kernel-chosen ports must travel between processes (the
// Python glue passes them, and a 16-byte random token one process chose, through jax.distributed's
// key-value store):
//   1. ListenCrossProcessTcp: one 127.0.0.1 listener per rank local to this process; returns their
//      ports. The listeners wait (keyed by group devices + link name) for phase 2.
//   2. ConnectCrossProcessTcp(ports of all n ranks, token): each local rank r connects to rank
//      (r+1)%n's port and sends the hello (token + both ranks, as in one process) — the listen backlog
//      takes the connection even before that process reaches its accept, so every process can do all
//      its connects first and no order between processes is needed; then each local rank accepts its
//      predecessor's connection, closing (and counting) every connection that does not present the
//      expected hello. All of it ends at the configured deadline (TimeoutSeconds); the listeners are
//      closed afterwards, so nothing connects later. The channel is registered for the group even on
//      failure: then it is broken and its runs return the connection error (never a hang).
// The engine finds the channel with CrossProcessTcp and runs it with TcpChannel::RunPieces.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/links/socket.h"
#include "xla_ffi/links/tcp.h"

namespace flexlink {

inline constexpr size_t kTcpTokenBytes = net::kRingTokenBytes;

// Phase 1 for the group `devices` (global ids, rank order) of which `local_devices` live in this
// process: `*ports` gets one port per local device, in the order of `local_devices`. Listening again
// before Connect replaces the pending listeners; a group that is already connected is an error.
Status ListenCrossProcessTcp(std::span<const int64_t> devices, std::span<const int64_t> local_devices,
                             std::string_view link_name, std::vector<uint16_t>* ports);

// Phase 2: `ports` are all n ranks' ports in rank order (this process's as Listen returned them),
// `token` the job's kTcpTokenBytes. `*refused` gets the number of connections closed for a missing or
// wrong hello (also on failure). On failure the message names the group and the rank whose
// connection failed, and a broken channel is registered.
Status ConnectCrossProcessTcp(std::span<const int64_t> devices, std::span<const int64_t> local_devices,
                              std::span<const uint16_t> ports, std::span<const uint8_t> token,
                              std::string_view link_name, int* refused);

// The connected (possibly broken) channel of the group, or nullptr if Connect never ran for it. The
// channel lives until the process exits.
TcpChannel* CrossProcessTcp(std::span<const int64_t> devices, std::string_view link_name);
// Connections refused while connecting the group (-1 if Connect never ran for it).
int CrossProcessTcpRefused(std::span<const int64_t> devices, std::string_view link_name);

}  // namespace flexlink
