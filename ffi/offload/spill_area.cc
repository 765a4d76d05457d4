// SpillArea: activations written to and read back from a directory (spill_area.h).
#include "offload/spill_area.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "backends/page_file.h"
#include "offload/spill_codec.h"

namespace nsp::spill {

namespace {

std::string Errno(const std::string& what, const std::string& path) { return page_file::ErrnoMessage(what, path); }

}  // namespace

std::pair<std::shared_ptr<SpillArea>, std::string> SpillArea::Open(const std::string& dir, int read_ahead) {
  if (read_ahead < 0) return {nullptr, "read_ahead must be >= 0"};
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return {nullptr, Errno("spill directory", dir)};
  if (!S_ISDIR(st.st_mode)) return {nullptr, "spill directory " + dir + " is not a directory"};
  if (::access(dir.c_str(), W_OK | X_OK) != 0) return {nullptr, Errno("spill directory (not writable)", dir)};
  return {std::shared_ptr<SpillArea>(new SpillArea(dir, read_ahead)), ""};
}

SpillArea::~SpillArea() { RemoveFiles(); }

std::string SpillArea::PathOf(int64_t slot, int32_t depth) const {
  return dir_ + "/site" + std::to_string(slot) + "-" + std::to_string(depth) + ".act";
}

namespace {

// An entry's file: this header, one ArrayHeader per array, then the arrays' stored bytes in order.
constexpr uint32_t kMagic = 0x4150534e;  // "NSPA"
struct FileHeader {
  uint32_t magic;
  uint32_t count;
};
struct ArrayHeader {
  uint32_t codec;  // Codec
  uint32_t elem;
  uint64_t bytes;   // in memory
  uint64_t stored;  // in the file
};

}  // namespace

std::string SpillArea::Save(int64_t slot, const std::vector<SpillArray>& arrays, int32_t* depth) {
  int32_t d;
  bool new_file;
  {
    std::lock_guard<std::mutex> lock(mu_);
    d = depth_[slot];
    new_file = std::none_of(written_.begin(), written_.end(),
                            [&](const Entry& e) { return e.slot == slot && e.depth == d; });
  }
  const std::string path = PathOf(slot, d);
  // The sparse form of the arrays that are smaller that way (one encoded buffer each, freed after the write).
  FileHeader file{kMagic, static_cast<uint32_t>(arrays.size())};
  std::vector<ArrayHeader> headers(arrays.size());
  std::vector<std::vector<uint8_t>> encoded(arrays.size());
  std::vector<iovec> iov{{&file, sizeof(file)}, {headers.data(), headers.size() * sizeof(ArrayHeader)}};
  size_t bytes = sizeof(file) + headers.size() * sizeof(ArrayHeader), array_bytes = 0, sparse = 0;
  for (size_t i = 0; i < arrays.size(); ++i) {
    const SpillArray& a = arrays[i];
    headers[i] = {static_cast<uint32_t>(Codec::kRaw), static_cast<uint32_t>(a.elem), a.bytes, a.bytes};
    const void* data = a.data;
    if (a.sparse && (a.elem == 2 || a.elem == 4) && a.bytes % a.elem == 0) {
      const size_t n = a.bytes / a.elem;
      const size_t packed = BitmapBytes(n, CountNonZero(a.data, n, a.elem), a.elem);
      if (packed < a.bytes) {
        encoded[i].resize(packed);
        EncodeBitmap(a.data, n, a.elem, encoded[i].data());
        headers[i].codec = static_cast<uint32_t>(Codec::kBitmap);
        headers[i].stored = packed;
        data = encoded[i].data();
        ++sparse;
      }
    }
    if (headers[i].stored) iov.push_back({const_cast<void*>(data), headers[i].stored});
    bytes += headers[i].stored;
    array_bytes += a.bytes;
  }
  // Rewritten in place (no O_TRUNC: the file keeps its blocks from the step before, as the file tier rewrites its
  // page files), then cut to this entry's size.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("cannot write spilled activations to", path);
  const ssize_t done = page_file::WriteAll(fd, iov.data(), static_cast<int>(iov.size()));
  std::string err;
  if (done < 0 || static_cast<size_t>(done) != bytes) {
    err = done < 0 ? Errno("cannot write spilled activations to", path)
                   : "cannot write spilled activations to " + path + ": short write";
  } else if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    err = Errno("cannot size", path);
  }
  ::close(fd);
  std::lock_guard<std::mutex> lock(mu_);
  if (new_file) written_.push_back({slot, d, 0});
  if (!err.empty()) return err;
  depth_[slot] = d + 1;
  order_.push_back({slot, d, bytes});
  stats_.saves += 1;
  stats_.bytes_written += static_cast<int64_t>(bytes);
  stats_.array_bytes += static_cast<int64_t>(array_bytes);
  stats_.arrays_sparse += static_cast<int64_t>(sparse);
  *depth = d;
  return "";
}

void SpillArea::HintReadAhead(size_t position) {
  for (size_t back = 1; back <= static_cast<size_t>(read_ahead_) && back <= position; ++back) {
    const Entry& e = order_[position - back];
    const int fd = ::open(PathOf(e.slot, e.depth).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;  // a hint only: the read itself reports a missing file
    ::posix_fadvise(fd, 0, static_cast<off_t>(e.bytes), POSIX_FADV_WILLNEED);
    ::close(fd);
    stats_.read_ahead_hints += 1;
  }
}

std::string SpillArea::Load(int64_t slot, int32_t depth, const std::vector<SpillOut>& arrays) {
  const std::string path = PathOf(slot, depth);
  size_t position, bytes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int32_t top = depth_[slot] - 1;
    if (top != depth) {
      return "spilled activations of call site " + std::to_string(slot) + " read out of order: entry " +
             std::to_string(depth) + " asked for, " +
             (top < 0 ? std::string("none") : "entry " + std::to_string(top)) + " on top (in " + dir_ + ")";
    }
    auto it = std::find_if(order_.rbegin(), order_.rend(),
                           [&](const Entry& e) { return e.slot == slot && e.depth == depth; });
    position = static_cast<size_t>(order_.rend() - it) - 1;
    bytes = order_[position].bytes;
    HintReadAhead(position);
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("cannot read spilled activations", path);
  std::string err = ReadEntry(fd, path, arrays);
  // Read once: the page cache need not keep it.
  ::posix_fadvise(fd, 0, static_cast<off_t>(bytes), POSIX_FADV_DONTNEED);
  ::close(fd);
  if (!err.empty()) return err;
  std::lock_guard<std::mutex> lock(mu_);
  // Found again: other stacks (another device's replica) may have pushed or popped meanwhile.
  auto it = std::find_if(order_.begin(), order_.end(),
                         [&](const Entry& e) { return e.slot == slot && e.depth == depth; });
  if (it != order_.end()) order_.erase(it);
  depth_[slot] = depth;
  stats_.loads += 1;
  stats_.bytes_read += static_cast<int64_t>(bytes);
  return "";
}

std::string SpillArea::ReadEntry(int fd, const std::string& path, const std::vector<SpillOut>& arrays) {
  FileHeader file{};
  std::vector<ArrayHeader> headers(arrays.size());
  iovec head[2] = {{&file, sizeof(file)}, {headers.data(), headers.size() * sizeof(ArrayHeader)}};
  const size_t head_bytes = sizeof(file) + headers.size() * sizeof(ArrayHeader);
  ssize_t got = page_file::ReadAll(fd, head, 2);
  if (got < 0) return Errno("cannot read spilled activations", path);
  if (static_cast<size_t>(got) != head_bytes || file.magic != kMagic || file.count != arrays.size()) {
    return "spilled activations " + path + " are damaged (their header does not match the read)";
  }
  std::vector<std::vector<uint8_t>> packed(arrays.size());
  std::vector<iovec> iov;
  size_t want = 0;
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (headers[i].bytes != arrays[i].bytes || headers[i].elem != arrays[i].elem) {
      return "spilled activations " + path + " hold another array " + std::to_string(i) + " (" +
             std::to_string(headers[i].bytes) + " bytes) than the read asks for (" +
             std::to_string(arrays[i].bytes) + ")";
    }
    void* to = arrays[i].data;
    if (headers[i].codec == static_cast<uint32_t>(Codec::kBitmap)) {
      packed[i].resize(headers[i].stored);
      to = packed[i].data();
    } else if (headers[i].codec != static_cast<uint32_t>(Codec::kRaw) || headers[i].stored != headers[i].bytes) {
      return "spilled activations " + path + " are damaged (array " + std::to_string(i) + ")";
    }
    if (headers[i].stored) iov.push_back({to, headers[i].stored});
    want += headers[i].stored;
  }
  got = iov.empty() ? 0 : page_file::ReadAll(fd, iov.data(), static_cast<int>(iov.size()));
  if (got < 0) return Errno("cannot read spilled activations", path);
  if (static_cast<size_t>(got) != want) return page_file::TruncatedMessage(path, got + head_bytes, want + head_bytes);
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (headers[i].codec != static_cast<uint32_t>(Codec::kBitmap)) continue;
    if (!DecodeBitmap(packed[i].data(), packed[i].size(), arrays[i].bytes / arrays[i].elem, arrays[i].elem,
                      arrays[i].data)) {
      return "spilled activations " + path + " are damaged (array " + std::to_string(i) + "'s sparse form)";
    }
  }
  return "";
}

void SpillArea::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  order_.clear();
  depth_.clear();
}

SpillStats SpillArea::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void SpillArea::RemoveFiles() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Entry& e : written_) ::unlink(PathOf(e.slot, e.depth).c_str());
  written_.clear();
  order_.clear();
  depth_.clear();
}

}  // namespace nsp::spill
