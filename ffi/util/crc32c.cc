// CRC-32C (crc32c.h): the table-driven fallback, crc32 chains (SSE4.2), PCLMUL folding beside them, and the
// choice among those and the wide folding units (crc32c_vpclmul_*.cc) by what the CPU has and NSP_CRC32C_ISA.
#include "util/crc32c.h"

#include <array>
#include <cstdlib>
#include <cstring>
#include <string>

#include "util/crc32c_fold.h"

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
using crc32c_fold::Crc128;
using crc32c_fold::Fold;
using crc32c_fold::FoldOperand;
using crc32c_fold::Load128;
using crc32c_fold::Load64;
using crc32c_fold::ShiftProduct;

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
// at a time with pclmulqdq (crc32c_fold.h has the maths) while its second part runs through crc32, the two
// interleaved in one loop. The last chunk's state joins the second part's after shifting it by that part's length.
constexpr size_t kFoldIters = 64;                      // 64-byte pclmul steps per block
constexpr size_t kCrcWordsPerIter = 3;                 // 8-byte crc32 steps per pclmul step (tuned on Zen 1)
constexpr size_t kFoldBytes = 64 * kFoldIters;         // first part of a block
constexpr size_t kCrcBytes = 8 * kCrcWordsPerIter * kFoldIters;  // second part
constexpr size_t kBlock = kFoldBytes + kCrcBytes;

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
    crc = static_cast<uint32_t>(Crc128(ShiftProduct(Crc128(a3), k.shift)) ^ cy);
  }
  return crc;
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
const bool kInterleaveCrc32 = [] {  // see FoldMixed256 (crc32c_vpclmul_avx2.cc)
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") != 0;
}();
#endif

const PathChoice& Choice() {
  static const PathChoice* choice = new PathChoice(ChoosePath());  // read once; leaked, like the thread pool
  return *choice;
}

}  // namespace

#if defined(__x86_64__)
namespace crc32c_fold {

namespace {
constexpr uint32_t Reverse32(uint32_t v) {
  uint32_t r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}

// The pair of constants that folds a chunk F bits forward, in both 64-bit halves' order Fold expects.
__m128i FoldPair(uint64_t f) {
  return _mm_set_epi64x(static_cast<long long>(FoldOperand(f - 1)), static_cast<long long>(FoldOperand(f + 63)));
}
}  // namespace

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

const WideConstants& Wide() {
  static const WideConstants k{FoldPair(8 * 32 * kWideRegs), FoldPair(8 * 64 * kWideRegs), FoldPair(512),
                               FoldPair(256), FoldPair(128)};
  return k;
}

}  // namespace crc32c_fold
#endif

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  const Path path = Choice().path;
#if defined(__x86_64__)
  if (path != Path::kPortable) {
    uint32_t state = ~crc;
    // Wide folding pays for its final reduction from a few steps on; whole steps, the rest below.
    if (path == Path::kVpclmulAvx512 && size >= 1024) state = crc32c_fold::FoldWide512(state, p, size);
    if (path == Path::kVpclmulAvx2) {
      if (kInterleaveCrc32) state = crc32c_fold::FoldMixed256(state, p, size);
      if (size >= 512) state = crc32c_fold::FoldWide256(state, p, size);
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
