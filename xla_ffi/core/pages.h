// Output pages. XLA:CPU hands collectives freshly allocated output buffers, and first-touching them
// (a page fault and a zeroed page each) costs more than the collective itself at large sizes. Two
// remedies, applied before the links write:
//  - ask for transparent huge pages (one fault per 2 MiB instead of per 4 KiB);
//  - fault the pages in ahead of the writes, shared by the call's ranks in whole 2 MiB blocks
//    (OutputFaults). The links write an output from all device threads (shm: each rank its slice of
//    every output); faults of many threads interleaved within one page-table page contend on its
//    lock, while whole blocks per thread do not.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace flexlink {

// The outputs of one call, faulted in by all its ranks together. At 64 MiB per rank out of place the
// faults took 60-150 ms per rank before a 25-35 ms collective, and device threads start a call at
// different times (8 threads on 2 cores here); when each rank faulted only its own output, the last
// to start faulted alone while the others waited, and a rank that drew blocks the hypervisor must
// back again (~6 ms per huge page instead of ~0.2) held up the whole call. So each rank publishes its
// output as 2 MiB blocks, and every rank claims blocks of any published output until none is left:
// right after publishing its own, while it waits at the rendezvous (a later rank's publication wakes
// it, CallContext::Arrive) and once all have arrived. FlexLink alone, 64 MiB all_reduce out of place,
// 3 pairs of processes x 14 calls, mean per call, ranks helping before arriving vs each rank faulting
// its own: 81 vs 120, 172 vs 188, 181 vs 204 ms. Touching is a locked `or 0` on one byte per page: it
// faults the page in for writing and cannot undo a value another rank's collective already stored
// there (after the rendezvous a helper may still be faulting a block a faster rank has begun to
// write).
// `aliases_input`: the output is the (donated) input, so its pages are known to be present. Only
// hints and writes that leave the bytes as they are; errors are ignored.
// One output buffer of a call (a call of k operands has k of them per rank).
struct OutputRegion {
  void* out = nullptr;
  size_t bytes = 0;
  bool aliases_input = false;
};

class OutputFaults {
 public:
  explicit OutputFaults(int ranks);
  ~OutputFaults();
  OutputFaults(const OutputFaults&) = delete;
  OutputFaults& operator=(const OutputFaults&) = delete;

  // By the owner, once per call, before anyone writes its outputs: for each output, checks
  // residency, advises huge pages, faults in the ends outside whole 2 MiB blocks (collapsing them
  // into huge pages when most of one is missing), then offers its blocks. True when it offered any.
  bool Publish(int rank, std::span<const OutputRegion> outputs);
  bool Publish(int rank, void* out, size_t bytes, bool aliases_input) {
    const OutputRegion one{out, bytes, aliases_input};
    return Publish(rank, std::span<const OutputRegion>(&one, 1));
  }
  // Faults published blocks, `rank`'s own first, until every published block is claimed.
  void Help(int rank);
  // Whether a published block is not claimed yet.
  bool Unclaimed() const;
  // Blocks `rank` has faulted in so far, of any output (for tests and diagnostics).
  size_t blocks_faulted(int rank) const { return faulted_[rank].load(std::memory_order_relaxed); }
  // Ends of `rank`'s outputs made huge pages by MADV_COLLAPSE so far (for tests and diagnostics).
  size_t ends_collapsed(int rank) const { return collapsed_[rank]; }
  // By the owner before its call returns (also on errors): stops new claims on its outputs and waits
  // for claimed blocks to finish (one block: well under a millisecond, ~6 ms at worst here), so no
  // helper touches a buffer XLA may free.
  void Withdraw(int rank);

 private:
  struct Slot;
  // One rank's published outputs: `slots` is written by the owner before it stores `count` (release),
  // and read by helpers only below the count they loaded (acquire).
  struct RankSlots {
    std::unique_ptr<Slot[]> slots;
    std::atomic<size_t> count{0};
  };
  bool Prepare(int rank, Slot& slot, const OutputRegion& region);
  void FaultBlock(Slot& slot, size_t block);
  const int n_;
  std::unique_ptr<RankSlots[]> ranks_;
  std::unique_ptr<std::atomic<size_t>[]> faulted_;
  std::unique_ptr<size_t[]> collapsed_;  // written by the owner only
};

}  // namespace flexlink
