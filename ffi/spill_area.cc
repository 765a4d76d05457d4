// SpillArea: activations written to and read back from a directory (spill_area.h).
#include "spill_area.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>

#include "page_file.h"

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

std::string SpillArea::Save(int64_t slot, const std::vector<std::pair<const void*, size_t>>& arrays,
                            int32_t* depth) {
  int32_t d;
  bool new_file;
  {
    std::lock_guard<std::mutex> lock(mu_);
    d = depth_[slot];
    new_file = std::none_of(written_.begin(), written_.end(),
                            [&](const Entry& e) { return e.slot == slot && e.depth == d; });
  }
  const std::string path = PathOf(slot, d);
  // Rewritten in place (no O_TRUNC: the file keeps its blocks from the step before, as the file tier rewrites its
  // page files), then cut to this entry's size.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("cannot write spilled activations to", path);
  std::vector<iovec> iov;
  size_t bytes = 0;
  for (const auto& [data, n] : arrays) {
    if (n == 0) continue;
    iov.push_back({const_cast<void*>(data), n});
    bytes += n;
  }
  const ssize_t done = iov.empty() ? 0 : page_file::WriteAll(fd, iov.data(), static_cast<int>(iov.size()));
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

std::string SpillArea::Load(int64_t slot, int32_t depth, const std::vector<std::pair<void*, size_t>>& arrays) {
  size_t bytes = 0;
  std::vector<iovec> iov;
  for (const auto& [data, n] : arrays) {
    if (n == 0) continue;
    iov.push_back({data, n});
    bytes += n;
  }
  const std::string path = PathOf(slot, depth);
  size_t position;
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
    if (order_[position].bytes != bytes) {
      return "spilled activations " + path + " hold " + std::to_string(order_[position].bytes) +
             " bytes, the read asks for " + std::to_string(bytes);
    }
    HintReadAhead(position);
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("cannot read spilled activations", path);
  const ssize_t done = iov.empty() ? 0 : page_file::ReadAll(fd, iov.data(), static_cast<int>(iov.size()));
  // Read once: the page cache need not keep it.
  ::posix_fadvise(fd, 0, static_cast<off_t>(bytes), POSIX_FADV_DONTNEED);
  ::close(fd);
  if (done < 0) return Errno("cannot read spilled activations", path);
  if (static_cast<size_t>(done) != bytes) return page_file::TruncatedMessage(path, done, bytes);
  std::lock_guard<std::mutex> lock(mu_);
  order_.erase(order_.begin() + static_cast<std::ptrdiff_t>(position));
  depth_[slot] = depth;
  stats_.loads += 1;
  stats_.bytes_read += static_cast<int64_t>(bytes);
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

namespace {
std::mutex registry_mu;
std::map<int64_t, std::shared_ptr<SpillArea>>& Registry() {
  static auto* areas = new std::map<int64_t, std::shared_ptr<SpillArea>>();
  return *areas;
}
int64_t next_id = 1;
}  // namespace

int64_t Register(std::shared_ptr<SpillArea> area) {
  std::lock_guard<std::mutex> lock(registry_mu);
  const int64_t id = next_id++;
  Registry()[id] = std::move(area);
  return id;
}

std::shared_ptr<SpillArea> Find(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Registry().find(id);
  return it == Registry().end() ? nullptr : it->second;
}

void Unregister(int64_t id) {
  std::shared_ptr<SpillArea> area;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = Registry().find(id);
    if (it == Registry().end()) return;
    area = std::move(it->second);
    Registry().erase(it);
  }
  area->RemoveFiles();
}

}  // namespace nsp::spill
