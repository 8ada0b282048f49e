// A simulated NCCL over SimDevice streams: InitAll makes a clique of communicators; an operation
// (or a group of them, between GroupStart and GroupEnd on a thread) is enqueued on its stream and,
// when the stream reaches it, waits until every rank's operation of the same sequence number has
// arrived; the last one to arrive runs them all. Reductions use the engine's element code in rank
// order (so results are comparable bitwise with the reference); every rank must issue the same
// sequence of collectives and matching sends and receives, or the simulation records an error.
// Like NCCL, two ranks of one communicator on one device are refused. Abort stops a clique's
// operations in flight without touching their buffers (ncclCommAbort).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tests/cpp/sim/sim_device.h"
#include "xla_ffi/cuda/comm_api.h"

namespace flexlink::sim {

class SimComm : public gpu::CommApi {
 public:
  explicit SimComm(SimDevice* device);
  ~SimComm() override;

  Status InitAll(std::span<const int> devices, std::vector<gpu::Comm>* comms) override;
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
  Status Abort(gpu::Comm comm) override;
  // A rank's communicator ends; an operation of its clique still unfinished is an error (the
  // engine destroys only drained groups), as is using or destroying it again.
  Status Destroy(gpu::Comm comm, double timeout_s) override;

  int inits() const { return inits_; }
  int destroys() const;  // Destroy calls so far
  // Communicators made and neither destroyed nor of an aborted clique.
  int live() const;
  int aborts() const;  // Abort calls so far (one per communicator)
  // Collectives and send/recv operations run so far (all ranks together).
  size_t operations() const;

  struct Op;
  struct Clique;
  struct Rank;

 private:
  Status Issue(Op op, gpu::Comm comm, gpu::Stream stream);
  void Submit(Rank* rank, gpu::Stream stream, std::vector<Op> ops);

  SimDevice& device_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Clique>> cliques_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  int inits_ = 0;
  int aborts_ = 0;
  int destroys_ = 0;
};

}  // namespace flexlink::sim
