// Helpers the software models (xrt_model.cc, axdimm_model.cc, cuda_model.cc) use. Header-only, so that each model
// still builds from its own .cc with the updater's sources and nothing else.
#pragma once

#include <cstdint>
#include <cstdlib>

namespace nsp_model {

// An integer setting from the environment (a fault count, a memory size); `fallback` when unset, empty or not a
// whole number, so a stray value never turns a fault on.
inline int64_t EnvInt(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  return (end != nullptr && *end == '\0') ? value : fallback;
}

}  // namespace nsp_model
