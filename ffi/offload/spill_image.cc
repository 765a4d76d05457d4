// Entries' file images and their buffers (spill_image.h).
#include "offload/spill_image.h"

#include <algorithm>
#include <cstring>

#include "backends/page_file.h"
#include "offload/spill_codec.h"

namespace nsp::spill {

ImageLayout PlanImage(const std::vector<SpillArray>& arrays) {
  ImageLayout layout;
  layout.headers.resize(arrays.size());
  layout.bytes = sizeof(FileHeader) + arrays.size() * sizeof(ArrayHeader);
  for (size_t i = 0; i < arrays.size(); ++i) {
    const SpillArray& a = arrays[i];
    ArrayHeader& h = layout.headers[i];
    h = {static_cast<uint32_t>(Codec::kRaw), static_cast<uint32_t>(a.elem), a.bytes, a.bytes};
    if (a.sparse && (a.elem == 2 || a.elem == 4) && a.bytes % a.elem == 0) {
      const size_t n = a.bytes / a.elem;
      const size_t packed = BitmapBytes(n, CountNonZero(a.data, n, a.elem), a.elem);
      if (packed < a.bytes) {
        h.codec = static_cast<uint32_t>(Codec::kBitmap);
        h.stored = packed;
        ++layout.sparse;
      }
    }
    layout.bytes += h.stored;
    layout.array_bytes += a.bytes;
  }
  return layout;
}

void WriteImage(const std::vector<SpillArray>& arrays, const ImageLayout& layout, uint8_t* out) {
  const FileHeader file{kImageMagic, static_cast<uint32_t>(arrays.size())};
  std::memcpy(out, &file, sizeof(file));
  std::memcpy(out + sizeof(file), layout.headers.data(), layout.headers.size() * sizeof(ArrayHeader));
  uint8_t* at = out + sizeof(file) + layout.headers.size() * sizeof(ArrayHeader);
  for (size_t i = 0; i < arrays.size(); ++i) {
    const ArrayHeader& h = layout.headers[i];
    if (h.codec == static_cast<uint32_t>(Codec::kBitmap)) {
      EncodeBitmap(arrays[i].data, arrays[i].bytes / arrays[i].elem, arrays[i].elem, at);
    } else if (h.stored) {
      std::memcpy(at, arrays[i].data, h.stored);
    }
    at += h.stored;
  }
}

std::string CheckHeaders(const FileHeader& file, const std::vector<ArrayHeader>& headers,
                         const std::vector<SpillOut>& arrays, const std::string& path) {
  if (file.magic != kImageMagic || file.count != arrays.size() || headers.size() != arrays.size()) {
    return "spilled activations " + path + " are damaged (their header does not match the read)";
  }
  for (size_t i = 0; i < arrays.size(); ++i) {
    const ArrayHeader& h = headers[i];
    if (h.bytes != arrays[i].bytes || h.elem != arrays[i].elem) {
      return "spilled activations " + path + " hold another array " + std::to_string(i) + " (" +
             std::to_string(h.bytes) + " bytes) than the read asks for (" + std::to_string(arrays[i].bytes) + ")";
    }
    const bool bitmap = h.codec == static_cast<uint32_t>(Codec::kBitmap);
    const bool raw = h.codec == static_cast<uint32_t>(Codec::kRaw) && h.stored == h.bytes;
    if (!bitmap && !raw) return "spilled activations " + path + " are damaged (array " + std::to_string(i) + ")";
  }
  return "";
}

std::string ReadImage(const uint8_t* image, size_t bytes, const std::vector<SpillOut>& arrays,
                      const std::string& path) {
  const size_t head = sizeof(FileHeader) + arrays.size() * sizeof(ArrayHeader);
  FileHeader file{};
  std::vector<ArrayHeader> headers(arrays.size());
  if (bytes >= head) {
    std::memcpy(&file, image, sizeof(file));
    std::memcpy(headers.data(), image + sizeof(file), headers.size() * sizeof(ArrayHeader));
  }
  if (std::string err = CheckHeaders(file, headers, arrays, path); !err.empty()) return err;
  size_t at = head;
  for (size_t i = 0; i < arrays.size(); ++i) {
    const ArrayHeader& h = headers[i];
    if (h.stored > bytes - at) return page_file::TruncatedMessage(path, static_cast<ssize_t>(bytes), at + h.stored);
    if (h.codec == static_cast<uint32_t>(Codec::kBitmap)) {
      if (!DecodeBitmap(image + at, h.stored, h.bytes / h.elem, h.elem, arrays[i].data)) {
        return "spilled activations " + path + " are damaged (array " + std::to_string(i) + "'s sparse form)";
      }
    } else if (h.stored) {
      std::memcpy(arrays[i].data, image + at, h.stored);
    }
    at += h.stored;
  }
  return "";
}

AlignedBuffer::AlignedBuffer(size_t capacity) {
  const size_t rounded = page_file::RoundUp(std::max<size_t>(capacity, 1));
  data_ = static_cast<uint8_t*>(std::aligned_alloc(page_file::kAlign, rounded));
  capacity_ = data_ ? rounded : 0;
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept : data_(other.data_), capacity_(other.capacity_) {
  other.data_ = nullptr;
  other.capacity_ = 0;
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = other.data_;
    capacity_ = other.capacity_;
    other.data_ = nullptr;
    other.capacity_ = 0;
  }
  return *this;
}

AlignedBuffer BufferPool::Take(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The smallest kept buffer that is large enough.
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->capacity() >= bytes && (best == free_.end() || it->capacity() < best->capacity())) best = it;
    }
    if (best != free_.end()) {
      AlignedBuffer out = std::move(*best);
      free_.erase(best);
      return out;
    }
    // None fits: a too-small kept buffer is dropped rather than kept beside the new one.
    if (!free_.empty() && free_.size() + 1 > keep_) free_.erase(free_.begin());
  }
  return AlignedBuffer(bytes);
}

void BufferPool::Give(AlignedBuffer buffer) {
  if (!buffer) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.size() < keep_) free_.push_back(std::move(buffer));
}

void BufferPool::Clear() {
  std::vector<AlignedBuffer> dropped;
  std::lock_guard<std::mutex> lock(mu_);
  dropped.swap(free_);
}

size_t BufferPool::KeptBytes() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t total = 0;
  for (const AlignedBuffer& b : free_) total += b.capacity();
  return total;
}

}  // namespace nsp::spill
