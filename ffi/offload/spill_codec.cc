// The bit-vector sparse format of spilled activations (spill_codec.h).
#include "offload/spill_codec.h"

#include <cstring>

namespace nsp::spill {

namespace {

template <typename Word>
size_t CountNonZeroT(const Word* w, size_t n) {
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) count += w[i] != 0;
  return count;
}

template <typename Word>
void EncodeT(const Word* w, size_t n, uint8_t* out) {
  uint8_t* bits = out;
  Word* values = reinterpret_cast<Word*>(out + (n + 7) / 8);  // unaligned stores are fine on the targets built
  std::memset(bits, 0, (n + 7) / 8);
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    if (w[i] != 0) {
      bits[i >> 3] |= static_cast<uint8_t>(1u << (i & 7));
      std::memcpy(values + k, w + i, sizeof(Word));
      ++k;
    }
  }
}

template <typename Word>
bool DecodeT(const uint8_t* in, size_t in_bytes, size_t n, Word* out) {
  const uint8_t* bits = in;
  const uint8_t* values = in + (n + 7) / 8;
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) k += (bits[i >> 3] >> (i & 7)) & 1;
  if (BitmapBytes(n, k, sizeof(Word)) != in_bytes) return false;
  k = 0;
  for (size_t i = 0; i < n; ++i) {
    if ((bits[i >> 3] >> (i & 7)) & 1) {
      std::memcpy(out + i, values + k * sizeof(Word), sizeof(Word));
      ++k;
    } else {
      out[i] = 0;
    }
  }
  return true;
}

}  // namespace

size_t CountNonZero(const void* data, size_t n, size_t elem) {
  return elem == 4 ? CountNonZeroT(static_cast<const uint32_t*>(data), n)
                   : CountNonZeroT(static_cast<const uint16_t*>(data), n);
}

void EncodeBitmap(const void* data, size_t n, size_t elem, uint8_t* out) {
  if (elem == 4) {
    EncodeT(static_cast<const uint32_t*>(data), n, out);
  } else {
    EncodeT(static_cast<const uint16_t*>(data), n, out);
  }
}

bool DecodeBitmap(const uint8_t* in, size_t in_bytes, size_t n, size_t elem, void* out) {
  return elem == 4 ? DecodeT(in, in_bytes, n, static_cast<uint32_t*>(out))
                   : DecodeT(in, in_bytes, n, static_cast<uint16_t*>(out));
}

}  // namespace nsp::spill
