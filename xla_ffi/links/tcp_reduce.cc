// all_reduce and reduce_scatter on the tcp link: partial values travel the chain 0 -> 1 -> ... -> n-1
// so every element is reduced in rank order, bitwise as shm reduces it (see tcp.h).
#include "xla_ffi/links/tcp_run.h"

namespace flexlink {

using tcp::Contiguous;
using tcp::Pieces;

// Partials 0 -> 1 -> ... -> n-1, then results n-1 -> 0 -> 1 -> ... -> n-2 (see tcp.h).
void TcpRun::AllReduce() {
  const size_t w = wire_.w, ww = wire_.ww;
  // This rank's wire values, chunk j at j * cu_ * ww (rank 0 needs them only to widen halves).
  char* partial = k_ > 0 || wire_.half() ? Scratch(range_.size() * ww) : nullptr;
  // Captures by value: the receive handlers run after this function returned.
  auto acc = [=, this](size_t j) { return partial + j * cu_ * ww; };
  auto out = [=, this](size_t j) { return out_ + ChunkBegin(j) * w; };
  auto in = [=, this](size_t j) { return in_ + ChunkBegin(j) * w; };
  for (size_t j = 0; j < m_ && k_ == 0; ++j) {
    if (wire_.half()) {
      wire_.Load(acc(j), in(j), ChunkCount(j));
      io_.Send(acc(j), ChunkCount(j) * ww);
    } else {
      io_.Send(in(j), ChunkCount(j) * w);
    }
  }
  for (size_t j = 0; j < m_ && k_ > 0; ++j)
    OnRecv(acc(j), ChunkCount(j) * ww, [=, this] {
      if (k_ < n_ - 1) {
        wire_.Fold(acc(j), in(j), ChunkCount(j), acc(j), /*to_wire=*/true);
        io_.Send(acc(j), ChunkCount(j) * ww);
      } else {
        wire_.Fold(acc(j), in(j), ChunkCount(j), out(j), /*to_wire=*/false);
        io_.Send(out(j), ChunkCount(j) * w);  // the result goes round to rank 0
      }
    });
  for (size_t j = 0; j < m_ && k_ < n_ - 1; ++j)
    OnRecv(out(j), ChunkCount(j) * w, [=, this] {
      if (k_ < n_ - 2) io_.Send(out(j), ChunkCount(j) * w);
    });
}

// Block c's partials travel 0 -> ... -> n-1 (items ordered block by block, so results start early);
// rank n-1 keeps block n-1 and sends the rest round: n-1 -> 0 -> ... -> c (see tcp.h).
void TcpRun::ReduceScatter() {
  const size_t w = wire_.w, ww = wire_.ww, inner = d_.inner, nb = n_;
  const size_t units = range_.size();
  const bool direct = !wire_.half() && Contiguous(range_.begin, range_.end, inner);
  char* partial = Scratch(nb * units * ww + (nb - 1) * units * w);
  char* finals = partial + nb * units * ww;  // blocks 0..n-2 of results, storage width
  auto acc = [=, this](size_t c, size_t j) { return partial + (c * units + j * cu_) * ww; };
  auto fin = [=, this](size_t c, size_t j) { return finals + (c * units + j * cu_) * w; };
  auto out = [=, this](size_t j) { return out_ + ChunkBegin(j) * w; };
  // Calls f(wire offset in chunk, own input piece, count) for chunk j of block c.
  auto own = [=, this](size_t c, size_t j, auto f) {
    Pieces(ChunkBegin(j), ChunkBegin(j) + ChunkCount(j), nb, c, inner,
           [&](size_t u, size_t e, size_t cnt) { f(u, in_ + e * w, cnt); });
  };
  for (size_t c = 0; c < nb && k_ == 0; ++c)
    for (size_t j = 0; j < m_; ++j) {
      const char* src = nullptr;
      if (direct) own(c, j, [&](size_t, const char* p, size_t) { src = p; });
      else own(c, j, [&](size_t u, const char* p, size_t cnt) { wire_.Load(acc(c, j) + u * ww, p, cnt); });
      io_.Send(direct ? src : acc(c, j), ChunkCount(j) * ww);
    }
  for (size_t c = 0; c < nb && k_ > 0; ++c)
    for (size_t j = 0; j < m_; ++j)
      OnRecv(acc(c, j), ChunkCount(j) * ww, [=, this] {
        const bool last = k_ == n_ - 1;
        char* dst = !last ? acc(c, j) : (c == nb - 1 ? out(j) : fin(c, j));
        own(c, j, [&](size_t u, const char* p, size_t cnt) {
          wire_.Fold(acc(c, j) + u * ww, p, cnt, dst + u * (last ? w : ww), /*to_wire=*/!last);
        });
        if (!last) io_.Send(acc(c, j), ChunkCount(j) * ww);
        else if (c != nb - 1) io_.Send(fin(c, j), ChunkCount(j) * w);
      });
  // Results of blocks k..n-2 arrive from the previous rank; keep ours, forward the others.
  for (size_t c = static_cast<size_t>(k_); c + 1 < nb; ++c)
    for (size_t j = 0; j < m_; ++j) {
      char* dst = c == static_cast<size_t>(k_) ? out(j) : fin(c, j);
      OnRecv(dst, ChunkCount(j) * w, [=, this] {
        if (c != static_cast<size_t>(k_)) io_.Send(dst, ChunkCount(j) * w);
      });
    }
}

}  // namespace flexlink
