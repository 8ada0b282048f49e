// Fault injection at the channel boundary (docs/faults.md): every channel the engine opens is wrapped
// in a FaultyChannel, which passes calls through untouched unless FLEXLINK_FAULTS /
// jax_flexlink.inject_faults names its link (core/faults.h). Faults are decided before the real
// channel runs, so an injected error or hang never touches a buffer (their status is kUnavailable:
// the executor may re-run the range elsewhere even in place); a slow fault runs the real channel and
// then waits (factor - 1) x its time. Stage 1's own timing calls are neither counted nor faulted.
#pragma once

#include <memory>
#include <span>
#include <string_view>

#include "xla_ffi/core/faults.h"
#include "xla_ffi/links/link.h"

namespace flexlink {

class FaultyChannel : public Channel {
 public:
  FaultyChannel(std::unique_ptr<Channel> inner, int ranks) : inner_(std::move(inner)), counter_(ranks) {}
  std::string_view link_name() const override { return inner_->link_name(); }
  Status Run(CallContext& ctx, int rank, int lane, std::span<const Piece> pieces) override;
  Status RunAlone(CallContext& ctx, int rank, const CallDesc& desc) override;

 private:
  // The fault that fires at this rank's next call of the link (counting it), or null.
  const Fault* Next(CallContext& ctx, int rank, std::shared_ptr<const FaultSet>* hold, uint64_t* call);
  // An injected error or hang at `call`, after this rank arrived: its status.
  Status Inject(CallContext& ctx, int rank, int lane, const Fault& f, uint64_t call, const FaultSet& set);
  std::unique_ptr<Channel> inner_;
  FaultCounter counter_;
};

}  // namespace flexlink
