// AVX-512 block kernels, 16 floats per instruction. This file alone is compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mfma; the dispatcher only calls into it after checking the CPU (and the OS, which must
// save the 512-bit state) supports all five. Like the AVX2 kernels it includes no standard library headers (see
// kernel_block.h), and it computes every element with the same operations in the same order, so the two agree
// bit for bit. The differences are the width and the tail: the last < 16 elements go through the same vector
// code with masked loads and stores instead of a padded copy.
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own placeholder operands (GCC bug 105593, fixed
// in GCC 13); the warnings point into the header, so silencing them around the include leaves this file's own.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include "kernels/kernel_block.h"
#include "kernels/kernel_prefetch.h"

namespace nsp::internal {
namespace {

constexpr int kAdam = 0, kAdamW = 1, kSgd = 2, kAdagrad = 3;

inline __m512 LoadBf16(const uint16_t* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 MaskLoadBf16(const uint16_t* src, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, src)), 16));
}

// fp32 -> bf16 with integer arithmetic, exactly as the AVX2 and portable kernels round: to nearest even, with a
// NaN kept a (quiet) NaN, since the rounding add could otherwise carry a NaN's payload into Inf.
inline __m256i RoundBf16Int(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);  // every lane is below 2^16: the truncating narrow is exact
}

// The same with AVX512_BF16's vcvtneps2bf16, which rounds alike (to nearest even, NaN made quiet the same way)
// but treats a denormal input as zero. Denormal params are rare but legal, so a vector holding one takes the
// integer rounding for those lanes: every ISA gives the same bf16 copy.
//
// Written as inline assembly: a function with target("avx512bf16") could not be inlined into the kernel's loop
// (GCC refuses to inline across differing targets), and a call per 16 elements is what this avoids. It only
// runs in the kernels picked when the CPU reports AVX512_BF16.
inline __m256i RoundBf16Insn(__m512 x) {
  __m256i out;
  __asm__("vcvtneps2bf16 %1, %0" : "=v"(out) : "v"(x));
  const __mmask16 denormal = _mm512_fpclass_ps_mask(x, 0x20);
  if (__builtin_expect(denormal != 0, 0)) out = _mm256_mask_blend_epi16(denormal, out, RoundBf16Int(x));
  return out;
}

template <bool BF16_INSN>
inline __m256i RoundBf16(__m512 x) {
  if constexpr (BF16_INSN) {
    return RoundBf16Insn(x);
  } else {
    return RoundBf16Int(x);
  }
}

// Out-of-place outputs are written with streaming stores when 64-byte aligned (Coefficients::streaming): the
// destination lines are not read first. One 16-float store is one whole line, so no pairing is needed.
inline bool Streamable(const float* out, const float* in) {
  return out != nullptr && out != in && (reinterpret_cast<unsigned long>(out) & 63) == 0;
}

// The results of one 16-float step, stored by the caller.
struct Step {
  __m512 p, m, v;
};

// TAIL: the step covers the lanes of `k` only (loads zero the others, stores leave them).
template <int KIND, bool GRAD_BF16, bool LAZY, bool BF16_INSN>
bool Avx512Block(const Coefficients& c, const Block& b) {
  const int64_t n16 = b.n & ~int64_t{15};
  const float* gf = static_cast<const float*>(b.grad);
  const uint16_t* gh = static_cast<const uint16_t*>(b.grad);
  const bool nt_p = c.streaming && Streamable(b.p_out, b.p_in), nt_m = c.streaming && Streamable(b.m_out, b.m_in);
  const bool nt_v = c.streaming && Streamable(b.v_out, b.v_in);
  // A params copy written over the fp32 gradient it was computed from is in place: its lines are in cache.
  const bool nt_copy = c.streaming && Streamable(b.p32_copy, b.p_in) && b.p32_copy != gf;
  const __m512 lr = _mm512_set1_ps(c.lr);
  const __m512 mu_a = _mm512_set1_ps(c.mu_a), mu_b = _mm512_set1_ps(c.mu_b);
  const __m512 nu_a = _mm512_set1_ps(c.nu_a), nu_b = _mm512_set1_ps(c.nu_b);
  const __m512 inv_bc1 = _mm512_set1_ps(c.inv_bc1), inv_bc2 = _mm512_set1_ps(c.inv_bc2);
  const __m512 eps = _mm512_set1_ps(c.eps);
  const __m512 l2 = _mm512_set1_ps(c.l2), wd = _mm512_set1_ps(c.decoupled_wd);
  const __m512 momentum = _mm512_set1_ps(c.momentum);
  const __m512 zero = _mm512_setzero_ps();
  const bool has_l2 = c.l2 != 0.0f;
  constexpr bool kAdamLike = KIND == kAdam || KIND == kAdamW;
  const bool writes_m = kAdamLike || (KIND == kSgd && c.sgd_has_momentum);
  constexpr bool kWritesV = kAdamLike || KIND == kAdagrad;
  // Lanes whose gradient had all exponent bits set (Inf or NaN), or-ed over the block.
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  __mmask16 non_finite = 0;

  // One step over the 16 elements at i; `tail` (a constant at each call) restricts it to the lanes of k.
  auto step = [&](int64_t i, bool tail, __mmask16 k) __attribute__((always_inline)) -> Step {
    auto load = [&](const float* src) __attribute__((always_inline)) {
      return tail ? _mm512_maskz_loadu_ps(k, src + i) : _mm512_loadu_ps(src + i);
    };
    __m512 g = GRAD_BF16 ? (tail ? MaskLoadBf16(gh + i, k) : LoadBf16(gh + i)) : load(gf);
    const __m512i g_exponent = _mm512_and_si512(_mm512_castps_si512(g), exponent);
    non_finite |= _mm512_cmpeq_epi32_mask(g_exponent, exponent);
    const __m512 p = load(b.p_in);
    const __m512 g_in = g;  // before L2 weight decay: what decides a lazy update's skip
    Step s{};
    __m512 update, m_old = zero, v_old = zero;
    if constexpr (kAdamLike) {
      if (KIND == kAdam && has_l2) g = _mm512_fmadd_ps(l2, p, g);
      m_old = load(b.m_in);
      v_old = load(b.v_in);
      s.m = _mm512_fmadd_ps(mu_a, m_old, _mm512_mul_ps(mu_b, g));
      s.v = _mm512_fmadd_ps(nu_a, v_old, _mm512_mul_ps(_mm512_mul_ps(nu_b, g), g));
      const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(s.v, inv_bc2)), eps);
      update = _mm512_div_ps(_mm512_mul_ps(s.m, inv_bc1), denom);
      if (KIND == kAdamW) update = _mm512_fmadd_ps(wd, p, update);
    } else if constexpr (KIND == kSgd) {
      if (has_l2) g = _mm512_fmadd_ps(l2, p, g);
      update = g;
      if (c.sgd_has_momentum) {
        m_old = load(b.m_in);
        s.m = _mm512_fmadd_ps(momentum, m_old, g);
        update = c.nesterov ? _mm512_fmadd_ps(momentum, s.m, g) : s.m;
      }
    } else {
      static_assert(KIND == kAdagrad);
      if (has_l2) g = _mm512_fmadd_ps(l2, p, g);
      v_old = load(b.v_in);
      s.v = _mm512_fmadd_ps(g, g, v_old);
      const __m512 scaled = _mm512_div_ps(g, _mm512_sqrt_ps(_mm512_add_ps(s.v, eps)));
      update = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s.v, zero, _CMP_GT_OQ), scaled);
    }
    s.p = _mm512_fnmadd_ps(lr, update, p);
    if constexpr (LAZY) {  // lanes with a zero gradient keep param and states
      const __mmask16 skip = _mm512_cmp_ps_mask(g_in, zero, _CMP_EQ_OQ);
      s.p = _mm512_mask_blend_ps(skip, s.p, p);
      s.m = _mm512_mask_blend_ps(skip, s.m, m_old);
      s.v = _mm512_mask_blend_ps(skip, s.v, v_old);
    }
    return s;
  };
  auto store = [&](int64_t i, const Step& s, bool tail, __mmask16 k) __attribute__((always_inline)) {
    auto put = [&](float* dst, __m512 v, bool stream) __attribute__((always_inline)) {
      if (tail) {
        _mm512_mask_storeu_ps(dst + i, k, v);
      } else if (stream) {
        _mm512_stream_ps(dst + i, v);
      } else {
        _mm512_storeu_ps(dst + i, v);
      }
    };
    if (writes_m) put(b.m_out, s.m, nt_m);
    if (kWritesV) put(b.v_out, s.v, nt_v);
    put(b.p_out, s.p, nt_p);
    if (b.p16_out != nullptr) {
      const __m256i h = RoundBf16<BF16_INSN>(s.p);
      if (tail) {
        _mm256_mask_storeu_epi16(b.p16_out + i, k, h);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.p16_out + i), h);
      }
    }
    if (b.p32_copy != nullptr) put(b.p32_copy, s.p, nt_copy);
  };

  // Prefetch on every input stream, one line per stream per iteration (kernel_prefetch.h).
  const int64_t ahead = c.prefetch;
  int64_t i = 0;
  for (; i < n16; i += 16) {
    PrefetchInputs<GRAD_BF16>(b, i, ahead, c.prefetch_level);
    store(i, step(i, false, 0xffff), false, 0xffff);
  }
  // No fence here: the dispatcher fences once per task (FenceStreamingStores), not once per block.
  if (i < b.n) {
    // The last < 16 elements: masked loads read zeros past the end (and never fault there), so each lane is
    // computed as it would be anywhere else.
    const __mmask16 k = static_cast<__mmask16>((1u << (b.n - i)) - 1);
    store(i, step(i, true, k), true, k);
  }
  return non_finite == 0;
}

template <int KIND, bool BF16_INSN>
BlockKernel Pick(int grad_bf16, int lazy) {
  if (lazy) {
    return grad_bf16 ? &Avx512Block<KIND, true, true, BF16_INSN> : &Avx512Block<KIND, false, true, BF16_INSN>;
  }
  return grad_bf16 ? &Avx512Block<KIND, true, false, BF16_INSN> : &Avx512Block<KIND, false, false, BF16_INSN>;
}

template <bool BF16_INSN>
BlockKernel PickKind(int32_t kind, int grad_bf16, int lazy) {
  switch (kind) {
    case kAdam: return Pick<kAdam, BF16_INSN>(grad_bf16, lazy);
    case kAdamW: return Pick<kAdamW, BF16_INSN>(grad_bf16, lazy);
    case kSgd: return Pick<kSgd, BF16_INSN>(grad_bf16, lazy);
    default: return Pick<kAdagrad, BF16_INSN>(grad_bf16, lazy);
  }
}

}  // namespace

BlockKernel Avx512Kernel(int32_t kind, int grad_bf16, int lazy, int bf16_insn) {
  return bf16_insn ? PickKind<true>(kind, grad_bf16, lazy) : PickKind<false>(kind, grad_bf16, lazy);
}

void Avx512Stream(float* p, const float* g, float* m, float* v, int64_t n) {
  const int64_t n16 = n & ~int64_t{15};
  for (int64_t i = 0; i < n16; i += 16) {
    const __m512 gi = _mm512_loadu_ps(g + i);
    _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), gi));
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gi));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gi));
  }
  if (n16 < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - n16)) - 1);
    const __m512 gi = _mm512_maskz_loadu_ps(k, g + n16);
    _mm512_mask_storeu_ps(p + n16, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, p + n16), gi));
    _mm512_mask_storeu_ps(m + n16, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, m + n16), gi));
    _mm512_mask_storeu_ps(v + n16, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, v + n16), gi));
  }
}

// Four 512-bit loads per iteration, prefetched 4 KiB ahead (see Avx2AllFinite); the tail through masked loads.
bool Avx512AllFinite(const void* data, int bf16, int64_t n) {
  const char* bytes = static_cast<const char*>(data);
  const int64_t total = n * (bf16 ? 2 : 4);
  const __m512i exponent = bf16 ? _mm512_set1_epi16(0x7f80) : _mm512_set1_epi32(0x7f800000);
  auto non_finite = [&](__m512i x) __attribute__((always_inline)) -> unsigned long long {
    x = _mm512_and_si512(x, exponent);
    return bf16 ? _mm512_cmpeq_epi16_mask(x, exponent) : _mm512_cmpeq_epi32_mask(x, exponent);
  };
  unsigned long long bad = 0;
  int64_t at = 0;
  for (; at + 256 <= total; at += 256) {
    for (int k = 0; k < 4; ++k) {
      _mm_prefetch(bytes + at + 4096 + 64 * k, _MM_HINT_T0);
      bad |= non_finite(_mm512_loadu_si512(bytes + at + 64 * k));
    }
  }
  // The last < 256 bytes, 64 at a time; bytes past the end load as zeros (never faulting), and zero is finite.
  for (; at < total; at += 64) {
    const int64_t left = total - at;
    const unsigned long long keep = left >= 64 ? ~0ull : (1ull << left) - 1;
    bad |= non_finite(_mm512_maskz_loadu_epi8(keep, bytes + at));
  }
  return bad == 0;
}

}  // namespace nsp::internal

