// XLA FFI handlers for the fused update (CPU platform): decode buffers and attributes, check them, and call
// the kernel. Two targets share one implementation: dense gradients, and Top-K compressed (values, indices).
//
// Operands: lr f32[], step s32[], param f32[n], grad (f32|bf16)[n] or values (f32|bf16)[k] + indices s32[k],
// mu f32[n|0], nu f32[n|0]. Results: param, mu, nu (aliased to the operands when the caller donates them) and,
// optionally, a bf16[n] copy of the new param. Hyperparameters other than lr and step are one attribute, the
// dictionary `hyper` (keys in hyper_params.h).
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

#include "kernels/update_kernel.h"
#include "util/engine_cpus.h"
#include "xla/ffi_common.h"

namespace nsp {
namespace {

constexpr char kOp[] = "nsp.fused_update";

using ffi_common::Invalid;

struct Prepared {
  UpdateHyperParams hp;
  StateSpan span;
};

// Reads scalars and attributes, checks sizes, and points a StateSpan at the operand and result buffers.
ffi::ErrorOr<Prepared> Prepare(ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::F32> param,
                               ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
                               ffi::ResultBuffer<ffi::F32> param_out, ffi::ResultBuffer<ffi::F32> mu_out,
                               ffi::ResultBuffer<ffi::F32> nu_out, ffi::RemainingRets extra,
                               ffi::Dictionary hyper) {
  auto decoded = ffi_common::HyperParams(kOp, lr, step, hyper);
  if (decoded.has_error()) return ffi::Unexpected(decoded.error());
  Prepared out;
  out.hp = *decoded;
  const UpdateHyperParams& hp = out.hp;

  const int64_t n = static_cast<int64_t>(param.element_count());
  if (static_cast<int64_t>(param_out->element_count()) != n) {
    return ffi::Unexpected(Invalid(kOp, "param result size does not match param"));
  }
  StateSpan& s = out.span;
  s.size = n;
  s.param_in = param.typed_data();
  s.param_out = param_out->typed_data();
  if (UsesMu(hp)) {
    if (static_cast<int64_t>(mu.element_count()) != n || static_cast<int64_t>(mu_out->element_count()) != n) {
      return ffi::Unexpected(Invalid(kOp, "mu must have as many elements as param"));
    }
    s.mu_in = mu.typed_data();
    s.mu_out = mu_out->typed_data();
  }
  if (UsesNu(hp)) {
    if (static_cast<int64_t>(nu.element_count()) != n || static_cast<int64_t>(nu_out->element_count()) != n) {
      return ffi::Unexpected(Invalid(kOp, "nu must have as many elements as param"));
    }
    s.nu_in = nu.typed_data();
    s.nu_out = nu_out->typed_data();
  }
  auto bf16 = ffi_common::OptionalBf16Result(kOp, extra, 0, n,
                                             "the bf16 param copy must be bfloat16 with as many elements as param");
  if (bf16.has_error()) return ffi::Unexpected(bf16.error());
  s.param_bf16_out = *bf16;
  return out;
}

ffi::Error DenseImpl(ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::F32> param,
                     ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
                     ffi::ResultBuffer<ffi::F32> param_out, ffi::ResultBuffer<ffi::F32> mu_out,
                     ffi::ResultBuffer<ffi::F32> nu_out, ffi::RemainingRets extra, ffi::Dictionary hyper) {
  auto prepared = Prepare(lr, step, param, mu, nu, param_out, mu_out, nu_out, extra, hyper);
  if (prepared.has_error()) return prepared.error();
  auto grad_type = ffi_common::GradTypeOf(kOp, grad);
  if (grad_type.has_error()) return grad_type.error();
  if (static_cast<int64_t>(grad.element_count()) != prepared->span.size) {
    return Invalid(kOp, "grad must have as many elements as param");
  }
  const EngineCpuScope cpus;  // NSP_ENGINE_CPUS
  UpdateDense(prepared->hp, prepared->span, grad.untyped_data(), *grad_type);
  return ffi::Error::Success();
}

ffi::Error SparseImpl(ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::F32> param,
                      ffi::AnyBuffer values, ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> mu,
                      ffi::Buffer<ffi::F32> nu, ffi::ResultBuffer<ffi::F32> param_out,
                      ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out,
                      ffi::RemainingRets extra, ffi::Dictionary hyper) {
  auto prepared = Prepare(lr, step, param, mu, nu, param_out, mu_out, nu_out, extra, hyper);
  if (prepared.has_error()) return prepared.error();
  auto value_type = ffi_common::GradTypeOf(kOp, values);
  if (value_type.has_error()) return value_type.error();
  const int64_t count = static_cast<int64_t>(indices.element_count());
  if (static_cast<int64_t>(values.element_count()) != count) {
    return Invalid(kOp, "values and indices must have the same length");
  }
  // Checked in full before anything is written: a bad index must not leave a half-updated state behind.
  if (std::string err = ValidateSparseIndices(indices.typed_data(), count, prepared->span.size); !err.empty()) {
    return Invalid(kOp, err);
  }
  const EngineCpuScope cpus;  // NSP_ENGINE_CPUS
  UpdateSparse(prepared->hp, prepared->span, indices.typed_data(), values.untyped_data(), *value_type, count);
  return ffi::Error::Success();
}

// The operands before the gradient: lr, step, param.
template <typename Binding>
auto LeadingArgs(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()   // lr
      .template Arg<ffi::Buffer<ffi::S32>>()   // step
      .template Arg<ffi::Buffer<ffi::F32>>();  // param
}

// The operands after the gradient (mu, nu), the results, and the hyperparameter attribute.
template <typename Binding>
auto StateArgsAndResults(Binding binding) {
  return ffi_common::WithHyperParamAttr(std::move(binding)
                                            .template Arg<ffi::Buffer<ffi::F32>>()  // mu
                                            .template Arg<ffi::Buffer<ffi::F32>>()  // nu
                                            .template Ret<ffi::Buffer<ffi::F32>>()  // param
                                            .template Ret<ffi::Buffer<ffi::F32>>()  // mu
                                            .template Ret<ffi::Buffer<ffi::F32>>()  // nu
                                            .RemainingRets());                      // [param_bf16]
}

}  // namespace
}  // namespace nsp

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspFusedUpdateDense, nsp::DenseImpl,
                              nsp::StateArgsAndResults(nsp::LeadingArgs(xla::ffi::Ffi::Bind())
                                                           .Arg<xla::ffi::AnyBuffer>()));  // grad

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspFusedUpdateSparse, nsp::SparseImpl,
                              nsp::StateArgsAndResults(nsp::LeadingArgs(xla::ffi::Ffi::Bind())
                                                           .Arg<xla::ffi::AnyBuffer>()                // values
                                                           .Arg<xla::ffi::Buffer<xla::ffi::S32>>()));  // indices
