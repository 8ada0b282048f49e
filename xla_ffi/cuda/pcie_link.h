// The pcie link: GPU -> pinned host -> GPU staging over each GPU's own PCIe lanes.
//
// Per group: pinned host slots (2 rounds x 2 parities x slot_bytes, allocated once at setup) that
// all ranks share, and per rank three streams (device-to-host, host-to-device, kernels), device
// scratch (2 parities of receive and send buffers, slot_bytes each) and events. A call is cut into
// chunks (pcie_chunks.h); chunk s of a round uses host slot s % 2, so the copy of chunk s+1 into the
// host overlaps the copies of chunk s out of it (double buffering, both copy engines busy).
// Every cross-rank dependency is an event: a consumer's host-to-device copy waits for the
// producers' "posted" events, a producer's reuse of a slot waits for the consumers' "consumed"
// events of two chunks earlier; pcie_gate.h orders the threads so each wait binds to the right
// record. Reductions run on the GPU after the host-to-device copies, in rank order with the engine's
// kernels (reduce-scatter through the host, then all-gather of the reduced slices: per rank and
// buffer N, N bytes device-to-host and 2N(n-1)/n host-to-device; docs/cuda.md has the comparison
// with reducing on host cores). Nothing waits for the device on the calling thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/cuda/device_api.h"
#include "xla_ffi/cuda/device_ledger.h"
#include "xla_ffi/cuda/gpu_link.h"
#include "xla_ffi/cuda/pcie_chunks.h"
#include "xla_ffi/cuda/pcie_gate.h"
#include "xla_ffi/plan/link_spec.h"

namespace flexlink::gpu {

struct PcieOptions {
  size_t slot_bytes = 8 << 20;  // one host slot; the link pins 4 per group and allocates 4 per rank on its GPU
};

class PcieLink : public GpuLink {
 public:
  PcieLink(std::string name, DeviceApi* api, PcieOptions options)
      : name_(std::move(name)), api_(api), options_(options) {}
  // Parameters: slot_mib (default 8).
  static Status FromSpec(const plan::LinkSpec& spec, DeviceApi* api, std::unique_ptr<GpuLink>* out);
  std::string_view name() const override { return name_; }
  std::unique_ptr<GpuChannel> Open(const GroupInfo& group) override;

 private:
  const std::string name_;
  DeviceApi* const api_;
  const PcieOptions options_;
};

class PcieChannel : public GpuChannel {
 public:
  static constexpr int kRing = 4;  // events per (rank, kind): records of seq s go to s % kRing

  PcieChannel(std::string name, DeviceApi* api, GroupInfo group, PcieOptions options);
  std::string_view link_name() const override { return name_; }
  Status Setup() override;
  Status Enqueue(const GpuWork& work) override;
  void Forsake(const std::string& why) override;
  bool Drained(std::string* busy) override { return ledger_.Drained(busy); }
  Status Release(double timeout_s) override;

 private:
  struct Rank {
    int device = 0;
    Stream d2h = nullptr, h2d = nullptr, comp = nullptr;
    Event fork = nullptr, join[3] = {};
    Event ring[PcieGate::kNumKinds][kRing] = {};
    // Per local parity (LocalParity): the host-to-device copies of a chunk done, the kernel that
    // read recv done, the packed send buffer ready, its device-to-host copy done.
    Event h2d_done[2] = {}, kernel_done[2] = {}, packed[2] = {}, sent[2] = {};
    Event d2h_end = nullptr;  // a call's copies out all issued (in-place ppermute's local parts wait)
    void* recv[2] = {};
    void* send[2] = {};
    uint64_t seq[2] = {0, 0};                // chunks of round 0 / 1 so far (the same on every rank)
    // Chunks so far, across calls: chunk ci of a call uses recv/send[(local + ci) % 2] and their
    // events. Carried across calls, and every reuse of a buffer waits on the event of its last
    // reader (kernel_done, sent) however long ago: consecutive calls may come on different XLA
    // streams (multi-stream scheduling), so nothing else orders a call's first chunks after the
    // previous call's last kernels. A wait on an event already complete costs nothing on the device.
    uint64_t local = 0;
  };
  // One rank's view of one call, for the per-kind schedules (pcie_kinds.cc).
  struct Call {
    const GpuWork* work;
    Rank* rank;
    int r, n;
    std::vector<PcieChunk> chunks;
  };

  Status EnqueueOrFail(Call& c);
  Status AllReduce(Call& c);
  Status AllGather(Call& c);
  Status ReduceScatterOrAllToAll(Call& c);
  Status Ppermute(Call& c);

  // The cross-rank protocol of one chunk of a round (pcie_link.cc).
  Status ProduceBegin(Call& c, int round, uint64_t s);
  Status ProduceEnd(Call& c, int round, uint64_t s);
  // after_own: the copies in also wait for this rank's own copy out of the chunk (in place).
  Status ConsumeBegin(Call& c, int round, uint64_t s, const std::vector<int>& producers, bool after_own = false);
  Status ConsumeEnd(Call& c, int round, uint64_t s);

  uint8_t* HostSlot(int round, uint64_t s) const { return static_cast<uint8_t*>(host_[round][s % 2]); }
  // The local buffers' parity of chunk `ci` of the call (Rank::local).
  static int LocalParity(const Call& c, size_t ci) { return static_cast<int>((c.rank->local + ci) % 2); }
  // `rows` copies of `width` bytes (one 2-D copy; nothing for an empty one).
  Status CopyRows(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows, Stream s);
  std::vector<int> Others(int r) const;

  const std::string name_;
  DeviceApi& api_;
  const GroupInfo group_;
  const PcieOptions options_;
  std::vector<Rank> ranks_;
  void* host_[2][2] = {};
  PcieGate gate_;
  Breaker breaker_;
  DeviceLedger ledger_{api_};  // what Setup made
};

}  // namespace flexlink::gpu
