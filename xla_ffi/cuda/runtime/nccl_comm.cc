#include "xla_ffi/cuda/runtime/nccl_comm.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <link.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/deadline.h"

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
  decltype(&ncclCommDestroy) CommDestroy;
  // NCCL 2.14 and later (non-blocking communicators, groups across processes): null before.
  decltype(&ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&ncclCommFinalize) CommFinalize;
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

// cudaSetDevice for NCCL (ncclCommInitRank* takes the current device); a failure is reported as a
// Status and cleared from the thread's last error (cuda_device.cc's Check does the same).
bool SetDeviceFor(int device) {
  if (cudaSetDevice(device) == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}

using Clock = std::chrono::steady_clock;

// The engine's deadline (FLEXLINK_TIMEOUT_S) from now.
Clock::time_point DeadlineFromNow(double* seconds) {
  *seconds = std::clamp(TimeoutSeconds(), 0.0, kMaxTimeoutSeconds);
  return DeadlineAfter(*seconds);
}

// Polling NCCL's state of a non-blocking communicator: yields first (a launch handed to NCCL's
// thread takes microseconds), then naps of up to 1 ms (joining peers takes milliseconds to seconds).
void Backoff(int polls) {
  if (polls < 200) std::this_thread::yield();
  else std::this_thread::sleep_for(std::chrono::microseconds(10 * std::min(100, polls - 199)));
}

// Whether the in-process communicators (InitAll) are created blocking (ncclConfig_t::blocking).
//   - Blocking, because a non-blocking communicator pays on every call: NCCL runs each ncclGroupEnd
//     of one (every collective is a group inside NCCL) on a thread it starts for it (group.cc,
//     groupLaunchNonBlocking), and the caller polls for its completion (Settle). A thread start per
//     call costs tens of microseconds against the 10 us budget for a 4 KiB AllReduce.
//   - What that leaves unbounded: since 2.22 NCCL connects a communicator's peers lazily, at the
//     first operation of each algorithm and the first send/recv to a peer (NCCL_RUNTIME_CONNECT=1,
//     the default), inside ncclGroupEnd, where it waits for those peers to do the same. A rank
//     whose host thread failed between the executor's rendezvous and its NCCL call would leave its
//     peers there. Every rank passed the same agreement with the same work just before (the
//     executor's Agree), so only a failure on the host between those two points does it. Non-
//     blocking would bound it (ncclInProgress, polled by Settle against the deadline), at the cost
//     above; NCCL_RUNTIME_CONNECT=0 (connect everything at init, from InitAll's one thread, where no
//     peer can be missing) is process-wide (read once; no ncclConfig_t field through 2.32) and shared
//     with XLA's own communicators; a warm-up collective at setup connects only the algorithm it
//     happened to use. docs/cuda.md ("Known limits").
//   - NCCL_COMM_BLOCKING in the environment overrides ncclConfig_t::blocking in every communicator
//     (NCCL's envConfigOverride, applied after the config since 2.15), so every path here (InitAll,
//     Settle) handles non-blocking communicators too: NCCL_COMM_BLOCKING=0 gives the bounded waits
//     at the per-call cost, for whoever prefers it.
constexpr int kInProcessBlocking = 1;

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
                  Resolve(lib, "ncclRecv", &s.Recv) && Resolve(lib, "ncclCommAbort", &s.CommAbort) &&
                  Resolve(lib, "ncclCommDestroy", &s.CommDestroy);
  s.CommInitRankConfig = reinterpret_cast<decltype(s.CommInitRankConfig)>(dlsym(lib, "ncclCommInitRankConfig"));
  s.CommGetAsyncError = reinterpret_cast<decltype(s.CommGetAsyncError)>(dlsym(lib, "ncclCommGetAsyncError"));
  s.CommFinalize = reinterpret_cast<decltype(s.CommFinalize)>(dlsym(lib, "ncclCommFinalize"));
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
  comms->clear();
  const int n = static_cast<int>(devices.size());
  // Every device is made current once before the group: a failure between ncclGroupStart and
  // ncclGroupEnd that is not NCCL's own leaves NCCL unaware, and its ncclGroupEnd would then start
  // joining only the ranks before it, which (blocking) wait for the others forever. Checked here,
  // the cudaSetDevice inside the group repeats one that just succeeded.
  for (int r = 0; r < n; ++r)
    if (!SetDeviceFor(devices[r]))
      return Status::Internal("cudaSetDevice(" + std::to_string(devices[r]) + ") for NCCL's communicator of rank " +
                              std::to_string(r));
  ncclUniqueId id;
  FLEXLINK_NCCL(sym_->GetUniqueId(&id), "ncclGetUniqueId");
  std::vector<ncclComm_t> made(n, nullptr);
  // Whatever was made is aborted on every way out but success: ncclCommAbort frees a communicator
  // whose initialisation failed or is still in progress (non-blocking), and nothing else would.
  auto give_up = [&](Status why) {
    for (ncclComm_t& c : made) {
      if (c) (void)sym_->CommAbort(c);
      c = nullptr;
    }
    return why;
  };
  // ncclCommInitRankConfig with blocking set explicitly (kInProcessBlocking above); NCCL before 2.14
  // has neither it nor non-blocking communicators, only ncclCommInitRank.
  const bool configured = sym_->CommInitRankConfig && sym_->CommGetAsyncError;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = kInProcessBlocking;
  auto started = [](ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; };
  // All ranks' communicators in one group from this thread: NCCL initialises them together, and no
  // rank of the group has anything in flight (the executor's setup runs inside the first call's
  // rendezvous, before any rank enqueues; jax-ml/jax#11637).
  FLEXLINK_NCCL(sym_->GroupStart(), "ncclGroupStart");
  for (int r = 0; r < n; ++r) {
    if (!SetDeviceFor(devices[r])) {
      (void)sym_->GroupEnd();
      return give_up(Status::Internal("cudaSetDevice(" + std::to_string(devices[r]) +
                                      ") for NCCL's communicator of rank " + std::to_string(r)));
    }
    // A failure inside the group is NCCL's group error too: its ncclGroupEnd then starts nothing.
    const ncclResult_t res = configured ? sym_->CommInitRankConfig(&made[r], n, id, r, &config)
                                        : sym_->CommInitRank(&made[r], n, id, r);
    if (!started(res)) {
      (void)sym_->GroupEnd();
      return give_up(Status::Internal(std::string(configured ? "ncclCommInitRankConfig" : "ncclCommInitRank") +
                                      " (rank " + std::to_string(r) + " of " + std::to_string(n) +
                                      "): " + sym_->GetErrorString(res)));
    }
  }
  const ncclResult_t end = sym_->GroupEnd();
  if (!started(end))
    return give_up(Status::Internal(std::string("ncclGroupEnd (creating the communicators): ") +
                                    sym_->GetErrorString(end)));
  // Non-blocking (NCCL_COMM_BLOCKING=0, or kInProcessBlocking = 0): ncclGroupEnd returned with the
  // initialisation running on NCCL's threads. Every rank is in this group, so no peer can be
  // missing; the deadline only keeps a broken NCCL or driver from holding setup forever.
  if (configured) {
    double seconds = 0;
    const auto deadline = DeadlineFromNow(&seconds);
    for (int r = 0; r < n; ++r) {
      for (int polls = 0;; ++polls) {
        ncclResult_t state = ncclSuccess;
        const ncclResult_t q = sym_->CommGetAsyncError(made[r], &state);
        if (q != ncclSuccess) state = q;
        if (state == ncclSuccess) break;
        if (state != ncclInProgress)
          return give_up(Status::Internal("creating NCCL's communicator of rank " + std::to_string(r) + " of " +
                                          std::to_string(n) + ": " + sym_->GetErrorString(state)));
        if (Clock::now() >= deadline)
          return give_up(Status::DeadlineExceeded("NCCL's communicators of " + std::to_string(n) +
                                                  " ranks were not complete after " + FormatSeconds(seconds) + " s"));
        Backoff(polls);
      }
    }
  }
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
  // As in InitAll: every device made current once before the group, so that the cudaSetDevice
  // inside it cannot be the first to fail (NCCL would then start joining only the ranks before it).
  for (size_t i = 0; i < m; ++i)
    if (!SetDeviceFor(devices[i]))
      return Status::Internal("cudaSetDevice(" + std::to_string(devices[i]) + ") for NCCL's communicator of rank " +
                              std::to_string(ranks[i]));
  std::vector<ncclComm_t> made(m, nullptr);
  // Non-blocking (blocking = 0): ncclCommInitRankConfig and ncclGroupEnd return ncclInProgress
  // instead of blocking until every process has joined, so a peer that died before or while joining
  // cannot leave this process stuck inside NCCL: the caller polls ncclCommGetAsyncError against its
  // deadline and the peers' liveness, and aborts (CommApi::InitRanks). NCCL_COMM_BLOCKING=1 in the
  // environment overrides it (kInProcessBlocking's note): ncclGroupEnd then blocks until every
  // process has joined, and a dead peer holds this thread there with no deadline.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  auto started = [](ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; };
  // This process's ranks in one group from this thread (several local GPUs): NCCL joins them to the
  // other processes' ranks together. The executor calls this inside its first call's cross-process
  // arrival, where no local rank has anything of the group in flight (jax-ml/jax#11637).
  FLEXLINK_NCCL(sym_->GroupStart(), "ncclGroupStart");
  for (size_t i = 0; i < m; ++i) {
    if (!SetDeviceFor(devices[i])) {
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
  if (r != ncclInProgress || !sym_->CommGetAsyncError) {
    std::string message = std::string(what) + ": " + sym_->GetErrorString(static_cast<ncclResult_t>(r));
    // NCCL refuses an operation on a communicator whose previous one never settled (a Settle that
    // gave up below) with ncclInvalidArgument; say so instead of leaving "invalid argument".
    if (r == ncclInvalidArgument && sym_->CommGetAsyncError)
      for (Comm c : comms) {
        ncclResult_t state = ncclSuccess;
        if (sym_->CommGetAsyncError(static_cast<ncclComm_t>(c), &state) == ncclSuccess && state == ncclInProgress) {
          message += " (the communicator's previous operation never completed: it is unusable)";
          break;
        }
      }
    return Status::Internal(message);
  }
  // A non-blocking communicator (InitRanksAsync's; InitAll's under NCCL_COMM_BLOCKING=0) answers an
  // operation or ncclGroupEnd with ncclInProgress: NCCL's thread is still issuing it. Usually that
  // is microseconds of host work, but the first operations of a communicator also connect it to its
  // peers (runtime connect), which waits for the peers to issue theirs: a rank that never does
  // leaves it in progress. Polled against the engine's deadline (FLEXLINK_TIMEOUT_S); past it the
  // call fails and the communicator stays in progress: NCCL refuses its later operations at once
  // (ncclInvalidArgument, worded above), and an abort (the hang detector's) frees it.
  double seconds = 0;
  const auto deadline = DeadlineFromNow(&seconds);
  for (Comm c : comms) {
    for (int polls = 0;; ++polls) {
      ncclResult_t state = ncclSuccess;
      FLEXLINK_NCCL(sym_->CommGetAsyncError(static_cast<ncclComm_t>(c), &state), "ncclCommGetAsyncError");
      if (state == ncclSuccess) break;
      if (state != ncclInProgress) return Status::Internal(std::string(what) + ": " + sym_->GetErrorString(state));
      if (Clock::now() >= deadline)
        return Status::DeadlineExceeded(std::string(what) + ": still in progress after " + FormatSeconds(seconds) +
                                        " s (NCCL connects a communicator's peers at its first operations and waits "
                                        "for them: a rank of the group that never issued its part?)");
      Backoff(polls);
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
    return Settle(r == ncclInProgress ? ncclSuccess : r, std::span<const Comm>(&comm, 1), what);
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

// ncclCommFinalize "flushes all issued communications" and completes once the communicator is
// quiescent (its own streams synchronised, its proxy stopped: NCCL's init.cc, commDestroySync, all
// local to this process); ncclCommDestroy then frees the rest without blocking. A non-blocking
// communicator answers the finalize with ncclInProgress and is polled, against `timeout_s`, as its
// operations are (Settle). NCCL before 2.14 has no finalize: ncclCommDestroy does it all.
Status NcclComm::Destroy(Comm comm, double timeout_s) {
  FLEXLINK_RETURN_IF_ERROR(Load());
  ncclComm_t c = static_cast<ncclComm_t>(comm);
  std::string why;
  if (sym_->CommFinalize) {
    ncclResult_t r = sym_->CommFinalize(c);
    const auto deadline = DeadlineAfter(timeout_s);
    for (int polls = 0; r == ncclInProgress && sym_->CommGetAsyncError; ++polls) {
      ncclResult_t state = ncclSuccess;
      if (sym_->CommGetAsyncError(c, &state) != ncclSuccess) break;
      r = state;
      if (r != ncclInProgress) break;
      if (Clock::now() >= deadline) {
        why = "ncclCommFinalize still in progress after " + FormatSeconds(timeout_s) + " s";
        break;
      }
      Backoff(polls);
    }
    if (why.empty() && r != ncclSuccess) why = std::string("ncclCommFinalize: ") + sym_->GetErrorString(r);
  }
  if (why.empty()) {
    const ncclResult_t r = sym_->CommDestroy(c);
    if (r == ncclSuccess) return Status::Ok();
    return Status::Internal(std::string("ncclCommDestroy: ") + sym_->GetErrorString(r));
  }
  // Nothing of it runs on a device any more (drained first), so an abort loses nothing; it frees
  // what the finalize could not.
  const ncclResult_t r = sym_->CommAbort(c);
  return Status::Internal(why + "; ended with ncclCommAbort instead" +
                          (r == ncclSuccess || r == ncclInProgress ? std::string() : std::string(" (which failed too: ") + sym_->GetErrorString(r) + ")"));
}

}  // namespace flexlink::gpu
