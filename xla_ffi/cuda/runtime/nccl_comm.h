// CommApi over NCCL, loaded with dlopen at the first communicator, never at import: the module
// imports on machines without a GPU or NCCL, and uses the NCCL XLA already loaded where there is one
// (XLA:GPU reaches NCCL the same way, dlopen("libnccl.so.2"), so a process has one NCCL). Order:
//   1. libnccl.so.2 already in the process (RTLD_NOLOAD): XLA's CUDA plugin loaded it;
//   2. the path Python gave (set_library): the nvidia-nccl-cu13 wheel's lib/libnccl.so.2;
//   3. libnccl.so.2 on the loader's search path.
#pragma once

#include <mutex>
#include <span>
#include <string>

#include "xla_ffi/cuda/comm_api.h"

namespace flexlink::gpu {

class NcclComm : public CommApi {
 public:
  void SetLibrary(std::string path);
  // The file NCCL was loaded from ("" before the first communicator), and its version.
  std::string LoadedFrom();
  int Version();

  Status InitAll(std::span<const int> devices, std::vector<Comm>* comms) override;
  Status NewId(CommId* id) override;
  Status InitRanksAsync(const CommId& id, int nranks, std::span<const int> ranks, std::span<const int> devices,
                        std::vector<Comm>* comms) override;
  Status JoinState(Comm comm, bool* done) override;
  Status GroupStart() override;
  Status GroupEnd() override;
  Status AllReduce(const void* send, void* recv, size_t count, CommType type, CommOp op, Comm comm,
                   Stream stream) override;
  Status AllGather(const void* send, void* recv, size_t count, CommType type, Comm comm, Stream stream) override;
  Status ReduceScatter(const void* send, void* recv, size_t count, CommType type, CommOp op, Comm comm,
                       Stream stream) override;
  Status Send(const void* send, size_t count, CommType type, int peer, Comm comm, Stream stream) override;
  Status Recv(void* recv, size_t count, CommType type, int peer, Comm comm, Stream stream) override;
  Status Abort(Comm comm) override;
  Status Destroy(Comm comm, double timeout_s) override;

  struct Symbols;

 private:
  Status Load();
  // `r` of an operation or ncclGroupEnd: ncclInProgress (non-blocking communicators: those of
  // InitRanksAsync, and InitAll's under NCCL_COMM_BLOCKING=0; nccl_comm.cc's kInProcessBlocking) polled until each of `comms` settles, against the engine's
  // deadline (TimeoutSeconds; kDeadlineExceeded past it), anything else but ncclSuccess an error
  // naming `what`.
  Status Settle(int r, std::span<const Comm> comms, const char* what);
  Status Issued(int r, Comm comm, const char* what);

  std::mutex mu_;
  std::string configured_;
  std::string loaded_from_;
  const Symbols* sym_ = nullptr;  // set once, then read without the lock
};

}  // namespace flexlink::gpu
