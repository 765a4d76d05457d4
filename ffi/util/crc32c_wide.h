// Internal to CRC-32C: folding with wide carry-less multiplies (VPCLMULQDQ), which fold two (ymm) or four (zmm)
// 128-bit chunks per instruction, so folding alone outruns crc32 and needs no second unit beside it. Every
// 128-bit lane of a register is folded as crc32c_fold.h says, with the same pair of constants in each lane. At
// the end the registers are folded onto one another, then the chunks of the last register onto its last chunk,
// and that chunk becomes the state. Written once for any register width, a Vec: its register type Reg and size
// kBytes, Load, Broadcast (a pair of constants into every lane), WithState, Fold, the pairs StepPair and WidthPair
// fold by, and Reduce (a register to a state). Ymm below, Zmm in the AVX-512 unit. Included only by the units
// compiled for those instructions (crc32c_vpclmul_*.cc).
#pragma once

#if defined(__x86_64__)

#include "util/crc32c_fold.h"

namespace nsp::crc32c_fold {
namespace {

// The registers of the first step, the running state folded into the first chunk.
template <typename Vec>
inline void LoadFirstStep(typename Vec::Reg (&a)[kWideRegs], const uint8_t* p, uint32_t crc) {
  for (int r = 0; r < kWideRegs; ++r) a[r] = Vec::Load(p + Vec::kBytes * r);
  a[0] = Vec::WithState(a[0], crc);
}

// Folds the registers onto one another (`by_width`: Vec::WidthPair broadcast): the last one then holds the whole.
template <typename Vec>
inline typename Vec::Reg FoldRegisters(typename Vec::Reg (&a)[kWideRegs], typename Vec::Reg by_width) {
  for (int r = 1; r < kWideRegs; ++r) a[r] = Vec::Fold(a[r - 1], by_width, a[r]);
  return a[kWideRegs - 1];
}

// Folds the whole steps of [p, p + n) from state `crc`, advancing p and n past them; n >= one step. Only whole
// steps are folded; the rest (less than one step) goes through crc32.
template <typename Vec>
inline uint32_t FoldWide(uint32_t crc, const uint8_t*& p, size_t& n) {
  constexpr size_t kStep = Vec::kBytes * kWideRegs;
  const WideConstants& w = Wide();
  const typename Vec::Reg by_step = Vec::Broadcast(Vec::StepPair(w));
  typename Vec::Reg a[kWideRegs];
  LoadFirstStep<Vec>(a, p, crc);
  p += kStep;
  n -= kStep;
  for (; n >= kStep; n -= kStep, p += kStep) {
    for (int r = 0; r < kWideRegs; ++r) a[r] = Vec::Fold(a[r], by_step, Vec::Load(p + Vec::kBytes * r));
  }
  return Vec::Reduce(FoldRegisters<Vec>(a, Vec::Broadcast(Vec::WidthPair(w))), w);
}

// The Vec of ymm registers: two 128-bit chunks each.
struct Ymm {
  using Reg = __m256i;
  static constexpr size_t kBytes = 32;
  static Reg Load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Reg Broadcast(__m128i pair) { return _mm256_broadcastsi128_si256(pair); }
  // The first chunk with the running state folded in.
  static Reg WithState(Reg first, uint32_t crc) {
    return _mm256_xor_si256(first, _mm256_setr_epi32(static_cast<int>(crc), 0, 0, 0, 0, 0, 0, 0));
  }
  static Reg Fold(Reg chunk, Reg k, Reg next) {
    const Reg lo = _mm256_clmulepi64_epi128(chunk, k, 0x00), hi = _mm256_clmulepi64_epi128(chunk, k, 0x11);
    return _mm256_xor_si256(_mm256_xor_si256(lo, hi), next);
  }
  static __m128i StepPair(const WideConstants& w) { return w.by_step256; }
  static __m128i WidthPair(const WideConstants& w) { return w.by256; }  // one register onto the next
  // The chunks of a register (lane 0 first in the message) folded into one, as a state.
  static uint32_t Reduce(Reg a, const WideConstants& w) {
    const __m128i lane0 = _mm256_castsi256_si128(a), lane1 = _mm256_extracti128_si256(a, 1);
    return static_cast<uint32_t>(Crc128(crc32c_fold::Fold(lane0, w.by128, lane1)));
  }
};

}  // namespace
}  // namespace nsp::crc32c_fold

#endif  // __x86_64__
