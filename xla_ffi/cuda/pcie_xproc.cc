#include "xla_ffi/cuda/pcie_xproc.h"

#include "xla_ffi/xproc/process_group.h"
#include "xla_ffi/xproc/steps.h"

namespace flexlink::gpu {
namespace {

char* Bytes(const void* p) { return static_cast<char*>(const_cast<void*>(p)); }
constexpr size_t kFlagStride = 16;  // uint32 words: one 64-byte line per flag

}  // namespace

PcieXprocChannel::PcieXprocChannel(std::string name, DeviceApi* api, GroupInfo group, xproc::ProcessGroup* segment)
    : name_(std::move(name)), api_(*api), group_(std::move(group)), segment_(*segment), ranks_(group_.size()) {}

uint32_t* PcieXprocChannel::Posted(int r) const { return segment_.flag_words() + r * kFlagStride; }

Status PcieXprocChannel::Setup() {
  return Status::Internal("flexlink: the " + name_ + " link across processes is set up with SetupLocal");
}

Status PcieXprocChannel::SetupLocal(std::span<const int> local) {
  const int n = group_.size();
  const std::string where = "flexlink: setting up the " + name_ + " link for group " + FormatIds(group_.ids) +
                            " across processes: ";
  auto check = [&](Status s) { return s.ok() ? s : Status(s.code(), where + s.message()); };
  if (size_t(n) * kFlagStride * sizeof(uint32_t) > segment_.flag_bytes())
    return Status::Internal(where + "the segment has no room for " + std::to_string(n) + " ranks' flags");
  // One registration per process: every local GPU copies to and from it as pinned memory.
  FLEXLINK_RETURN_IF_ERROR(check(ledger_.RegisterHost(segment_.mapping(), segment_.mapping_bytes())));
  for (int r : local) {
    FLEXLINK_RETURN_IF_ERROR(check(api_.SetDevice(group_.devices[r])));
    FLEXLINK_RETURN_IF_ERROR(
        check(ledger_.AllocDevice(group_.devices[r], size_t(n) * segment_.slot_bytes(), &ranks_[r].scratch)));
  }
  return Status::Ok();
}

Status PcieXprocChannel::Release(double) {
  (void)breaker_.Break(Status::Internal("it was released by the engine's shutdown"));
  return ledger_.Release();
}

void PcieXprocChannel::StoreRaised() {
  const uint32_t raised = raised_.load(std::memory_order_acquire);
  for (int j = 0; j < group_.size(); ++j)
    std::atomic_ref<uint32_t>(*Posted(j)).store(raised, std::memory_order_release);
}

Status PcieXprocChannel::Abort() {
  // Waits are GEQ, wrap-aware: (int32_t)(flag - step) >= 0. Every rank's steps are the same
  // sequence and the host rendezvous keeps their enqueues within one call of each other, so every
  // pending or future wait, in every process, asks for a step within one call's steps of this
  // process's furthest rank; 2^30 past it satisfies them all and stays inside the GEQ's half range.
  uint32_t furthest = 0;
  bool any = false;
  for (const Rank& k : ranks_) {
    if (!k.scratch) continue;  // another process's rank
    const uint32_t seq = k.seq.load(std::memory_order_acquire);
    if (!any || static_cast<int32_t>(seq - furthest) > 0) furthest = seq, any = true;
  }
  raised_.store(furthest + (1u << 30), std::memory_order_release);
  aborted_.store(true, std::memory_order_release);
  StoreRaised();
  return Status::Ok();
}

void PcieXprocChannel::Unblock() {
  // A rank whose stream was still draining when Abort ran stores its own step afterwards, lowering
  // its flag below what a peer's stream waits for; storing the raised value on every poll ends that.
  if (aborted_.load(std::memory_order_acquire)) StoreRaised();
}

Status PcieXprocChannel::Enqueue(const GpuWork& work) {
  FLEXLINK_RETURN_IF_ERROR(breaker_.Check(name_));
  const CallDesc& d = *work.desc;
  const int n = group_.size(), r = work.rank;
  Rank& k = ranks_[r];
  const Stream st = work.stream;
  char* scratch = static_cast<char*>(k.scratch);
  xproc::StepCursor cursor(d, n, segment_.slot_bytes(), work.pieces);
  thread_local std::vector<xproc::StepPiece> pieces;
  Status s;
#define XPCIE_TRY(expr)    \
  do {                     \
    s = (expr);            \
    if (!s.ok()) goto out; \
  } while (0)
  while (cursor.Next(&pieces)) {
    const uint32_t step = k.seq.fetch_add(1, std::memory_order_acq_rel) + 1;
    const int b = static_cast<int>(step & 1);
    char* mine = segment_.staging(b, r);
    // Stage. Buffer b was last read at step − 2; every peer finished that before it posted step − 1
    // (its stream computes a step before it stages and posts the next), and this stream waited for
    // that post: one flag per rank and step is enough, as on CPU (docs/xproc.md, "Steps").
    for (const xproc::StepPiece& piece : pieces) {
      const Part& p = d.parts[piece.part];
      const size_t w = p.width(), m = piece.units.size();
      if (m == 0) continue;
      switch (d.kind) {
        case Kind::kPpermute:
          if (d.DestinationOf(r) < 0) break;  // nobody reads this rank's slot
          [[fallthrough]];
        case Kind::kAllReduce:
        case Kind::kAllGather:
          XPCIE_TRY(api_.Copy(mine + piece.offset, Bytes(p.in) + piece.units.begin * w, m * w, st));
          break;
        case Kind::kReduceScatter:
        case Kind::kAllToAll: {
          // The slot holds [n][units]: block b = x[o, b, i] of the piece's units, as the CPU side.
          LayoutArgs a{LayoutArgs::kPack, w, size_t(n), p.inner, piece.units.begin, m, 0, size_t(n), m,
                       scratch, Bytes(p.in)};
          XPCIE_TRY(api_.Layout(a, st));
          XPCIE_TRY(api_.Copy(mine + piece.offset, scratch, size_t(n) * m * w, st));
          break;
        }
      }
    }
    // Posted; every peer's.
    XPCIE_TRY(api_.WriteValue32(Posted(r), step, st));
    for (int j = 0; j < n; ++j)
      if (j != r) XPCIE_TRY(api_.WaitValue32(Posted(j), step, st));
    // Compute.
    for (const xproc::StepPiece& piece : pieces) {
      const Part& p = d.parts[piece.part];
      const size_t w = p.width(), m = piece.units.size();
      if (m == 0) continue;
      char* out = Bytes(p.out);
      switch (d.kind) {
        case Kind::kAllReduce:
        case Kind::kReduceScatter: {
          const size_t block = d.kind == Kind::kReduceScatter ? size_t(r) * m * w : 0;
          ReduceArgs a;
          a.dtype = p.dtype;
          a.op = d.op;
          a.dst = out + piece.units.begin * w;
          a.rows = scratch;
          a.row_stride = m;
          a.nrows = n;
          a.count = m;
          if (d.kind == Kind::kAllReduce) {  // its own row straight from the device
            a.own = r;
            a.own_src = Bytes(p.in) + piece.units.begin * w;
          }
          for (int j = 0; j < n; ++j)
            if (j != a.own)
              XPCIE_TRY(api_.Copy(scratch + size_t(j) * m * w, segment_.staging(b, j) + piece.offset + block, m * w, st));
          XPCIE_TRY(api_.Reduce(a, st));
          break;
        }
        case Kind::kAllGather:
        case Kind::kAllToAll: {
          const size_t block = d.kind == Kind::kAllToAll ? size_t(r) * m * w : 0;
          for (int j = 0; j < n; ++j)
            XPCIE_TRY(api_.Copy(scratch + size_t(j) * m * w, segment_.staging(b, j) + piece.offset + block, m * w, st));
          LayoutArgs a{LayoutArgs::kUnpack, w, size_t(n), p.inner, piece.units.begin, m, 0, size_t(n), m,
                       scratch, out};
          XPCIE_TRY(api_.Layout(a, st));
          break;
        }
        case Kind::kPpermute: {
          const int src = d.sources[r];
          if (src < 0) XPCIE_TRY(api_.Zero(out + piece.units.begin * w, m * w, st));
          else XPCIE_TRY(api_.Copy(out + piece.units.begin * w, segment_.staging(b, src) + piece.offset, m * w, st));
          break;
        }
      }
    }
  }
#undef XPCIE_TRY
out:
  if (!s.ok()) {
    const bool prefixed = s.message().rfind("flexlink:", 0) == 0;
    return breaker_.Break(prefixed ? s : Status(s.code(), LinkWhere(work.label, d.kind, group_.ids, name_) + s.message()));
  }
  return s;
}

}  // namespace flexlink::gpu
