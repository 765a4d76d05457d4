// Host side of the updater kernel: what the host derives before a run (the coefficient block and the flags word)
// and the check of a Top-K run that the decompressor trusts. Never synthesized; the software models of the vendor
// libraries and the tests link it next to the kernel.
#include <cmath>
#include <cstdio>

#include "backends/hls/nsp_updater_hls.h"

namespace {

thread_local char g_message[256];

const char* Fail(const char* what, double value) {
  std::snprintf(g_message, sizeof g_message, "%s, got %g", what, value);
  return g_message;
}

// The checks of nsp::ValidateHyperParams (ffi/kernels/update_kernel.cc), with its wording.
const char* Validate(int32_t kind, int64_t step, double b1, double b2, double eps, double weight_decay,
                     double momentum) {
  if (kind < NSP_HLS_ADAM || kind > NSP_HLS_ADAGRAD) return Fail("unknown optimizer kind", kind);
  if (step < 1) return Fail("step must be >= 1 (the 1-based number of this update)", static_cast<double>(step));
  if (!(b1 >= 0.0 && b1 < 1.0)) return Fail("b1 must be in [0, 1)", b1);
  if (!(b2 >= 0.0 && b2 < 1.0)) return Fail("b2 must be in [0, 1)", b2);
  if (!(eps >= 0.0)) return Fail("eps must be >= 0", eps);
  if (!(weight_decay >= 0.0)) return Fail("weight_decay must be >= 0", weight_decay);
  if (!(momentum >= 0.0)) return Fail("momentum must be >= 0", momentum);
  return nullptr;
}

}  // namespace

extern "C" const char* nsp_hls_make_coeffs(int32_t kind, float lr, int64_t step, double b1, double b2, double eps,
                                           double weight_decay, double momentum, float* coeffs) {
  if (const char* err = Validate(kind, step, b1, b2, eps, weight_decay, momentum)) return err;
  for (int i = 0; i < NSP_HLS_NUM_COEFFS; ++i) coeffs[i] = 0.0f;
  coeffs[NSP_HLS_C_LR] = lr;
  coeffs[NSP_HLS_C_EPS] = static_cast<float>(eps);
  // The derivation of nsp's MakeCoefficients (ffi/kernels/update_kernel.cc): every coefficient computed in double and
  // rounded to fp32 once, so 1 - b2 and the bias corrections keep their digits.
  switch (kind) {
    case NSP_HLS_ADAM:
    case NSP_HLS_ADAMW: {
      coeffs[NSP_HLS_C_MU_A] = static_cast<float>(b1);
      coeffs[NSP_HLS_C_MU_B] = static_cast<float>(1.0 - b1);
      coeffs[NSP_HLS_C_NU_A] = static_cast<float>(b2);
      coeffs[NSP_HLS_C_NU_B] = static_cast<float>(1.0 - b2);
      const double t = static_cast<double>(step);
      coeffs[NSP_HLS_C_INV_BC1] = static_cast<float>(1.0 / (1.0 - std::pow(b1, t)));
      coeffs[NSP_HLS_C_INV_BC2] = static_cast<float>(1.0 / (1.0 - std::pow(b2, t)));
      if (kind == NSP_HLS_ADAM) coeffs[NSP_HLS_C_L2] = static_cast<float>(weight_decay);
      else coeffs[NSP_HLS_C_DECOUPLED_WD] = static_cast<float>(weight_decay);
      break;
    }
    case NSP_HLS_SGD:
      coeffs[NSP_HLS_C_L2] = static_cast<float>(weight_decay);
      coeffs[NSP_HLS_C_MOMENTUM] = static_cast<float>(momentum);
      break;
    default:  // AdaGrad
      coeffs[NSP_HLS_C_L2] = static_cast<float>(weight_decay);
      coeffs[NSP_HLS_C_NU_A] = 1.0f;
      coeffs[NSP_HLS_C_NU_B] = 1.0f;
      break;
  }
  return nullptr;
}

extern "C" uint32_t nsp_hls_flags(int32_t kind, int32_t grad_format, int lazy, int nesterov, double momentum,
                                  int bf16_out) {
  uint32_t flags = static_cast<uint32_t>(kind) & NSP_HLS_FLAG_KIND_MASK;
  flags |= (static_cast<uint32_t>(grad_format) & NSP_HLS_FLAG_GRAD_MASK) << NSP_HLS_FLAG_GRAD_SHIFT;
  if (lazy) flags |= NSP_HLS_FLAG_LAZY;
  if (nesterov) flags |= NSP_HLS_FLAG_NESTEROV;
  if (kind == NSP_HLS_SGD && momentum != 0.0) flags |= NSP_HLS_FLAG_MOMENTUM;
  if (bf16_out) flags |= NSP_HLS_FLAG_BF16_OUT;
  return flags;
}

extern "C" int nsp_hls_uses_m(uint32_t flags) {
  const uint32_t kind = flags & NSP_HLS_FLAG_KIND_MASK;
  return kind == NSP_HLS_ADAM || kind == NSP_HLS_ADAMW || (kind == NSP_HLS_SGD && (flags & NSP_HLS_FLAG_MOMENTUM));
}

extern "C" int nsp_hls_uses_v(uint32_t flags) { return (flags & NSP_HLS_FLAG_KIND_MASK) != NSP_HLS_SGD; }

extern "C" int64_t nsp_hls_check_topk(const int32_t* idx, int64_t count, int64_t n, int64_t index_base) {
  int64_t prev = index_base;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t k = idx[j];
    if (k < prev || k >= index_base + n) return j;
    prev = k;
  }
  return -1;
}
