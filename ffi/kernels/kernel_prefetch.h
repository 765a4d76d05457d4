// The software prefetch of the AVX2 and AVX-512 block kernels (kernel_block.h: no standard library here either).
#pragma once

#include <xmmintrin.h>  // _mm_prefetch

#include "kernels/kernel_block.h"  // Block, and int64_t

namespace nsp::internal {

// One line of every input stream (p, m, v, the gradient), `ahead` elements past element `i` (Coefficients::prefetch,
// 512 by default: one core alone cannot keep enough loads in flight otherwise, +20% single-threaded), into the
// cache level of HINT. Past the block's end is fine: a prefetch never faults, and a sparse update's next block
// continues the same arrays.
template <bool GRAD_BF16, int HINT>
inline void PrefetchInputsTo(const Block& b, int64_t i, int64_t ahead) {
  constexpr auto hint = static_cast<_mm_hint>(HINT);
  _mm_prefetch(reinterpret_cast<const char*>(b.p_in + i + ahead), hint);
  if (b.m_in != nullptr) _mm_prefetch(reinterpret_cast<const char*>(b.m_in + i + ahead), hint);
  if (b.v_in != nullptr) _mm_prefetch(reinterpret_cast<const char*>(b.v_in + i + ahead), hint);
  const void* g = GRAD_BF16 ? static_cast<const void*>(static_cast<const uint16_t*>(b.grad) + i + ahead)
                            : static_cast<const void*>(static_cast<const float*>(b.grad) + i + ahead);
  _mm_prefetch(static_cast<const char*>(g), hint);
}

// Coefficients::prefetch_level picks the level: 1 (L1, the default), 2 (L2) or 3 (the last level). The branch is
// the same every iteration, so the predictor makes it free.
template <bool GRAD_BF16>
inline void PrefetchInputs(const Block& b, int64_t i, int64_t ahead, int32_t level) {
  if (ahead == 0) return;
  if (level == 2) {
    PrefetchInputsTo<GRAD_BF16, _MM_HINT_T1>(b, i, ahead);
  } else if (level == 3) {
    PrefetchInputsTo<GRAD_BF16, _MM_HINT_T2>(b, i, ahead);
  } else {
    PrefetchInputsTo<GRAD_BF16, _MM_HINT_T0>(b, i, ahead);
  }
}

}  // namespace nsp::internal
