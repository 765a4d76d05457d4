// What every backend shares: the state names, host-memory page buffers and the host CPU update a backend runs
// unless it has its own.
#include "backend.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace nsp {

void* Backend::AllocPageBuffer(size_t bytes) {
  void* p = nullptr;
  if (::posix_memalign(&p, 4096, bytes) != 0) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return p;
}

void Backend::FreePageBuffer(void* buffer, size_t /*bytes*/) { std::free(buffer); }

const char* StateName(int state) {
  static const char* const kNames[kNumStates] = {"param", "mu", "nu"};
  return state >= 0 && state < kNumStates ? kNames[state] : "?";
}

std::string CheckSlotAndState(const char* what, int slot, int state) {
  if (slot >= 0 && slot <= 1 && state >= 0 && state < kNumStates) return {};
  return std::string(what) + ": slot must be 0 or 1 and state 0 (param), 1 (mu) or 2 (nu), got slot " +
         std::to_string(slot) + ", state " + std::to_string(state);
}

void Backend::Compute(const UpdateHyperParams& hp, const StateSpan& span, const PageGrad& grad) {
  if (grad.dense != nullptr) {
    UpdateDense(hp, span, grad.dense, grad.type);
  } else {
    UpdateSparse(hp, span, grad.indices, grad.values, grad.type, grad.count, grad.index_base);
  }
}

bool Backend::ComputeIfFinite(const UpdateHyperParams& hp, const StateSpan& span, const void* grad, GradType type) {
  return UpdateDenseIfFinite(hp, span, grad, type);
}

}  // namespace nsp
