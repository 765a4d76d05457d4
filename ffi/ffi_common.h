// Pieces shared by the XLA FFI handlers: errors named after the op, gradient dtypes, the hyperparameter
// attributes every update takes, and their decoding.
#pragma once

#include <string>
#include <utility>

#include "update_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace nsp::ffi_common {

namespace ffi = xla::ffi;

inline ffi::Error Invalid(const char* op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

inline ffi::ErrorOr<GradType> GradTypeOf(const char* op, const ffi::AnyBuffer& buffer) {
  switch (buffer.element_type()) {
    case ffi::DataType::F32: return GradType::kF32;
    case ffi::DataType::BF16: return GradType::kBF16;
    default: return ffi::Unexpected(Invalid(op, "gradients must be float32 or bfloat16"));
  }
}

// The hyperparameters of one update from its scalar operands (lr, step: traced) and attributes (static).
inline ffi::ErrorOr<UpdateHyperParams> HyperParams(const char* op, ffi::Buffer<ffi::F32> lr,
                                                   ffi::Buffer<ffi::S32> step, int32_t kind, double b1, double b2,
                                                   double eps, double weight_decay, double momentum,
                                                   bool nesterov, bool lazy) {
  if (lr.element_count() != 1 || step.element_count() != 1) {
    return ffi::Unexpected(Invalid(op, "lr and step must be scalars"));
  }
  UpdateHyperParams hp;
  hp.kind = static_cast<OptimizerKind>(kind);
  hp.lr = lr.typed_data()[0];
  hp.step = step.typed_data()[0];
  hp.b1 = b1;
  hp.b2 = b2;
  hp.eps = eps;
  hp.weight_decay = weight_decay;
  hp.momentum = momentum;
  hp.nesterov = nesterov;
  hp.lazy = lazy;
  if (std::string err = ValidateHyperParams(hp); !err.empty()) return ffi::Unexpected(Invalid(op, err));
  return hp;
}

// Adds the hyperparameter attributes, in the order the handlers' signatures list them.
template <typename Binding>
auto WithHyperParamAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<int32_t>("kind")
      .template Attr<double>("b1")
      .template Attr<double>("b2")
      .template Attr<double>("eps")
      .template Attr<double>("weight_decay")
      .template Attr<double>("momentum")
      .template Attr<bool>("nesterov")
      .template Attr<bool>("lazy");
}

}  // namespace nsp::ffi_common
