// XLA FFI handlers of the staged gradient (engine/gradient_stage.h): a step that never holds its whole gradient.
//
// nsp_gradient_stage writes one gradient leaf into its shard's stage file, at the leaf's place in the shard,
// as soon as the backward pass has produced it (the leaf's buffer is then free), and returns whether the leaf
// is finite (s32[]: 1 or 0): the store update (nsp_store_update_staged, store_update_ffi.cc) takes the AND of
// those as its apply operand, so it runs after every leaf is staged. nsp_gradient_stage_load reads one leaf of
// the new params back from the stage file, where the update wrote them over the gradient; it takes the
// update's version result (never read) so that it runs after the update. Both have side effects.
//
// Attributes: handle (the shard's engine), offset (the leaf's first element in the shard).
#include <string>

#include "engine/engine_registry.h"
#include "engine/store_engine.h"
#include "xla/ffi/api/ffi.h"
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

ffi::Error StageImpl(ffi::AnyBuffer grad, ffi::Result<ffi::Buffer<ffi::S32>> finite, int64_t handle,
                     int64_t offset) {
  constexpr const char* kOp = "nsp_gradient_stage";
  auto type = ffi_common::GradTypeOf(kOp, grad);
  if (type.has_error()) return type.error();
  const int64_t n = static_cast<int64_t>(grad.element_count());
  auto stage = StageOf(kOp, handle, offset, n);
  if (stage.has_error()) return stage.error();
  finite->typed_data()[0] = AllFinite(grad.untyped_data(), *type, n) ? 1 : 0;
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
                                  .Attr<int64_t>("handle")
                                  .Attr<int64_t>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspGradientStageLoad, nsp::LoadImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // the update's version (ordering)
                                  .RemainingArgs()                          // more to run after (never read)
                                  .Ret<xla::ffi::AnyBuffer>()               // the leaf's new params
                                  .Attr<int64_t>("handle")
                                  .Attr<int64_t>("offset"));
