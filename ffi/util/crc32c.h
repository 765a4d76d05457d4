// CRC-32C (Castagnoli), the checksum of zarr v3's "crc32c" codec: hardware when the CPU has it -- 512- or 256-bit
// VPCLMULQDQ folding on long inputs, else PCLMUL folding beside SSE4.2 crc32, else crc32 alone -- and a
// table-driven fallback.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace nsp {

uint32_t Crc32c(const void* data, size_t size);
// The CRC-32C of (the bytes whose CRC-32C is `crc`) followed by `data`.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

// The implementation in use: "vpclmul-avx512", "vpclmul-avx2", "pclmul", "sse4.2" or "portable" -- the fastest
// the CPU has, or the one NSP_CRC32C_ISA names (read once, at first use).
const char* Crc32cIsa();
// "" when NSP_CRC32C_ISA is unset or names an implementation this CPU can run, else a message naming the problem
// (the fastest implementation the CPU has runs then).
const std::string& Crc32cIsaError();

}  // namespace nsp
