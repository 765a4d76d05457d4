// The near-storage updater as an FPGA kernel: Vitis-HLS-style C++ that also compiles with plain g++ (C simulation).
//
// One top function, nsp_update_page, updates one page of optimizer state: it reads p, m, v (fp32) and a gradient --
// dense fp32, dense bf16, or a sorted run of Top-K (index, value) pairs that its decompressor scatters into a dense
// burst -- and writes p, m, v (in place when the host binds the same buffer to an input and its output) plus an
// optional bf16 copy of the new params. The arithmetic is ffi/kernels/kernel_portable.cc's, operation for operation in
// fp32, so the result matches nsp's CPU kernel bit for bit (built without floating-point contraction).
//
// Hyperparameters reach the kernel as a small block of fp32 coefficients that the host derives once per step
// (nsp_hls_make_coeffs: bias corrections in double, then rounded once, exactly as the CPU kernel's dispatcher does),
// so the fabric needs neither pow nor double arithmetic. The kernel's choices (optimizer kind, gradient format,
// lazy, Nesterov, momentum, bf16 copy) are bits of one flags word (nsp_hls_flags), so one bitstream serves them all.
//
// Everything here is plain C: the software models of the vendor libraries (ffi/backends/xrt/xrt_model.cc,
// ffi/backends/axdimm/axdimm_model.cc) and ctypes call it as is.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Optimizer kinds: the values of nsp::OptimizerKind (ffi/kernels/update_kernel.h).
enum { NSP_HLS_ADAM = 0, NSP_HLS_ADAMW = 1, NSP_HLS_SGD = 2, NSP_HLS_ADAGRAD = 3 };

// Gradient formats. Top-K: `topk_count` values (fp32 or bf16) with their int32 indices, sorted ascending, each in
// [index_base, index_base + n); equal indices add up (scatter-add), so zero-valued padding is harmless.
enum { NSP_HLS_GRAD_F32 = 0, NSP_HLS_GRAD_BF16 = 1, NSP_HLS_TOPK_F32 = 2, NSP_HLS_TOPK_BF16 = 3 };

// The flags word (an AXI-Lite register): bits 0-1 kind, bits 2-3 gradient format, then single-bit options.
#define NSP_HLS_FLAG_KIND_MASK 0x3u
#define NSP_HLS_FLAG_GRAD_SHIFT 2
#define NSP_HLS_FLAG_GRAD_MASK 0x3u
#define NSP_HLS_FLAG_LAZY (1u << 4)      // elements whose gradient is exactly zero keep p, m, v
#define NSP_HLS_FLAG_NESTEROV (1u << 5)  // SGD: Nesterov momentum
#define NSP_HLS_FLAG_MOMENTUM (1u << 6)  // SGD: keeps a momentum trace in m (momentum != 0)
#define NSP_HLS_FLAG_BF16_OUT (1u << 7)  // also write a bf16 copy of the new params

// Positions in the coefficient block (fp32 words); the block is NSP_HLS_NUM_COEFFS words, the rest reserved (0).
enum {
  NSP_HLS_C_LR = 0,
  NSP_HLS_C_MU_A = 1,          // m <- mu_a * m + mu_b * g
  NSP_HLS_C_MU_B = 2,
  NSP_HLS_C_NU_A = 3,          // v <- nu_a * v + nu_b * g * g
  NSP_HLS_C_NU_B = 4,
  NSP_HLS_C_INV_BC1 = 5,       // Adam/AdamW: 1 / (1 - b1^t)
  NSP_HLS_C_INV_BC2 = 6,       // Adam/AdamW: 1 / (1 - b2^t)
  NSP_HLS_C_EPS = 7,
  NSP_HLS_C_L2 = 8,            // weight decay added to the gradient (Adam, SGD, AdaGrad)
  NSP_HLS_C_DECOUPLED_WD = 9,  // weight decay added to the update (AdamW)
  NSP_HLS_C_MOMENTUM = 10,     // SGD
  NSP_HLS_NUM_COEFFS = 16
};

// Elements per burst and per decompressor buffer: 1024 fp32 words fill one 36 Kb block RAM.
#define NSP_HLS_CHUNK 1024

// The kernel. Unused ports may be null: m_in/m_out when the kind keeps no first moment, v_in/v_out when it keeps
// no second moment, p_bf16_out without NSP_HLS_FLAG_BF16_OUT, grad_f32 / grad_bf16 / topk_idx for the formats that
// do not read them. `n` elements per page; the Top-K indices must have passed nsp_hls_check_topk.
void nsp_update_page(const float* p_in, const float* m_in, const float* v_in, float* p_out, float* m_out, float* v_out,
                     uint16_t* p_bf16_out, const float* grad_f32, const uint16_t* grad_bf16, const int32_t* topk_idx,
                     const float* coeffs, int32_t n, int32_t topk_count, int32_t index_base, uint32_t flags);

// ---- Host side (nsp_updater_host.cc; never synthesized) ----

// Fills `coeffs` (NSP_HLS_NUM_COEFFS words) for one step. `step` is 1-based. Returns NULL, or a message naming the
// problem (an unknown kind, a hyperparameter out of range) valid until the calling thread's next call.
const char* nsp_hls_make_coeffs(int32_t kind, float lr, int64_t step, double b1, double b2, double eps,
                                double weight_decay, double momentum, float* coeffs);

// Packs the flags word. `momentum` is the SGD momentum (its trace is kept when it is non-zero).
uint32_t nsp_hls_flags(int32_t kind, int32_t grad_format, int lazy, int nesterov, double momentum, int bf16_out);

// Whether a kernel run with these flags reads and writes m / v.
int nsp_hls_uses_m(uint32_t flags);
int nsp_hls_uses_v(uint32_t flags);

// -1 when the `count` indices are sorted ascending and each lies in [index_base, index_base + n), else the position
// of the first one that is not: the decompressor trusts its input, so the host checks it before a run.
int64_t nsp_hls_check_topk(const int32_t* idx, int64_t count, int64_t n, int64_t index_base);

#ifdef __cplusplus
}
#endif
