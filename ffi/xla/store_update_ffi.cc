// XLA FFI handlers that hand one device's gradient shard to its own store shard and return the new params.
//
// Called inside shard_map, so each device's call sees only its shard: operand `shard` (from
// jax.lax.axis_index) picks the engine among the store's `handles`. The call reads committed version `version`,
// runs the engine (pages streamed through the tier's buffers, params first), syncs, commits version + 1 and
// returns the new params (fp32, and optionally bf16) plus the new version. It has side effects (the store
// changes), so JAX must mark it side-effecting.
//
// Operands: lr f32[], step s32[], version s32[], shard s32[], apply s32[] (0: the gradient is not finite, skip
// the step and hand back the committed params), adopt s32[] (1: start the step from the caller's params, given
// last, instead of from the committed version's), then grad (f32|bf16)[n] (dense target) or
// values (f32|bf16)[k] + indices s32[k] (sparse target; shard positions, sorted), then none or all of the
// params tree's leaves (f32|bf16, the whole tree on every device; read only when adopt is 1).
// Results: params f32[n] (or bf16[n] alone), version s32[], [params_bf16 bf16[n]]. Attributes: handles (one
// engine handle per shard), staleness, and hyper, the hyperparameters other than lr and step as one dictionary
// (hyper_params.h).
//
// A third target (single-shard stores) takes the gradient as the params tree's leaves instead of one flat
// vector: operands lr, step, version, shard, apply, adopt, then one (f32|bf16) buffer per leaf in the layout's
// order, then none or all of the params leaves;
// results version s32[], then the leaves' new params in the same dtypes. Python aliases each result to its
// gradient operand, so the update neither concatenates the gradient nor allocates the params it returns.
// Its apply operand may be -1: the engine then checks the leaves for NaN/Inf itself: inside the update's own
// pass on a two-slot memory store (a non-finite gradient leaves the committed slot whole), else in one
// vectorised pass before it (XLA:CPU's reduction over a standalone gradient ran at a quarter of memory speed).
//
// A fourth target (nsp_store_update_staged) reads the gradient from the shard's stage file instead of from
// operands, and writes the new params over it there (gradient_stage_ffi.cc stages the leaves and reads them back).
//
// The handlers only decode their operands: which of step, skip or background step runs, and the checks of the
// version and of the gradient's finiteness, are the engine's one door (ShardEngine::RunStep), which the module's
// eager ShardEngine.step goes through as well.
#include <memory>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

#include "engine/engine_registry.h"
#include "engine/store_engine.h"
#include "xla/ffi_common.h"

namespace nsp {
namespace {

constexpr char kOp[] = "nsp.store_update";

using ffi_common::Invalid;

struct Call {
  std::shared_ptr<ShardEngine> engine;  // held while the call runs: a store closed meanwhile cannot free it
  ShardUpdate update;
  ParamsIn params_in;  // the caller's params when the step adopts them (RunStep points update.params_in here)
  StepCall step;       // the version read and what the apply operand says of the gradient
  bool adopts() const { return !params_in.leaves.empty(); }  // the step starts from the caller's params
};

// The apply operand: 1 the gradient is finite, 0 it is not (skip the step), -1 the engine checks it.
GradCheck GradCheckOf(int32_t apply) {
  return apply < 0 ? GradCheck::kCheck : apply == 0 ? GradCheck::kNotFinite : GradCheck::kFinite;
}

// The scalar operands every target takes first.
struct Scalars {
  ffi::Buffer<ffi::F32> lr;
  ffi::Buffer<ffi::S32> step, version, shard, apply, adopt;
};

// The engine of store shard `shard` and the update's hyperparameters: what every target starts from.
ffi::ErrorOr<Call> StartCall(const Scalars& in, ffi::Span<const int64_t> handles, ffi::Dictionary hyper) {
  const auto& [lr, step, version, shard, apply, adopt] = in;
  const int32_t s = shard.typed_data()[0];
  if (s < 0 || static_cast<size_t>(s) >= handles.size()) {
    return ffi::Unexpected(Invalid(kOp, "shard " + std::to_string(s) + " is not one of the store's " +
                                            std::to_string(handles.size()) + " shards"));
  }
  std::string why;
  std::shared_ptr<ShardEngine> engine = FindEngine(handles[s], &why);
  if (engine == nullptr) return ffi::Unexpected(Invalid(kOp, why));
  auto hp = ffi_common::HyperParams(kOp, lr, step, hyper);
  if (hp.has_error()) return ffi::Unexpected(hp.error());
  Call call{std::move(engine), {}, {}, {}};
  call.step.version = version.typed_data()[0];
  call.step.grad_check = GradCheckOf(apply.typed_data()[0]);
  call.update.hp = *hp;
  return call;
}

// Operands [first, first + leaves) of `args` are the params leaves; when `adopt` is set, the step starts from
// them (call.params_in). Every device holds the whole tree: this shard's elements start at shard x shard size.
ffi::Error TakeParams(Call& call, const Scalars& in, ffi::RemainingArgs args, size_t first, size_t leaves) {
  if (in.adopt.typed_data()[0] == 0) return ffi::Error::Success();
  if (leaves == 0) return Invalid(kOp, "adopt is set but no params were given");
  ParamsIn& p = call.params_in;
  for (size_t i = first; i < first + leaves; ++i) {
    auto leaf = args.get<ffi::AnyBuffer>(i);
    if (leaf.has_error()) return leaf.error();
    auto type = ffi_common::GradTypeOf(kOp, *leaf);
    if (type.has_error()) return type.error();
    if (i > first && *type != p.type) {
      return Invalid(kOp, "the params leaves must share one dtype (float32 or bfloat16)");
    }
    p.type = *type;
    p.leaves.push_back(leaf->untyped_data());
    p.sizes.push_back(static_cast<int64_t>(leaf->element_count()));
  }
  p.offset = static_cast<int64_t>(in.shard.typed_data()[0]) * call.engine->size();
  if (std::string err = p.Finalize(); !err.empty()) return Invalid(kOp, err);
  return ffi::Error::Success();
}

// Runs the call's step through the engine's one door (skip, step or background step, as the engine decides) and
// returns the version it leaves committed (with staleness, the one its background step will commit: what the
// caller reads next). `call` is in its final place here, so the update may point at the params it holds.
ffi::ErrorOr<int32_t> RunStep(Call& call, int32_t staleness) {
  if (call.adopts()) call.update.params_in = &call.params_in;
  call.step.staleness = staleness;
  StepOutcome outcome;
  if (std::string err = call.engine->RunStep(call.update, call.step, &outcome); !err.empty()) {
    return ffi::Unexpected(Invalid(kOp, err));
  }
  return static_cast<int32_t>(outcome.version);
}

// What the dense and sparse targets start from: the call (StartCall), its params results, the caller's params
// when the step adopts them, and the gradient's dtype from `grad` (the dense gradient, or the sparse values).
ffi::ErrorOr<Call> Prepare(const Scalars& scalars, const ffi::AnyBuffer& grad, ffi::RemainingArgs params_in,
                           ffi::Result<ffi::AnyBuffer> params, ffi::RemainingRets extra,
                           ffi::Span<const int64_t> handles, ffi::Dictionary hyper) {
  auto started = StartCall(scalars, handles, hyper);
  if (started.has_error()) return started;
  Call call = *started;
  const int64_t n = call.engine->size();
  if (static_cast<int64_t>(params->element_count()) != n) {
    return ffi::Unexpected(Invalid(kOp, "the params result has " + std::to_string(params->element_count()) +
                                            " elements, the shard " + std::to_string(n)));
  }
  // The params result in float32, or in bfloat16 alone (bf16 params: half the bytes, and no float32 copy).
  if (params->element_type() == ffi::DataType::F32) {
    call.update.params_out = static_cast<float*>(params->untyped_data());
    auto bf16 = ffi_common::OptionalBf16Result(kOp, extra, 1, n,
                                               "the bf16 params result must be bfloat16 with one element per shard "
                                               "element");
    if (bf16.has_error()) return ffi::Unexpected(bf16.error());
    call.update.params_bf16_out = *bf16;
  } else if (params->element_type() == ffi::DataType::BF16 && extra.size() == 1) {
    call.update.params_bf16_out = static_cast<uint16_t*>(params->untyped_data());
  } else {
    return ffi::Unexpected(Invalid(kOp, "the params result must be float32 (optionally with a bfloat16 copy) or "
                                        "bfloat16 alone"));
  }
  if (ffi::Error e = TakeParams(call, scalars, params_in, 0, params_in.size()); e.failure()) {
    return ffi::Unexpected(e);
  }
  auto type = ffi_common::GradTypeOf(kOp, grad);
  if (type.has_error()) return ffi::Unexpected(type.error());
  call.update.grad_type = *type;
  return call;
}

ffi::Error Finish(Call& call, ffi::RemainingRets extra, int32_t staleness) {
  auto committed = RunStep(call, staleness);
  if (committed.has_error()) return committed.error();
  auto version_out = extra.get<ffi::Buffer<ffi::S32>>(0);
  if (version_out.has_error()) return version_out.error();
  (*version_out)->typed_data()[0] = *committed;
  return ffi::Error::Success();
}

ffi::Error DenseImpl(ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::S32> version,
                     ffi::Buffer<ffi::S32> shard, ffi::Buffer<ffi::S32> apply, ffi::Buffer<ffi::S32> adopt,
                     ffi::AnyBuffer grad, ffi::RemainingArgs params_in, ffi::Result<ffi::AnyBuffer> params,
                     ffi::RemainingRets extra, ffi::Span<const int64_t> handles, int32_t staleness,
                     ffi::Dictionary hyper) {
  auto call = Prepare({lr, step, version, shard, apply, adopt}, grad, params_in, params, extra, handles, hyper);
  if (call.has_error()) return call.error();
  if (static_cast<int64_t>(grad.element_count()) != call->engine->size()) {
    return Invalid(kOp, "the gradient shard has " + std::to_string(grad.element_count()) +
                            " elements, the store shard " + std::to_string(call->engine->size()));
  }
  call->update.grad = grad.untyped_data();
  return Finish(*call, extra, staleness);
}

ffi::Error SparseImpl(ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::S32> version,
                      ffi::Buffer<ffi::S32> shard, ffi::Buffer<ffi::S32> apply, ffi::Buffer<ffi::S32> adopt,
                      ffi::AnyBuffer values, ffi::Buffer<ffi::S32> indices, ffi::RemainingArgs params_in,
                      ffi::Result<ffi::AnyBuffer> params, ffi::RemainingRets extra, ffi::Span<const int64_t> handles,
                      int32_t staleness, ffi::Dictionary hyper) {
  auto call = Prepare({lr, step, version, shard, apply, adopt}, values, params_in, params, extra, handles, hyper);
  if (call.has_error()) return call.error();
  if (values.element_count() != indices.element_count()) return Invalid(kOp, "values and indices differ in length");
  call->update.values = values.untyped_data();
  call->update.indices = indices.typed_data();
  call->update.count = static_cast<int64_t>(indices.element_count());
  return Finish(*call, extra, staleness);
}

// Runs the call's step on a shard given as pieces (in memory, or in its stage file) and writes the version it
// leaves committed.
ffi::Error RunPieces(Call& call, ShardPieces& pieces, int32_t staleness,
                     ffi::Result<ffi::Buffer<ffi::S32>>& version_out) {
  if (std::string err = pieces.Finalize(call.engine->size()); !err.empty()) return Invalid(kOp, err);
  call.update.grad_type = pieces.type;
  call.update.pieces = &pieces;
  auto committed = RunStep(call, staleness);
  if (committed.has_error()) return committed.error();
  version_out->typed_data()[0] = *committed;
  return ffi::Error::Success();
}

ffi::Error PiecesImpl(ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::S32> version,
                      ffi::Buffer<ffi::S32> shard, ffi::Buffer<ffi::S32> apply, ffi::Buffer<ffi::S32> adopt,
                      ffi::RemainingArgs grads, ffi::Result<ffi::Buffer<ffi::S32>> version_out,
                      ffi::RemainingRets params, ffi::Span<const int64_t> handles, int32_t staleness,
                      ffi::Dictionary hyper) {
  const Scalars scalars{lr, step, version, shard, apply, adopt};
  auto call = StartCall(scalars, handles, hyper);
  if (call.has_error()) return call.error();
  // The gradient leaves, then (optionally) as many params leaves.
  const size_t leaves = params.size();
  if (leaves == 0 || (grads.size() != leaves && grads.size() != 2 * leaves)) {
    return Invalid(kOp, "one gradient leaf per params leaf is needed (and optionally the params leaves), got " +
                            std::to_string(grads.size()) + " operands for " + std::to_string(leaves) + " leaves");
  }
  if (ffi::Error e = TakeParams(*call, scalars, grads, leaves, grads.size() - leaves); e.failure()) return e;
  ShardPieces pieces;
  for (size_t i = 0; i < leaves; ++i) {
    auto g = grads.get<ffi::AnyBuffer>(i);
    auto p = params.get<ffi::AnyBuffer>(i);
    if (g.has_error()) return g.error();
    if (p.has_error()) return p.error();
    auto type = ffi_common::GradTypeOf(kOp, *g);
    if (type.has_error()) return type.error();
    if (i == 0) pieces.type = *type;
    if (*type != pieces.type || (*p)->element_type() != g->element_type() ||
        (*p)->element_count() != g->element_count()) {
      return Invalid(kOp, "every gradient leaf and its params result must share one dtype (float32 or bfloat16) "
                          "and size");
    }
    pieces.grad.push_back(g->untyped_data());
    pieces.out.push_back((*p)->untyped_data());
    pieces.sizes.push_back(static_cast<int64_t>(g->element_count()));
  }
  return RunPieces(*call, pieces, staleness, version_out);
}

// The staged target: the gradient is in the shard's stage file (gradient_stage_ffi.cc wrote it leaf by leaf),
// and the new params go back there, over it. Operands: the scalars (apply 0 or 1: the stage calls' AND), the
// factor the gradient is scaled by as it is read (f32[]: global-norm clipping; 1: none), then the params
// leaves, which give the leaves' sizes and dtype (the gradient's) and are read only when adopt is 1.
ffi::Error StagedImpl(ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::S32> version,
                      ffi::Buffer<ffi::S32> shard, ffi::Buffer<ffi::S32> apply, ffi::Buffer<ffi::S32> adopt,
                      ffi::Buffer<ffi::F32> grad_scale, ffi::RemainingArgs params,
                      ffi::Result<ffi::Buffer<ffi::S32>> version_out, ffi::Span<const int64_t> handles,
                      int32_t staleness, ffi::Dictionary hyper) {
  const Scalars scalars{lr, step, version, shard, apply, adopt};
  if (apply.typed_data()[0] < 0) return Invalid(kOp, "a staged gradient's apply operand must be 0 or 1");
  auto call = StartCall(scalars, handles, hyper);
  if (call.has_error()) return call.error();
  if (params.size() == 0) return Invalid(kOp, "the staged update needs the params leaves");
  if (ffi::Error e = TakeParams(*call, scalars, params, 0, params.size()); e.failure()) return e;
  ShardPieces pieces;
  GradientStage* stage = nullptr;
  if (std::string e = call->engine->Stage(&stage); !e.empty()) return Invalid(kOp, e);
  pieces.stage = stage;
  pieces.scale = grad_scale.typed_data()[0];
  for (size_t i = 0; i < params.size(); ++i) {
    auto p = params.get<ffi::AnyBuffer>(i);
    if (p.has_error()) return p.error();
    auto type = ffi_common::GradTypeOf(kOp, *p);
    if (type.has_error()) return type.error();
    if (i == 0) pieces.type = *type;
    if (*type != pieces.type) return Invalid(kOp, "the params leaves must share one dtype (float32 or bfloat16)");
    pieces.sizes.push_back(static_cast<int64_t>(p->element_count()));
  }
  return RunPieces(*call, pieces, staleness, version_out);
}

// The scalar operands every target takes first: lr, step, version, shard, apply (the gradient is finite),
// adopt (start from the caller's params).
template <typename Binding>
auto ScalarArgs(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>();
}

template <typename Binding>
auto WithAttrs(Binding binding) {
  return ffi_common::WithHyperParamAttr(std::move(binding)
                                            .template Attr<ffi::Span<const int64_t>>("handles")
                                            .template Attr<int32_t>("staleness"));
}

}  // namespace
}  // namespace nsp

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspStoreUpdateDense, nsp::DenseImpl,
                              nsp::WithAttrs(nsp::ScalarArgs(xla::ffi::Ffi::Bind())
                                                 .Arg<xla::ffi::AnyBuffer>()              // grad
                                                 .RemainingArgs()                         // [params leaves]
                                                 .Ret<xla::ffi::AnyBuffer>()             // params (f32|bf16)
                                                 .RemainingRets()));                      // version, [bf16]

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspStoreUpdateSparse, nsp::SparseImpl,
                              nsp::WithAttrs(nsp::ScalarArgs(xla::ffi::Ffi::Bind())
                                                 .Arg<xla::ffi::AnyBuffer>()              // values
                                                 .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // indices
                                                 .RemainingArgs()                         // [params leaves]
                                                 .Ret<xla::ffi::AnyBuffer>()             // params (f32|bf16)
                                                 .RemainingRets()));                      // version, [bf16]

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspStoreUpdatePieces, nsp::PiecesImpl,
                              nsp::WithAttrs(nsp::ScalarArgs(xla::ffi::Ffi::Bind())
                                                 .RemainingArgs()                         // gradient, [params] leaves
                                                 .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // version
                                                 .RemainingRets()));                      // params leaves

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspStoreUpdateStaged, nsp::StagedImpl,
                              nsp::WithAttrs(nsp::ScalarArgs(xla::ffi::Ffi::Bind())
                                                 .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // gradient scale
                                                 .RemainingArgs()                         // params leaves
                                                 .Ret<xla::ffi::Buffer<xla::ffi::S32>>()));  // version
