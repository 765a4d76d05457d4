// Internal to CRC-32C: the carry-less folding maths its x86 paths share, and the interface between the dispatcher
// (crc32c.cc) and the wide-register folding, which lives in translation units of its own (crc32c_vpclmul_*.cc)
// because each is compiled for one instruction set. Like kernel_block.h, kept free of standard-library templates:
// those units must not emit inline library code the linker could pick for a CPU without their instructions.
// Every function here has internal linkage, so each unit keeps the copy it compiled for itself.
//
// The maths, with the message as a polynomial over GF(2) and P the Castagnoli polynomial: the crc32 state
// after a prefix is prefix * x^32 mod P, so a 128-bit chunk c may replace the prefix it ends as long as
// c = prefix (mod P). Loaded little-endian, register bit i of a chunk is the coefficient of x^(127 - i); a
// carry-less product of two 64-bit halves so loaded is then x * a * b. Folding chunk c = hi * x^64 + lo forward
// by F bits multiplies hi by x^(F + 63) mod P and lo by x^(F - 1) mod P (FoldPair), a product of at most 96 bits
// that is xored into the chunk F bits later. The last chunk becomes a state with two crc32 instructions from
// zero (Crc128); a state joins another after shifting it by the length between them (ShiftProduct).
#pragma once

#if defined(__x86_64__)

#include <cstddef>
#include <cstdint>
#include <cstring>

// GCC 12's AVX-512 headers trip -Wuninitialized on their own placeholder operands (GCC bug 105593, fixed in
// GCC 13); the warnings point into the header, so silencing them around the include leaves this file's own.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

namespace nsp::crc32c_fold {

// Wide folding's registers per step: each loop step folds kWideRegs registers forward over the kWideRegs
// registers of input after them.
constexpr int kWideRegs = 4;

// The pairs of constants wide folding uses, computed once by the dispatcher (crc32c.cc).
struct WideConstants {
  __m128i by_step256;  // 4 ymm registers forward: 1024 bits
  __m128i by_step512;  // 4 zmm registers forward: 2048 bits
  __m128i by512, by256, by128;
};
const WideConstants& Wide();
// x^n mod P, with bit j the coefficient of x^j, loaded as a carry-less operand (bit 63 - j).
uint64_t FoldOperand(uint64_t n);

// Fold the whole wide steps of [p, p + n) from state `crc`, advancing p and n past them: 128-byte steps with ymm
// registers (n >= 128), 256-byte steps with zmm registers (n >= 256). Only on CPUs with those instructions.
uint32_t FoldWide256(uint32_t crc, const uint8_t*& p, size_t& n);
uint32_t FoldWide512(uint32_t crc, const uint8_t*& p, size_t& n);
// Runs the whole blocks of FoldMixed256's size from state `crc`, advancing p and n past them (see there).
uint32_t FoldMixed256(uint32_t crc, const uint8_t*& p, size_t& n);

namespace {

inline uint64_t Load64(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  return word;
}

inline __m128i Load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// Folds `chunk` forward onto `next` by the distance the pair `k` encodes.
__attribute__((target("sse4.2,pclmul"))) inline __m128i Fold(__m128i chunk, __m128i k, __m128i next) {
  const __m128i lo = _mm_clmulepi64_si128(chunk, k, 0x00), hi = _mm_clmulepi64_si128(chunk, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

// The state a 128-bit chunk stands for.
__attribute__((target("sse4.2"))) inline uint64_t Crc128(__m128i chunk) {
  const uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(chunk)));
  return _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(chunk, 1)));
}

// A state shifted forward by the length `operand` encodes (FoldOperand(8 * bytes - 65)), still to be reduced.
__attribute__((target("sse4.2,pclmul"))) inline __m128i ShiftProduct(uint64_t state, uint64_t operand) {
  return _mm_clmulepi64_si128(_mm_cvtsi64_si128(static_cast<long long>(state)),
                              _mm_cvtsi64_si128(static_cast<long long>(operand)), 0x00);
}

}  // namespace
}  // namespace nsp::crc32c_fold

#endif  // __x86_64__
