// ShardPieces and ParamsIn (shard_pieces.h): where a shard's elements lie among a tree's leaves.
#include "shard_pieces.h"

#include <algorithm>
#include <cstring>

#include "kernel_block.h"

namespace nsp {

namespace {

// Calls fn(i, lo, hi) for each piece i that overlaps elements [begin, end), with [lo, hi) the overlap (in the
// same positions as `starts`), in order.
template <typename Fn>
void ForEachOverlap(const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes, int64_t begin,
                    int64_t end, Fn fn) {
  // The first piece that ends after `begin`.
  size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin();
  i = i == 0 ? 0 : i - 1;
  for (; i < sizes.size() && starts[i] < end; ++i) {
    const int64_t lo = std::max(begin, starts[i]);
    const int64_t hi = std::min(end, starts[i] + sizes[i]);
    if (hi > lo) fn(i, lo, hi);
  }
}

}  // namespace

std::string ShardPieces::Finalize(int64_t shard_size) {
  if (grad.size() != sizes.size() || out.size() != sizes.size()) {
    return "pieces: gradients, outputs and sizes differ in count";
  }
  starts.resize(sizes.size());
  int64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) return "pieces: negative size";
    starts[i] = total;
    total += sizes[i];
  }
  if (total > shard_size) {
    return "the pieces hold " + std::to_string(total) + " elements, more than the shard's " +
           std::to_string(shard_size);
  }
  return {};
}

void ShardPieces::GatherGrad(int64_t begin, int64_t n, char* dst) const {
  const int64_t bytes = GradBytes(type);
  std::memset(dst, 0, static_cast<size_t>(n * bytes));  // padding past the last piece stays zero
  ForEachOverlap(starts, sizes, begin, begin + n, [&](size_t i, int64_t lo, int64_t hi) {
    std::memcpy(dst + (lo - begin) * bytes, static_cast<const char*>(grad[i]) + (lo - starts[i]) * bytes,
                static_cast<size_t>((hi - lo) * bytes));
  });
}

void ShardPieces::ScatterParams(int64_t begin, int64_t n, const float* src) const {
  ForEachOverlap(starts, sizes, begin, begin + n, [&](size_t i, int64_t lo, int64_t hi) {
    if (type == GradType::kF32) {
      std::memcpy(static_cast<float*>(out[i]) + (lo - starts[i]), src + (lo - begin),
                  sizeof(float) * static_cast<size_t>(hi - lo));
    } else {
      internal::RoundToBf16(src + (lo - begin), static_cast<uint16_t*>(out[i]) + (lo - starts[i]), hi - lo);
    }
  });
}

std::string ParamsIn::Finalize() {
  if (leaves.size() != sizes.size()) return "params: leaves and sizes differ in count";
  starts.resize(sizes.size());
  int64_t at = -offset;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) return "params: negative size";
    starts[i] = at;
    at += sizes[i];
  }
  return {};
}

void ParamsIn::Gather(int64_t begin, int64_t n, float* dst) const {
  std::fill(dst, dst + n, 0.0f);  // padding
  ForEachOverlap(starts, sizes, begin, begin + n, [&](size_t i, int64_t lo, int64_t hi) {
    if (type == GradType::kF32) {
      std::memcpy(dst + (lo - begin), static_cast<const float*>(leaves[i]) + (lo - starts[i]),
                  sizeof(float) * static_cast<size_t>(hi - lo));
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(leaves[i]) + (lo - starts[i]);
      for (int64_t k = 0; k < hi - lo; ++k) {
        const uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
        std::memcpy(dst + (lo - begin) + k, &bits, sizeof(bits));
      }
    }
  });
}

}  // namespace nsp
