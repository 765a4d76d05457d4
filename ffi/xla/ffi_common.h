// Pieces shared by the XLA FFI handlers: errors named after the op, gradient dtypes, the optional bf16 params
// result, and the hyperparameter dictionary every update takes (one attribute, `hyper`) with its decoding.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

#include "kernels/hyper_params.h"
#include "kernels/update_kernel.h"

namespace nsp {
namespace ffi = xla::ffi;  // the name the handler files use for the XLA FFI API
}  // namespace nsp

namespace nsp::ffi_common {

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

// The optional bf16 copy of the new params, result `index` among `rets`: null when the call has none, else its
// data, which must be bfloat16 with `n` elements (`error` says so otherwise).
inline ffi::ErrorOr<uint16_t*> OptionalBf16Result(const char* op, const ffi::RemainingRets& rets, size_t index,
                                                  int64_t n, const char* error) {
  if (rets.size() <= index) return static_cast<uint16_t*>(nullptr);
  auto result = rets.get<ffi::AnyBuffer>(index);
  if (result.has_error()) return ffi::Unexpected(result.error());
  ffi::AnyBuffer out = **result;
  if (out.element_type() != ffi::DataType::BF16 || static_cast<int64_t>(out.element_count()) != n) {
    return ffi::Unexpected(Invalid(op, error));
  }
  return static_cast<uint16_t*>(out.untyped_data());
}

// What an attribute holds, for error messages: the first of a few types it decodes as.
inline std::string AttrTypeName(const ffi::Dictionary& dict, const char* key) {
  if (dict.contains<bool>(key)) return "bool";
  if (dict.contains<int32_t>(key)) return "int32";
  if (dict.contains<int64_t>(key)) return "int64";
  if (dict.contains<float>(key)) return "float32";
  if (dict.contains<double>(key)) return "float64";
  if (dict.contains<std::string_view>(key)) return "a string";
  return "another type";
}

// The type HyperParams reads a key as, for error messages.
template <typename T>
constexpr const char* AttrTypeName() {
  if constexpr (std::is_same_v<T, bool>) return "a bool";
  else if constexpr (std::is_same_v<T, int32_t>) return "an int32";
  else return "a float64";
}

// The hyperparameters of one update from its scalar operands (lr, step: traced) and its attribute `hyper`
// (static: one dictionary, hyper_params.h's keys), decoded and validated once.
inline ffi::ErrorOr<UpdateHyperParams> HyperParams(const char* op, ffi::Buffer<ffi::F32> lr,
                                                   ffi::Buffer<ffi::S32> step, const ffi::Dictionary& attrs) {
  if (lr.element_count() != 1 || step.element_count() != 1) {
    return ffi::Unexpected(Invalid(op, "lr and step must be scalars"));
  }
  for (auto it = attrs.begin(); it != attrs.end(); ++it) {
    if (!hyper::IsKey(*it)) return ffi::Unexpected(Invalid(op, hyper::UnknownKey(*it)));
  }
  UpdateHyperParams hp;
  hp.lr = lr.typed_data()[0];
  hp.step = step.typed_data()[0];
  auto read = [&attrs](const char* key, auto* out) -> std::string {
    using T = std::remove_pointer_t<decltype(out)>;
    if (!attrs.contains(key)) return hyper::MissingKey(key);
    if (!attrs.contains<T>(key)) return hyper::WrongType(key, AttrTypeName<T>(), AttrTypeName(attrs, key));
    ffi::ErrorOr<T> value = attrs.get<T>(key);
    if (value.has_error()) return std::string("hyperparameter '") + key + "': " + value.error().message();
    *out = *value;
    return "";
  };
  if (std::string err = hyper::DecodeHyperParams(read, hp); !err.empty()) return ffi::Unexpected(Invalid(op, err));
  return hp;
}

// Binds the hyperparameter dictionary: the one attribute `hyper` HyperParams decodes.
template <typename Binding>
auto WithHyperParamAttr(Binding binding) {
  return std::move(binding).template Attr<ffi::Dictionary>("hyper");
}

}  // namespace nsp::ffi_common
