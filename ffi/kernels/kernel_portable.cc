// Portable block kernels: plain loops the compiler vectorises for the baseline instruction set. They are the
// fallback on CPUs without AVX2/FMA and handle the tails (< 8 elements) of the AVX2 kernels.
#include <cmath>
#include <cstring>

#include "kernels/kernel_block.h"
#include "kernels/update_kernel.h"

namespace nsp::internal {
namespace {

constexpr int kAdam = static_cast<int>(OptimizerKind::kAdam);
constexpr int kAdamW = static_cast<int>(OptimizerKind::kAdamW);
constexpr int kSgd = static_cast<int>(OptimizerKind::kSgd);
constexpr int kAdagrad = static_cast<int>(OptimizerKind::kAdagrad);


// Round to nearest even, as jnp.astype(bfloat16) does; NaN stays a (quiet) NaN.
inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

template <int KIND, bool GRAD_BF16, bool LAZY>
bool PortableBlock(const Coefficients& c, const Block& b) {
  const float* gf = static_cast<const float*>(b.grad);
  const uint16_t* gh = static_cast<const uint16_t*>(b.grad);
  uint32_t non_finite = 0;
  for (int64_t i = 0; i < b.n; ++i) {
    float g = GRAD_BF16 ? WidenBf16(gh[i]) : gf[i];
    uint32_t g_bits;
    std::memcpy(&g_bits, &g, sizeof g_bits);
    non_finite |= (g_bits & 0x7f800000u) == 0x7f800000u;  // all exponent bits set: Inf or NaN
    const float p = b.p_in[i];
    if (LAZY && g == 0.0f) {  // a lazy update leaves elements without gradient as they are
      b.p_out[i] = p;
      if (b.m_out != nullptr) b.m_out[i] = b.m_in[i];
      if (b.v_out != nullptr) b.v_out[i] = b.v_in[i];
      if (b.p16_out != nullptr) b.p16_out[i] = F32ToBf16(p);
      if (b.p32_copy != nullptr) b.p32_copy[i] = p;
      continue;
    }
    float update;  // the step is p <- p - lr * update
    if constexpr (KIND == kAdam || KIND == kAdamW) {
      if (KIND == kAdam && c.l2 != 0.0f) g += c.l2 * p;
      const float m = c.mu_a * b.m_in[i] + c.mu_b * g;
      const float v = c.nu_a * b.v_in[i] + c.nu_b * g * g;
      update = (m * c.inv_bc1) / (std::sqrt(v * c.inv_bc2) + c.eps);
      if (KIND == kAdamW) update += c.decoupled_wd * p;
      b.m_out[i] = m;
      b.v_out[i] = v;
    } else if constexpr (KIND == kSgd) {
      if (c.l2 != 0.0f) g += c.l2 * p;
      update = g;
      if (c.sgd_has_momentum) {
        const float m = c.momentum * b.m_in[i] + g;
        b.m_out[i] = m;
        update = c.nesterov ? g + c.momentum * m : m;
      }
    } else {
      static_assert(KIND == kAdagrad);
      if (c.l2 != 0.0f) g += c.l2 * p;
      const float v = b.v_in[i] + g * g;
      update = v > 0.0f ? g / std::sqrt(v + c.eps) : 0.0f;
      b.v_out[i] = v;
    }
    const float new_p = p - c.lr * update;
    b.p_out[i] = new_p;
    if (b.p16_out != nullptr) b.p16_out[i] = F32ToBf16(new_p);
    if (b.p32_copy != nullptr) b.p32_copy[i] = new_p;
  }
  return non_finite == 0;
}

template <int KIND>
BlockKernel Pick(int grad_bf16, int lazy) {
  if (lazy) return grad_bf16 ? &PortableBlock<KIND, true, true> : &PortableBlock<KIND, false, true>;
  return grad_bf16 ? &PortableBlock<KIND, true, false> : &PortableBlock<KIND, false, false>;
}

}  // namespace

BlockKernel PortableKernel(int32_t kind, int grad_bf16, int lazy) {
  switch (kind) {
    case kAdam: return Pick<kAdam>(grad_bf16, lazy);
    case kAdamW: return Pick<kAdamW>(grad_bf16, lazy);
    case kSgd: return Pick<kSgd>(grad_bf16, lazy);
    default: return Pick<kAdagrad>(grad_bf16, lazy);
  }
}

float WidenBf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void RoundToBf16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = F32ToBf16(in[i]);
}

void PortableStream(float* p, const float* g, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    p[i] += gi;
    m[i] += gi;
    v[i] += gi;
  }
}

bool PortableAllFinite(const void* data, int bf16, int64_t n) {
  // NaN and Inf are the values whose exponent bits are all ones: |bits| above the largest finite value. Written
  // as a branch-free OR over signed compares so the compiler vectorises it.
  using U32 = uint32_t __attribute__((may_alias));
  using U16 = uint16_t __attribute__((may_alias));
  int32_t any = 0;
  if (!bf16) {
    const U32* x = static_cast<const U32*>(data);
    for (int64_t i = 0; i < n; ++i) any |= static_cast<int32_t>(x[i] & 0x7fffffffu) > 0x7f7fffff;
  } else {
    const U16* x = static_cast<const U16*>(data);
    for (int64_t i = 0; i < n; ++i) any |= static_cast<int16_t>(x[i] & 0x7fffu) > 0x7f7f;
  }
  return any == 0;
}

}  // namespace nsp::internal
