#include "crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace nsp {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    table[i] = c;
  }
  return table;
}

uint32_t PortableCrc(uint32_t crc, const uint8_t* p, size_t n) {
  static const std::array<uint32_t, 256> table = MakeTable();
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// One crc32 instruction has a latency of 3 cycles but a throughput of 1 per cycle, so a single chain of them
// runs at a third of the unit's speed. The loop below runs three independent chains over three adjacent lanes
// of kLane bytes and then joins them. Joining uses linearity: the CRC state after lanes A then B equals
// Shift(state after A) ^ (state of B started from 0), where Shift feeds kLane zero bytes -- a linear map on the
// 32-bit state, applied with four table lookups (one per state byte).
constexpr size_t kLane = 4096;

__attribute__((target("sse4.2"))) uint32_t HardwareZeros(uint32_t crc, size_t n) {
  uint64_t c = crc;
  for (size_t i = 0; i < n; i += 8) c = _mm_crc32_u64(c, 0);
  return static_cast<uint32_t>(c);
}

using ShiftTable = std::array<std::array<uint32_t, 256>, 4>;

ShiftTable MakeShiftTable() {
  ShiftTable t{};
  for (int k = 0; k < 4; ++k) {
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = HardwareZeros(b << (8 * k), kLane);
  }
  return t;
}

inline uint32_t ShiftLane(const ShiftTable& t, uint32_t c) {
  return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
}

inline uint64_t Load64(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  return word;
}

__attribute__((target("sse4.2"))) uint32_t HardwareCrc(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = crc;
  if (n >= 3 * kLane) {
    static const ShiftTable shift = MakeShiftTable();
    for (; n >= 3 * kLane; n -= 3 * kLane, p += 3 * kLane) {
      uint64_t c1 = 0, c2 = 0;
      for (size_t i = 0; i < kLane; i += 8) {
        c = _mm_crc32_u64(c, Load64(p + i));
        c1 = _mm_crc32_u64(c1, Load64(p + kLane + i));
        c2 = _mm_crc32_u64(c2, Load64(p + 2 * kLane + i));
      }
      const uint32_t ab = ShiftLane(shift, static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c1);
      c = ShiftLane(shift, ab) ^ static_cast<uint32_t>(c2);
    }
  }
  for (; n >= 8; n -= 8, p += 8) c = _mm_crc32_u64(c, Load64(p));
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

const bool kHasSse42 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2") != 0;
}();
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  if (kHasSse42) return ~HardwareCrc(~crc, p, size);
#endif
  return ~PortableCrc(~crc, p, size);
}

uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }

}  // namespace nsp
