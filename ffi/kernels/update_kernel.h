// The near-storage update kernel: one general updater for Adam, AdamW, SGD (momentum, Nesterov) and AdaGrad.
//
// Every optimizer here is a pair of moving averages (AXPBY: a*x + b*y) followed by a parameter step, so one
// streaming pass reads p, g, m, v and writes p, m, v (28 bytes per parameter for fp32 Adam) and optionally a
// bf16 copy of p. Gradients arrive either dense (fp32 or bf16) or Top-K compressed as sorted (index, value)
// pairs; compressed gradients are scattered block by block into a small cache-resident buffer inside the same
// pass, so a dense gradient is never materialised in memory.
//
// This header is plain C++ with no XLA types: the XLA FFI handlers and the storage engine both call it.
#pragma once

#include <cstdint>
#include <string>

namespace nsp {

enum class OptimizerKind : int32_t { kAdam = 0, kAdamW = 1, kSgd = 2, kAdagrad = 3 };

enum class GradType : int32_t { kF32 = 0, kBF16 = 1 };
inline int64_t GradBytes(GradType t) { return t == GradType::kF32 ? 4 : 2; }

// Hyperparameters of one update call. `step` is the 1-based number of this update (bias correction uses b^step).
struct UpdateHyperParams {
  OptimizerKind kind = OptimizerKind::kAdam;
  float lr = 1e-3f;
  int64_t step = 1;
  // Held in double so that coefficients such as 1 - b2 are computed before rounding to float
  // (1 - 0.999f is 1.3e-5 away from 0.001 in relative terms).
  double b1 = 0.9;            // Adam/AdamW: decay of the first moment.
  double b2 = 0.999;          // Adam/AdamW: decay of the second moment.
  double eps = 1e-8;          // Adam/AdamW: added to sqrt(v_hat); AdaGrad: added to v under the square root.
  double weight_decay = 0.0;  // AdamW: decoupled; Adam, SGD, AdaGrad: L2 added to the gradient.
  double momentum = 0.0;      // SGD: momentum (0 = plain SGD, no state).
  bool nesterov = false;      // SGD: Nesterov momentum.
  // Lazy (sparse) update: an element whose gradient is exactly zero keeps its param and states unchanged --
  // no momentum step, no decay of m/v, no weight decay -- as in LazyAdam / SparseAdam. For Top-K compressed
  // gradients: only the sent entries move. Bias correction still uses the global step.
  bool lazy = false;
};

// One contiguous slice of optimizer state. Inputs and outputs may alias (in-place update) or not; they must
// not partially overlap. `mu_*`/`nu_*` may be null for kinds that do not use them; the extra outputs may be null.
struct StateSpan {
  const float* param_in = nullptr;
  float* param_out = nullptr;
  const float* mu_in = nullptr;
  float* mu_out = nullptr;
  const float* nu_in = nullptr;
  float* nu_out = nullptr;
  uint16_t* param_bf16_out = nullptr;
  float* param_copy_out = nullptr;  // a second fp32 destination of the new param (the store's returned params)
  int64_t size = 0;
};

// Which states each kind reads and writes.
bool UsesMu(const UpdateHyperParams& hp);
bool UsesNu(const UpdateHyperParams& hp);

// Returns an empty string when the hyperparameters are usable, else a message naming the problem.
std::string ValidateHyperParams(const UpdateHyperParams& hp);

// Returns an empty string when `indices` are usable for a state of `size` elements (each in [0, size) and
// non-decreasing), else a message naming the first offending position.
std::string ValidateSparseIndices(const int32_t* indices, int64_t count, int64_t size);

// Dense update: `grad` holds span.size elements of `grad_type`.
void UpdateDense(const UpdateHyperParams& hp, const StateSpan& span, const void* grad, GradType grad_type);

// Compressed update: the gradient is zero except at `indices` (validated beforehand with ValidateSparseIndices),
// where it is the sum of the matching `values` (scatter-add semantics: zero-valued padding is harmless).
// Index i addresses element i - index_base of the span, so a page of a larger array can be updated with the
// run of indices that falls inside it; every index must lie in [index_base, index_base + span.size).
void UpdateSparse(const UpdateHyperParams& hp, const StateSpan& span, const int32_t* indices, const void* values,
                  GradType value_type, int64_t count, int64_t index_base = 0);

// A streaming loop that moves the same bytes as a dense fp32 Adam update (reads p, g, m, v; writes p, m, v)
// with trivial arithmetic: the memory roofline the update kernel is measured against.
void StreamRoofline(float* p, const float* g, float* m, float* v, int64_t size);

// Whether every one of the n values (fp32 or bf16) is finite: one multithreaded pass at memory speed.
bool AllFinite(const void* data, GradType type, int64_t n);

// UpdateDense that checks the gradient for NaN/Inf as it goes: the kernel tests each gradient value as it loads
// it, so the check costs neither a pass over memory nor a stall between blocks. Returns false once a block with
// a non-finite value is done (that block's outputs and some others' are then written from it): only for updates
// whose inputs stay intact (another version slot) and whose outputs the caller can restore.
bool UpdateDenseIfFinite(const UpdateHyperParams& hp, const StateSpan& span, const void* grad, GradType grad_type);

// Name of the instruction set the kernels dispatch to on this machine: "avx512" (AVX-512 F/BW/VL/DQ, with
// AVX512_BF16's conversion for the bf16 param copy where present), "avx2-fma" or "portable" -- the best the CPU
// has, or the one NSP_KERNEL_ISA names (read once, at first use).
// The update kernels' own time since the process started: calls of UpdateDense, UpdateSparse and
// UpdateDenseIfFinite (every path: fused_update, the stores' engines) and the wall time spent inside them. It tells
// the kernel's time from a call's overhead around it (a jitted call's dispatch, a store's I/O).
struct KernelClock {
  int64_t calls = 0;
  int64_t nanoseconds = 0;
};
KernelClock KernelTime();

const char* KernelIsa();

// "" when NSP_KERNEL_ISA is unset or names an ISA this CPU can run, else a message naming the problem (an unknown
// name, or the features the CPU lacks). The kernels never run an ISA the CPU lacks: with a bad NSP_KERNEL_ISA
// they run the best one it has, and the Python module refuses to import.
const std::string& KernelIsaError();

}  // namespace nsp
