// CRC-32C (Castagnoli), the checksum of zarr v3's "crc32c" codec: hardware (SSE4.2 crc32, with PCLMUL folding
// beside it on long inputs) when the CPU has it, else a table-driven fallback.
#pragma once

#include <cstddef>
#include <cstdint>

namespace nsp {

uint32_t Crc32c(const void* data, size_t size);
// The CRC-32C of (the bytes whose CRC-32C is `crc`) followed by `data`.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

}  // namespace nsp
