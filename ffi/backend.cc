// What every backend shares: the state names and the host CPU update a backend runs unless it has its own.
#include "backend.h"

namespace nsp {

const char* StateName(int state) {
  static const char* const kNames[kNumStates] = {"param", "mu", "nu"};
  return state >= 0 && state < kNumStates ? kNames[state] : "?";
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
