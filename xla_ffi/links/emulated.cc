#include "xla_ffi/links/emulated.h"

#include <chrono>
#include <thread>
#include <vector>

#include "xla_ffi/links/shm.h"
#include "xla_ffi/links/tcp.h"

namespace flexlink {

double EmulatedPace::Seconds(const CallDesc& desc, std::span<const Piece> pieces, int n) const {
  double bytes = 0;
  for (const Piece& piece : pieces) bytes += static_cast<double>(piece.units.size() * desc.parts[piece.part].width());
  const double ranks = n;
  // Bytes the nccl-tests formula credits per second of link time, per byte of busbw.
  double moved = 0;
  switch (desc.kind) {
    case Kind::kAllReduce: moved = bytes * 2 * (ranks - 1) / ranks; break;
    case Kind::kAllGather:
    case Kind::kReduceScatter:
    case Kind::kAllToAll: moved = bytes * ranks * (ranks - 1) / ranks; break;
    case Kind::kPpermute: moved = bytes; break;
  }
  return latency_us.load() * 1e-6 + moved / (gbps.load() * 1e9);
}

Status EmulatedChannel::Run(CallContext& ctx, int rank, int lane, std::span<const Piece> pieces) {
  // Under the executor the clock starts when the range was posted (see CallContext::DispatchTime).
  const auto dispatched = ctx.DispatchTime(rank);
  const auto start = dispatched.time_since_epoch().count() != 0 ? dispatched
                                                                 : std::chrono::steady_clock::now();
  FLEXLINK_RETURN_IF_ERROR(base_->Run(ctx, rank, lane, pieces));
  if (pieces.empty()) return Status::Ok();
  const double seconds = pace_->Seconds(ctx.desc(rank), pieces, ctx.size());
  std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                            std::chrono::duration<double>(seconds)));
  return Status::Ok();
}

Status EmulatedChannel::RunAlone(CallContext& ctx, int rank, const CallDesc& desc) {
  FLEXLINK_RETURN_IF_ERROR(ctx.Arrive(rank, desc, link_name()));
  ctx.SetDispatchTime(rank, ctx.ArrivedTime());
  thread_local std::vector<Piece> pieces;
  desc.AllPieces(&pieces);
  return Run(ctx, rank, /*lane=*/0, pieces);
}

EmulatedLink::EmulatedLink(std::string name, std::unique_ptr<Link> base, double gbps, double latency_us)
    : name_(std::move(name)), base_(std::move(base)), pace_(std::make_shared<EmulatedPace>()) {
  SetRate(gbps, latency_us);
}

void EmulatedLink::SetRate(double gbps, double latency_us) {
  pace_->gbps.store(gbps);
  pace_->latency_us.store(latency_us);
}

std::unique_ptr<Channel> EmulatedLink::Open(std::span<const int64_t> devices) {
  return std::make_unique<EmulatedChannel>(name_, base_->Open(devices), pace_);
}

Status EmulatedLink::FromSpec(const plan::LinkSpec& spec, std::unique_ptr<Link>* out) {
  FLEXLINK_RETURN_IF_ERROR(plan::CheckParamKeys(spec, {"gbps", "latency_us", "base"}));
  if (spec.params.count("gbps") == 0)
    return Status::InvalidArgument("flexlink: link spec \"" + plan::FormatLinkSpec(spec) +
                                   "\": an emulated link needs gbps=<bus bandwidth in GB/s>");
  double gbps = 0, latency_us = 0;
  FLEXLINK_RETURN_IF_ERROR(plan::GetDoubleParam(spec, "gbps", 0, 1e-6, 1e6, &gbps));
  FLEXLINK_RETURN_IF_ERROR(plan::GetDoubleParam(spec, "latency_us", 0, 0, 1e7, &latency_us));
  auto base_it = spec.params.find("base");
  const std::string base = base_it == spec.params.end() ? "shm" : base_it->second;
  std::unique_ptr<Link> base_link;
  if (base == "shm") {
    base_link = std::make_unique<ShmLink>();
  } else if (base == "tcp") {
    base_link = std::make_unique<TcpLink>(spec.name.empty() ? "tcp" : spec.name);
  } else {
    return Status::InvalidArgument("flexlink: link spec \"" + plan::FormatLinkSpec(spec) + "\": base=\"" +
                                   base + "\" is not a link an emulated link can wrap (shm, tcp)");
  }
  *out = std::make_unique<EmulatedLink>(spec.name.empty() ? "emulated" : spec.name, std::move(base_link),
                                        gbps, latency_us);
  return Status::Ok();
}

}  // namespace flexlink
