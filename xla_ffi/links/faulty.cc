#include "xla_ffi/links/faulty.h"

#include <chrono>
#include <limits>
#include <string>
#include <thread>

#include "xla_ffi/core/rendezvous.h"

namespace flexlink {
namespace {

// Stage 1's nested calls run under run ids from INT64_MIN (core/executor_profile.cc).
bool IsProfileRun(int64_t run_id) {
  return run_id < std::numeric_limits<int64_t>::min() + (int64_t{1} << 40);
}

}  // namespace

const Fault* FaultyChannel::Next(CallContext& ctx, int rank, std::shared_ptr<const FaultSet>* hold,
                                 uint64_t* call) {
  *hold = CurrentFaults();
  if (!*hold || IsProfileRun(ctx.run_id())) return nullptr;
  *call = counter_.Next(rank, **hold);
  return (*hold)->ForLink(link_name(), *call);
}

Status FaultyChannel::Inject(CallContext& ctx, int rank, int lane, const Fault& f, uint64_t call,
                             const FaultSet& set) {
  const std::string what = ErrorPrefix(ctx.label()) + "link " + std::string(link_name()) + ": injected ";
  const std::string tail = " (FLEXLINK_FAULTS \"" + set.text + "\")";
  if (f.kind == Fault::Kind::kError)
    return Status::Unavailable(what + "error at its call " + std::to_string(call) + tail);
  // A hang: nothing happens until the lane's deadline (or an abort); then give up untouched.
  Status s = ctx.WaitLane(rank, lane, link_name());
  return Status::Unavailable(what + "hang at its call " + std::to_string(call) + ": " + s.message() + tail);
}

Status FaultyChannel::Run(CallContext& ctx, int rank, int lane, std::span<const Piece> pieces) {
  std::shared_ptr<const FaultSet> hold;
  uint64_t call = 0;
  const Fault* f = Next(ctx, rank, &hold, &call);
  if (!f) return inner_->Run(ctx, rank, lane, pieces);
  if (f->kind != Fault::Kind::kSlow) return Inject(ctx, rank, lane, *f, call, *hold);
  const auto start = std::chrono::steady_clock::now();
  Status s = inner_->Run(ctx, rank, lane, pieces);
  std::this_thread::sleep_for((std::chrono::steady_clock::now() - start) * (f->factor - 1));
  return s;
}

Status FaultyChannel::RunAlone(CallContext& ctx, int rank, const CallDesc& desc) {
  std::shared_ptr<const FaultSet> hold;
  uint64_t call = 0;
  const Fault* f = Next(ctx, rank, &hold, &call);
  if (!f) return inner_->RunAlone(ctx, rank, desc);
  if (f->kind != Fault::Kind::kSlow) {
    FLEXLINK_RETURN_IF_ERROR(ctx.Arrive(rank, desc, link_name()));
    return Inject(ctx, rank, /*lane=*/0, *f, call, *hold);
  }
  const auto start = std::chrono::steady_clock::now();
  Status s = inner_->RunAlone(ctx, rank, desc);
  std::this_thread::sleep_for((std::chrono::steady_clock::now() - start) * (f->factor - 1));
  return s;
}

}  // namespace flexlink
