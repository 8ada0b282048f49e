#include "xla_ffi/core/call.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

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

Status CheckDistinct(std::span<const int64_t> devices, std::string_view label) {
  std::vector<int64_t> sorted(devices.begin(), devices.end());
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end()) return Status::Ok();
  return Status::InvalidArgument(ErrorPrefix(label) + "group " + FormatIds(devices) +
                                 " names a device more than once");
}

Status CheckEvenGroups(std::span<const int64_t> group_sizes, std::string_view label) {
  for (int64_t s : group_sizes)
    if (s != group_sizes[0])
      return Status::InvalidArgument(ErrorPrefix(label) + "all_to_all: groups must all have the same size, got sizes " +
                                     FormatIds(group_sizes));
  return Status::Ok();
}

std::string ErrorPrefix(std::string_view label) {
  return label.empty() ? std::string("flexlink: ") : "flexlink: " + std::string(label) + ": ";
}

void CallDesc::AddPart(Part p) {
  const uint64_t end = virtual_bytes();
  p.offset = (end + kPartAlignBytes - 1) / kPartAlignBytes * kPartAlignBytes;
  parts.push_back(p);
}

size_t CallDesc::total_units() const {
  size_t u = 0;
  for (const Part& p : parts) u += p.units;
  return u;
}

uint64_t CallDesc::InputBytes(int n) const {
  uint64_t b = 0;
  for (const Part& p : parts) b += static_cast<uint64_t>(in_count(p, n)) * p.width();
  return b;
}

uint64_t CallDesc::InputBytes(UnitRange virtual_range, int n) const {
  thread_local std::vector<Piece> pieces;
  PiecesOf(virtual_range, &pieces);
  uint64_t b = 0;
  for (const Piece& piece : pieces)
    b += static_cast<uint64_t>(piece.units.size()) * in_per_unit(n) * parts[piece.part].width();
  return b;
}

void CallDesc::PiecesOf(UnitRange range, std::vector<Piece>* out) const {
  out->clear();
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& p = parts[i];
    if (p.offset >= range.end) break;
    const uint64_t end = p.offset + p.bytes();
    if (end <= range.begin || p.units == 0) continue;
    const uint64_t b0 = std::max<uint64_t>(range.begin, p.offset) - p.offset;
    const uint64_t b1 = std::min<uint64_t>(range.end, end) - p.offset;
    const size_t w = p.width();
    // A unit belongs to the range holding its first byte (ceil on both ends).
    const UnitRange units{static_cast<size_t>((b0 + w - 1) / w), static_cast<size_t>((b1 + w - 1) / w)};
    if (!units.empty()) out->push_back({i, units});
  }
}

int CallDesc::DestinationOf(int r) const {
  for (size_t d = 0; d < sources.size(); ++d)
    if (sources[d] == r) return static_cast<int>(d);
  return -1;
}

bool CallDesc::SameCall(const CallDesc& o) const {
  if (kind != o.kind || parts.size() != o.parts.size() || sources != o.sources) return false;
  if (Reduces(kind) && op != o.op) return false;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part &a = parts[i], &b = o.parts[i];
    if (a.dtype != b.dtype || a.units != b.units || a.outer != b.outer || a.inner != b.inner) return false;
  }
  return true;
}

std::string CallDesc::Describe() const {
  // Appends one piece at a time (GCC 12 warns falsely on "literal" + std::string chains).
  std::string s(Name(kind));
  if (Reduces(kind)) {
    s += "(";
    s += Name(op);
    s += ")";
  }
  if (kind == Kind::kPpermute) {
    constexpr size_t kShownPairs = 16;
    s += "(";
    size_t shown = 0;
    for (size_t r = 0; r < sources.size(); ++r) {  // in source order, as the pairs are usually written
      const int d = DestinationOf(static_cast<int>(r));
      if (d < 0) continue;
      if (shown++ == kShownPairs) {
        s += ", ...";
        break;
      }
      if (shown > 1) s += ", ";
      s += std::to_string(r);
      s += "->";
      s += std::to_string(d);
    }
    s += shown == 0 ? "no pairs)" : ")";
  }
  auto part = [&](const Part& p, bool alone) {
    s += Name(p.dtype);
    s += "[";
    s += std::to_string(p.units);
    if (alone) s += " per rank";
    if (kind != Kind::kAllReduce && kind != Kind::kPpermute) {
      s += alone ? ", outer " : " outer ";
      s += std::to_string(p.outer);
    }
    s += "]";
  };
  if (parts.size() == 1) {
    s += " ";
    part(parts[0], true);
    return s;
  }
  s += " of ";
  s += std::to_string(parts.size());
  s += " operands per rank:";
  constexpr size_t kShown = 6;  // a long list of leaves would drown the message
  for (size_t i = 0; i < parts.size() && i < kShown; ++i) {
    s += i ? ", " : " ";
    part(parts[i], false);
  }
  if (parts.size() > kShown) {
    s += ", ... (";
    s += std::to_string(parts.size() - kShown);
    s += " more)";
  }
  return s;
}

namespace {

bool Overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes && b_bytes && x < y + b_bytes && y < x + a_bytes;
}

// `where()` and `shapes()` make their text only for an error: every call of every rank describes
// itself here, on XLA's device thread (docs/cuda.md, "The host path of a call").
template <class Where>
Status DescribeOperand(const CallRequest& req, ReduceOp op, const OperandRequest& x, int n, const Where& where,
                       Part* part) {
  const size_t in_count = Product(x.in_dims), out_count = Product(x.out_dims);
  auto shapes = [&] { return "input " + Shape(x.in_dtype, x.in_dims) + ", output " + Shape(x.out_dtype, x.out_dims); };
  if (x.in_dtype != x.out_dtype)
    return Status::InvalidArgument(where() + "input and output dtypes differ (" + shapes() + ")");
  if (Reduces(req.kind)) {
    Status s = CheckReduction(x.in_dtype, op);
    if (!s.ok()) return Status::InvalidArgument(where() + s.message());
  }
  Part d;
  d.dtype = x.in_dtype;
  d.in = x.in;
  d.out = x.out;
  const int64_t rank = static_cast<int64_t>(x.in_dims.size());
  switch (req.kind) {
    case Kind::kAllReduce:
    case Kind::kPpermute:
      if (in_count != out_count)
        return Status::InvalidArgument(where() + "output size differs from input size (" + shapes() + ")");
      d.units = in_count;
      d.inner = in_count;
      break;
    case Kind::kAllGather:
      if (req.axis < 0 || req.axis > rank)
        return Status::InvalidArgument(where() + "axis " + std::to_string(req.axis) +
                                       " out of range for " + shapes());
      if (out_count != in_count * n)
        return Status::InvalidArgument(where() + "output must hold " + std::to_string(n) +
                                       " x the input elements for a group of " + std::to_string(n) +
                                       " (" + shapes() + ")");
      d.units = in_count;
      d.outer = Product(x.in_dims.first(req.axis));
      d.inner = d.outer ? in_count / d.outer : 0;
      break;
    case Kind::kReduceScatter:
      if (req.axis < 0 || req.axis >= rank)
        return Status::InvalidArgument(where() + "scatter axis " + std::to_string(req.axis) +
                                       " out of range for " + shapes());
      if (x.in_dims[req.axis] % n != 0 || in_count != out_count * n)
        return Status::InvalidArgument(where() + "input dimension " + std::to_string(req.axis) +
                                       " must be split evenly over the group of " + std::to_string(n) +
                                       " with the output holding one block (" + shapes() + ")");
      d.units = out_count;
      d.outer = Product(x.in_dims.first(req.axis));
      d.inner = d.outer ? out_count / d.outer : 0;
      break;
    case Kind::kAllToAll:
      if (req.axis < 0 || req.axis >= rank)
        return Status::InvalidArgument(where() + "axis " + std::to_string(req.axis) + " out of range for " + shapes());
      if (x.in_dims[req.axis] % n != 0)
        return Status::InvalidArgument(where() + "input dimension " + std::to_string(req.axis) + " (" +
                                       std::to_string(x.in_dims[req.axis]) + ") must split evenly into " +
                                       std::to_string(n) + " blocks, one per rank of the group (" + shapes() + ")");
      if (in_count != out_count)
        return Status::InvalidArgument(where() + "output size differs from input size (" + shapes() + ")");
      d.units = in_count / n;
      d.outer = Product(x.in_dims.first(req.axis));
      d.inner = d.outer ? d.units / d.outer : 0;
      break;
  }
  // all_reduce, ppermute and all_to_all run in place (the output exactly the input buffer: the links
  // take care that nobody overwrites what a peer still reads); an output that overlaps its input
  // otherwise, or any overlap for all_gather and reduce_scatter, is an error.
  if (req.kind != Kind::kAllReduce && n > 1) {
    const size_t w = ByteWidth(d.dtype);
    const bool exchange = req.kind == Kind::kPpermute || req.kind == Kind::kAllToAll;
    if (Overlap(x.in, in_count * w, x.out, out_count * w) && !(exchange && x.in == x.out))
      return Status::InvalidArgument(
          where() + "the output overlaps the input (" + shapes() + "); " +
          (exchange ? std::string(Name(req.kind)) + " runs in place only with the output being the input " +
                          "buffer itself, else it needs a separate output buffer"
                    : "only all_reduce, ppermute and all_to_all run in place, " + std::string(Name(req.kind)) +
                          " needs a separate output buffer"));
  }
  *part = d;
  return Status::Ok();
}

// ppermute's (source, destination) pairs as a per-destination source table.
template <class Where>
Status DescribePairs(std::span<const int64_t> pairs, int n, const Where& where, std::vector<int32_t>* sources) {
  if (pairs.size() % 2 != 0)
    return Status::InvalidArgument(where() + "pairs must be (source, destination) ranks, flattened: got " +
                                   std::to_string(pairs.size()) + " numbers " + FormatIds(pairs));
  sources->assign(static_cast<size_t>(n), -1);
  std::vector<char> is_source(static_cast<size_t>(n), 0);
  for (size_t i = 0; i < pairs.size(); i += 2) {
    const int64_t s = pairs[i], d = pairs[i + 1];
    if (s < 0 || s >= n || d < 0 || d >= n) {
      std::string pair = "(";  // appended: GCC 12 warns falsely on "literal" + std::string chains
      pair += std::to_string(s);
      pair += ", ";
      pair += std::to_string(d);
      pair += ")";
      return Status::InvalidArgument(where() + "pair " + pair + " names a rank outside the group of " +
                                     std::to_string(n) + " (ranks are positions 0.." + std::to_string(n - 1) +
                                     " in the group)");
    }
    if (is_source[s])
      return Status::InvalidArgument(where() + "rank " + std::to_string(s) + " is the source of more than one pair " +
                                     "(sources must be unique): " + FormatIds(pairs));
    if ((*sources)[d] >= 0)
      return Status::InvalidArgument(where() + "rank " + std::to_string(d) + " is the destination of more than one " +
                                     "pair (destinations must be unique): " + FormatIds(pairs));
    is_source[s] = 1;
    (*sources)[d] = static_cast<int32_t>(s);
  }
  return Status::Ok();
}

}  // namespace

Status DescribeCall(const CallRequest& req, int n, std::string_view label, CallDesc* desc) {
  auto where = [&] { return ErrorPrefix(label) + std::string(Name(req.kind)) + ": "; };
  if (req.operands.empty())
    return Status::InvalidArgument(where() + "no operands (a call takes x_1, ..., x_k and the token, k >= 1)");
  desc->kind = req.kind;
  desc->op = ReduceOp::kSum;
  desc->parts.clear();
  desc->sources.clear();
  if (Reduces(req.kind)) {
    auto op = ParseReduceOp(req.reduction);
    if (!op)
      return Status::InvalidArgument(where() + "unknown reduction '" + std::string(req.reduction) +
                                     "' (expected sum, prod, max or min)");
    desc->op = *op;
  }
  if (req.kind == Kind::kPpermute) FLEXLINK_RETURN_IF_ERROR(DescribePairs(req.pairs, n, where, &desc->sources));
  const bool several = req.operands.size() > 1;
  for (size_t i = 0; i < req.operands.size(); ++i) {
    auto at = [&] { return several ? where() + "operand " + std::to_string(i) + ": " : where(); };
    Part part;
    FLEXLINK_RETURN_IF_ERROR(DescribeOperand(req, desc->op, req.operands[i], n, at, &part));
    desc->AddPart(part);
  }
  return Status::Ok();
}

Status ResolveGroup(std::span<const int64_t> groups, std::span<const int64_t> group_sizes,
                    int64_t device, std::string_view label, std::span<const int64_t>* members,
                    int* rank) {
  auto where = [&] { return ErrorPrefix(label); };  // for an error only: every call resolves its group
  size_t total = 0;
  for (int64_t s : group_sizes) {
    if (s <= 0)
      return Status::InvalidArgument(where() + "group sizes must be positive, got " +
                                     FormatIds(group_sizes));
    total += static_cast<size_t>(s);
  }
  if (total != groups.size())
    return Status::InvalidArgument(where() + "group sizes " + FormatIds(group_sizes) + " add up to " +
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
    return Status::InvalidArgument(where() + "device " + std::to_string(device) +
                                   " is not in any group of " + FormatIds(groups) + " (sizes " +
                                   FormatIds(group_sizes) + ")");
  if (found > 1)
    return Status::InvalidArgument(where() + "device " + std::to_string(device) +
                                   " appears more than once in the groups " + FormatIds(groups));
  return Status::Ok();
}

}  // namespace flexlink
