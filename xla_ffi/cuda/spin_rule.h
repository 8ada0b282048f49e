// Who spins, and how long, before sleeping while it waits for its group's peers on the host (the
// call's rendezvous, the locks every rank takes, the pcie link's gate, a segment's barriers across
// processes). Spinning pays only where every waiting rank has a core of its own: a futex sleep and
// wake-up per call costs more than a 4 KiB call's whole host budget (docs/cuda.md, "The host path
// of a call"), but a spinning rank on a shared core takes the time of the rank it waits for. The
// CPU engine never spins: its device threads outnumber the cores.
#pragma once

#include <chrono>

namespace flexlink::gpu {

inline constexpr std::chrono::microseconds kArrivalSpin{50};

// The hardware threads this process may run on (its CPU affinity; else the machine's count).
unsigned UsableHardwareThreads();

// A group of `ranks` in this process (Communicator::spin, GroupInfo::spin): FLEXLINK_SPIN_US when
// set; else kArrivalSpin when the process may run on more hardware threads than the group has ranks
// (a GPU server: XLA's device threads, one per GPU, each find a core); else none.
std::chrono::nanoseconds ArrivalSpin(int ranks, unsigned hardware_threads);

// A group across processes (xproc::ProcessGroup::SetSpin): all its `ranks` run on this host,
// `local_ranks` of them in this process. FLEXLINK_SPIN_US when set; else kArrivalSpin when this
// process may run on more hardware threads than it has ranks and the machine has more than the group
// has (processes are often bound to cores of their own, so the machine's count, not this process's
// affinity, bounds the others'); else none.
std::chrono::nanoseconds XprocSpin(int ranks, int local_ranks, unsigned usable_threads, unsigned machine_threads);

}  // namespace flexlink::gpu
