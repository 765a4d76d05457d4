// AVX2 + FMA block kernels, 8 floats per instruction. This file alone is compiled with -mavx2 -mfma; the
// dispatcher only calls into it after checking the CPU supports both. It deliberately includes no standard
// library headers (see kernel_block.h).
#include <immintrin.h>

#include "kernels/kernel_block.h"
#include "kernels/kernel_prefetch.h"

namespace nsp::internal {
namespace {

constexpr int kAdam = 0, kAdamW = 1, kSgd = 2, kAdagrad = 3;

inline __m256 LoadBf16(const uint16_t* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Round to nearest even; NaNs become quiet NaNs (the rounding add could otherwise carry a NaN into Inf).
inline void StoreBf16(uint16_t* dst, __m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
  // packus works per 128-bit lane; the permute puts the 8 halves back in order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}

// Out-of-place outputs (a store writing the other version slot, a params copy) are written with streaming stores
// when 64-byte aligned (Coefficients::streaming): the destination lines are not read first, a third less traffic.
inline bool Streamable(const float* out, const float* in) {
  return out != nullptr && out != in && (reinterpret_cast<unsigned long>(out) & 63) == 0;
}

inline void Store(float* dst, __m256 v, bool stream) {
  if (stream) {
    _mm256_stream_ps(dst, v);
  } else {
    _mm256_storeu_ps(dst, v);
  }
}

// The results of one 8-float step, stored by the caller.
struct Step {
  __m256 p, m, v;
};

template <int KIND, bool GRAD_BF16, bool LAZY>
bool Avx2Block(const Coefficients& c, const Block& b) {
  const int64_t n8 = b.n & ~int64_t{7}, n16 = b.n & ~int64_t{15};
  const float* gf = static_cast<const float*>(b.grad);
  const bool nt_p = c.streaming && Streamable(b.p_out, b.p_in), nt_m = c.streaming && Streamable(b.m_out, b.m_in);
  const bool nt_v = c.streaming && Streamable(b.v_out, b.v_in);
  // A params copy written over the fp32 gradient it was computed from is in place: its lines are in cache.
  const bool nt_copy = c.streaming && Streamable(b.p32_copy, b.p_in) && b.p32_copy != gf;
  const uint16_t* gh = static_cast<const uint16_t*>(b.grad);
  const __m256 lr = _mm256_set1_ps(c.lr);
  const __m256 mu_a = _mm256_set1_ps(c.mu_a), mu_b = _mm256_set1_ps(c.mu_b);
  const __m256 nu_a = _mm256_set1_ps(c.nu_a), nu_b = _mm256_set1_ps(c.nu_b);
  const __m256 inv_bc1 = _mm256_set1_ps(c.inv_bc1), inv_bc2 = _mm256_set1_ps(c.inv_bc2);
  const __m256 eps = _mm256_set1_ps(c.eps);
  const __m256 l2 = _mm256_set1_ps(c.l2), wd = _mm256_set1_ps(c.decoupled_wd);
  const __m256 momentum = _mm256_set1_ps(c.momentum);
  const __m256 zero = _mm256_setzero_ps();
  const bool has_l2 = c.l2 != 0.0f;
  constexpr bool kAdamLike = KIND == kAdam || KIND == kAdamW;
  const bool writes_m = kAdamLike || (KIND == kSgd && c.sgd_has_momentum);
  constexpr bool kWritesV = kAdamLike || KIND == kAdagrad;
  // Lanes whose gradient had all exponent bits set (Inf or NaN), or-ed over the block.
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  __m256i non_finite = _mm256_setzero_si256();

  auto step = [&](int64_t i) __attribute__((always_inline)) -> Step {
    __m256 g = GRAD_BF16 ? LoadBf16(gh + i) : _mm256_loadu_ps(gf + i);
    const __m256i g_exponent = _mm256_and_si256(_mm256_castps_si256(g), exponent);
    non_finite = _mm256_or_si256(non_finite, _mm256_cmpeq_epi32(g_exponent, exponent));
    const __m256 p = _mm256_loadu_ps(b.p_in + i);
    const __m256 g_in = g;  // before L2 weight decay: what decides a lazy update's skip
    Step s{};
    __m256 update, m_old = zero, v_old = zero;
    if constexpr (kAdamLike) {
      if (KIND == kAdam && has_l2) g = _mm256_fmadd_ps(l2, p, g);
      m_old = _mm256_loadu_ps(b.m_in + i);
      v_old = _mm256_loadu_ps(b.v_in + i);
      s.m = _mm256_fmadd_ps(mu_a, m_old, _mm256_mul_ps(mu_b, g));
      s.v = _mm256_fmadd_ps(nu_a, v_old, _mm256_mul_ps(_mm256_mul_ps(nu_b, g), g));
      const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(s.v, inv_bc2)), eps);
      update = _mm256_div_ps(_mm256_mul_ps(s.m, inv_bc1), denom);
      if (KIND == kAdamW) update = _mm256_fmadd_ps(wd, p, update);
    } else if constexpr (KIND == kSgd) {
      if (has_l2) g = _mm256_fmadd_ps(l2, p, g);
      update = g;
      if (c.sgd_has_momentum) {
        m_old = _mm256_loadu_ps(b.m_in + i);
        s.m = _mm256_fmadd_ps(momentum, m_old, g);
        update = c.nesterov ? _mm256_fmadd_ps(momentum, s.m, g) : s.m;
      }
    } else {
      static_assert(KIND == kAdagrad);
      if (has_l2) g = _mm256_fmadd_ps(l2, p, g);
      v_old = _mm256_loadu_ps(b.v_in + i);
      s.v = _mm256_fmadd_ps(g, g, v_old);
      const __m256 scaled = _mm256_div_ps(g, _mm256_sqrt_ps(_mm256_add_ps(s.v, eps)));
      update = _mm256_and_ps(_mm256_cmp_ps(s.v, zero, _CMP_GT_OQ), scaled);
    }
    s.p = _mm256_fnmadd_ps(lr, update, p);
    if constexpr (LAZY) {  // lanes with a zero gradient keep param and states
      const __m256 skip = _mm256_cmp_ps(g_in, zero, _CMP_EQ_OQ);
      s.p = _mm256_blendv_ps(s.p, p, skip);
      s.m = _mm256_blendv_ps(s.m, m_old, skip);
      s.v = _mm256_blendv_ps(s.v, v_old, skip);
    }
    return s;
  };
  // Stores `count` consecutive steps output by output. With two steps, each output's 64-byte line is written by
  // two adjacent stores: streaming stores that leave a line half written while moving on to the next output ran
  // at half the speed of plain stores on Zen (its write-combining buffers are flushed early); whole lines run at
  // the speed of an in-place update.
  auto store = [&](int64_t i, const Step* s, int count) __attribute__((always_inline)) {
    if (writes_m) {
      for (int k = 0; k < count; ++k) Store(b.m_out + i + 8 * k, s[k].m, nt_m);
    }
    if (kWritesV) {
      for (int k = 0; k < count; ++k) Store(b.v_out + i + 8 * k, s[k].v, nt_v);
    }
    for (int k = 0; k < count; ++k) Store(b.p_out + i + 8 * k, s[k].p, nt_p);
    if (b.p16_out != nullptr) {
      for (int k = 0; k < count; ++k) StoreBf16(b.p16_out + i + 8 * k, s[k].p);
    }
    if (b.p32_copy != nullptr) {
      for (int k = 0; k < count; ++k) Store(b.p32_copy + i + 8 * k, s[k].p, nt_copy);
    }
  };

  // Prefetch on every input stream, one line per stream per iteration (kernel_prefetch.h).
  const int64_t ahead = c.prefetch;
  int64_t i = 0;
  for (; i < n16; i += 16) {
    PrefetchInputs<GRAD_BF16>(b, i, ahead, c.prefetch_level);
    const Step s[2] = {step(i), step(i + 8)};
    store(i, s, 2);
  }
  if (i < n8) {
    const Step s[1] = {step(i)};
    store(i, s, 1);
  }
  // No fence here: the dispatcher fences once per task (FenceStreamingStores), not once per block.
  if (n8 < b.n) {
    // The last < 8 elements go through the same vector code on a zero-padded copy, so every element is
    // computed identically wherever it sits (a store's pages and an in-memory update agree bit for bit).
    const int64_t r = b.n - n8;
    const int64_t gsize = GRAD_BF16 ? 2 : 4;
    alignas(32) float p_in[8] = {}, p_out[8], m_in[8] = {}, m_out[8], v_in[8] = {}, v_out[8], copy[8];
    alignas(32) uint16_t p16[8];
    alignas(32) unsigned char g[32] = {};
    __builtin_memcpy(p_in, b.p_in + n8, r * 4);
    if (b.m_in != nullptr) __builtin_memcpy(m_in, b.m_in + n8, r * 4);
    if (b.v_in != nullptr) __builtin_memcpy(v_in, b.v_in + n8, r * 4);
    __builtin_memcpy(g, static_cast<const unsigned char*>(b.grad) + n8 * gsize, r * gsize);
    const Block tail{p_in, p_out, b.m_in ? m_in : nullptr, b.m_out ? m_out : nullptr,
                     b.v_in ? v_in : nullptr, b.v_out ? v_out : nullptr, b.p16_out ? p16 : nullptr,
                     b.p32_copy ? copy : nullptr, g, 8};
    if (!Avx2Block<KIND, GRAD_BF16, LAZY>(c, tail)) non_finite = exponent;
    __builtin_memcpy(b.p_out + n8, p_out, r * 4);
    if (b.m_out != nullptr) __builtin_memcpy(b.m_out + n8, m_out, r * 4);
    if (b.v_out != nullptr) __builtin_memcpy(b.v_out + n8, v_out, r * 4);
    if (b.p16_out != nullptr) __builtin_memcpy(b.p16_out + n8, p16, r * 2);
    if (b.p32_copy != nullptr) __builtin_memcpy(b.p32_copy + n8, copy, r * 4);
  }
  return _mm256_testz_si256(non_finite, non_finite) != 0;
}

template <int KIND>
BlockKernel Pick(int grad_bf16, int lazy) {
  if (lazy) return grad_bf16 ? &Avx2Block<KIND, true, true> : &Avx2Block<KIND, false, true>;
  return grad_bf16 ? &Avx2Block<KIND, true, false> : &Avx2Block<KIND, false, false>;
}

}  // namespace

BlockKernel Avx2Kernel(int32_t kind, int grad_bf16, int lazy) {
  switch (kind) {
    case kAdam: return Pick<kAdam>(grad_bf16, lazy);
    case kAdamW: return Pick<kAdamW>(grad_bf16, lazy);
    case kSgd: return Pick<kSgd>(grad_bf16, lazy);
    default: return Pick<kAdagrad>(grad_bf16, lazy);
  }
}

void Avx2Stream(float* p, const float* g, float* m, float* v, int64_t n) {
  const int64_t n8 = n & ~int64_t{7};
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), gi));
    _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), gi));
    _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), gi));
  }
  if (n8 < n) PortableStream(p + n8, g + n8, m + n8, v + n8, n - n8);
}

// Four 256-bit loads per iteration, prefetched 4 KiB ahead: a read-only stream needs more requests in flight
// than the hardware prefetcher alone keeps (it stops at every 4 KiB page). Over 21M fp32 values on 2 threads
// here: 1.9-2.2 ms, against 3.7-5.6 ms for the portable loop (huge or 4 KiB pages).
bool Avx2AllFinite(const void* data, int bf16, int64_t n) {
  const char* bytes = static_cast<const char*>(data);
  const int64_t total = n * (bf16 ? 2 : 4);
  const __m256i exponent = bf16 ? _mm256_set1_epi16(0x7f80) : _mm256_set1_epi32(0x7f800000);
  __m256i bad = _mm256_setzero_si256();
  int64_t at = 0;
  for (; at + 128 <= total; at += 128) {
    _mm_prefetch(bytes + at + 4096, _MM_HINT_T0);
    _mm_prefetch(bytes + at + 4096 + 64, _MM_HINT_T0);
    for (int k = 0; k < 4; ++k) {
      const __m256i x = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + at + 32 * k)),
                                         exponent);
      bad = _mm256_or_si256(bad, bf16 ? _mm256_cmpeq_epi16(x, exponent) : _mm256_cmpeq_epi32(x, exponent));
    }
  }
  const int64_t done = at / (bf16 ? 2 : 4);
  return _mm256_testz_si256(bad, bad) && PortableAllFinite(bytes + at, bf16, n - done);
}

}  // namespace nsp::internal

