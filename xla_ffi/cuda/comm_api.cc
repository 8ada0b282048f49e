#include "xla_ffi/cuda/comm_api.h"

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

Status CommApi::InitRanks(const CommId&, int, std::span<const int>, std::span<const int>, std::vector<Comm>*) {
  return Status::FailedPrecondition("this collective library has no communicators across processes");
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
    // round nothing and stay native.
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
