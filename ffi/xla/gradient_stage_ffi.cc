// XLA FFI handlers of the staged gradient (engine/gradient_stage.h): a step that never holds its whole gradient.
//
// nsp_gradient_stage writes one gradient leaf into its shard's stage file, at the leaf's place in the shard, as soon
// as the backward pass has produced it (the leaf's buffer is then free), and returns whether the leaf is finite
// (s32[]: 1 or 0) and, with attribute norm, its sum of squares (f32[]: its share of the global norm a clipped step
// scales the gradient by, applied as the update reads it): the store update (nsp_store_update_staged,
// store_update_ffi.cc) takes the AND of those as its apply operand, so it runs after every leaf is staged.
// nsp_gradient_stage_load reads one leaf of the new params back from the stage file, where the update wrote them
// over the gradient; it takes the update's version result, and the previous leaf's next params, as operands it never
// reads, so that it runs after the update and after the step applied the previous leaf. Both have side effects.
//
// Attributes: handle (the shard's engine), offset (the leaf's first element in the shard), norm (the stage call).
#include <cmath>
#include <cstdint>
#include <string>

#include "engine/engine_registry.h"
#include "engine/store_engine.h"
#include "xla/ffi/api/ffi.h"
#include "kernels/kernel_block.h"
#include "xla/ffi_common.h"

namespace nsp {
namespace {

using ffi_common::Invalid;

// The stage file of engine `handle`, after checking that `n` elements fit at `offset` in its shard.
ffi::ErrorOr<GradientStage*> StageOf(const char* op, int64_t handle, int64_t offset, int64_t n) {
  std::string why;
  std::shared_ptr<ShardEngine> engine = FindEngine(handle, &why);
  if (engine == nullptr) return ffi::Unexpected(Invalid(op, why));
  if (offset < 0 || offset + n > engine->size()) {
    return ffi::Unexpected(Invalid(op, "a leaf of " + std::to_string(n) + " elements at " + std::to_string(offset) +
                                           " does not fit the shard's " + std::to_string(engine->size())));
  }
  GradientStage* stage = nullptr;
  if (std::string e = engine->Stage(&stage); !e.empty()) return ffi::Unexpected(Invalid(op, e));
  return stage;
}

// The sum of the squares of `n` elements (float32 or bf16) in double: finite exactly when every element is (a
// float32's square cannot overflow a double). Eight partial sums, so the loop is not one long dependency chain.
double SumOfSquares(const void* data, GradType type, int64_t n) {
  double part[8] = {};
  if (type == GradType::kF32) {
    const float* g = static_cast<const float*>(data);
    for (int64_t i = 0; i < n; ++i) part[i & 7] += static_cast<double>(g[i]) * g[i];
  } else {
    const uint16_t* g = static_cast<const uint16_t*>(data);
    for (int64_t i = 0; i < n; ++i) {
      const double x = internal::WidenBf16(g[i]);
      part[i & 7] += x * x;
    }
  }
  double sum = 0;
  for (double p : part) sum += p;
  return sum;
}

ffi::Error StageImpl(ffi::AnyBuffer grad, ffi::Result<ffi::Buffer<ffi::S32>> finite,
                     ffi::Result<ffi::Buffer<ffi::F32>> sum_squares, int64_t handle, int64_t offset, bool norm) {
  constexpr const char* kOp = "nsp_gradient_stage";
  auto type = ffi_common::GradTypeOf(kOp, grad);
  if (type.has_error()) return type.error();
  const int64_t n = static_cast<int64_t>(grad.element_count());
  auto stage = StageOf(kOp, handle, offset, n);
  if (stage.has_error()) return stage.error();
  if (norm) {  // the leaf's share of the global norm, and whether it is finite, in one pass
    const double sum = SumOfSquares(grad.untyped_data(), *type, n);
    finite->typed_data()[0] = std::isfinite(sum) ? 1 : 0;
    sum_squares->typed_data()[0] = static_cast<float>(sum);
  } else {
    finite->typed_data()[0] = AllFinite(grad.untyped_data(), *type, n) ? 1 : 0;
    sum_squares->typed_data()[0] = 0.0f;
  }
  if (std::string e = (*stage)->Write(offset, grad.untyped_data(), n, GradBytes(*type)); !e.empty()) {
    return Invalid(kOp, e);
  }
  return ffi::Error::Success();
}

ffi::Error LoadImpl(ffi::Buffer<ffi::S32> /*after*/, ffi::RemainingArgs /*also_after*/,
                    ffi::Result<ffi::AnyBuffer> leaf, int64_t handle, int64_t offset) {
  constexpr const char* kOp = "nsp_gradient_stage_load";
  auto type = ffi_common::GradTypeOf(kOp, *leaf);
  if (type.has_error()) return type.error();
  const int64_t n = static_cast<int64_t>(leaf->element_count());
  auto stage = StageOf(kOp, handle, offset, n);
  if (stage.has_error()) return stage.error();
  if (std::string e = (*stage)->Read(offset, leaf->untyped_data(), n, GradBytes(*type)); !e.empty()) {
    return Invalid(kOp, e);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nsp

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspGradientStage, nsp::StageImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()               // one gradient leaf
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()   // finite: 1 or 0
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // sum of squares (with norm)
                                  .Attr<int64_t>("handle")
                                  .Attr<int64_t>("offset")
                                  .Attr<bool>("norm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspGradientStageLoad, nsp::LoadImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // the update's version (ordering)
                                  .RemainingArgs()                          // more to run after (never read)
                                  .Ret<xla::ffi::AnyBuffer>()               // the leaf's new params
                                  .Attr<int64_t>("handle")
                                  .Attr<int64_t>("offset"));
