// Internal interface between the dispatcher (update_kernel.cc) and the per-ISA block kernels.
// Kept free of standard-library templates: the AVX2 and AVX-512 translation units are compiled with -mavx2 -mfma
// and -mavx512* and must not emit inline library code that the linker could pick for the portable build.
#pragma once

#include <cstdint>

namespace nsp::internal {

// Per-call scalars, derived once from UpdateHyperParams.
struct Coefficients {
  int32_t kind;        // OptimizerKind
  float lr;
  float mu_a, mu_b;    // mu <- mu_a * mu + mu_b * g
  float nu_a, nu_b;    // nu <- nu_a * nu + nu_b * g * g
  float inv_bc1;       // Adam: 1 / (1 - b1^t)
  float inv_bc2;       // Adam: 1 / (1 - b2^t)
  float eps;
  float l2;            // weight decay added to the gradient (Adam, SGD, AdaGrad)
  float decoupled_wd;  // weight decay added to the update (AdamW)
  float momentum;      // SGD
  int32_t nesterov;    // SGD
  int32_t sgd_has_momentum;
  int32_t streaming;   // write out-of-place outputs with streaming (non-temporal) stores; the caller fences
  int32_t prefetch;    // software prefetch distance on every input stream, in elements (0: none)
  int32_t prefetch_level;  // the cache level prefetched into: 1 (L1), 2 (L2) or 3 (last level)
};

// Pointers for one block; `grad` is fp32 or bf16 (uint16_t) as the kernel was chosen for.
struct Block {
  const float* p_in;
  float* p_out;
  const float* m_in;
  float* m_out;
  const float* v_in;
  float* v_out;
  uint16_t* p16_out;  // may be null
  float* p32_copy;    // may be null
  const void* grad;
  int64_t n;
};

// Returns whether every gradient value of the block was finite (no NaN/Inf): the kernel tests each value as it
// loads it, so a caller that can discard the block's outputs checks the gradient at no extra pass.
using BlockKernel = bool (*)(const Coefficients&, const Block&);

// grad_bf16, lazy: 0/1. Returns the kernel for one (kind, gradient dtype, lazy) choice; bf16 output is handled
// inside. Lazy kernels leave elements whose gradient is zero as they are (UpdateHyperParams::lazy); it is a
// separate instantiation so that the usual update carries no trace of it in its loop.
BlockKernel PortableKernel(int32_t kind, int grad_bf16, int lazy);
BlockKernel Avx2Kernel(int32_t kind, int grad_bf16, int lazy);
// bf16_insn: 1 where the CPU has AVX512_BF16, whose conversion instruction then writes the bf16 param copy.
BlockKernel Avx512Kernel(int32_t kind, int grad_bf16, int lazy, int bf16_insn);

void PortableStream(float* p, const float* g, float* m, float* v, int64_t n);

// fp32 -> bf16, round to nearest even with NaN kept quiet: the rounding of the kernels' bf16 output, for params
// handed back without an update (a skipped or stale step).
void RoundToBf16(const float* in, uint16_t* out, int64_t n);
// bf16 -> fp32 is exact: the bf16 bits are the fp32's upper half.
float WidenBf16(uint16_t h);
void Avx2Stream(float* p, const float* g, float* m, float* v, int64_t n);
void Avx512Stream(float* p, const float* g, float* m, float* v, int64_t n);

// Whether none of the n values (fp32, or bf16 bit patterns when `bf16`) is NaN or Inf: all exponent bits set.
bool PortableAllFinite(const void* data, int bf16, int64_t n);
bool Avx2AllFinite(const void* data, int bf16, int64_t n);
bool Avx512AllFinite(const void* data, int bf16, int64_t n);

}  // namespace nsp::internal
