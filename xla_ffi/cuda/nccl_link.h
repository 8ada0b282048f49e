// The nccl link (NVLink, and whatever else NCCL picks): one NCCL communicator per rank of a group,
// made for all local ranks together at the group's setup (CommApi::InitAll: no rank's collective is
// in flight then, jax-ml/jax#11637) and kept for the group's life; each rank's thread drives only
// its own communicator.
//
// A piece maps to NCCL directly where NCCL's buffer layout is the part's: all_reduce always (with
// NCCL's own reduction where it has one, float16/bfloat16 included, as XLA's collectives do),
// all_gather / reduce_scatter of a whole part with outer == 1, all_to_all with outer == 1 and
// ppermute (grouped sends and receives). Otherwise the piece is staged through device scratch in
// chunks: a layout kernel packs the rows NCCL sends and/or unpacks the rows it received, on a
// kernel stream, double-buffered so that the kernels of one chunk overlap NCCL's work on the next.
// Reductions NCCL lacks (int16/uint16, complex products) gather the contributions and reduce them
// in rank order with the engine's kernel.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/cuda/comm_api.h"
#include "xla_ffi/cuda/device_api.h"
#include "xla_ffi/cuda/device_ledger.h"
#include "xla_ffi/cuda/gpu_link.h"
#include "xla_ffi/plan/link_spec.h"

namespace flexlink::gpu {

struct NcclOptions {
  size_t staging_bytes = 8 << 20;  // each of the 4 scratch buffers per rank (2 send, 2 receive)
};

class NcclLink : public GpuLink {
 public:
  NcclLink(std::string name, DeviceApi* api, CommApi* comm, NcclOptions options)
      : name_(std::move(name)), api_(api), comm_(comm), options_(options) {}
  // Parameters: staging_mib (default 8).
  static Status FromSpec(const plan::LinkSpec& spec, DeviceApi* api, CommApi* comm, std::unique_ptr<GpuLink>* out);
  std::string_view name() const override { return name_; }
  std::unique_ptr<GpuChannel> Open(const GroupInfo& group) override;

 private:
  const std::string name_;
  DeviceApi* const api_;
  CommApi* const comm_;
  const NcclOptions options_;
};

class NcclChannel : public GpuChannel {
 public:
  NcclChannel(std::string name, DeviceApi* api, CommApi* comm, GroupInfo group, NcclOptions options);
  std::string_view link_name() const override { return name_; }
  Status Setup() override;
  // A group spanning processes (gpu_xproc.h): only this process's ranks `local` (their CUDA devices
  // in the group's `devices`), on communicator `id` made by the leader process and joined by every
  // process (CommApi::InitRanks, non-blocking, waiting as `watch` says). Called once, from one
  // thread, while every local rank waits inside its first call's cross-process arrival.
  Status SetupAcrossProcesses(const CommId& id, std::span<const int> local, const CommApi::JoinWatch& watch);
  Status Enqueue(const GpuWork& work) override;
  Status Abort() override;
  bool Drained(std::string* busy) override { return ledger_.Drained(busy); }
  Status Release(double timeout_s) override;

 private:
  Status SetupRank(int r, Comm comm, const std::string& where);
  struct Rank {
    Comm comm = nullptr;
    Stream comp = nullptr;
    Event fork = nullptr, join = nullptr;
    // Per local parity (staged % 2): NCCL's op on the chunk done, the packed send rows ready, the
    // kernel that read the received rows done.
    Event nccl_done[2] = {}, packed[2] = {}, kernel_done[2] = {};
    void* send[2] = {};
    void* recv[2] = {};
    // Staged chunks so far, across calls (and pieces): chunk g uses send/recv[g % 2]. Carried across
    // calls, and every reuse of a buffer waits on its last reader's event (nccl_done for send,
    // kernel_done for recv) however long ago: consecutive calls may come on different XLA streams
    // (multi-stream scheduling), so nothing else orders a call's first chunks after the previous
    // call's last kernels. A wait on an event already complete costs nothing on the device.
    uint64_t staged = 0;
  };
  struct Call {
    const GpuWork* work;
    Rank* rank;
    int r, n;
    bool forked = false;  // the kernel stream was forked from the call's stream (joined at the end, always)
  };
  // A piece NCCL takes as it is (no staging).
  bool Direct(const CallDesc& d, const Piece& piece) const;
  Status EnqueueDirect(Call& c, const std::vector<const Piece*>& pieces);
  Status EnqueueStaged(Call& c, const Piece& piece);
  Status Fork(Call& c);

  const std::string name_;
  DeviceApi& api_;
  CommApi& comm_;
  const GroupInfo group_;
  const NcclOptions options_;
  std::vector<Rank> ranks_;
  Breaker breaker_;
  DeviceLedger ledger_{api_};  // what SetupRank made
  bool aborted_ = false;  // Abort's thread only
};

}  // namespace flexlink::gpu
