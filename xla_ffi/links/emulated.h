// The emulated link: a real link (shm by default, or tcp) paced to a given bus bandwidth and
// latency, so GPU-like topologies (NVLink >> PCIe ~ NIC) can be reproduced at small scale here.
//
//   emulated[:name]@gbps=X[,latency_us=Y][,base=shm|tcp]
//
// A range runs on the base channel, then the rank sleeps (sleep_until: no CPU burnt, this machine has
// two cores) until start + latency + time, where `time` makes the nccl-tests bus bandwidth of the
// range equal gbps (GB/s, 1e9 bytes/s), with `range bytes` summed over the range's pieces of every part:
//   all_reduce      algbw = range bytes / time,            busbw = algbw * 2(n-1)/n
//   all_gather      algbw = range bytes * n / time,        busbw = algbw * (n-1)/n   (gathered output)
//   reduce_scatter  algbw = range bytes * n / time,        busbw = algbw * (n-1)/n   (input of the range)
//   ppermute        algbw = range bytes / time,            busbw = algbw             (SendRecv)
//   all_to_all      algbw = range bytes * n / time,        busbw = algbw * (n-1)/n   (the whole buffer)
// Every rank paces the same way, so the call's time on the link is the paced time (as long as the
// base link is faster than the pace). The rate can be changed while running (SetRate), which is how
// tests and the balancer's re-convergence check slow a link down mid-run.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "xla_ffi/links/link.h"
#include "xla_ffi/plan/link_spec.h"

namespace flexlink {

// The pace shared by a link and every channel it opened.
struct EmulatedPace {
  std::atomic<double> gbps{1.0};
  std::atomic<double> latency_us{0.0};
  // Seconds the pieces of `desc` on `n` ranks take at this pace (a piece of u units counts u
  // elements of its part, as bytes in the formulas above).
  double Seconds(const CallDesc& desc, std::span<const Piece> pieces, int n) const;
};

class EmulatedChannel final : public Channel {
 public:
  EmulatedChannel(std::string name, std::unique_ptr<Channel> base, std::shared_ptr<const EmulatedPace> pace)
      : name_(std::move(name)), base_(std::move(base)), pace_(std::move(pace)) {}
  std::string_view link_name() const override { return name_; }
  Status Run(CallContext& ctx, int rank, int lane, std::span<const Piece> pieces) override;
  // Alone, too, the pace starts when the last rank arrived (as under the executor), so one link alone
  // and a split are timed alike.
  Status RunAlone(CallContext& ctx, int rank, const CallDesc& desc) override;

 private:
  const std::string name_;
  const std::unique_ptr<Channel> base_;
  const std::shared_ptr<const EmulatedPace> pace_;
};

class EmulatedLink final : public Link {
 public:
  // `base` is the link that moves the bytes (its own name is not used: errors and stats name this one).
  EmulatedLink(std::string name, std::unique_ptr<Link> base, double gbps, double latency_us);
  // From "emulated[:name]@gbps=X[,latency_us=Y][,base=shm|tcp]"; gbps is required.
  static Status FromSpec(const plan::LinkSpec& spec, std::unique_ptr<Link>* out);

  std::string_view name() const override { return name_; }
  std::unique_ptr<Channel> Open(std::span<const int64_t> devices) override;

  // Thread-safe; takes effect at the next range any channel of this link runs.
  void SetRate(double gbps, double latency_us);
  double gbps() const { return pace_->gbps.load(); }
  double latency_us() const { return pace_->latency_us.load(); }

 private:
  const std::string name_;
  const std::unique_ptr<Link> base_;
  const std::shared_ptr<EmulatedPace> pace_;
};

}  // namespace flexlink
