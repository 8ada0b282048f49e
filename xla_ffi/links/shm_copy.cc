#include "xla_ffi/links/shm_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace flexlink::shm {
namespace {

// Streaming pays only for whole lines of enough of them; shorter copies stay cached.
constexpr size_t kStreamMinBytes = 4096;

template <size_t kLen>
void CopyRowsFixed(char* dst, size_t dst_stride, const char* src, size_t src_stride, size_t rows) {
  for (size_t o = 0; o < rows; ++o) std::memcpy(dst + o * dst_stride, src + o * src_stride, kLen);
}

}  // namespace

void CopyOut(char* dst, const char* src, size_t bytes, bool stream) {
#if defined(__SSE2__)
  if (stream && bytes >= kStreamMinBytes) {
    const size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
    std::memcpy(dst, src, head);
    dst += head, src += head, bytes -= head;
    const size_t body = bytes / 64 * 64;
    for (size_t i = 0; i < body; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + body, src + body, bytes - body);
    _mm_sfence();  // streaming stores are weakly ordered: complete them before any later signal
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, bytes);
}

void ZeroOut(char* dst, size_t bytes, bool stream) {
#if defined(__SSE2__)
  if (stream && bytes >= kStreamMinBytes) {
    const size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
    std::memset(dst, 0, head);
    dst += head, bytes -= head;
    const size_t body = bytes / 16 * 16;
    const __m128i zero = _mm_setzero_si128();
    for (size_t i = 0; i < body; i += 16) _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), zero);
    std::memset(dst + body, 0, bytes - body);
    _mm_sfence();
    return;
  }
#endif
  (void)stream;
  std::memset(dst, 0, bytes);
}

void CopyRows(char* dst, size_t dst_stride, const char* src, size_t src_stride, size_t rows, size_t len) {
  switch (len) {
    case 1: return CopyRowsFixed<1>(dst, dst_stride, src, src_stride, rows);
    case 2: return CopyRowsFixed<2>(dst, dst_stride, src, src_stride, rows);
    case 4: return CopyRowsFixed<4>(dst, dst_stride, src, src_stride, rows);
    case 8: return CopyRowsFixed<8>(dst, dst_stride, src, src_stride, rows);
    case 16: return CopyRowsFixed<16>(dst, dst_stride, src, src_stride, rows);
    default:
      for (size_t o = 0; o < rows; ++o) std::memcpy(dst + o * dst_stride, src + o * src_stride, len);
  }
}

void CopyUnits(Rows dst, ConstRows src, size_t inner, size_t w, UnitRange range, bool stream) {
  if (range.empty()) return;
  auto piece = [&](size_t o, size_t i0, size_t i1) {
    CopyOut(dst.base + (o * dst.row + i0 - dst.first) * w, src.base + (o * src.row + i0 - src.first) * w,
            (i1 - i0) * w, stream);
  };
  const auto [first_full, last_full] = FullRows(range, inner);
  if (first_full >= last_full) {  // the range lies within one row (or two partial rows)
    ForEachRow(range, inner, piece);
    return;
  }
  if (range.begin < first_full * inner) piece(first_full - 1, range.begin - (first_full - 1) * inner, inner);
  if (stream && inner * w >= kStreamMinBytes) {  // long rows: stream each
    for (size_t o = first_full; o < last_full; ++o) piece(o, 0, inner);
  } else {
    CopyRows(dst.base + (first_full * dst.row - dst.first) * w, dst.row * w,
             src.base + (first_full * src.row - src.first) * w, src.row * w, last_full - first_full, inner * w);
  }
  if (range.end > last_full * inner) piece(last_full, 0, range.end - last_full * inner);
}

}  // namespace flexlink::shm
