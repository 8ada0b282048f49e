#include "xla_ffi/cuda/comm_api.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "xla_ffi/core/deadline.h"

namespace flexlink::gpu {
namespace {

CommOp OpOf(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return CommOp::kSum;
    case ReduceOp::kProd: return CommOp::kProd;
    case ReduceOp::kMax: return CommOp::kMax;
    case ReduceOp::kMin: return CommOp::kMin;
  }
  return CommOp::kSum;
}

NcclReduction Native(CommType type, CommOp op, size_t lanes = 1) { return {true, type, op, lanes}; }

}  // namespace

Status CommApi::NewId(CommId*) {
  return Status::FailedPrecondition("this collective library has no communicators across processes");
}

Status CommApi::InitRanksAsync(const CommId&, int, std::span<const int>, std::span<const int>, std::vector<Comm>*) {
  return Status::FailedPrecondition("this collective library has no communicators across processes");
}

Status CommApi::JoinState(Comm, bool*) {
  return Status::FailedPrecondition("this collective library has no communicators across processes");
}

Status CommApi::InitRanks(const CommId& id, int nranks, std::span<const int> ranks, std::span<const int> devices,
                          const JoinWatch& watch, std::vector<Comm>* comms) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = start + ClampedSeconds(watch.timeout_s);
  std::vector<Comm> made;
  Status s = InitRanksAsync(id, nranks, ranks, devices, &made);
  // Whatever InitRanksAsync made before failing is aborted too: NCCL frees a communicator in
  // progress only through ncclCommAbort, and a later retry must not find it half-joined.
  auto give_up = [&](Status why) {
    for (Comm c : made)
      if (c) (void)Abort(c);
    comms->clear();
    return why;
  };
  if (!s.ok()) return give_up(s);
  std::vector<bool> done(made.size(), false);
  for (int polls = 0;; ++polls) {
    bool all = true;
    for (size_t i = 0; i < made.size(); ++i) {
      if (done[i]) continue;
      bool d = false;
      Status js = JoinState(made[i], &d);
      if (!js.ok()) return give_up(Status(js.code(), "joining rank " + std::to_string(ranks[i]) + " of " +
                                                          std::to_string(nranks) + ": " + js.message()));
      done[i] = d;
      all = all && d;
    }
    if (all) break;
    if (watch.check) {
      std::string why = watch.check();
      if (!why.empty()) return give_up(Status::Unavailable(why));
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      return give_up(Status::DeadlineExceeded("the communicator was not complete after " + FormatSeconds(watch.timeout_s) +
                                              " s (every rank of every process must join it)"));
    }
    // Joining takes NCCL's bootstrap and topology exchange (tens of ms and more): short yields first
    // for the fast case (every process already there), then 10 ms polls.
    std::this_thread::sleep_for(polls < 20 ? std::chrono::microseconds(500) : std::chrono::milliseconds(10));
  }
  *comms = std::move(made);
  return Status::Ok();
}

NcclReduction NcclReductionOf(DType dtype, ReduceOp op) {
  const CommOp o = OpOf(op);
  switch (dtype) {
    // bool is stored as bytes 0/1: or = max, and = min (sum counts as or, prod as and).
    case DType::kPred:
      return Native(CommType::kUint8, op == ReduceOp::kSum || op == ReduceOp::kMax ? CommOp::kMax : CommOp::kMin);
    case DType::kS8: return Native(CommType::kInt8, o);
    case DType::kU8: return Native(CommType::kUint8, o);
    case DType::kS32: return Native(CommType::kInt32, o);
    case DType::kU32: return Native(CommType::kUint32, o);
    case DType::kS64: return Native(CommType::kInt64, o);
    case DType::kU64: return Native(CommType::kUint64, o);
    // NCCL reduces float16/bfloat16 in their own precision, rounding at every step of its ring;
    // FlexLink's contract is float32 accumulation in rank order, rounded once (the CPU engine's and
    // the pcie link's result, bitwise), so these gather and reduce with the engine's kernel. max/min
    // round nothing and stay native. (Floating max/min everywhere on the GPU are NCCL's: a NaN operand
    // is dropped, as XLA:GPU's own all-reduce does; the engine's kernels for the pcie link do the same,
    // elementwise.h's FMax/FMin, so a split call gives one result. The CPU engine propagates NaN.)
    case DType::kF16:
      if (op == ReduceOp::kMax || op == ReduceOp::kMin) return Native(CommType::kFloat16, o);
      return {};
    case DType::kBF16:
      if (op == ReduceOp::kMax || op == ReduceOp::kMin) return Native(CommType::kBfloat16, o);
      return {};
    case DType::kF32: return Native(CommType::kFloat32, o);
    case DType::kF64: return Native(CommType::kFloat64, o);
    case DType::kC64:
      if (op == ReduceOp::kSum) return Native(CommType::kFloat32, CommOp::kSum, 2);
      return {};
    case DType::kC128:
      if (op == ReduceOp::kSum) return Native(CommType::kFloat64, CommOp::kSum, 2);
      return {};
    case DType::kS16:
    case DType::kU16: return {};
  }
  return {};
}

}  // namespace flexlink::gpu
