// Vocabulary shared by every layer: element types, reductions and collective kinds. The engine has its
// own DType (not xla::ffi::DataType) so that it builds and is tested without XLA; ffi/ maps between them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace flexlink {

enum class DType : uint8_t {
  kPred, kS8, kS16, kS32, kS64, kU8, kU16, kU32, kU64, kF16, kBF16, kF32, kF64, kC64, kC128,
};

enum class ReduceOp : uint8_t { kSum, kProd, kMax, kMin };

// Values index per-kind tables (plans, fits, the tuning cache by name): append, never reorder.
enum class Kind : uint8_t { kAllReduce, kAllGather, kReduceScatter, kPpermute, kAllToAll };
inline constexpr size_t kNumKinds = 5;
inline constexpr Kind kAllKinds[kNumKinds] = {Kind::kAllReduce, Kind::kAllGather, Kind::kReduceScatter,
                                             Kind::kPpermute, Kind::kAllToAll};
// Whether the kind reduces (takes a reduction); the others only move bytes.
inline constexpr bool Reduces(Kind k) { return k == Kind::kAllReduce || k == Kind::kReduceScatter; }

size_t ByteWidth(DType t);
// numpy-style names ("float32", "bfloat16", "bool", ...), used in messages and by engine_run.
std::string_view Name(DType t);
std::string_view Name(ReduceOp op);
std::string_view Name(Kind k);  // "all_reduce", "all_gather", "reduce_scatter", "ppermute", "all_to_all"

std::optional<DType> ParseDType(std::string_view name);
std::optional<ReduceOp> ParseReduceOp(std::string_view name);
std::optional<Kind> ParseKind(std::string_view name);

}  // namespace flexlink
