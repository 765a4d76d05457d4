// Dispatch of the update kernels: derives per-call coefficients, picks the AVX-512, AVX2 or portable block kernel
// once per process, splits the state across the thread pool, and for compressed gradients scatters each block's
// (index, value) pairs into a stack buffer right before that block is updated.
#include "kernels/update_kernel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "kernels/kernel_block.h"
#include "util/thread_pool.h"

namespace nsp {
namespace {

using internal::Block;
using internal::BlockKernel;
using internal::Coefficients;

// Elements per block of a compressed update (decompressed into it: 8 KiB of fp32 gradient stays in L1 while the
// block is updated) or of a checked one (a block with a NaN/Inf stops the rest of the update).
constexpr int64_t kSparseBlock = 2048;
// Below this many elements per task, splitting across threads costs more than it saves.
constexpr int64_t kMinPerTask = 1 << 16;

enum class Isa : int { kPortable = 0, kAvx2Fma = 1, kAvx512 = 2 };
constexpr const char* kIsaNames[] = {"portable", "avx2-fma", "avx512"};
constexpr int kNumIsas = 3;

// Returns the CPU features `isa`'s kernels are compiled for that this CPU lacks, separated by ", "; empty when it
// has them all. __builtin_cpu_supports also checks that the OS saves the registers (XSAVE's AVX and AVX-512
// state): a feature the OS leaves off counts as absent, so no kernel can fault on an unknown instruction.
std::string MissingFeatures(Isa isa) {
  if (isa == Isa::kPortable) return {};
#if (defined(__x86_64__) || defined(__i386__)) && !defined(NSP_NO_AVX2)
  __builtin_cpu_init();
  std::string missing;
  auto need = [&](bool has, const char* name) {
    if (!has) missing += (missing.empty() ? "" : ", ") + std::string(name);
  };
  if (isa == Isa::kAvx2Fma) {
    need(__builtin_cpu_supports("avx2"), "avx2");
    need(__builtin_cpu_supports("fma"), "fma");
  } else {
    need(__builtin_cpu_supports("avx512f"), "avx512f");
    need(__builtin_cpu_supports("avx512bw"), "avx512bw");
    need(__builtin_cpu_supports("avx512vl"), "avx512vl");
    need(__builtin_cpu_supports("avx512dq"), "avx512dq");
    need(__builtin_cpu_supports("fma"), "fma");
  }
  return missing;
#else
  return "an x86-64 build";
#endif
}

struct IsaChoice {
  Isa isa = Isa::kPortable;
  bool avx512_bf16 = false;  // AVX512_BF16's conversion instruction writes the bf16 param copies
  std::string error;         // a bad NSP_KERNEL_ISA; the kernels then run the best ISA the CPU has
};

// The best ISA the CPU has, unless NSP_KERNEL_ISA names another one it has.
IsaChoice ChooseIsa() {
  IsaChoice out;
  for (int i = kNumIsas - 1; i > 0; --i) {
    if (MissingFeatures(static_cast<Isa>(i)).empty()) {
      out.isa = static_cast<Isa>(i);
      break;
    }
  }
#if (defined(__x86_64__) || defined(__i386__)) && !defined(NSP_NO_AVX2)
  out.avx512_bf16 = out.isa == Isa::kAvx512 && __builtin_cpu_supports("avx512bf16");
#endif
  const char* env = std::getenv("NSP_KERNEL_ISA");
  if (env == nullptr || *env == '\0') return out;
  std::string supported;
  for (int i = 0; i < kNumIsas; ++i) {
    if (MissingFeatures(static_cast<Isa>(i)).empty()) supported += (i ? ", " : "") + std::string(kIsaNames[i]);
  }
  for (int i = 0; i < kNumIsas; ++i) {
    if (std::strcmp(env, kIsaNames[i]) != 0) continue;
    const std::string missing = MissingFeatures(static_cast<Isa>(i));
    if (!missing.empty()) {
      out.error = "NSP_KERNEL_ISA='" + std::string(env) + "' asks for kernels this CPU cannot run: it lacks " +
                  missing + " (it can run: " + supported + ")";
      return out;
    }
    out.isa = static_cast<Isa>(i);
    out.avx512_bf16 = out.avx512_bf16 && out.isa == Isa::kAvx512;
    return out;
  }
  out.error = "NSP_KERNEL_ISA='" + std::string(env) + "' is not one of portable, avx2-fma, avx512 (this CPU can run: " +
              supported + ")";
  return out;
}

// Read once, at first use; never freed (kernels may run from threads alive at exit).
const IsaChoice& Choice() {
  static const IsaChoice* choice = new IsaChoice(ChooseIsa());
  return *choice;
}

// Out-of-place outputs (the memory tier's other version slot, a fresh params copy) are written with streaming
// stores, whole 64-byte lines at a time: their lines are not read first, so the two-slot update moves 28 B/param
// like an in-place one instead of 40. NSP_STREAMING_STORES=0 turns them off (plain stores), to compare.
const bool kStreamingStores = [] {
  const char* env = std::getenv("NSP_STREAMING_STORES");
  return env == nullptr || std::string(env) != "0";
}();

// Tuning knobs, read once, for measuring the kernel's hypotheses (bench/kernel_sweep.py --hypotheses); the
// defaults are what those measurements supported on the machines the record names.
int64_t EnvInt(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  return (end != env && *end == '\0' && v >= lo && v <= hi) ? v : fallback;
}

// NSP_KERNEL_PREFETCH: software prefetch distance in elements on every input stream (0: none; default 512, 2 KiB
// of fp32: one core alone cannot keep enough loads in flight without it).
const int32_t kPrefetch = static_cast<int32_t>(EnvInt("NSP_KERNEL_PREFETCH", 512, 0, 1 << 16));

// NSP_KERNEL_PREFETCH_LEVEL: the cache level that prefetch fills, 1 (L1, default), 2 (L2) or 3 (last level).
const int32_t kPrefetchLevel = static_cast<int32_t>(EnvInt("NSP_KERNEL_PREFETCH_LEVEL", 1, 1, 3));

// NSP_KERNEL_TASK_ELEMS: elements per task of a pass (0: one task per thread, each a contiguous share; default 1M,
// 4 MiB per fp32 stream). Tasks are taken in turn from a shared counter, so with tasks smaller than a share a
// thread that was descheduled for a while (a virtual CPU) leaves its remaining tasks to the others instead of
// holding up the whole pass. Measured at 64M params on 2 virtual CPUs (bench/results/update_kernel_hypotheses*.json):
// 1M-element tasks ran 1.13x and 1.19x DeepSpeedCPUAdam in two rounds (median over runs) where one share per
// thread ran 1.06x and 1.04x, and their run-to-run spread fell from 12% to 2.5%.
const int64_t kTaskElems = EnvInt("NSP_KERNEL_TASK_ELEMS", int64_t{1} << 20, 0, int64_t{1} << 40);

BlockKernel SelectKernel(const UpdateHyperParams& hp, GradType grad_type) {
  const int bf16 = grad_type == GradType::kBF16 ? 1 : 0, lazy = hp.lazy ? 1 : 0;
  const int32_t k = static_cast<int32_t>(hp.kind);
#if (defined(__x86_64__) || defined(__i386__)) && !defined(NSP_NO_AVX2)
  const IsaChoice& isa = Choice();
  if (isa.isa == Isa::kAvx512) return internal::Avx512Kernel(k, bf16, lazy, isa.avx512_bf16 ? 1 : 0);
  if (isa.isa == Isa::kAvx2Fma) return internal::Avx2Kernel(k, bf16, lazy);
#endif
  return internal::PortableKernel(k, bf16, lazy);
}

// The NaN/Inf scan of the chosen ISA (kernel_block.h).
using FiniteScan = bool (*)(const void* data, int bf16, int64_t n);

FiniteScan SelectFiniteScan() {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(NSP_NO_AVX2)
  if (Choice().isa == Isa::kAvx512) return internal::Avx512AllFinite;
  if (Choice().isa == Isa::kAvx2Fma) return internal::Avx2AllFinite;
#endif
  return internal::PortableAllFinite;
}

// Streaming stores are weakly ordered: every task fences once after its last block, before the thread pool hands
// its outputs to anyone (a later plain store to the same place included). Not once per block: a fence waits for
// every write-combining buffer to drain, and per 2048-element block that stall cost ~10% of the update here.
void FenceStreamingStores(const Coefficients& c) {
#if defined(__x86_64__) || defined(__i386__)
  if (c.streaming) _mm_sfence();
#else
  (void)c;
#endif
}

Coefficients MakeCoefficients(const UpdateHyperParams& hp) {
  Coefficients c{};
  c.kind = static_cast<int32_t>(hp.kind);
  c.streaming = kStreamingStores ? 1 : 0;
  c.prefetch = kPrefetch;
  c.prefetch_level = kPrefetchLevel;
  c.lr = hp.lr;
  c.eps = static_cast<float>(hp.eps);
  switch (hp.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      c.mu_a = static_cast<float>(hp.b1);
      c.mu_b = static_cast<float>(1.0 - hp.b1);
      c.nu_a = static_cast<float>(hp.b2);
      c.nu_b = static_cast<float>(1.0 - hp.b2);
      // Bias corrections in double, then rounded once: 1 - b^t loses digits in float.
      const double t = static_cast<double>(hp.step);
      c.inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(hp.b1, t)));
      c.inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(hp.b2, t)));
      if (hp.kind == OptimizerKind::kAdam) c.l2 = static_cast<float>(hp.weight_decay);
      else c.decoupled_wd = static_cast<float>(hp.weight_decay);
      break;
    }
    case OptimizerKind::kSgd:
      c.l2 = static_cast<float>(hp.weight_decay);
      c.momentum = static_cast<float>(hp.momentum);
      c.sgd_has_momentum = hp.momentum != 0.0;
      c.nesterov = hp.nesterov;
      break;
    case OptimizerKind::kAdagrad:
      c.l2 = static_cast<float>(hp.weight_decay);
      c.nu_a = 1.0f;
      c.nu_b = 1.0f;
      break;
  }
  return c;
}

// Splits [0, size) into ranges whose boundaries are multiples of kSparseBlock: one per thread (at most
// GetNumThreads()), or tasks of about kTaskElems when that is set and smaller.
struct Split {
  int num_tasks;
  int64_t chunk;
};

Split SplitWork(int64_t size) {
  const int64_t max_tasks = std::max<int64_t>(1, std::min<int64_t>(GetNumThreads(), size / kMinPerTask));
  int64_t chunk = (size + max_tasks - 1) / max_tasks;
  if (kTaskElems > 0 && max_tasks > 1) chunk = std::min(chunk, std::max(kTaskElems, kMinPerTask));
  chunk = (chunk + kSparseBlock - 1) / kSparseBlock * kSparseBlock;
  const int num_tasks = static_cast<int>(std::max<int64_t>(1, (size + chunk - 1) / chunk));
  return {num_tasks, chunk};
}

Block SliceBlock(const StateSpan& s, int64_t begin, int64_t n, const void* grad) {
  auto at = [begin](auto* ptr) { return ptr == nullptr ? nullptr : ptr + begin; };
  return Block{at(s.param_in), at(s.param_out),      at(s.mu_in),          at(s.mu_out), at(s.nu_in),
               at(s.nu_out),   at(s.param_bf16_out), at(s.param_copy_out), grad,         n};
}

// KernelTime's counters, and the scope that adds one call's wall time to them.
std::atomic<int64_t> g_kernel_calls{0};
std::atomic<int64_t> g_kernel_ns{0};

class KernelCall {
 public:
  KernelCall() : start_(std::chrono::steady_clock::now()) {}
  ~KernelCall() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_);
    g_kernel_ns.fetch_add(ns.count(), std::memory_order_relaxed);
    g_kernel_calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

float ValueAt(const void* values, GradType type, int64_t j) {
  return type == GradType::kF32 ? static_cast<const float*>(values)[j]
                                : internal::WidenBf16(static_cast<const uint16_t*>(values)[j]);
}

}  // namespace

bool UsesMu(const UpdateHyperParams& hp) {
  return hp.kind == OptimizerKind::kAdam || hp.kind == OptimizerKind::kAdamW ||
         (hp.kind == OptimizerKind::kSgd && hp.momentum != 0.0);
}

bool UsesNu(const UpdateHyperParams& hp) { return hp.kind != OptimizerKind::kSgd; }

std::string ValidateHyperParams(const UpdateHyperParams& hp) {
  std::ostringstream err;
  const int k = static_cast<int>(hp.kind);
  if (k < 0 || k > 3) err << "unknown optimizer kind " << k;
  else if (hp.step < 1) err << "step must be >= 1 (the 1-based number of this update), got " << hp.step;
  else if (!(hp.b1 >= 0.0 && hp.b1 < 1.0)) err << "b1 must be in [0, 1), got " << hp.b1;
  else if (!(hp.b2 >= 0.0 && hp.b2 < 1.0)) err << "b2 must be in [0, 1), got " << hp.b2;
  else if (!(hp.eps >= 0.0)) err << "eps must be >= 0, got " << hp.eps;
  else if (!(hp.weight_decay >= 0.0)) err << "weight_decay must be >= 0, got " << hp.weight_decay;
  else if (!(hp.momentum >= 0.0)) err << "momentum must be >= 0, got " << hp.momentum;
  return err.str();
}

std::string ValidateSparseIndices(const int32_t* indices, int64_t count, int64_t size) {
  int64_t prev = 0;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t idx = indices[j];
    if (idx < 0 || idx >= size) {
      std::ostringstream err;
      err << "index " << idx << " at position " << j << " is out of range for a parameter of " << size
          << " elements";
      return err.str();
    }
    if (idx < prev) {
      std::ostringstream err;
      err << "indices must be sorted ascending: index " << idx << " at position " << j << " follows " << prev;
      return err.str();
    }
    prev = idx;
  }
  return {};
}

void UpdateDense(const UpdateHyperParams& hp, const StateSpan& span, const void* grad, GradType grad_type) {
  if (span.size == 0) return;
  const KernelCall timed;
  const Coefficients c = MakeCoefficients(hp);
  const BlockKernel kernel = SelectKernel(hp, grad_type);
  const int64_t gbytes = GradBytes(grad_type);
  const Split split = SplitWork(span.size);
  ParallelFor(split.num_tasks, [&](int t) {
    const int64_t begin = t * split.chunk;
    const int64_t n = std::min(split.chunk, span.size - begin);
    kernel(c, SliceBlock(span, begin, n, static_cast<const char*>(grad) + begin * gbytes));
    FenceStreamingStores(c);
  });
}

void UpdateSparse(const UpdateHyperParams& hp, const StateSpan& span, const int32_t* indices, const void* values,
                  GradType value_type, int64_t count, int64_t index_base) {
  if (span.size == 0) return;
  const KernelCall timed;
  const Coefficients c = MakeCoefficients(hp);
  const BlockKernel kernel = SelectKernel(hp, GradType::kF32);  // blocks are decompressed to fp32
  const Split split = SplitWork(span.size);
  ParallelFor(split.num_tasks, [&](int t) {
    const int64_t begin = t * split.chunk;
    const int64_t end = std::min(begin + split.chunk, span.size);
    // Indices are sorted, so this task's pairs are one contiguous run starting here.
    int64_t j = std::lower_bound(indices, indices + count, begin + index_base) - indices;
    // Zeroed once; after each block only the entries it set are cleared again (a few dozen at 1% density,
    // instead of re-zeroing the whole block).
    alignas(64) float dense[kSparseBlock] = {};
    for (int64_t block = begin; block < end; block += kSparseBlock) {
      const int64_t n = std::min(kSparseBlock, end - block);
      const int64_t base = block + index_base;
      const int64_t first = j;
      for (; j < count && indices[j] < base + n; ++j) dense[indices[j] - base] += ValueAt(values, value_type, j);
      kernel(c, SliceBlock(span, block, n, dense));
      for (int64_t r = first; r < j; ++r) dense[indices[r] - base] = 0.0f;
    }
    FenceStreamingStores(c);
  });
}

void StreamRoofline(float* p, const float* g, float* m, float* v, int64_t size) {
  const Split split = SplitWork(size);
  ParallelFor(split.num_tasks, [&](int t) {
    const int64_t begin = t * split.chunk;
    const int64_t n = std::min(split.chunk, size - begin);
#if (defined(__x86_64__) || defined(__i386__)) && !defined(NSP_NO_AVX2)
    if (Choice().isa == Isa::kAvx512) {
      internal::Avx512Stream(p + begin, g + begin, m + begin, v + begin, n);
      return;
    }
    if (Choice().isa == Isa::kAvx2Fma) {
      internal::Avx2Stream(p + begin, g + begin, m + begin, v + begin, n);
      return;
    }
#endif
    internal::PortableStream(p + begin, g + begin, m + begin, v + begin, n);
  });
}

bool AllFinite(const void* data, GradType type, int64_t n) {
  if (n <= 0) return true;  // an empty leaf (SplitWork needs at least one element)
  const int bf16 = type == GradType::kBF16 ? 1 : 0;
  const FiniteScan scan = SelectFiniteScan();
  const Split split = SplitWork(n);
  std::atomic<bool> bad{false};
  ParallelFor(split.num_tasks, [&](int t) {
    const int64_t begin = t * split.chunk;
    const int64_t count = std::min(n, begin + split.chunk) - begin;
    if (!scan(static_cast<const char*>(data) + begin * GradBytes(type), bf16, count)) {
      bad.store(true, std::memory_order_relaxed);
    }
  });
  return !bad.load();
}

bool UpdateDenseIfFinite(const UpdateHyperParams& hp, const StateSpan& span, const void* grad, GradType grad_type) {
  if (span.size == 0) return true;
  const KernelCall timed;
  const Coefficients c = MakeCoefficients(hp);
  const BlockKernel kernel = SelectKernel(hp, grad_type);
  const int64_t gbytes = GradBytes(grad_type);
  const Split split = SplitWork(span.size);
  std::atomic<bool> bad{false};
  ParallelFor(split.num_tasks, [&](int t) {
    const int64_t end = std::min(span.size, (t + 1) * split.chunk);
    for (int64_t block = t * split.chunk; block < end; block += kSparseBlock) {
      const int64_t n = std::min(kSparseBlock, end - block);
      // The kernel tests the gradient as it loads it; the block's outputs are written either way, which the
      // caller allows (see the declaration), so a bad block only stops the rest.
      if (bad.load(std::memory_order_relaxed) ||
          !kernel(c, SliceBlock(span, block, n, static_cast<const char*>(grad) + block * gbytes))) {
        bad.store(true, std::memory_order_relaxed);
        break;
      }
    }
    FenceStreamingStores(c);
  });
  return !bad.load();
}

KernelClock KernelTime() {
  return KernelClock{g_kernel_calls.load(std::memory_order_relaxed), g_kernel_ns.load(std::memory_order_relaxed)};
}

const char* KernelIsa() { return kIsaNames[static_cast<int>(Choice().isa)]; }

const std::string& KernelIsaError() { return Choice().error; }

}  // namespace nsp
