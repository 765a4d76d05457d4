// An entry's file image: what one push of a spill area (spill_area.h) writes, laid out in memory exactly as in
// its file, so that it can wait in memory (written behind the forward pass, read ahead of the backward) and move
// to or from the disk in one transfer: a FileHeader, one ArrayHeader per array, then each array's stored bytes
// (as it is, or in the bit-vector sparse format of spill_codec.h where that is smaller). The image sits in a
// buffer aligned for direct I/O, zero-padded to whole blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace nsp::spill {

// One array of an entry: its bytes, its element size (for the sparse format: 2 or 4), and whether the sparse
// format may be tried on it (it is used only where it is smaller).
struct SpillArray {
  const void* data;
  size_t bytes;
  size_t elem;
  bool sparse;
};
struct SpillOut {
  void* data;
  size_t bytes;
  size_t elem;
};

constexpr uint32_t kImageMagic = 0x4150534e;  // "NSPA"
struct FileHeader {
  uint32_t magic;
  uint32_t count;
};
struct ArrayHeader {
  uint32_t codec;  // Codec (spill_codec.h)
  uint32_t elem;
  uint64_t bytes;   // in memory
  uint64_t stored;  // in the image
};

// How the image of some arrays is laid out: each array's header, and the image's bytes before padding.
struct ImageLayout {
  std::vector<ArrayHeader> headers;
  size_t bytes = 0;
  size_t array_bytes = 0;  // the arrays' bytes as they are in memory
  size_t sparse = 0;       // arrays stored in the sparse format
};
// Decides each array's format (the sparse one where allowed and smaller: one pass counting non-zeros).
ImageLayout PlanImage(const std::vector<SpillArray>& arrays);
// Writes the image of `arrays` laid out as `layout` to `out` (layout.bytes of it).
void WriteImage(const std::vector<SpillArray>& arrays, const ImageLayout& layout, uint8_t* out);
// Whether an entry's headers, as read, describe what the read asks for: the magic, one header per array of the
// same size and element, each stored raw or in the sparse format. Returns "" or an error naming `path`.
std::string CheckHeaders(const FileHeader& file, const std::vector<ArrayHeader>& headers,
                         const std::vector<SpillOut>& arrays, const std::string& path);
// Unpacks the image at `image` (`bytes` of it, or more) into `arrays`, which must be what was saved. Returns ""
// or an error naming `path` (a damaged image is refused, never unpacked wrongly).
std::string ReadImage(const uint8_t* image, size_t bytes, const std::vector<SpillOut>& arrays,
                      const std::string& path);

// Memory aligned for direct I/O (page_file::kAlign), owned; move-only.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // `capacity` rounded up to whole blocks; empty (data() null) when the memory cannot be had.
  explicit AlignedBuffer(size_t capacity);
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  uint8_t* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  uint8_t* data_ = nullptr;
  size_t capacity_ = 0;
};

// Images' buffers kept for the next entries: a fresh allocation of a few hundred MB is fresh pages, which the
// kernel faults in and zeroes on first touch, every push of every step. Keeps at most `keep` buffers (those in
// use at once: the entries written behind or read ahead, and one being made).
class BufferPool {
 public:
  explicit BufferPool(size_t keep) : keep_(keep) {}
  // A buffer of at least `bytes` (a kept one that is large enough, else a new one; empty if none can be had).
  AlignedBuffer Take(size_t bytes);
  void Give(AlignedBuffer buffer);
  void Clear();
  size_t KeptBytes();

 private:
  std::mutex mu_;
  std::vector<AlignedBuffer> free_;
  const size_t keep_;
};

}  // namespace nsp::spill
