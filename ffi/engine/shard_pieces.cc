// ShardPieces and ParamsIn (shard_pieces.h): where a shard's elements lie among a tree's leaves.
#include "engine/shard_pieces.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/kernel_block.h"

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

// Lays leaves of `sizes` end to end from position `first`: (*starts)[i] is where leaf i starts, *end where the
// last one ends. Returns "" or an error naming `what`.
std::string PlaceLeaves(const std::vector<int64_t>& sizes, int64_t first, const char* what,
                        std::vector<int64_t>* starts, int64_t* end) {
  starts->resize(sizes.size());
  int64_t at = first;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) return std::string(what) + ": negative size";
    (*starts)[i] = at;
    at += sizes[i];
  }
  *end = at;
  return {};
}

}  // namespace

std::string ShardPieces::Finalize(int64_t shard_size) {
  if (stage != nullptr ? !grad.empty() || !out.empty() : grad.size() != sizes.size() || out.size() != sizes.size()) {
    return "pieces: gradients, outputs and sizes differ in count";
  }
  int64_t total = 0;
  if (std::string err = PlaceLeaves(sizes, 0, "pieces", &starts, &total); !err.empty()) return err;
  if (total > shard_size) {
    return "the pieces hold " + std::to_string(total) + " elements, more than the shard's " +
           std::to_string(shard_size);
  }
  return {};
}

int64_t ShardPieces::Covered(const ShardPieces* pieces, int64_t begin, int64_t n) {
  if (pieces == nullptr) return n;
  const int64_t end = pieces->sizes.empty() ? 0 : pieces->starts.back() + pieces->sizes.back();
  return std::max<int64_t>(0, std::min(n, end - begin));
}

void ShardPieces::ScaleGrad(char* data, int64_t n) const {
  if (type == GradType::kF32) {
    float* g = reinterpret_cast<float*>(data);
    for (int64_t i = 0; i < n; ++i) g[i] *= scale;
    return;
  }
  uint16_t* g = reinterpret_cast<uint16_t*>(data);
  float widened[256];
  for (int64_t at = 0; at < n; at += 256) {
    const int64_t m = std::min<int64_t>(256, n - at);
    for (int64_t i = 0; i < m; ++i) widened[i] = internal::WidenBf16(g[at + i]) * scale;
    internal::RoundToBf16(widened, g + at, m);
  }
}

std::string ShardPieces::GatherGrad(int64_t begin, int64_t n, char* dst) const {
  const int64_t bytes = GradBytes(type);
  std::memset(dst, 0, static_cast<size_t>(n * bytes));  // padding past the last piece stays zero
  if (stage != nullptr) {
    const int64_t covered = Covered(this, begin, n);
    if (covered <= 0) return {};
    if (std::string e = stage->Read(begin, dst, covered, bytes); !e.empty()) return e;
    if (scale != 1.0f) ScaleGrad(dst, covered);
    return {};
  }
  ForEachOverlap(starts, sizes, begin, begin + n, [&](size_t i, int64_t lo, int64_t hi) {
    std::memcpy(dst + (lo - begin) * bytes, static_cast<const char*>(grad[i]) + (lo - starts[i]) * bytes,
                static_cast<size_t>((hi - lo) * bytes));
  });
  return {};
}

namespace {

// n fp32 params from src into dst in the pieces' dtype (rounded to bf16 for bf16 pieces).
void StoreParams(GradType type, const float* src, void* dst, int64_t n) {
  if (type == GradType::kF32) {
    std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(n));
  } else {
    internal::RoundToBf16(src, static_cast<uint16_t*>(dst), n);
  }
}

}  // namespace

std::string ShardPieces::ScatterParams(int64_t begin, int64_t n, const float* src) const {
  if (stage != nullptr) {
    const int64_t covered = Covered(this, begin, n);
    if (covered <= 0) return {};
    if (sink != nullptr) {
      StoreParams(type, src, sink + (begin - sink_begin) * GradBytes(type), covered);
      return {};
    }
    if (type == GradType::kF32) return stage->Write(begin, src, covered, sizeof(float));
    thread_local std::vector<uint16_t> rounded;  // a page at a time, per thread
    rounded.resize(static_cast<size_t>(covered));
    internal::RoundToBf16(src, rounded.data(), covered);
    return stage->Write(begin, rounded.data(), covered, sizeof(uint16_t));
  }
  ForEachOverlap(starts, sizes, begin, begin + n, [&](size_t i, int64_t lo, int64_t hi) {
    StoreParams(type, src + (lo - begin), static_cast<char*>(out[i]) + (lo - starts[i]) * GradBytes(type), hi - lo);
  });
  return {};
}

std::string ParamsIn::Finalize() {
  if (leaves.size() != sizes.size()) return "params: leaves and sizes differ in count";
  int64_t end = 0;
  return PlaceLeaves(sizes, -offset, "params", &starts, &end);
}

void ParamsIn::Gather(int64_t begin, int64_t n, float* dst) const {
  std::fill(dst, dst + n, 0.0f);  // padding
  ForEachOverlap(starts, sizes, begin, begin + n, [&](size_t i, int64_t lo, int64_t hi) {
    if (type == GradType::kF32) {
      std::memcpy(dst + (lo - begin), static_cast<const float*>(leaves[i]) + (lo - starts[i]),
                  sizeof(float) * static_cast<size_t>(hi - lo));
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(leaves[i]) + (lo - starts[i]);
      for (int64_t k = 0; k < hi - lo; ++k) dst[lo - begin + k] = internal::WidenBf16(src[k]);
    }
  });
}

}  // namespace nsp
