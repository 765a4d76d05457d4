// A shard's elements as a params tree's leaves, without a flat copy: the gradient coming in and the new params
// going out as one piece per leaf (ShardPieces), and the caller's params a step may start from (ParamsIn). Both
// map shard positions onto leaves the same way (ForEachOverlap in shard_pieces.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/gradient_stage.h"
#include "kernels/update_kernel.h"

namespace nsp {

// A shard given as consecutive pieces, one per parameter leaf in the layout's order (a tree's leaves, without
// a flat copy): piece i covers the next sizes[i] elements; elements past the last piece are padding (zero
// gradient). Each piece's gradient is read from grad[i] and its new params are written to out[i] in the same
// dtype (`type`); out[i] may be grad[i] (updated in place): a page's gradient is read before its params land.
// With `stage` set the pieces are not in memory (grad and out stay empty): the gradient was staged in that file,
// the pieces end to end, and the new params are written over it there (the caller reads them back).
struct ShardPieces {
  GradType type = GradType::kF32;
  std::vector<const void*> grad;
  std::vector<void*> out;
  std::vector<int64_t> sizes;
  std::vector<int64_t> starts;  // filled by Finalize: starts[i] = sizes[0] + ... + sizes[i-1]
  const GradientStage* stage = nullptr;
  // With `stage`: the factor each gradient element is multiplied by as it is read (global-norm clipping of a
  // staged gradient, whose norm is known only once every leaf is staged), in float32, rounded back to bf16 for a
  // bf16 gradient. 1 reads the gradient as it is.
  float scale = 1.0f;
  // With `stage`: where the new params go instead of the stage file, when set: elements from `sink_begin` on, in
  // the pieces' dtype. A one-slot store's update holds a window's params there until the window is recorded in
  // its redo journal, because until then the stage file's gradient is what recovery redoes the window from.
  char* sink = nullptr;
  int64_t sink_begin = 0;
  std::string Finalize(int64_t shard_size);
  // Copies elements [begin, begin + n) of the gradient into dst (type's bytes per element; zeros in padding).
  // Returns "" or the stage file's error.
  std::string GatherGrad(int64_t begin, int64_t n, char* dst) const;
  // Writes fp32 params for elements [begin, begin + n) into the pieces, rounded to bf16 when type is bf16.
  std::string ScatterParams(int64_t begin, int64_t n, const float* src) const;
  // Multiplies `n` gradient elements at `data` (of `type`) by `scale`.
  void ScaleGrad(char* data, int64_t n) const;
  // How many of elements [begin, begin + n) come from the caller: those some piece covers (a shard's padding
  // past the last piece comes from nobody), or all n when the shard is not given as pieces (`pieces` null).
  static int64_t Covered(const ShardPieces* pieces, int64_t begin, int64_t n);
};

// The caller's params, for a step that starts from them instead of from the committed version's: the caller
// changed its params since the step that led to them (a transform after the optimizer scaled its updates, or
// code edited them), and, as in optax, the params passed to an update are the ones it updates. Given as the
// params tree's leaves (fp32 or bf16, every device holding all of them); this shard's elements start at
// `offset` in their concatenation, and elements past the last leaf are padding (zero).
struct ParamsIn {
  GradType type = GradType::kF32;
  std::vector<const void*> leaves;
  std::vector<int64_t> sizes;
  std::vector<int64_t> starts;  // filled by Finalize, from `offset`: where each leaf starts in shard positions
  int64_t offset = 0;
  std::string Finalize();
  // fp32 copies of the shard's elements [begin, begin + n) into dst (zeros in the padding).
  void Gather(int64_t begin, int64_t n, float* dst) const;
};

}  // namespace nsp
