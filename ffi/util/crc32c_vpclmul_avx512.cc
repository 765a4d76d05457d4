// CRC-32C folding with 512-bit carry-less multiplies (VPCLMULQDQ on zmm registers). This file alone is compiled
// with -msse4.2 -mpclmul -mavx2 -mvpclmulqdq -mavx512f -mavx512vl; the dispatcher (crc32c.cc) only calls into it
// on a CPU that has them all. No standard-library headers (see crc32c_fold.h).
#if defined(__x86_64__)

#include "util/crc32c_wide.h"

namespace nsp::crc32c_fold {
namespace {

// zmm registers: four 128-bit chunks each.
struct Zmm {
  using Reg = __m512i;
  static constexpr size_t kBytes = 64;
  static Reg Load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static Reg Broadcast(__m128i pair) { return _mm512_broadcast_i32x4(pair); }
  static Reg WithState(Reg first, uint32_t crc) {
    return _mm512_xor_si512(first, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  }
  static Reg Fold(Reg chunk, Reg k, Reg next) {
    const Reg lo = _mm512_clmulepi64_epi128(chunk, k, 0x00), hi = _mm512_clmulepi64_epi128(chunk, k, 0x11);
    return _mm512_ternarylogic_epi64(lo, hi, next, 0x96);  // lo ^ hi ^ next
  }
  static __m128i StepPair(const WideConstants& w) { return w.by_step512; }
  static __m128i WidthPair(const WideConstants& w) { return w.by512; }
  // Lanes 0-1 onto lanes 2-3, then as a ymm register.
  static uint32_t Reduce(Reg a, const WideConstants& w) {
    const __m256i low = _mm512_castsi512_si256(a), high = _mm512_extracti64x4_epi64(a, 1);
    return Ymm::Reduce(Ymm::Fold(low, Ymm::Broadcast(w.by256), high), w);
  }
};

}  // namespace

uint32_t FoldWide512(uint32_t crc, const uint8_t*& p, size_t& n) { return FoldWide<Zmm>(crc, p, n); }

}  // namespace nsp::crc32c_fold

#endif  // __x86_64__
