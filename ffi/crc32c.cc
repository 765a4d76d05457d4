#include "crc32c.h"

#include <array>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__)
// GCC 12's AVX-512 headers trip -Wuninitialized on their own placeholder operands (GCC bug 105593, fixed in
// GCC 13); the warnings point into the header, so silencing them around the include leaves this file's own.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
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
// On Intel cores one crc32 instruction has a latency of 3 cycles but a throughput of 1 per cycle, so a chain of them
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

// Where crc32 runs one instruction per ~3 cycles whatever the number of chains (AMD Zen 1 measured ~5 GB/s
// with 1, 2 or 3 chains), carry-less multiplies add a second unit: each block's first part is folded 64 bytes
// at a time with pclmulqdq while its second part runs through crc32, the two interleaved in one loop.
//
// The maths, with the message as a polynomial over GF(2) and P the Castagnoli polynomial: the crc32 state
// after a prefix is prefix * x^32 mod P, so a 128-bit chunk c may replace the prefix it ends as long as
// c = prefix (mod P). Loaded little-endian, register bit i of a chunk is the coefficient of x^(127 - i); a
// carry-less product of two 64-bit halves so loaded is then x * a * b. Folding chunk c = hi * x^64 + lo forward
// by F bits multiplies hi by x^(F + 63) mod P and lo by x^(F - 1) mod P (the constants below), a product of
// at most 96 bits that is xored into the chunk F bits later. The last chunk becomes a state with two crc32
// instructions from zero; the second part's state joins after shifting the first's by its length (one more
// product, with x^(8 * len - 65)).
constexpr size_t kFoldIters = 64;                      // 64-byte pclmul steps per block
constexpr size_t kCrcWordsPerIter = 3;                 // 8-byte crc32 steps per pclmul step (tuned on Zen 1)
constexpr size_t kFoldBytes = 64 * kFoldIters;         // first part of a block
constexpr size_t kCrcBytes = 8 * kCrcWordsPerIter * kFoldIters;  // second part
constexpr size_t kBlock = kFoldBytes + kCrcBytes;

constexpr uint32_t Reverse32(uint32_t v) {
  uint32_t r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}

// x^n mod P, with bit j the coefficient of x^j, loaded as a carry-less operand (bit 63 - j).
uint64_t FoldOperand(uint64_t n) {
  constexpr uint64_t kNormalPoly = (uint64_t{1} << 32) | Reverse32(kPoly);
  uint64_t r = 1;
  for (uint64_t i = 0; i < n; ++i) {
    r <<= 1;
    if (r >> 32) r ^= kNormalPoly;
  }
  uint64_t operand = 0;
  for (int j = 0; j < 32; ++j) operand |= ((r >> j) & 1u) << (63 - j);
  return operand;
}

struct FoldConstants {
  __m128i by512;   // fold a chunk 4 chunks forward: (low half, high half)
  __m128i by128;   // fold a chunk onto the next one
  uint64_t shift;  // shift a state over the block's crc32 part
};

__attribute__((target("sse4.2,pclmul"))) FoldConstants MakeFoldConstants() {
  FoldConstants k;
  k.by512 = _mm_set_epi64x(static_cast<long long>(FoldOperand(511)), static_cast<long long>(FoldOperand(575)));
  k.by128 = _mm_set_epi64x(static_cast<long long>(FoldOperand(127)), static_cast<long long>(FoldOperand(191)));
  k.shift = FoldOperand(8 * kCrcBytes - 65);
  return k;
}

__attribute__((target("sse4.2,pclmul"))) inline __m128i Fold(__m128i chunk, __m128i k, __m128i next) {
  const __m128i lo = _mm_clmulepi64_si128(chunk, k, 0x00), hi = _mm_clmulepi64_si128(chunk, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

__attribute__((target("sse4.2"))) inline uint64_t Crc128(__m128i chunk) {
  const uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(chunk)));
  return _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(chunk, 1)));
}

inline __m128i Load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// Runs whole blocks from state `crc`, advancing p and n past them.
__attribute__((target("sse4.2,pclmul"))) uint32_t FoldBlocks(uint32_t crc, const uint8_t*& p, size_t& n) {
  static const FoldConstants k = MakeFoldConstants();
  for (; n >= kBlock; n -= kBlock, p += kBlock) {
    const uint8_t* x = p;
    const uint8_t* y = p + kFoldBytes;
    __m128i a0 = _mm_xor_si128(Load128(x), _mm_cvtsi32_si128(static_cast<int>(crc)));
    __m128i a1 = Load128(x + 16), a2 = Load128(x + 32), a3 = Load128(x + 48);
    uint64_t cy = 0;
    for (size_t it = 1; it <= kFoldIters; ++it) {
      if (it < kFoldIters) {
        x += 64;
        a0 = Fold(a0, k.by512, Load128(x));
        a1 = Fold(a1, k.by512, Load128(x + 16));
        a2 = Fold(a2, k.by512, Load128(x + 32));
        a3 = Fold(a3, k.by512, Load128(x + 48));
      }
      for (size_t j = 0; j < kCrcWordsPerIter; ++j, y += 8) cy = _mm_crc32_u64(cy, Load64(y));
    }
    a1 = Fold(a0, k.by128, a1);
    a2 = Fold(a1, k.by128, a2);
    a3 = Fold(a2, k.by128, a3);
    const __m128i shifted = _mm_clmulepi64_si128(_mm_cvtsi64_si128(static_cast<long long>(Crc128(a3))),
                                                 _mm_cvtsi64_si128(static_cast<long long>(k.shift)), 0x00);
    crc = static_cast<uint32_t>(Crc128(shifted) ^ cy);
  }
  return crc;
}

// Wider carry-less multiplies (VPCLMULQDQ) fold two (ymm) or four (zmm) 128-bit chunks per instruction, so
// folding alone outruns crc32 and needs no second unit beside it: every 128-bit lane of a register is folded as
// above, with the same pair of constants in each lane. Each loop step folds kWideRegs registers forward over
// the kWideRegs registers of input after them (F = 8 * bytes per step); at the end the registers are folded onto
// one another, then the chunks of the last register onto its last chunk, and that chunk becomes the state.
// Only whole steps are folded; the rest (less than one step) goes through crc32.
constexpr int kWideRegs = 4;

// The pair of constants that folds a chunk F bits forward, in both 64-bit halves' order Fold expects.
__m128i FoldPair(uint64_t f) {
  return _mm_set_epi64x(static_cast<long long>(FoldOperand(f - 1)), static_cast<long long>(FoldOperand(f + 63)));
}

struct WideConstants {
  __m128i by_step256;  // 4 ymm registers forward: 1024 bits
  __m128i by_step512;  // 4 zmm registers forward: 2048 bits
  __m128i by512, by256, by128;
};

const WideConstants& Wide() {
  static const WideConstants k{FoldPair(8 * 32 * kWideRegs), FoldPair(8 * 64 * kWideRegs), FoldPair(512),
                               FoldPair(256), FoldPair(128)};
  return k;
}

// The chunks of a ymm register (lane 0 first in the message) folded into one, as a state.
__attribute__((target("sse4.2,pclmul,avx2,vpclmulqdq"))) uint32_t Reduce256(__m256i a) {
  const __m128i lane0 = _mm256_castsi256_si128(a), lane1 = _mm256_extracti128_si256(a, 1);
  return static_cast<uint32_t>(Crc128(Fold(lane0, Wide().by128, lane1)));
}

__attribute__((target("sse4.2,pclmul,avx2,vpclmulqdq"))) inline __m256i Fold256(__m256i chunk, __m256i k,
                                                                                __m256i next) {
  const __m256i lo = _mm256_clmulepi64_epi128(chunk, k, 0x00), hi = _mm256_clmulepi64_epi128(chunk, k, 0x11);
  return _mm256_xor_si256(_mm256_xor_si256(lo, hi), next);
}

__attribute__((target("avx2"))) inline __m256i Load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Folds the whole 128-byte steps of [p, p + n) from state `crc`, advancing p and n past them. n >= 128.
__attribute__((target("sse4.2,pclmul,avx2,vpclmulqdq"))) uint32_t FoldWide256(uint32_t crc, const uint8_t*& p,
                                                                              size_t& n) {
  constexpr size_t kStep = 32 * kWideRegs;
  const WideConstants& w = Wide();
  const __m256i by_step = _mm256_broadcastsi128_si256(w.by_step256);
  __m256i a[kWideRegs];
  for (int r = 0; r < kWideRegs; ++r) a[r] = Load256(p + 32 * r);
  a[0] = _mm256_xor_si256(a[0], _mm256_setr_epi32(static_cast<int>(crc), 0, 0, 0, 0, 0, 0, 0));
  p += kStep;
  n -= kStep;
  for (; n >= kStep; n -= kStep, p += kStep) {
    for (int r = 0; r < kWideRegs; ++r) a[r] = Fold256(a[r], by_step, Load256(p + 32 * r));
  }
  const __m256i by256 = _mm256_broadcastsi128_si256(w.by256);
  for (int r = 1; r < kWideRegs; ++r) a[r] = Fold256(a[r - 1], by256, a[r]);
  return Reduce256(a[kWideRegs - 1]);
}

// On AMD Zen 3 folding alone runs at ~8 bytes per cycle (one 256-bit carry-less multiply per two cycles), and the
// crc32 unit beside it sits idle: there each block folds its first part while three crc32 chains run over three
// lanes of its second part, in one loop (25.8 -> ~37 GB/s on a 4 MiB page, measured on a Zen 3 EPYC). The
// chains join the folded state by carry-less shifts: state(block) = fold * x^(3L) + c0 * x^(2L) + c1 * x^L + c2
// for lanes of L bytes, the three products summed before one reduction. Intel's VPCLMULQDQ cores are documented
// to issue one multiply per cycle, four times the crc32 unit's bytes; there this split would make the crc32 part
// the bottleneck, so other vendors run FoldWide256 alone (not measured: no such machine here).
constexpr size_t kMixIters = 64;                       // 128-byte fold steps per block
constexpr size_t kMixWords = 5;                        // 8-byte crc32 steps per chain per fold step
constexpr size_t kMixFold = 32 * kWideRegs * kMixIters;  // first part of a block
constexpr size_t kMixLane = 8 * kMixWords * kMixIters;   // each of the three crc32 lanes
constexpr size_t kMixBlock = kMixFold + 3 * kMixLane;

__attribute__((target("sse4.2,pclmul"))) inline __m128i ShiftProduct(uint64_t state, uint64_t operand) {
  return _mm_clmulepi64_si128(_mm_cvtsi64_si128(static_cast<long long>(state)),
                              _mm_cvtsi64_si128(static_cast<long long>(operand)), 0x00);
}

// Runs whole blocks of kMixBlock bytes from state `crc`, advancing p and n past them.
__attribute__((target("sse4.2,pclmul,avx2,vpclmulqdq"))) uint32_t FoldMixed256(uint32_t crc, const uint8_t*& p,
                                                                               size_t& n) {
  static const uint64_t shift1 = FoldOperand(8 * kMixLane - 65), shift2 = FoldOperand(16 * kMixLane - 65),
                        shift3 = FoldOperand(24 * kMixLane - 65);
  const WideConstants& w = Wide();
  const __m256i by_step = _mm256_broadcastsi128_si256(w.by_step256);
  const __m256i by256 = _mm256_broadcastsi128_si256(w.by256);
  for (; n >= kMixBlock; n -= kMixBlock, p += kMixBlock) {
    const uint8_t* x = p;
    const uint8_t* y = p + kMixFold;
    __m256i a[kWideRegs];
    for (int r = 0; r < kWideRegs; ++r) a[r] = Load256(x + 32 * r);
    a[0] = _mm256_xor_si256(a[0], _mm256_setr_epi32(static_cast<int>(crc), 0, 0, 0, 0, 0, 0, 0));
    uint64_t c0 = 0, c1 = 0, c2 = 0;
    for (size_t it = 1; it <= kMixIters; ++it) {
      if (it < kMixIters) {
        x += 32 * kWideRegs;
        for (int r = 0; r < kWideRegs; ++r) a[r] = Fold256(a[r], by_step, Load256(x + 32 * r));
      }
      for (size_t j = 0; j < kMixWords; ++j, y += 8) {
        c0 = _mm_crc32_u64(c0, Load64(y));
        c1 = _mm_crc32_u64(c1, Load64(y + kMixLane));
        c2 = _mm_crc32_u64(c2, Load64(y + 2 * kMixLane));
      }
    }
    for (int r = 1; r < kWideRegs; ++r) a[r] = Fold256(a[r - 1], by256, a[r]);
    const __m128i joined = _mm_xor_si128(_mm_xor_si128(ShiftProduct(Reduce256(a[kWideRegs - 1]), shift3),
                                                       ShiftProduct(c0, shift2)),
                                         ShiftProduct(c1, shift1));
    crc = static_cast<uint32_t>(Crc128(joined) ^ c2);
  }
  return crc;
}

__attribute__((target("sse4.2,pclmul,avx2,avx512f,avx512vl,vpclmulqdq"))) inline __m512i Fold512(__m512i chunk,
                                                                                                __m512i k,
                                                                                                __m512i next) {
  const __m512i lo = _mm512_clmulepi64_epi128(chunk, k, 0x00), hi = _mm512_clmulepi64_epi128(chunk, k, 0x11);
  return _mm512_ternarylogic_epi64(lo, hi, next, 0x96);  // lo ^ hi ^ next
}

// FoldWide256 with zmm registers: whole 256-byte steps, n >= 256.
__attribute__((target("sse4.2,pclmul,avx2,avx512f,avx512vl,vpclmulqdq"))) uint32_t FoldWide512(
    uint32_t crc, const uint8_t*& p, size_t& n) {
  constexpr size_t kStep = 64 * kWideRegs;
  const WideConstants& w = Wide();
  const __m512i by_step = _mm512_broadcast_i32x4(w.by_step512);
  __m512i a[kWideRegs];
  for (int r = 0; r < kWideRegs; ++r) a[r] = _mm512_loadu_si512(p + 64 * r);
  a[0] = _mm512_xor_si512(a[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  p += kStep;
  n -= kStep;
  for (; n >= kStep; n -= kStep, p += kStep) {
    for (int r = 0; r < kWideRegs; ++r) a[r] = Fold512(a[r], by_step, _mm512_loadu_si512(p + 64 * r));
  }
  const __m512i by512 = _mm512_broadcast_i32x4(w.by512);
  for (int r = 1; r < kWideRegs; ++r) a[r] = Fold512(a[r - 1], by512, a[r]);
  // Lanes 0-1 onto lanes 2-3, then as a ymm register.
  const __m256i low = _mm512_castsi512_si256(a[kWideRegs - 1]), high = _mm512_extracti64x4_epi64(a[kWideRegs - 1], 1);
  return Reduce256(Fold256(low, _mm256_broadcastsi128_si256(w.by256), high));
}
#endif

// The implementations, slowest first; NSP_CRC32C_ISA forces one the CPU has (tests and benchmarks compare them).
enum class Path : int { kPortable = 0, kSse42 = 1, kPclmul = 2, kVpclmulAvx2 = 3, kVpclmulAvx512 = 4 };
constexpr const char* kPathNames[] = {"portable", "sse4.2", "pclmul", "vpclmul-avx2", "vpclmul-avx512"};
constexpr int kNumPaths = 5;

bool CpuHas(Path path) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool sse42 = __builtin_cpu_supports("sse4.2"), pclmul = sse42 && __builtin_cpu_supports("pclmul");
  const bool vpclmul = pclmul && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
  switch (path) {
    case Path::kPortable: return true;
    case Path::kSse42: return sse42;
    case Path::kPclmul: return pclmul;
    case Path::kVpclmulAvx2: return vpclmul;
    case Path::kVpclmulAvx512:
      return vpclmul && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  }
  return false;
#else
  return path == Path::kPortable;
#endif
}

struct PathChoice {
  Path path = Path::kPortable;
  std::string error;  // a bad NSP_CRC32C_ISA; the best path the CPU has runs then
};

PathChoice ChoosePath() {
  PathChoice out;
  std::string supported;
  for (int i = 0; i < kNumPaths; ++i) {
    if (!CpuHas(static_cast<Path>(i))) continue;
    out.path = static_cast<Path>(i);
    supported += (i ? ", " : "") + std::string(kPathNames[i]);
  }
  const char* env = std::getenv("NSP_CRC32C_ISA");
  if (env == nullptr || *env == '\0') return out;
  for (int i = 0; i < kNumPaths; ++i) {
    if (std::strcmp(env, kPathNames[i]) != 0) continue;
    if (CpuHas(static_cast<Path>(i))) {
      out.path = static_cast<Path>(i);
    } else {
      out.error = "NSP_CRC32C_ISA='" + std::string(env) + "' asks for a CRC-32C this CPU cannot run (it can run: " +
                  supported + ")";
    }
    return out;
  }
  out.error = "NSP_CRC32C_ISA='" + std::string(env) +
              "' is not one of portable, sse4.2, pclmul, vpclmul-avx2, vpclmul-avx512 (this CPU can run: " +
              supported + ")";
  return out;
}

#if defined(__x86_64__)
const bool kInterleaveCrc32 = [] {  // see FoldMixed256
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") != 0;
}();
#endif

const PathChoice& Choice() {
  static const PathChoice* choice = new PathChoice(ChoosePath());  // read once; leaked, like the thread pool
  return *choice;
}

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  const Path path = Choice().path;
#if defined(__x86_64__)
  if (path != Path::kPortable) {
    uint32_t state = ~crc;
    // Wide folding pays for its final reduction from a few steps on; whole steps, the rest below.
    if (path == Path::kVpclmulAvx512 && size >= 1024) state = FoldWide512(state, p, size);
    if (path == Path::kVpclmulAvx2) {
      if (kInterleaveCrc32) state = FoldMixed256(state, p, size);
      if (size >= 512) state = FoldWide256(state, p, size);
    }
    if (path == Path::kPclmul) state = FoldBlocks(state, p, size);  // whole blocks; the rest below
    return ~HardwareCrc(state, p, size);
  }
#endif
  return ~PortableCrc(~crc, p, size);
}

uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }

const char* Crc32cIsa() { return kPathNames[static_cast<int>(Choice().path)]; }

const std::string& Crc32cIsaError() { return Choice().error; }

}  // namespace nsp
