#include "xla_ffi/core/types.h"

#include <array>
#include <utility>

namespace flexlink {
namespace {

struct DTypeInfo {
  DType type;
  std::string_view name;
  size_t width;
};

constexpr std::array<DTypeInfo, 15> kDTypes = {{
    {DType::kPred, "bool", 1},       {DType::kS8, "int8", 1},        {DType::kS16, "int16", 2},
    {DType::kS32, "int32", 4},       {DType::kS64, "int64", 8},      {DType::kU8, "uint8", 1},
    {DType::kU16, "uint16", 2},      {DType::kU32, "uint32", 4},     {DType::kU64, "uint64", 8},
    {DType::kF16, "float16", 2},     {DType::kBF16, "bfloat16", 2},  {DType::kF32, "float32", 4},
    {DType::kF64, "float64", 8},     {DType::kC64, "complex64", 8},  {DType::kC128, "complex128", 16},
}};

constexpr std::array<std::pair<ReduceOp, std::string_view>, 4> kOps = {{
    {ReduceOp::kSum, "sum"}, {ReduceOp::kProd, "prod"}, {ReduceOp::kMax, "max"}, {ReduceOp::kMin, "min"},
}};

constexpr std::array<std::pair<Kind, std::string_view>, kNumKinds> kKinds = {{
    {Kind::kAllReduce, "all_reduce"},
    {Kind::kAllGather, "all_gather"},
    {Kind::kReduceScatter, "reduce_scatter"},
    {Kind::kPpermute, "ppermute"},
    {Kind::kAllToAll, "all_to_all"},
}};

}  // namespace

size_t ByteWidth(DType t) { return kDTypes[static_cast<size_t>(t)].width; }
std::string_view Name(DType t) { return kDTypes[static_cast<size_t>(t)].name; }
std::string_view Name(ReduceOp op) { return kOps[static_cast<size_t>(op)].second; }
std::string_view Name(Kind k) { return kKinds[static_cast<size_t>(k)].second; }

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& d : kDTypes)
    if (d.name == name) return d.type;
  return std::nullopt;
}

std::optional<ReduceOp> ParseReduceOp(std::string_view name) {
  for (const auto& [op, n] : kOps)
    if (n == name) return op;
  return std::nullopt;
}

std::optional<Kind> ParseKind(std::string_view name) {
  for (const auto& [k, n] : kKinds)
    if (n == name) return k;
  return std::nullopt;
}

}  // namespace flexlink
