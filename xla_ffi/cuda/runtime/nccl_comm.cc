#include "xla_ffi/cuda/runtime/nccl_comm.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <link.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <string>

namespace flexlink::gpu {

// NCCL's entry points, resolved from the loaded library; the header gives their types only.
struct NcclComm::Symbols {
  decltype(&ncclGetVersion) GetVersion;
  decltype(&ncclGetErrorString) GetErrorString;
  decltype(&ncclGetUniqueId) GetUniqueId;
  decltype(&ncclCommInitRank) CommInitRank;
  decltype(&ncclGroupStart) GroupStart;
  decltype(&ncclGroupEnd) GroupEnd;
  decltype(&ncclAllReduce) AllReduce;
  decltype(&ncclAllGather) AllGather;
  decltype(&ncclReduceScatter) ReduceScatter;
  decltype(&ncclSend) Send;
  decltype(&ncclRecv) Recv;
  decltype(&ncclCommAbort) CommAbort;
  // NCCL 2.14 and later (non-blocking communicators, groups across processes): null before.
  decltype(&ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError;
};

namespace {

ncclDataType_t TypeOf(CommType t) {
  switch (t) {
    case CommType::kInt8: return ncclInt8;
    case CommType::kUint8: return ncclUint8;
    case CommType::kInt32: return ncclInt32;
    case CommType::kUint32: return ncclUint32;
    case CommType::kInt64: return ncclInt64;
    case CommType::kUint64: return ncclUint64;
    case CommType::kFloat16: return ncclFloat16;
    case CommType::kFloat32: return ncclFloat32;
    case CommType::kFloat64: return ncclFloat64;
    case CommType::kBfloat16: return ncclBfloat16;
  }
  return ncclUint8;
}

ncclRedOp_t OpOf(CommOp op) {
  switch (op) {
    case CommOp::kSum: return ncclSum;
    case CommOp::kProd: return ncclProd;
    case CommOp::kMax: return ncclMax;
    case CommOp::kMin: return ncclMin;
  }
  return ncclSum;
}

template <class F>
bool Resolve(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr;
}

std::string PathOf(void* lib) {
  struct link_map* map = nullptr;
  if (dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name) return map->l_name;
  return "libnccl.so.2";
}

}  // namespace

void NcclComm::SetLibrary(std::string path) {
  std::lock_guard<std::mutex> lock(mu_);
  configured_ = std::move(path);
}

std::string NcclComm::LoadedFrom() {
  std::lock_guard<std::mutex> lock(mu_);
  return loaded_from_;
}

int NcclComm::Version() {
  if (!Load().ok()) return 0;
  int v = 0;
  return sym_->GetVersion(&v) == ncclSuccess ? v : 0;
}

Status NcclComm::Load() {
  std::lock_guard<std::mutex> lock(mu_);
  if (sym_) return Status::Ok();
  std::string tried;
  void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (!lib && !configured_.empty()) {
    lib = dlopen(configured_.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) tried += std::string("; ") + dlerror();
  }
  if (!lib) {
    lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!lib) tried += std::string("; ") + dlerror();
  }
  if (!lib)
    return Status::FailedPrecondition(
        "the nccl link needs NCCL (libnccl.so.2: the nvidia-nccl-cu13 wheel jax's CUDA plugin depends on) and "
        "none could be loaded" + tried);
  static Symbols s;  // one NCCL per process
  const bool ok = Resolve(lib, "ncclGetVersion", &s.GetVersion) && Resolve(lib, "ncclGetErrorString", &s.GetErrorString) &&
                  Resolve(lib, "ncclGetUniqueId", &s.GetUniqueId) && Resolve(lib, "ncclCommInitRank", &s.CommInitRank) &&
                  Resolve(lib, "ncclGroupStart", &s.GroupStart) && Resolve(lib, "ncclGroupEnd", &s.GroupEnd) &&
                  Resolve(lib, "ncclAllReduce", &s.AllReduce) && Resolve(lib, "ncclAllGather", &s.AllGather) &&
                  Resolve(lib, "ncclReduceScatter", &s.ReduceScatter) && Resolve(lib, "ncclSend", &s.Send) &&
                  Resolve(lib, "ncclRecv", &s.Recv) && Resolve(lib, "ncclCommAbort", &s.CommAbort);
  s.CommInitRankConfig = reinterpret_cast<decltype(s.CommInitRankConfig)>(dlsym(lib, "ncclCommInitRankConfig"));
  s.CommGetAsyncError = reinterpret_cast<decltype(s.CommGetAsyncError)>(dlsym(lib, "ncclCommGetAsyncError"));
  if (!ok)
    return Status::FailedPrecondition("the NCCL loaded from " + PathOf(lib) +
                                      " lacks an entry point FlexLink needs (NCCL 2.7 or later has them all)");
  loaded_from_ = PathOf(lib);
  sym_ = &s;
  return Status::Ok();
}

#define FLEXLINK_NCCL(call, what)                                                                   \
  do {                                                                                             \
    const ncclResult_t r_ = (call);                                                                \
    if (r_ != ncclSuccess) return Status::Internal(std::string(what) + ": " + sym_->GetErrorString(r_)); \
  } while (0)

Status NcclComm::InitAll(std::span<const int> devices, std::vector<Comm>* comms) {
  FLEXLINK_RETURN_IF_ERROR(Load());
  ncclUniqueId id;
  FLEXLINK_NCCL(sym_->GetUniqueId(&id), "ncclGetUniqueId");
  const int n = static_cast<int>(devices.size());
  std::vector<ncclComm_t> made(n, nullptr);
  // All ranks' communicators in one group from this thread: NCCL initialises them together, and no
  // rank of the group has anything in flight (the executor's setup runs inside the first call's
  // rendezvous, before any rank enqueues; jax-ml/jax#11637).
  FLEXLINK_NCCL(sym_->GroupStart(), "ncclGroupStart");
  for (int r = 0; r < n; ++r) {
    if (cudaSetDevice(devices[r]) != cudaSuccess) {
      (void)sym_->GroupEnd();
      return Status::Internal("cudaSetDevice(" + std::to_string(devices[r]) + ") for NCCL's communicator of rank " +
                              std::to_string(r));
    }
    const ncclResult_t res = sym_->CommInitRank(&made[r], n, id, r);
    if (res != ncclSuccess) {
      (void)sym_->GroupEnd();
      return Status::Internal(std::string("ncclCommInitRank: ") + sym_->GetErrorString(res));
    }
  }
  FLEXLINK_NCCL(sym_->GroupEnd(), "ncclGroupEnd (creating the communicators)");
  comms->assign(made.begin(), made.end());
  return Status::Ok();
}

static_assert(sizeof(ncclUniqueId) == kCommIdBytes, "CommId carries ncclUniqueId's bytes");

Status NcclComm::NewId(CommId* out) {
  FLEXLINK_RETURN_IF_ERROR(Load());
  ncclUniqueId id;
  FLEXLINK_NCCL(sym_->GetUniqueId(&id), "ncclGetUniqueId");
  std::memcpy(out->data(), &id, kCommIdBytes);
  return Status::Ok();
}

Status NcclComm::InitRanksAsync(const CommId& cid, int nranks, std::span<const int> ranks,
                                std::span<const int> devices, std::vector<Comm>* comms) {
  FLEXLINK_RETURN_IF_ERROR(Load());
  comms->clear();
  if (ranks.size() != devices.size()) return Status::InvalidArgument("InitRanks: as many devices as ranks");
  if (!sym_->CommInitRankConfig || !sym_->CommGetAsyncError)
    return Status::FailedPrecondition("GPU groups across processes need NCCL 2.14 or later (non-blocking "
                                      "communicators: ncclCommInitRankConfig, ncclCommGetAsyncError); the NCCL loaded "
                                      "from " + loaded_from_ + " lacks them");
  ncclUniqueId id;
  std::memcpy(&id, cid.data(), kCommIdBytes);
  const size_t m = ranks.size();
  std::vector<ncclComm_t> made(m, nullptr);
  // Non-blocking (blocking = 0): ncclCommInitRankConfig and ncclGroupEnd return ncclInProgress
  // instead of blocking until every process has joined, so a peer that died before or while joining
  // cannot leave this process stuck inside NCCL: the caller polls ncclCommGetAsyncError against its
  // deadline and the peers' liveness, and aborts (CommApi::InitRanks).
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  auto started = [](ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; };
  // This process's ranks in one group from this thread (several local GPUs): NCCL joins them to the
  // other processes' ranks together. The executor calls this inside its first call's cross-process
  // arrival, where no local rank has anything of the group in flight (jax-ml/jax#11637).
  FLEXLINK_NCCL(sym_->GroupStart(), "ncclGroupStart");
  for (size_t i = 0; i < m; ++i) {
    if (cudaSetDevice(devices[i]) != cudaSuccess) {
      (void)sym_->GroupEnd();
      for (ncclComm_t c : made) comms->push_back(c);  // aborted by the caller
      return Status::Internal("cudaSetDevice(" + std::to_string(devices[i]) + ") for NCCL's communicator of rank " +
                              std::to_string(ranks[i]));
    }
    const ncclResult_t res = sym_->CommInitRankConfig(&made[i], nranks, id, ranks[i], &config);
    if (!started(res)) {
      (void)sym_->GroupEnd();
      for (ncclComm_t c : made) comms->push_back(c);
      return Status::Internal("ncclCommInitRankConfig (rank " + std::to_string(ranks[i]) + " of " +
                              std::to_string(nranks) + "): " + sym_->GetErrorString(res));
    }
  }
  const ncclResult_t end = sym_->GroupEnd();
  comms->assign(made.begin(), made.end());
  if (!started(end))
    return Status::Internal(std::string("ncclGroupEnd (joining the communicator across processes): ") +
                            sym_->GetErrorString(end));
  return Status::Ok();
}

Status NcclComm::JoinState(Comm comm, bool* done) {
  FLEXLINK_RETURN_IF_ERROR(Load());
  ncclResult_t state = ncclSuccess;
  FLEXLINK_NCCL(sym_->CommGetAsyncError(static_cast<ncclComm_t>(comm), &state), "ncclCommGetAsyncError");
  *done = state == ncclSuccess;
  if (state == ncclSuccess || state == ncclInProgress) return Status::Ok();
  return Status::Internal(std::string("joining the communicator: ") + sym_->GetErrorString(state));
}

Status NcclComm::Settle(int r, std::span<const Comm> comms, const char* what) {
  if (r == ncclSuccess) return Status::Ok();
  if (r != ncclInProgress) return Status::Internal(std::string(what) + ": " + sym_->GetErrorString(static_cast<ncclResult_t>(r)));
  // A non-blocking communicator (InitRanksAsync) may answer an operation or ncclGroupEnd with
  // ncclInProgress: the enqueue is still under way on the host. Polled to completion, bounded: the
  // enqueue waits for no peer (the device does), so it takes microseconds; the bound only keeps a
  // broken NCCL from hanging the device thread.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (Comm c : comms) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      FLEXLINK_NCCL(sym_->CommGetAsyncError(static_cast<ncclComm_t>(c), &state), "ncclCommGetAsyncError");
      if (state == ncclSuccess) break;
      if (state != ncclInProgress) return Status::Internal(std::string(what) + ": " + sym_->GetErrorString(state));
      if (std::chrono::steady_clock::now() >= deadline)
        return Status::DeadlineExceeded(std::string(what) + ": still in progress after 60 s");
      std::this_thread::yield();
    }
  }
  return Status::Ok();
}

namespace {
// The communicators of this thread's open ncclGroupStart/End (GroupEnd settles them, Settle).
struct OpenGroup {
  int depth = 0;
  std::vector<Comm> comms;
};
thread_local OpenGroup t_group;
}  // namespace

Status NcclComm::GroupStart() {
  FLEXLINK_RETURN_IF_ERROR(Load());
  FLEXLINK_NCCL(sym_->GroupStart(), "ncclGroupStart");
  if (t_group.depth++ == 0) t_group.comms.clear();
  return Status::Ok();
}

Status NcclComm::GroupEnd() {
  const ncclResult_t r = sym_->GroupEnd();
  if (t_group.depth > 0 && --t_group.depth > 0) return Settle(r == ncclInProgress ? ncclSuccess : r, {}, "ncclGroupEnd");
  return Settle(r, t_group.comms, "ncclGroupEnd");
}

Status NcclComm::Issued(int r, Comm comm, const char* what) {
  if (t_group.depth > 0) {
    // Inside a group the operation runs at ncclGroupEnd, which settles it.
    t_group.comms.push_back(comm);
    return Settle(r == ncclInProgress ? ncclSuccess : r, {}, what);
  }
  return Settle(r, std::span<const Comm>(&comm, 1), what);
}

Status NcclComm::AllReduce(const void* send, void* recv, size_t count, CommType type, CommOp op, Comm comm,
                           Stream stream) {
  return Issued(sym_->AllReduce(send, recv, count, TypeOf(type), OpOf(op), static_cast<ncclComm_t>(comm),
                                static_cast<cudaStream_t>(stream)), comm, "ncclAllReduce");
}

Status NcclComm::AllGather(const void* send, void* recv, size_t count, CommType type, Comm comm, Stream stream) {
  return Issued(sym_->AllGather(send, recv, count, TypeOf(type), static_cast<ncclComm_t>(comm),
                                static_cast<cudaStream_t>(stream)), comm, "ncclAllGather");
}

Status NcclComm::ReduceScatter(const void* send, void* recv, size_t count, CommType type, CommOp op, Comm comm,
                               Stream stream) {
  return Issued(sym_->ReduceScatter(send, recv, count, TypeOf(type), OpOf(op), static_cast<ncclComm_t>(comm),
                                    static_cast<cudaStream_t>(stream)), comm, "ncclReduceScatter");
}

Status NcclComm::Send(const void* send, size_t count, CommType type, int peer, Comm comm, Stream stream) {
  return Issued(sym_->Send(send, count, TypeOf(type), peer, static_cast<ncclComm_t>(comm),
                           static_cast<cudaStream_t>(stream)), comm, "ncclSend");
}

Status NcclComm::Recv(void* recv, size_t count, CommType type, int peer, Comm comm, Stream stream) {
  return Issued(sym_->Recv(recv, count, TypeOf(type), peer, static_cast<ncclComm_t>(comm),
                           static_cast<cudaStream_t>(stream)), comm, "ncclRecv");
}

// NCCL's documentation: "Frees resources associated with communicator object and aborts any
// uncompleted operations"; unlike ncclCommDestroy it does not wait for them, which is why PyTorch's
// NCCL watchdog uses it on a hung communicator too.
Status NcclComm::Abort(Comm comm) {
  FLEXLINK_RETURN_IF_ERROR(Load());
  // A non-blocking communicator's abort may itself answer ncclInProgress: its resources are freed
  // in the background, and it is never used again either way.
  const ncclResult_t r = sym_->CommAbort(static_cast<ncclComm_t>(comm));
  if (r != ncclSuccess && r != ncclInProgress) return Status::Internal(std::string("ncclCommAbort: ") + sym_->GetErrorString(r));
  return Status::Ok();
}

}  // namespace flexlink::gpu
