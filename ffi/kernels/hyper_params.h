// The optimizer hyperparameters' keys and their one decoding into UpdateHyperParams.
//
// Every update names its static hyperparameters in one dictionary: the XLA FFI handlers get it as the attribute
// `hyper` (an ffi::Dictionary, ffi_common.h), the storage engine's Python bindings as one Python dict
// (module.cc); nsp.spec.hyper_attrs builds both. Each side only says how to read one key of
// one type from its dictionary; DecodeHyperParams reads every key, in one place, and validates the result.
// Plain C++: no XLA or nanobind types.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/update_kernel.h"

namespace nsp::hyper {

// The keys, and the type each is read as: kind int32; b1, b2, eps, weight_decay, momentum float64;
// nesterov, lazy bool. lr and step are not here: they are traced operands (the FFI) or plain arguments.
inline constexpr char kKind[] = "kind";
inline constexpr char kB1[] = "b1";
inline constexpr char kB2[] = "b2";
inline constexpr char kEps[] = "eps";
inline constexpr char kWeightDecay[] = "weight_decay";
inline constexpr char kMomentum[] = "momentum";
inline constexpr char kNesterov[] = "nesterov";
inline constexpr char kLazy[] = "lazy";
inline constexpr const char* kKeys[] = {kKind, kB1, kB2, kEps, kWeightDecay, kMomentum, kNesterov, kLazy};
inline constexpr int kNumKeys = sizeof(kKeys) / sizeof(kKeys[0]);

inline bool IsKey(std::string_view name) {
  for (const char* key : kKeys) {
    if (name == key) return true;
  }
  return false;
}

// The message for a key the dictionary lacks, or holds with another type (`expected`: "int32", "float64",
// "bool"; `got`: what it holds, if the caller can tell).
inline std::string MissingKey(const char* key) {
  return std::string("hyperparameter '") + key + "' is missing";
}
inline std::string WrongType(const char* key, const char* expected, const std::string& got = "") {
  return std::string("hyperparameter '") + key + "' must be " + expected + (got.empty() ? "" : ", got " + got);
}
inline std::string UnknownKey(std::string_view key) {
  return "unknown hyperparameter '" + std::string(key) + "'";
}

// Fills `hp` (lr and step set by the caller beforehand) from one dictionary and validates it. `read(key, &field)`
// reads one key into an int32_t, double or bool and returns "" or a message naming the key (MissingKey,
// WrongType). Returns "" or the first problem.
template <typename Read>
std::string DecodeHyperParams(Read&& read, UpdateHyperParams& hp) {
  int32_t kind = 0;
  std::string err = read(kKind, &kind);
  if (err.empty()) err = read(kB1, &hp.b1);
  if (err.empty()) err = read(kB2, &hp.b2);
  if (err.empty()) err = read(kEps, &hp.eps);
  if (err.empty()) err = read(kWeightDecay, &hp.weight_decay);
  if (err.empty()) err = read(kMomentum, &hp.momentum);
  if (err.empty()) err = read(kNesterov, &hp.nesterov);
  if (err.empty()) err = read(kLazy, &hp.lazy);
  if (!err.empty()) return err;
  hp.kind = static_cast<OptimizerKind>(kind);
  return ValidateHyperParams(hp);
}

}  // namespace nsp::hyper
