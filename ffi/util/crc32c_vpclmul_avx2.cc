// CRC-32C folding with 256-bit carry-less multiplies (VPCLMULQDQ on ymm registers). This file alone is compiled
// with -msse4.2 -mpclmul -mavx2 -mvpclmulqdq; the dispatcher (crc32c.cc) only calls into it on a CPU that has
// them all. No standard-library headers (see crc32c_fold.h).
#if defined(__x86_64__)

#include "util/crc32c_wide.h"

namespace nsp::crc32c_fold {

uint32_t FoldWide256(uint32_t crc, const uint8_t*& p, size_t& n) { return FoldWide<Ymm>(crc, p, n); }

// On AMD Zen 3 folding alone runs at ~8 bytes per cycle (one 256-bit carry-less multiply per two cycles), and the
// crc32 unit beside it sits idle: there each block folds its first part while three crc32 chains run over three
// lanes of its second part, in one loop (25.8 -> ~37 GB/s on a 4 MiB page, measured on a Zen 3 EPYC). The
// chains join the folded state by carry-less shifts: state(block) = fold * x^(3L) + c0 * x^(2L) + c1 * x^L + c2
// for lanes of L bytes, the three products summed before one reduction. Intel's VPCLMULQDQ cores are documented
// to issue one multiply per cycle, four times the crc32 unit's bytes; there this split would make the crc32 part
// the bottleneck, so other vendors run FoldWide256 alone (not measured: no such machine here).
namespace {
constexpr size_t kMixIters = 64;                           // 128-byte fold steps per block
constexpr size_t kMixWords = 5;                            // 8-byte crc32 steps per chain per fold step
constexpr size_t kMixFold = Ymm::kBytes * kWideRegs * kMixIters;  // first part of a block
constexpr size_t kMixLane = 8 * kMixWords * kMixIters;     // each of the three crc32 lanes
constexpr size_t kMixBlock = kMixFold + 3 * kMixLane;
}  // namespace

uint32_t FoldMixed256(uint32_t crc, const uint8_t*& p, size_t& n) {
  static const uint64_t shift1 = FoldOperand(8 * kMixLane - 65), shift2 = FoldOperand(16 * kMixLane - 65),
                        shift3 = FoldOperand(24 * kMixLane - 65);
  const WideConstants& w = Wide();
  const __m256i by_step = Ymm::Broadcast(w.by_step256);
  const __m256i by_width = Ymm::Broadcast(w.by256);
  for (; n >= kMixBlock; n -= kMixBlock, p += kMixBlock) {
    const uint8_t* x = p;
    const uint8_t* y = p + kMixFold;
    __m256i a[kWideRegs];
    LoadFirstStep<Ymm>(a, x, crc);
    uint64_t c0 = 0, c1 = 0, c2 = 0;
    for (size_t it = 1; it <= kMixIters; ++it) {
      if (it < kMixIters) {
        x += Ymm::kBytes * kWideRegs;
        for (int r = 0; r < kWideRegs; ++r) a[r] = Ymm::Fold(a[r], by_step, Ymm::Load(x + Ymm::kBytes * r));
      }
      for (size_t j = 0; j < kMixWords; ++j, y += 8) {
        c0 = _mm_crc32_u64(c0, Load64(y));
        c1 = _mm_crc32_u64(c1, Load64(y + kMixLane));
        c2 = _mm_crc32_u64(c2, Load64(y + 2 * kMixLane));
      }
    }
    const uint32_t folded = Ymm::Reduce(FoldRegisters<Ymm>(a, by_width), w);
    const __m128i joined = _mm_xor_si128(_mm_xor_si128(ShiftProduct(folded, shift3), ShiftProduct(c0, shift2)),
                                         ShiftProduct(c1, shift1));
    crc = static_cast<uint32_t>(Crc128(joined) ^ c2);
  }
  return crc;
}

}  // namespace nsp::crc32c_fold

#endif  // __x86_64__
