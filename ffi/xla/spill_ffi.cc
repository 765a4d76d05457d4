// The XLA FFI handlers of activation offload (nsp.offload): nsp_spill_save pushes a layer's residuals onto its
// call site's stack in the spill area in the forward pass and returns the entry's depth as a token;
// nsp_spill_load pops them in the backward pass. The load takes the token (so it follows its save, and names the
// entry it expects) and the backward's cotangent at that layer (so XLA cannot run it before the backward gets
// there: a data dependency, never read). Both have side effects: XLA keeps them and their order. Each device
// has its own stacks (the stack id is the call site and the device ordinal): a data-parallel step's replicas
// push and pop at once, each its own.
#include <string>
#include <utility>
#include <vector>

#include "offload/spill_area.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace nsp::spill {
namespace {

ffi::Error Invalid(const char* op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

// The stack of call site `slot` on device `device`.
int64_t StackOf(int64_t slot, int32_t device) { return slot * 4096 + device; }

ffi::ErrorOr<std::shared_ptr<SpillArea>> AreaOf(const char* op, int64_t id) {
  auto area = Areas().Find(id);
  if (!area) return ffi::Unexpected(Invalid(op, "spill area " + std::to_string(id) + " is closed"));
  return area;
}

size_t ElemBytes(const ffi::AnyBuffer& a) {
  return a.element_count() ? a.size_bytes() / a.element_count() : 0;
}

ffi::Error SaveImpl(int32_t device, ffi::RemainingArgs arrays, ffi::Result<ffi::Buffer<ffi::S32>> token,
                    int64_t area_id, int64_t slot, bool sparse) {
  constexpr const char* kOp = "nsp_spill_save";
  auto area = AreaOf(kOp, area_id);
  if (area.has_error()) return area.error();
  std::vector<SpillArray> parts;
  for (size_t i = 0; i < arrays.size(); ++i) {
    auto a = arrays.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    parts.push_back({a->untyped_data(), a->size_bytes(), ElemBytes(*a), sparse});
  }
  if (std::string err = (*area)->Save(StackOf(slot, device), parts, token->typed_data()); !err.empty()) {
    return ffi::Error::Internal(std::string(kOp) + ": " + err);
  }
  return ffi::Error::Success();
}

ffi::Error LoadImpl(int32_t device, ffi::Buffer<ffi::S32> token, ffi::AnyBuffer /*after*/,
                    ffi::RemainingRets arrays, int64_t area_id, int64_t slot) {
  constexpr const char* kOp = "nsp_spill_load";
  auto area = AreaOf(kOp, area_id);
  if (area.has_error()) return area.error();
  if (token.element_count() != 1) return Invalid(kOp, "the token must be a scalar");
  std::vector<SpillOut> parts;
  for (size_t i = 0; i < arrays.size(); ++i) {
    auto a = arrays.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    parts.push_back({(*a)->untyped_data(), (*a)->size_bytes(), ElemBytes(**a)});
  }
  if (std::string err = (*area)->Load(StackOf(slot, device), token.typed_data()[0], parts); !err.empty()) {
    return ffi::Error::Internal(std::string(kOp) + ": " + err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nsp::spill

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspSpillSave, nsp::spill::SaveImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("area")
                                  .Attr<int64_t>("slot")
                                  .Attr<bool>("sparse"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspSpillLoad, nsp::spill::LoadImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<int64_t>("area")
                                  .Attr<int64_t>("slot"));
