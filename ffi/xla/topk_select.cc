// XLA FFI handler: exact Top-K by magnitude of one flat vector on the CPU (nsp.primitives.topk, method "auto").
//
// The k entries of largest |x| (ordered as float32 bit patterns, so NaN counts above +inf, as in the jnp paths),
// ties broken towards lower positions (lax.top_k's rule), returned in ascending position order: values in x's
// dtype and int32 positions. Nothing input-sized is allocated: a radix select on the 31 magnitude bits (four
// histogram passes of 8 bits, each over the entries that still match the prefix found so far), then one pass that
// counts and one that writes the kept entries, every pass cut into blocks on the kernels' thread pool. In XLA:CPU
// the same selection written in jnp materialises its masks and conversions (reductions there do not fuse their
// producers): 4 bytes per entry.
//
// nsp_topk_select: operand x f32[n] or bf16[n]; results values (x's dtype)[k], indices s32[k], 1 <= k <= n.
//
// nsp_topk_feedback: Top-K with error feedback in place (nsp.optim.topk_compress on one device): operands the
// residual f32[S * m] (aliased to the first result) and the gradient's leaves (f32 or bf16, in the layout's
// order, covering the residual's first elements; the rest is padding); attributes `shards` (S) and `decay`.
// Adds the gradient into the residual (float32, as `residual + g` rounds), selects the k largest magnitudes of
// each of the S shards, hands them out (values f32[S * k], shard-local indices s32[S * k], shard by shard), and
// leaves in the residual what was not sent, times `decay`. Neither the gradient nor the sum is copied.
#include <algorithm>
#include <functional>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "util/float_mode.h"
#include "util/thread_pool.h"
#include "xla/ffi_common.h"

namespace nsp {
namespace {

using ffi_common::Invalid;

constexpr char kOp[] = "nsp.topk_select";
constexpr int64_t kBlock = 1 << 16;

// |x| as float32 bits: for non-negative floats the integer order is the float order.
inline uint32_t KeyF32(const float* x, int64_t i) {
  uint32_t b;
  std::memcpy(&b, x + i, 4);
  return b & 0x7FFFFFFFu;
}

inline uint32_t KeyBf16(const uint16_t* x, int64_t i) { return (static_cast<uint32_t>(x[i]) << 16) & 0x7FFFFFFFu; }

template <typename KeyOf>
struct Selection {
  const KeyOf& key;
  int64_t n;
  int64_t blocks() const { return (n + kBlock - 1) / kBlock; }

  // The k-th largest key, and how many entries equal to it are kept (the rest of k are above it).
  std::pair<uint32_t, int64_t> KthLargest(int64_t k) const {
    uint32_t prefix = 0, mask = 0;
    int64_t remaining = k;
    const int64_t nb = blocks();
    std::vector<std::array<int64_t, 256>> hist(static_cast<size_t>(nb));
    for (int shift = 24; shift >= 0; shift -= 8) {
      ParallelFor(static_cast<int>(nb), [&](int b) {
        auto& h = hist[static_cast<size_t>(b)];
        h.fill(0);
        const int64_t begin = static_cast<int64_t>(b) * kBlock, end = std::min(n, begin + kBlock);
        for (int64_t i = begin; i < end; ++i) {
          const uint32_t kk = key(i);
          if ((kk & mask) == prefix) ++h[(kk >> shift) & 0xFFu];
        }
      });
      std::array<int64_t, 256> total{};
      for (const auto& h : hist) {
        for (int d = 0; d < 256; ++d) total[d] += h[d];
      }
      int digit = 255;
      for (; digit > 0; --digit) {  // the digit where the remaining count is reached, from the top
        if (total[digit] >= remaining) break;
        remaining -= total[digit];
      }
      prefix |= static_cast<uint32_t>(digit) << shift;
      mask |= 0xFFu << shift;
    }
    return {prefix, remaining};
  }

  template <typename Emit>
  void Write(uint32_t kth, int64_t room, const Emit& emit) const {
    const int64_t nb = blocks();
    std::vector<int64_t> above(static_cast<size_t>(nb)), tied(static_cast<size_t>(nb));
    ParallelFor(static_cast<int>(nb), [&](int b) {
      const int64_t begin = static_cast<int64_t>(b) * kBlock, end = std::min(n, begin + kBlock);
      int64_t a = 0, t = 0;
      for (int64_t i = begin; i < end; ++i) {
        const uint32_t kk = key(i);
        a += kk > kth;
        t += kk == kth;
      }
      above[static_cast<size_t>(b)] = a;
      tied[static_cast<size_t>(b)] = t;
    });
    std::vector<int64_t> out_start(static_cast<size_t>(nb)), tie_start(static_cast<size_t>(nb));
    int64_t out = 0, ties = 0;
    for (int64_t b = 0; b < nb; ++b) {
      out_start[static_cast<size_t>(b)] = out;
      tie_start[static_cast<size_t>(b)] = ties;
      const int64_t taken = std::max<int64_t>(0, std::min(tied[static_cast<size_t>(b)], room - ties));
      out += above[static_cast<size_t>(b)] + taken;
      ties += tied[static_cast<size_t>(b)];
    }
    ParallelFor(static_cast<int>(nb), [&](int b) {
      const int64_t begin = static_cast<int64_t>(b) * kBlock, end = std::min(n, begin + kBlock);
      int64_t slot = out_start[static_cast<size_t>(b)], tie = tie_start[static_cast<size_t>(b)];
      for (int64_t i = begin; i < end; ++i) {
        const uint32_t kk = key(i);
        if (kk > kth || (kk == kth && tie++ < room)) emit(slot++, i);
      }
    });
  }
};

// The fast path: a key above which about 1.5 k entries are expected, from a fixed sample; one pass collects the
// positions of the entries at or above it (in position order, block by block); the exact selection then runs
// on those candidates alone. Exact whenever at least k entries pass the cut (every entry of the top k is then a
// candidate); false when fewer do (ties, skewed data), and the caller takes the full radix select. The candidates
// take about 1.5 k positions of memory: a fraction of the input, never the input's size.
template <typename T, typename KeyOf>
bool SelectFromSample(const T* x, int64_t n, int64_t k, const KeyOf& key, T* values, int32_t* indices) {
  constexpr int64_t kSample = 1 << 15;
  if (n < 8 * kSample || k * 4 > n) return false;
  std::vector<uint32_t> sample(static_cast<size_t>(kSample));
  uint64_t h = 0x9E3779B97F4A7C15ull;
  for (auto& s : sample) {  // splitmix64 positions: spread over rows and columns of any layout
    h += 0x9E3779B97F4A7C15ull;
    uint64_t z = h;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    s = key(static_cast<int64_t>((z ^ (z >> 31)) % static_cast<uint64_t>(n)));
  }
  const double expected = 1.5 * static_cast<double>(k) * kSample / static_cast<double>(n);
  const int64_t hits = std::max<int64_t>(1, std::min<int64_t>(kSample, static_cast<int64_t>(expected)));
  std::nth_element(sample.begin(), sample.begin() + (hits - 1), sample.end(), std::greater<uint32_t>());
  const uint32_t cut = sample[static_cast<size_t>(hits - 1)];
  // A cut on a value many entries share (ties, zeros of a sparse input) would make the candidates most of the
  // input: the full radix select is cheaper then.
  const int64_t at_or_above = std::count_if(sample.begin(), sample.end(), [cut](uint32_t s) { return s >= cut; });
  if (at_or_above > 4 * hits) return false;
  const int64_t nb = (n + kBlock - 1) / kBlock;
  std::vector<std::vector<int32_t>> found(static_cast<size_t>(nb));
  ParallelFor(static_cast<int>(nb), [&](int b) {
    const int64_t begin = static_cast<int64_t>(b) * kBlock, end = std::min(n, begin + kBlock);
    auto& mine = found[static_cast<size_t>(b)];
    for (int64_t i = begin; i < end; ++i) {
      if (key(i) >= cut) mine.push_back(static_cast<int32_t>(i));
    }
  });
  std::vector<int32_t> candidates;
  for (const auto& f : found) candidates.insert(candidates.end(), f.begin(), f.end());
  const int64_t m = static_cast<int64_t>(candidates.size());
  if (m < k) return false;
  const int32_t* pos = candidates.data();
  const auto candidate_key = [&](int64_t j) { return key(pos[j]); };
  Selection<decltype(candidate_key)> sel{candidate_key, m};
  const auto [kth, room] = sel.KthLargest(k);
  sel.Write(kth, room, [&](int64_t slot, int64_t j) {
    values[slot] = x[pos[j]];
    indices[slot] = pos[j];
  });
  return true;
}

template <typename T, typename KeyOf>
void Select(const T* x, int64_t n, int64_t k, const KeyOf& key, T* values, int32_t* indices) {
  if (SelectFromSample(x, n, k, key, values, indices)) return;
  Selection<KeyOf> sel{key, n};
  const auto [kth, room] = sel.KthLargest(k);
  sel.Write(kth, room, [&](int64_t slot, int64_t i) {
    values[slot] = x[i];
    indices[slot] = static_cast<int32_t>(i);
  });
}

ffi::Error TopkSelectImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> values,
                          ffi::Result<ffi::Buffer<ffi::S32>> indices) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t k = static_cast<int64_t>(indices->element_count());
  if (k < 1 || k > n || static_cast<int64_t>(values->element_count()) != k) {
    return Invalid(kOp, "needs 1 <= k <= n and k values and indices, got n = " + std::to_string(n) +
                            ", k = " + std::to_string(k));
  }
  if (n > INT32_MAX) return Invalid(kOp, "the vector has more entries than int32 positions reach");
  if (values->element_type() != x.element_type()) return Invalid(kOp, "the values must have the input's dtype");
  if (x.element_type() == ffi::DataType::F32) {
    const auto* data = static_cast<const float*>(x.untyped_data());
    const auto key = [data](int64_t i) { return KeyF32(data, i); };
    Select(data, n, k, key, static_cast<float*>(values->untyped_data()), indices->typed_data());
  } else if (x.element_type() == ffi::DataType::BF16) {
    const auto* data = static_cast<const uint16_t*>(x.untyped_data());
    const auto key = [data](int64_t i) { return KeyBf16(data, i); };
    Select(data, n, k, key, static_cast<uint16_t*>(values->untyped_data()), indices->typed_data());
  } else {
    return Invalid(kOp, "the input must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

ffi::Error TopkFeedbackImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t shards, float decay) {
  constexpr char kFeedbackOp[] = "nsp.topk_feedback";
  if (args.size() < 1 || rets.size() != 3 || shards < 1) {
    return Invalid(kFeedbackOp, "needs the residual and the gradient leaves; returns residual, values, indices");
  }
  auto residual_in = args.get<ffi::AnyBuffer>(0);
  auto residual = rets.get<ffi::AnyBuffer>(0);
  auto values = rets.get<ffi::AnyBuffer>(1);
  auto indices = rets.get<ffi::AnyBuffer>(2);
  if (residual_in.has_error()) return residual_in.error();
  if (residual.has_error()) return residual.error();
  if (values.has_error()) return values.error();
  if (indices.has_error()) return indices.error();
  const int64_t total = static_cast<int64_t>((*residual)->element_count());
  const int64_t k_all = static_cast<int64_t>((*values)->element_count());
  if ((*residual)->element_type() != ffi::DataType::F32 || residual_in->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(residual_in->element_count()) != total || (*values)->element_type() != ffi::DataType::F32 ||
      (*indices)->element_type() != ffi::DataType::S32 || (*indices)->element_count() != (*values)->element_count() ||
      total % shards || k_all % shards) {
    return Invalid(kFeedbackOp, "the residual and values must be float32, the indices int32, both split evenly over "
                                "the shards");
  }
  const int64_t m = total / shards, k = k_all / shards;
  if (k < 1 || k > m) return Invalid(kFeedbackOp, "needs 1 <= k <= shard size");
  if (m > INT32_MAX) return Invalid(kFeedbackOp, "a shard has more entries than int32 positions reach");
  float* r = static_cast<float*>((*residual)->untyped_data());
  if (residual_in->untyped_data() != r) {  // not aliased (XLA kept the operand): start from a copy
    std::memcpy(r, residual_in->untyped_data(), sizeof(float) * static_cast<size_t>(total));
  }
  const CallerFloatMode mode;  // the additions round as XLA's would (denormals flushed)
  int64_t offset = 0;
  for (size_t l = 1; l < args.size(); ++l) {
    auto g = args.get<ffi::AnyBuffer>(l);
    if (g.has_error()) return g.error();
    const int64_t n = static_cast<int64_t>(g->element_count());
    const bool bf16 = g->element_type() == ffi::DataType::BF16;
    if ((!bf16 && g->element_type() != ffi::DataType::F32) || offset + n > total) {
      return Invalid(kFeedbackOp, "gradient leaf " + std::to_string(l - 1) + " must be float32 or bfloat16 and "
                                  "lie within the residual");
    }
    const void* data = g->untyped_data();
    float* out = r + offset;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    ParallelFor(static_cast<int>(blocks), [&](int b) {
      const auto scope = mode.Enter();
      const int64_t begin = static_cast<int64_t>(b) * kBlock, end = std::min(n, begin + kBlock);
      if (bf16) {
        const auto* x = static_cast<const uint16_t*>(data);
        for (int64_t i = begin; i < end; ++i) {
          uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
          float v;
          std::memcpy(&v, &bits, 4);
          out[i] = out[i] + v;
        }
      } else {
        const auto* x = static_cast<const float*>(data);
        for (int64_t i = begin; i < end; ++i) out[i] = out[i] + x[i];
      }
    });
    offset += n;
  }
  auto* vals = static_cast<float*>((*values)->untyped_data());
  auto* idx = static_cast<int32_t*>((*indices)->untyped_data());
  for (int64_t s = 0; s < shards; ++s) {
    float* shard = r + s * m;
    const auto key = [shard](int64_t i) { return KeyF32(shard, i); };
    Select(shard, m, k, key, vals + s * k, idx + s * k);
    for (int64_t j = 0; j < k; ++j) shard[idx[s * k + j]] = 0.0f;  // sent: nothing left of it
    if (decay != 1.0f) {
      const int64_t blocks = (m + kBlock - 1) / kBlock;
      ParallelFor(static_cast<int>(blocks), [&](int b) {
        const auto scope = mode.Enter();
        const int64_t begin = static_cast<int64_t>(b) * kBlock, end = std::min(m, begin + kBlock);
        for (int64_t i = begin; i < end; ++i) shard[i] = shard[i] * decay;
      });
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nsp

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspTopkSelect, nsp::TopkSelectImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspTopkFeedback, nsp::TopkFeedbackImpl,
                              xla::ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("shards")
                                  .Attr<float>("decay"));
