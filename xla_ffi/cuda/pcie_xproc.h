// The pcie link across processes (gpu_xproc.h): every rank stages through the group's shared
// segment (xla_ffi/xproc/), which every process of the host maps and registers as pinned memory
// (DeviceApi::RegisterHost = cudaHostRegister, portable and mapped): one staging buffer for all the
// processes of the host. CUDA events do not cross processes, so the devices are ordered with stream
// memory operations on 32-bit flags in the same segment (DeviceApi::WriteValue32/WaitValue32 =
// cuStreamWriteValue32/cuStreamWaitValue32, GEQ, wrap-aware), all on the call's stream:
//
//   step s (the call's pieces cut by xproc::StepCursor so that a rank's staged bytes fit a slot;
//   every rank cuts the same steps), buffer b = s % 2:
//     1. stage: this rank's input units into its slot of buffer b (device-to-host copies; blocks of
//        reduce_scatter/all_to_all packed on the device first, as the CPU side's Stage lays them);
//     2. write its `posted` flag = s;
//     3. wait until every other rank's `posted` reached s;
//     4. compute: host-to-device copies of what this rank needs from every slot into device scratch,
//        then the reduction kernel (rank order: bitwise the CPU engine's) or the unpack kernel.
//   One flag per rank is enough (the CPU side's one-barrier argument, docs/xproc.md "Steps"): a
//   rank rewrites buffer b at step s + 2 only after its stream saw every peer post s + 1, and a peer
//   posts s + 1 only after its stream computed step s, the last one that read buffer b.
// The host never waits. Bytes per rank (N: the rank's input; all_gather: N = its output):
// all_reduce N device-to-host and (n−1)N host-to-device (its own row is read from the device);
// all_gather N/n and N; reduce_scatter N and N; all_to_all N and N; ppermute N and N (sources only
// stage). all_reduce moves more than the in-process link's reduce-scatter + all-gather through the
// host (N and 2N(n−1)/n): the first version keeps one step per chunk and no second round; the
// two-round schedule is the next step for large n.
// Why flags here although the in-process link avoided them (docs/cuda.md): across processes there
// are no events to bind a wait to, and one rank per GPU (NCCL's rule for the other link anyway);
// whether the waits behave next to XLA's own NCCL kernels is to be checked on a GPU.
#pragma once

#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/cuda/device_api.h"
#include "xla_ffi/cuda/device_ledger.h"
#include "xla_ffi/cuda/gpu_link.h"

namespace flexlink::xproc {
class ProcessGroup;
}

namespace flexlink::gpu {

// The group's slot, i.e. one step's chunk per rank, where FLEXLINK_XPROC_SLOT_BYTES does not set
// another: the size the slots had when this link was written (CPU groups went to 1 MiB for their
// cores' caches, xproc::kCpuSlotBytes; DMA copies do not go through those). Unmeasured on a GPU.
inline constexpr size_t kPcieStagingSlotBytes = size_t{4} << 20;

class PcieXprocChannel : public GpuChannel {
 public:
  PcieXprocChannel(std::string name, DeviceApi* api, GroupInfo group, xproc::ProcessGroup* segment);
  std::string_view link_name() const override { return name_; }
  Status Setup() override;  // refused: SetupLocal is the set-up of a group across processes
  // This process's ranks `local`, once, from one thread: the segment registered, device scratch.
  Status SetupLocal(std::span<const int> local);
  Status Enqueue(const GpuWork& work) override;
  // The group is broken (a peer process gone or hung): every rank's flag, in every process, raised
  // to a step no wait asks for, so no stream waits on a peer that will never post.
  Status Abort() override;
  void Unblock() override;
  bool Drained(std::string* busy) override { return ledger_.Drained(busy); }
  // The segment's registration and the scratch; the segment itself is the group's.
  Status Release(double timeout_s) override;

 private:
  struct Rank {
    void* scratch = nullptr;  // n slots of device memory
    std::atomic<uint32_t> seq{0};  // steps so far (the same on every rank); read by Abort
  };
  uint32_t* Posted(int r) const;
  void StoreRaised();

  const std::string name_;
  DeviceApi& api_;
  const GroupInfo group_;
  xproc::ProcessGroup& segment_;
  std::vector<Rank> ranks_;
  Breaker breaker_;
  DeviceLedger ledger_{api_};  // what SetupLocal made
  std::atomic<bool> aborted_{false};
  std::atomic<uint32_t> raised_{0};  // what Abort raised every flag to; Unblock stores it again
};

}  // namespace flexlink::gpu
