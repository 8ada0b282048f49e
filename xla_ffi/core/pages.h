// Output pages. XLA:CPU hands collectives freshly allocated output buffers, and first-touching them
// (a page fault and a zeroed page each) costs more than the copy itself at large sizes. Two remedies,
// applied by each rank to its own output before it arrives at the rendezvous:
//  - ask for transparent huge pages (one fault per 2 MiB instead of per 4 KiB);
//  - fault the pages in from the owning device thread. The links write an output from all device
//    threads (shm: each rank its slice of every output); faults of many threads interleaved on one
//    buffer contend on its page-table locks, while each thread faulting its own buffer does not, and
//    it does so while it would otherwise wait for slower ranks.
#pragma once

#include <atomic>
#include <cstddef>

namespace flexlink {

// `aliases_input`: the output is the (donated) input, so its pages are known to be present.
// Only hints and harmless writes into the output's own bytes: contents before the collective writes
// them are unspecified anyway; errors are ignored.
void PrepareOutput(void* out, size_t bytes, bool aliases_input);

// Whether an output may get huge pages now. A huge-page prefault far below memory speed, in the
// thread's CPU time (so preemption does not count), means the kernel handed out 2 MiB blocks that the
// hypervisor must back again first (a VM with free page reporting, as here: ~0.35 GB/s instead of
// ~7 GB/s, and whole processes then ran at 0.41-0.65x of native at 16 MiB). After such a prefault the
// next kBackoffOutputs outputs (a few calls of every rank) get small pages, then huge pages are tried
// again. 14 pairs of processes, 16 MiB all_reduce out of place, 12 calls each, ratio of means to
// native: without 0.49-1.57 (geometric mean 0.94), with 1.02-2.35 (1.42), better in 11 of 14 pairs;
// six more processes with it: 0.64-1.15. docs/engine.md.
class HugePageGovernor {
 public:
  static constexpr double kSlowBytesPerSecond = 0.8e9;
  static constexpr int kBackoffOutputs = 128;

  // Takes one output's turn; true when it may get huge pages.
  bool Allow();
  // Reports a huge-page prefault of `bytes` that took `cpu_seconds` of its thread's CPU time.
  void Record(size_t bytes, double cpu_seconds);
  int backoff() const { return backoff_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int> backoff_{0};
};

}  // namespace flexlink
