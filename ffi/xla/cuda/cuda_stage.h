// The CUDA side of the store update's XLA FFI targets (ffi/xla/cuda/cuda_stage.cc): what the Python module exposes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/api.h"

// The store update's targets for the CUDA platform: each stages its operands from device memory into reused
// pinned host buffers on the handler's stream, runs the CPU handler of the same name on them, and copies the
// results back up (ffi/xla/cuda/cuda_stage.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdateDenseCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdateSparseCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdatePiecesCuda);
// The same handlers for a platform without a stream (the CPU, with the CUDA entry points of the software model:
// "device" pointers are then host memory). They wait for their copies up before returning, since a CPU
// consumer of their results is not ordered after a stream.
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdateDenseCudaHost);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdateSparseCudaHost);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdatePiecesCudaHost);

namespace nsp::cuda {

// Counters of the CUDA handlers since the process started: what they allocated, copied and waited for.
std::vector<std::pair<std::string, int64_t>> Stats();

}  // namespace nsp::cuda
