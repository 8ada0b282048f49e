// The collective library the nccl link drives, behind one interface: nccl_comm.cc implements it
// with NCCL (the CUDA module), tests/cpp/sim with a host simulation that also checks every rank
// issues the same sequence of operations. Types and ops are NCCL's, by their own names.
#pragma once

#include <array>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "xla_ffi/core/status.h"
#include "xla_ffi/cuda/device_api.h"

namespace flexlink::gpu {

using Comm = void*;  // ncclComm_t / the simulation's communicator

enum class CommType { kInt8, kUint8, kInt32, kUint32, kInt64, kUint64, kFloat16, kFloat32, kFloat64, kBfloat16 };
enum class CommOp { kSum, kProd, kMax, kMin };

// A communicator's identity across processes: ncclUniqueId's 128 bytes (NCCL_UNIQUE_ID_BYTES), made
// by one process (the group's leader) and carried to the others (jax.distributed's key-value store,
// at lowering; gpu_xproc.h).
inline constexpr size_t kCommIdBytes = 128;
using CommId = std::array<unsigned char, kCommIdBytes>;

class CommApi {
 public:
  virtual ~CommApi() = default;
  // One communicator per device of `devices` (rank order), made together from the calling thread
  // (ncclCommInitAll): no rank's collective can be in flight while they are made.
  virtual Status InitAll(std::span<const int> devices, std::vector<Comm>* comms) = 0;
  // Groups spanning processes (gpu_xproc.h). NewId: a fresh communicator identity
  // (ncclGetUniqueId), made once by the leader process. InitRanksAsync: starts joining this
  // process's ranks `ranks` (of `nranks`, global rank order) to the communicator `id`, rank ranks[i]
  // on CUDA device devices[i], all from the calling thread inside one group (ncclGroupStart, one
  // ncclCommInitRankConfig per local rank with ncclConfig_t::blocking = 0, ncclGroupEnd), so several
  // local GPUs join without a thread per rank and no local rank has anything in flight meanwhile
  // (jax-ml/jax#11637). It returns at once: the communicators complete only when every rank of
  // every process has joined, which a dead peer prevents forever; JoinState polls one
  // (ncclCommGetAsyncError): *done false while it is still in progress (ncclInProgress), an error
  // when joining failed. A communicator still in progress can be aborted (Abort). Defaults: not
  // supported by this library.
  virtual Status NewId(CommId* id);
  virtual Status InitRanksAsync(const CommId& id, int nranks, std::span<const int> ranks,
                                std::span<const int> devices, std::vector<Comm>* comms);
  virtual Status JoinState(Comm comm, bool* done);

  // How InitRanks waits for a join to complete.
  struct JoinWatch {
    double timeout_s = 60;  // the deadline, from the start of the join
    // Polled about every 10 ms while joining: a non-empty reason gives up with it (a peer process
    // exited, another process failed the group). Optional.
    std::function<std::string()> check;
  };
  // InitRanksAsync, then JoinState on every communicator until all are done, against the deadline
  // and `watch.check`. Every wait has a deadline: on an error, a failed check (kUnavailable, the
  // check's reason) or the deadline (kDeadlineExceeded) every communicator made here is aborted
  // (ncclCommAbort frees one still in progress) and none is returned. The caller names the group,
  // the collective and the missing ranks (only it knows them: NCCL does not say who is late).
  Status InitRanks(const CommId& id, int nranks, std::span<const int> ranks, std::span<const int> devices,
                   const JoinWatch& watch, std::vector<Comm>* comms);
  // Operations between GroupStart and GroupEnd on this thread are issued together (send/recv sets).
  virtual Status GroupStart() = 0;
  virtual Status GroupEnd() = 0;
  virtual Status AllReduce(const void* send, void* recv, size_t count, CommType type, CommOp op, Comm comm,
                           Stream stream) = 0;
  // recv holds the ranks' `count` elements one after another, rank order.
  virtual Status AllGather(const void* send, void* recv, size_t count, CommType type, Comm comm,
                           Stream stream) = 0;
  // send holds one block of `count` elements per rank; rank r receives the reduction of block r.
  virtual Status ReduceScatter(const void* send, void* recv, size_t count, CommType type, CommOp op,
                               Comm comm, Stream stream) = 0;
  virtual Status Send(const void* send, size_t count, CommType type, int peer, Comm comm, Stream stream) = 0;
  virtual Status Recv(void* recv, size_t count, CommType type, int peer, Comm comm, Stream stream) = 0;
  // Ends the communicator now (ncclCommAbort): its operations still in flight on the device stop
  // and its resources are freed; it is never used again. What the hang detector does to a group
  // whose nccl range missed its deadline, as PyTorch's NCCL watchdog does.
  virtual Status Abort(Comm comm) = 0;
  // Ends a communicator none of whose operations is left on any device (the engine's shutdown
  // drains a group first, GpuEngine::Shutdown): ncclCommFinalize, then ncclCommDestroy. A
  // non-blocking communicator's finalize is polled within `timeout_s`; a blocking one's (the
  // in-process cliques') returns only when done, which with the group drained is a synchronisation
  // of NCCL's own idle streams. Finalizing that fails or outlasts the deadline ends it with an
  // abort instead (nothing of it runs any more; NCCL's abort first waits for the finalize's job)
  // and says so. Every rank of a group is destroyed, one after another
  // from one thread: NCCL frees an in-process clique's shared resources at its last rank.
  virtual Status Destroy(Comm comm, double timeout_s) = 0;
};

// How the nccl link runs a reduction of (dtype, op): natively (NCCL's type and op, `lanes`
// NCCL elements per element: complex sums are sums of their float parts), or not at all
// (int16/uint16, complex products: NCCL has no such reduction; float16/bfloat16 sums and products:
// NCCL's rounding differs from float32 accumulation; the link gathers and reduces with the engine's
// kernel instead).
struct NcclReduction {
  bool native = false;
  CommType type = CommType::kUint8;
  CommOp op = CommOp::kSum;
  size_t lanes = 1;
};
NcclReduction NcclReductionOf(DType dtype, ReduceOp op);

}  // namespace flexlink::gpu
