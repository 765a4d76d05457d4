// FlashNeuron's bit-vector sparse format for spilled activations: one bit per element (set: non-zero) followed
// by the non-zero elements, packed. Lossless (an element is "zero" when all its bits are: -0.0 is kept as it
// is), and used for an array only when it is smaller than the array as it is: post-ReLU activations, about half
// zeros, take 0.53x (float32) or 0.56x (bfloat16) of their bytes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace nsp::spill {

enum class Codec : uint32_t { kRaw = 0, kBitmap = 1 };

// Elements of `elem` bytes (2 or 4) at `data` whose bits are not all zero.
size_t CountNonZero(const void* data, size_t n, size_t elem);
// Bytes of the bitmap form of `n` elements with `nonzero` of them non-zero.
inline size_t BitmapBytes(size_t n, size_t nonzero, size_t elem) { return (n + 7) / 8 + nonzero * elem; }
// Writes the bitmap form of `data` to `out` (BitmapBytes of it).
void EncodeBitmap(const void* data, size_t n, size_t elem, uint8_t* out);
// Writes the `n` elements the bitmap form `in` holds to `out`; returns false when `in_bytes` is not what the
// bitmap says it should be (a damaged file).
bool DecodeBitmap(const uint8_t* in, size_t in_bytes, size_t n, size_t elem, void* out);

}  // namespace nsp::spill
