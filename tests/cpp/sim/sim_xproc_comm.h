// A simulated NCCL whose communicators span processes (the GPU engine's groups across processes,
// xla_ffi/cuda/gpu_xproc.h), for fork-based tests on a machine without GPUs. NewId makes a random
// identity (like ncclGetUniqueId: no resource yet); InitRanksAsync maps the communicator's
// shared-memory file named by it (0600, created by whichever process comes first, unlinked by the
// last of the n ranks to join, or by an abort before that) and returns at once, as a non-blocking
// ncclCommInitRankConfig does; JoinState completes once every rank of every process has joined and
// then connected, and never while a peer that died before connecting is missing.
//
// An operation runs when its stream reaches it, as in SimComm, but the ranks meet in the shared
// file instead of in process memory: a collective of sequence number k stages the rank's send
// buffer and the operation's description into its slot of buffer k % 2, publishes `posted = k + 1`,
// waits until every rank posted k + 1, checks that every rank issued the same operation, and
// computes its own output from every rank's slot (the engine's element code, rank order: results are
// bitwise comparable with the reference). One counter per rank suffices with two buffers: a rank
// rewrites buffer k % 2 only after every rank posted k, i.e. finished computing k − 2, the last
// operation that read it. Point-to-point messages go through a mailbox pair per ordered rank pair
// (message m in mailbox m % 2; a send waits for message m − 2 to have been received). Sends of a
// group are posted before its receives wait, as NCCL progresses a group's operations together.
//
// Every wait has the device's wait_timeout_s and checks the peer's process every 20 ms: a peer that
// exited or times out records an error (SimDevice::Error) naming the rank and pid, and the
// operation's outputs are left as they were, instead of a hang. Operations larger than the slot are
// refused with an error (the simulation does not chunk; the tests keep below it).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tests/cpp/sim/sim_device.h"
#include "xla_ffi/cuda/comm_api.h"

namespace flexlink::sim {

class SimXprocComm : public gpu::CommApi {
 public:
  // slot_bytes: the most one rank's operation may send (a collective's send buffer, one message).
  explicit SimXprocComm(SimDevice* device, size_t slot_bytes = size_t{1} << 20);
  ~SimXprocComm() override;

  // Refused: this simulation only makes communicators across processes (SimComm makes cliques).
  Status InitAll(std::span<const int> devices, std::vector<gpu::Comm>* comms) override;
  Status NewId(gpu::CommId* id) override;
  Status InitRanksAsync(const gpu::CommId& id, int nranks, std::span<const int> ranks,
                        std::span<const int> devices, std::vector<gpu::Comm>* comms) override;
  Status JoinState(gpu::Comm comm, bool* done) override;

  // Faults of this process's next join (the tests' peers that die during the communicators' set-up):
  // _exit(42) before joining, or after joining but before connecting (the others' joins then never
  // complete), or stall alive without joining (60 s, then _exit(43)).
  enum class JoinFault { kNone, kExitBeforeJoin, kExitAfterJoin, kStallBeforeJoin };
  void SetJoinFault(JoinFault f) { join_fault_ = f; }
  Status GroupStart() override;
  Status GroupEnd() override;
  Status AllReduce(const void* send, void* recv, size_t count, gpu::CommType type, gpu::CommOp op, gpu::Comm comm,
                   gpu::Stream stream) override;
  Status AllGather(const void* send, void* recv, size_t count, gpu::CommType type, gpu::Comm comm,
                   gpu::Stream stream) override;
  Status ReduceScatter(const void* send, void* recv, size_t count, gpu::CommType type, gpu::CommOp op,
                       gpu::Comm comm, gpu::Stream stream) override;
  Status Send(const void* send, size_t count, gpu::CommType type, int peer, gpu::Comm comm, gpu::Stream stream) override;
  Status Recv(void* recv, size_t count, gpu::CommType type, int peer, gpu::Comm comm, gpu::Stream stream) override;
  // This process's side of the communicator ends (ncclCommAbort): its waiting operations return
  // without touching their buffers, issuing more is an error. Other processes' ranks are theirs to
  // abort (as with NCCL, each process aborts its own communicators).
  Status Abort(gpu::Comm comm) override;
  // This process's side ends once its operations are done; using it afterwards is an error.
  Status Destroy(gpu::Comm comm, double timeout_s) override;

  int inits() const;              // joins (InitRanksAsync) this process started
  int live() const;               // this process's communicators neither destroyed nor aborted
  size_t operations() const;      // operations this process's ranks completed
  // The shared-memory name of a communicator id ("/flexlink-simnccl-<32 hex>").
  static std::string NameOf(const gpu::CommId& id);

  struct Op;
  struct Shared;
  struct Rank;

 private:
  Status Issue(Op op, gpu::Comm comm, gpu::Stream stream);
  void Submit(Rank* rank, gpu::Stream stream, std::vector<Op> ops);

  SimDevice& device_;
  const size_t slot_bytes_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Shared>> shared_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  int inits_ = 0;
  JoinFault join_fault_ = JoinFault::kNone;
};

}  // namespace flexlink::sim
