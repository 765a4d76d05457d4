// The backend ABI's kernel arguments (nsp_backend_abi.h) as the update kernel's structs, and back: the host side
// (plugin_backend.cc) turns what the engine computes into what it hands a plugin, and a plugin (plugin_device.cc)
// turns that back. One list of the fields the two sides share, so neither direction can miss one.
#pragma once

#include <cstdint>

#include "backends/backend.h"
#include "kernels/update_kernel.h"
#include "nsp_backend_abi.h"

// The fields each pair of structs shares by name and type (or a type that converts); those that differ in kind
// (an enum, a bool) are converted apart.
#define NSP_ABI_HYPER_FIELDS(X) X(lr) X(step) X(b1) X(b2) X(eps) X(weight_decay) X(momentum)
#define NSP_ABI_SPAN_FIELDS(X) \
  X(param_in) X(param_out) X(mu_in) X(mu_out) X(nu_in) X(nu_out) X(param_bf16_out) X(param_copy_out) X(size)
#define NSP_ABI_GRAD_FIELDS(X) X(dense) X(indices) X(values) X(count) X(index_base)
#define NSP_ABI_COPY_FIELD(field) to.field = from.field;

namespace nsp::abi {

inline nsp_hyper_params ToAbi(const UpdateHyperParams& from) {
  nsp_hyper_params to{};
  to.struct_size = sizeof to;
  NSP_ABI_HYPER_FIELDS(NSP_ABI_COPY_FIELD)
  to.kind = static_cast<int32_t>(from.kind);
  to.nesterov = from.nesterov ? 1 : 0;
  to.lazy = from.lazy ? 1 : 0;
  return to;
}

inline UpdateHyperParams FromAbi(const nsp_hyper_params& from) {
  UpdateHyperParams to;
  NSP_ABI_HYPER_FIELDS(NSP_ABI_COPY_FIELD)
  to.kind = static_cast<OptimizerKind>(from.kind);
  to.nesterov = from.nesterov != 0;
  to.lazy = from.lazy != 0;
  return to;
}

inline nsp_state_span ToAbi(const StateSpan& from) {
  nsp_state_span to{};
  to.struct_size = sizeof to;
  NSP_ABI_SPAN_FIELDS(NSP_ABI_COPY_FIELD)
  return to;
}

inline StateSpan FromAbi(const nsp_state_span& from) {
  StateSpan to;
  NSP_ABI_SPAN_FIELDS(NSP_ABI_COPY_FIELD)
  return to;
}

inline nsp_page_grad ToAbi(const PageGrad& from) {
  nsp_page_grad to{};
  to.struct_size = sizeof to;
  NSP_ABI_GRAD_FIELDS(NSP_ABI_COPY_FIELD)
  to.grad_type = static_cast<int32_t>(from.type);
  return to;
}

}  // namespace nsp::abi
