#include "xla_ffi/xproc/fingerprint.h"

#include <cstring>
#include <string>
#include <vector>

#include "xla_ffi/xproc/layout.h"

namespace flexlink::xproc {
namespace {

struct AreaHeader {
  uint32_t bytes;  // serialized bytes after this header; 0: too long, hash only
  uint32_t reserved;
  uint64_t hash;
};

// Appends to a reused buffer (resize + memcpy: GCC 12 warns falsely on vector::insert here).
class Writer {
 public:
  explicit Writer(std::vector<char>* buf) : buf_(*buf) { buf_.clear(); }
  template <class T>
  void Put(T v) {
    const size_t at = buf_.size();
    buf_.resize(at + sizeof v);
    std::memcpy(buf_.data() + at, &v, sizeof v);
  }
  const std::vector<char>& bytes() const { return buf_; }

 private:
  std::vector<char>& buf_;
};

class Reader {
 public:
  Reader(const char* p, size_t n) : p_(p), end_(p + n) {}
  template <class T>
  bool Get(T* v) {
    if (static_cast<size_t>(end_ - p_) < sizeof(T)) return false;
    std::memcpy(v, p_, sizeof(T));
    p_ += sizeof(T);
    return true;
  }

 private:
  const char* p_;
  const char* end_;
};

uint64_t Fnv1a(const char* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(p[i])) * 1099511628211ull;
  return h;
}

// Rebuilds a buffer-less CallDesc; false when the bytes are not a fingerprint (never, between
// processes of one build; checked anyway since the bytes come from another process).
bool Parse(const char* area, CallDesc* d) {
  AreaHeader h;
  std::memcpy(&h, area, sizeof h);
  if (h.bytes == 0 || h.bytes > kFingerprintBytes - sizeof h) return false;
  Reader r(area + sizeof h, h.bytes);
  uint8_t kind, op;
  uint32_t parts, sources;
  if (!r.Get(&kind) || !r.Get(&op) || !r.Get(&parts) || !r.Get(&sources)) return false;
  d->kind = static_cast<Kind>(kind);
  d->op = static_cast<ReduceOp>(op);
  d->parts.clear();
  d->sources.clear();
  for (uint32_t i = 0; i < parts; ++i) {
    uint8_t dtype;
    uint64_t units, outer, inner;
    if (!r.Get(&dtype) || !r.Get(&units) || !r.Get(&outer) || !r.Get(&inner)) return false;
    Part p;
    p.dtype = static_cast<DType>(dtype);
    p.units = units;
    p.outer = outer;
    p.inner = inner;
    d->AddPart(p);
  }
  for (uint32_t i = 0; i < sources; ++i) {
    int32_t s;
    if (!r.Get(&s)) return false;
    d->sources.push_back(s);
  }
  return true;
}

}  // namespace

void WriteFingerprint(const CallDesc& desc, char* area) {
  thread_local std::vector<char> buf;
  Writer w(&buf);
  w.Put(static_cast<uint8_t>(desc.kind));
  // The reduction is part of the call only for the kinds that reduce (CallDesc::SameCall).
  w.Put(static_cast<uint8_t>(Reduces(desc.kind) ? desc.op : ReduceOp::kSum));
  w.Put(static_cast<uint32_t>(desc.parts.size()));
  w.Put(static_cast<uint32_t>(desc.sources.size()));
  for (const Part& p : desc.parts) {
    w.Put(static_cast<uint8_t>(p.dtype));
    w.Put(static_cast<uint64_t>(p.units));
    w.Put(static_cast<uint64_t>(p.outer));
    w.Put(static_cast<uint64_t>(p.inner));
  }
  for (int32_t s : desc.sources) w.Put(s);
  const auto& b = w.bytes();
  AreaHeader h{};
  h.hash = Fnv1a(b.data(), b.size());
  const bool fits = b.size() <= kFingerprintBytes - sizeof h;
  h.bytes = fits ? static_cast<uint32_t>(b.size()) : 0;
  std::memcpy(area, &h, sizeof h);
  if (fits) std::memcpy(area + sizeof h, b.data(), b.size());
}

bool SameFingerprint(const char* a, const char* b) {
  AreaHeader ha, hb;
  std::memcpy(&ha, a, sizeof ha);
  std::memcpy(&hb, b, sizeof hb);
  if (ha.hash != hb.hash || ha.bytes != hb.bytes) return false;
  return ha.bytes == 0 || std::memcmp(a + sizeof ha, b + sizeof hb, ha.bytes) == 0;
}

std::string DescribeFingerprint(const char* area) {
  CallDesc d;
  if (!Parse(area, &d)) return "a call of more operands than its fingerprint can describe";
  return d.Describe();
}

}  // namespace flexlink::xproc
