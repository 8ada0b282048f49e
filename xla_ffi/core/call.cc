#include "xla_ffi/core/call.h"

#include <string>

#include "xla_ffi/core/reduce.h"

namespace flexlink {
namespace {

size_t Product(std::span<const int64_t> dims) {
  size_t p = 1;
  for (int64_t d : dims) p *= static_cast<size_t>(d);
  return p;
}

std::string Shape(DType t, std::span<const int64_t> dims) {
  std::string s(Name(t));
  s += "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

}  // namespace

std::string FormatIds(std::span<const int64_t> ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ids[i]);
  }
  return s + "]";
}

std::string ErrorPrefix(std::string_view label) {
  return label.empty() ? std::string("flexlink: ") : "flexlink: " + std::string(label) + ": ";
}

std::string CallDesc::Describe() const {
  // Appends one piece at a time (GCC 12 warns falsely on "literal" + std::string chains).
  std::string s(Name(kind));
  if (kind != Kind::kAllGather) {
    s += "(";
    s += Name(op);
    s += ")";
  }
  s += " ";
  s += Name(dtype);
  s += "[";
  s += std::to_string(units);
  s += " per rank";
  if (kind != Kind::kAllReduce) {
    s += ", outer ";
    s += std::to_string(outer);
  }
  return s + "]";
}

Status DescribeCall(const CallRequest& req, int n, std::string_view label, CallDesc* desc) {
  const std::string where = ErrorPrefix(label) + std::string(Name(req.kind)) + ": ";
  const size_t in_count = Product(req.in_dims), out_count = Product(req.out_dims);
  const std::string shapes =
      "input " + Shape(req.in_dtype, req.in_dims) + ", output " + Shape(req.out_dtype, req.out_dims);
  if (req.in_dtype != req.out_dtype)
    return Status::InvalidArgument(where + "input and output dtypes differ (" + shapes + ")");
  CallDesc d;
  d.kind = req.kind;
  d.dtype = req.in_dtype;
  d.in = req.in;
  d.out = req.out;
  if (req.kind != Kind::kAllGather) {
    auto op = ParseReduceOp(req.reduction);
    if (!op)
      return Status::InvalidArgument(where + "unknown reduction '" + std::string(req.reduction) +
                                     "' (expected sum, prod, max or min)");
    d.op = *op;
    Status s = CheckReduction(d.dtype, d.op);
    if (!s.ok()) return Status::InvalidArgument(where + s.message());
  }
  const int64_t rank = static_cast<int64_t>(req.in_dims.size());
  switch (req.kind) {
    case Kind::kAllReduce:
      if (in_count != out_count)
        return Status::InvalidArgument(where + "output size differs from input size (" + shapes + ")");
      d.units = in_count;
      d.inner = in_count;
      break;
    case Kind::kAllGather:
      if (req.axis < 0 || req.axis > rank)
        return Status::InvalidArgument(where + "axis " + std::to_string(req.axis) +
                                       " out of range for " + shapes);
      if (out_count != in_count * n)
        return Status::InvalidArgument(where + "output must hold " + std::to_string(n) +
                                       " x the input elements for a group of " + std::to_string(n) +
                                       " (" + shapes + ")");
      d.units = in_count;
      d.outer = Product(req.in_dims.first(req.axis));
      d.inner = d.outer ? in_count / d.outer : 0;
      break;
    case Kind::kReduceScatter:
      if (req.axis < 0 || req.axis >= rank)
        return Status::InvalidArgument(where + "scatter axis " + std::to_string(req.axis) +
                                       " out of range for " + shapes);
      if (req.in_dims[req.axis] % n != 0 || in_count != out_count * n)
        return Status::InvalidArgument(where + "input dimension " + std::to_string(req.axis) +
                                       " must be split evenly over the group of " + std::to_string(n) +
                                       " with the output holding one block (" + shapes + ")");
      d.units = out_count;
      d.outer = Product(req.in_dims.first(req.axis));
      d.inner = d.outer ? out_count / d.outer : 0;
      break;
  }
  *desc = d;
  return Status::Ok();
}

Status ResolveGroup(std::span<const int64_t> groups, std::span<const int64_t> group_sizes,
                    int64_t device, std::string_view label, std::span<const int64_t>* members,
                    int* rank) {
  const std::string where = ErrorPrefix(label);
  size_t total = 0;
  for (int64_t s : group_sizes) {
    if (s <= 0)
      return Status::InvalidArgument(where + "group sizes must be positive, got " +
                                     FormatIds(group_sizes));
    total += static_cast<size_t>(s);
  }
  if (total != groups.size())
    return Status::InvalidArgument(where + "group sizes " + FormatIds(group_sizes) + " add up to " +
                                   std::to_string(total) + " but " + std::to_string(groups.size()) +
                                   " device ids were given");
  size_t offset = 0;
  int found = 0;
  for (int64_t s : group_sizes) {
    auto g = groups.subspan(offset, static_cast<size_t>(s));
    for (size_t i = 0; i < g.size(); ++i) {
      if (g[i] != device) continue;
      if (++found > 1) break;
      *members = g;
      *rank = static_cast<int>(i);
    }
    offset += static_cast<size_t>(s);
  }
  if (found == 0)
    return Status::InvalidArgument(where + "device " + std::to_string(device) +
                                   " is not in any group of " + FormatIds(groups) + " (sizes " +
                                   FormatIds(group_sizes) + ")");
  if (found > 1)
    return Status::InvalidArgument(where + "device " + std::to_string(device) +
                                   " appears more than once in the groups " + FormatIds(groups));
  return Status::Ok();
}

}  // namespace flexlink
