// The link interface. A Link is a configured transport ("shm", later "tcp", "emulated:nvlink@...");
// opening it on a communicator gives a Channel, which owns whatever the transport needs per group
// (staging memory, sockets, ...). A channel runs a sub-collective for one call on a range of units
// (see CallDesc) for every rank; it never decides routing — the engine (and later the executor and
// balancer of the multi-path engine) decides which channel runs which range.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/rendezvous.h"
#include "xla_ffi/core/status.h"

namespace flexlink {

class Channel {
 public:
  virtual ~Channel() = default;

  // The name of the link this channel belongs to (stats and error messages use it).
  virtual std::string_view link_name() const = 0;

  // Runs `pieces` of `ctx`'s call for `rank`: each a part and a unit range of it (core/call.h), in
  // order, part by part. Called by every rank of the call with the same pieces, each rank on its own
  // thread, after ctx.Arrive returned OK, so every rank's buffers are in ctx.desc(r). `lane` is this
  // channel's private barrier sequence in ctx (ranges of one call may run on several channels
  // concurrently). Touches the call's buffers only within the pieces (a channel may write peers'
  // outputs there, as shm does), and must not return while a peer may still read or write this
  // rank's buffers within them.
  virtual Status Run(CallContext& ctx, int rank, int lane, std::span<const Piece> pieces) = 0;

  // Runs the whole call on this channel alone, the arrival included. The default arrives and runs
  // every part whole; a channel may do work before arriving (shm stages small inputs, all parts of
  // the call together, so that the arrival is the only rendezvous of the call).
  virtual Status RunAlone(CallContext& ctx, int rank, const CallDesc& desc) {
    FLEXLINK_RETURN_IF_ERROR(ctx.Arrive(rank, desc, link_name()));
    thread_local std::vector<Piece> pieces;
    desc.AllPieces(&pieces);
    return Run(ctx, rank, /*lane=*/0, pieces);
  }
};

class Link {
 public:
  virtual ~Link() = default;
  virtual std::string_view name() const = 0;
  // A channel of this link for a group of `devices` (global ids, rank order).
  virtual std::unique_ptr<Channel> Open(std::span<const int64_t> devices) = 0;
};

}  // namespace flexlink
