// SpillArea: activations written to and read back from a directory, the disk's work on an I/O thread of the
// area's own (spill_area.h).
#include "offload/spill_area.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "backends/page_file.h"
#include "offload/spill_codec.h"

namespace nsp::spill {

namespace {

std::string Errno(const std::string& what, const std::string& path) { return page_file::ErrnoMessage(what, path); }

// Whether files in `dir` can be written with O_DIRECT: the flag at open and one block's write (some file systems
// take the flag and refuse the I/O). `*why` gets the refusal.
bool TakesDirectIo(const std::string& dir, std::string* why) {
  const std::string probe = dir + "/.nsp-direct-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0600);
  if (fd < 0) {
    *why = std::strerror(errno);
    return false;
  }
  AlignedBuffer block(page_file::kAlign);
  bool ok = false;
  if (block) {
    std::memset(block.data(), 0, page_file::kAlign);
    ok = ::pwrite(fd, block.data(), page_file::kAlign, 0) == static_cast<ssize_t>(page_file::kAlign);
    if (!ok) *why = std::strerror(errno);
  } else {
    *why = "no memory for a probe block";
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return ok;
}

}  // namespace

std::pair<std::shared_ptr<SpillArea>, std::string> SpillArea::Open(const std::string& dir,
                                                                   const SpillOptions& options) {
  if (options.read_ahead < 0) return {nullptr, "read_ahead must be >= 0"};
  if (options.write_behind < 0) return {nullptr, "write_behind must be >= 0"};
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return {nullptr, Errno("spill directory", dir)};
  if (!S_ISDIR(st.st_mode)) return {nullptr, "spill directory " + dir + " is not a directory"};
  if (::access(dir.c_str(), W_OK | X_OK) != 0) return {nullptr, Errno("spill directory (not writable)", dir)};
  bool direct = false;
  const bool wanted = options.io == IoMode::kDirect ||
                      (options.io == IoMode::kAuto && std::getenv("NSP_NO_DIRECT_IO") == nullptr);
  if (wanted) {
    std::string why;
    direct = TakesDirectIo(dir, &why);
    if (!direct && options.io == IoMode::kDirect) {
      return {nullptr, "spill directory " + dir + " does not take direct I/O (O_DIRECT): " + why};
    }
  }
  std::shared_ptr<SpillArea> area(new SpillArea(dir, options, direct));
  std::string why;
  if (!area->io_.Start([raw = area.get()] { raw->IoLoop(); }, &why)) {
    return {nullptr, "cannot start the I/O thread of spill area " + dir + ": " + why};
  }
  return {area, ""};
}

SpillArea::SpillArea(std::string dir, const SpillOptions& options, bool direct)
    : dir_(std::move(dir)),
      read_ahead_(options.read_ahead),
      write_behind_(options.write_behind),
      image_limit_(options.image_limit),
      direct_(direct),
      // The images in use at once: those written behind or read ahead (a push or pop at an entry is one of them).
      pool_(std::make_shared<BufferPool>(
          static_cast<size_t>(std::max({options.read_ahead, options.write_behind, 1})))) {}

SpillArea::~SpillArea() { RemoveFiles(); }

SpillArea::Held::~Held() {
  if (fd >= 0) ::close(fd);  // a write dropped: its entry was popped from memory first
  if (pool) pool->Give(std::move(image));
}

std::string SpillArea::PathOf(int64_t slot, int32_t depth) const {
  return dir_ + "/site" + std::to_string(slot) + "-" + std::to_string(depth) + ".act";
}

// Rewritten in place (no O_TRUNC: the file keeps its blocks from the step before, as the file tier rewrites its
// page files), then cut to the entry's size if that changed.
int SpillArea::OpenToWrite(const std::string& path) const {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (direct_ ? O_DIRECT : 0), 0600);
}

std::string SpillArea::WriteFile(Held& held) {
  const size_t n = direct_ ? page_file::RoundUp(held.bytes) : held.bytes;
  iovec iov{held.image.data(), n};
  const ssize_t done = page_file::WriteAll(held.fd, &iov, 1);
  std::string err;
  if (done < 0) {
    err = Errno("cannot write spilled activations to", held.path);
  } else if (static_cast<size_t>(done) != n) {
    err = "cannot write spilled activations to " + held.path + ": short write";
  } else {
    struct stat st {};
    if (::fstat(held.fd, &st) != 0 || static_cast<size_t>(st.st_size) != n) {
      if (::ftruncate(held.fd, static_cast<off_t>(n)) != 0) err = Errno("cannot size", held.path);
    }
  }
  ::close(held.fd);
  held.fd = -1;
  return err;
}

std::string SpillArea::ReadFile(const std::string& path, size_t bytes, AlignedBuffer* image) {
  const size_t n = direct_ ? page_file::RoundUp(bytes) : bytes;
  *image = pool_->Take(n);
  if (!*image) return "cannot hold " + std::to_string(n) + " bytes of spilled activations in memory (" + path + ")";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct_ ? O_DIRECT : 0));
  if (fd < 0) return Errno("cannot read spilled activations", path);
  iovec iov{image->data(), n};
  const ssize_t got = page_file::ReadAll(fd, &iov, 1);
  const int read_errno = errno;
  // Read once: the page cache need not keep it (direct reads never put it there).
  if (!direct_) ::posix_fadvise(fd, 0, static_cast<off_t>(n), POSIX_FADV_DONTNEED);
  ::close(fd);
  if (got < 0) {
    errno = read_errno;
    return Errno("cannot read spilled activations", path);
  }
  if (static_cast<size_t>(got) < bytes) return page_file::TruncatedMessage(path, got, bytes);
  return "";
}

int SpillArea::WritesInMemory() const {
  int n = 0;
  for (const auto& [key, held] : held_) n += held->state == State::kQueuedWrite || held->state == State::kWriting;
  return n;
}

std::string SpillArea::Save(int64_t slot, const std::vector<SpillArray>& arrays, int32_t* depth) {
  const ImageLayout layout = PlanImage(arrays);
  const size_t padded = direct_ ? page_file::RoundUp(layout.bytes) : layout.bytes;
  const bool imaged = write_behind_ > 0 && padded <= image_limit_;
  int32_t d;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (imaged && !stop_ && write_error_.empty() && WritesInMemory() >= write_behind_) {
      stats_.save_waits += 1;
      cv_.wait(lock, [&] { return stop_ || !write_error_.empty() || WritesInMemory() < write_behind_; });
    }
    if (stop_) return "spill area " + dir_ + " is closed";
    if (!write_error_.empty()) return write_error_;
    d = depth_[slot];
  }
  const std::string path = PathOf(slot, d);
  std::shared_ptr<Held> held;
  std::string err;
  bool opened;
  if (imaged) {
    held = std::make_shared<Held>();
    held->pool = pool_;
    held->path = path;
    held->bytes = layout.bytes;
    held->image = pool_->Take(padded);
    if (!held->image) {
      return "cannot hold " + std::to_string(padded) + " bytes of spilled activations in memory (" + path + ")";
    }
    WriteImage(arrays, layout, held->image.data());
    std::memset(held->image.data() + layout.bytes, 0, padded - layout.bytes);
    // Opened here, not by the I/O thread: a directory removed or turned read-only fails this step's push.
    held->fd = OpenToWrite(path);
    opened = held->fd >= 0;
    if (!opened) err = Errno("cannot write spilled activations to", path);
  } else {
    err = WriteThrough(path, arrays, layout);
    opened = err.empty() || ::access(path.c_str(), F_OK) == 0;
  }

  std::lock_guard<std::mutex> lock(mu_);
  if (opened) {  // a file exists now: removed at close
    const bool known = std::any_of(written_.begin(), written_.end(),
                                   [&](const Entry& e) { return e.slot == slot && e.depth == d; });
    if (!known) written_.push_back({slot, d, 0, imaged});
  }
  if (!err.empty()) return err;
  depth_[slot] = d + 1;
  order_.push_back({slot, d, layout.bytes, imaged});
  stats_.saves += 1;
  stats_.bytes_written += static_cast<int64_t>(layout.bytes);
  stats_.array_bytes += static_cast<int64_t>(layout.array_bytes);
  stats_.arrays_sparse += static_cast<int64_t>(layout.sparse);
  if (imaged) {
    held->state = State::kQueuedWrite;
    held_[{slot, d}] = std::move(held);
    tasks_.push_back({slot, d});
    cv_.notify_all();
  } else {
    stats_.disk_bytes_written += static_cast<int64_t>(layout.bytes);
  }
  *depth = d;
  return "";
}

std::string SpillArea::WriteThrough(const std::string& path, const std::vector<SpillArray>& arrays,
                                    const ImageLayout& layout) {
  // The image's parts where they are: the headers, each array (its sparse form encoded apart, freed after).
  const FileHeader file{kImageMagic, static_cast<uint32_t>(arrays.size())};
  std::vector<ArrayHeader> headers = layout.headers;
  std::vector<std::vector<uint8_t>> encoded(arrays.size());
  std::vector<iovec> iov{{const_cast<FileHeader*>(&file), sizeof(file)},
                         {headers.data(), headers.size() * sizeof(ArrayHeader)}};
  for (size_t i = 0; i < arrays.size(); ++i) {
    const void* data = arrays[i].data;
    if (headers[i].codec == static_cast<uint32_t>(Codec::kBitmap)) {
      encoded[i].resize(headers[i].stored);
      EncodeBitmap(arrays[i].data, arrays[i].bytes / arrays[i].elem, arrays[i].elem, encoded[i].data());
      data = encoded[i].data();
    }
    if (headers[i].stored) iov.push_back({const_cast<void*>(data), headers[i].stored});
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("cannot write spilled activations to", path);
  const ssize_t done = page_file::WriteAll(fd, iov.data(), static_cast<int>(iov.size()));
  std::string err;
  if (done < 0) {
    err = Errno("cannot write spilled activations to", path);
  } else if (static_cast<size_t>(done) != layout.bytes) {
    err = "cannot write spilled activations to " + path + ": short write";
  } else if (::ftruncate(fd, static_cast<off_t>(layout.bytes)) != 0) {
    err = Errno("cannot size", path);
  }
  ::close(fd);
  return err;
}

std::string SpillArea::ReadThrough(const std::string& path, const std::vector<SpillOut>& arrays) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("cannot read spilled activations", path);
  FileHeader file{};
  std::vector<ArrayHeader> headers(arrays.size());
  iovec head[2] = {{&file, sizeof(file)}, {headers.data(), headers.size() * sizeof(ArrayHeader)}};
  const size_t head_bytes = sizeof(file) + headers.size() * sizeof(ArrayHeader);
  std::string err;
  ssize_t got = page_file::ReadAll(fd, head, 2);
  std::vector<std::vector<uint8_t>> packed(arrays.size());
  std::vector<iovec> iov;
  size_t want = 0;
  if (got < 0) {
    err = Errno("cannot read spilled activations", path);
  } else if (static_cast<size_t>(got) != head_bytes) {
    err = "spilled activations " + path + " are damaged (their header does not match the read)";
  } else {
    err = CheckHeaders(file, headers, arrays, path);
  }
  for (size_t i = 0; err.empty() && i < arrays.size(); ++i) {
    void* to = arrays[i].data;
    if (headers[i].codec == static_cast<uint32_t>(Codec::kBitmap)) {
      packed[i].resize(headers[i].stored);
      to = packed[i].data();
    }
    if (headers[i].stored) iov.push_back({to, headers[i].stored});
    want += headers[i].stored;
  }
  if (err.empty()) {
    got = iov.empty() ? 0 : page_file::ReadAll(fd, iov.data(), static_cast<int>(iov.size()));
    if (got < 0) {
      err = Errno("cannot read spilled activations", path);
    } else if (static_cast<size_t>(got) != want) {
      err = page_file::TruncatedMessage(path, got + head_bytes, want + head_bytes);
    }
  }
  // Read once: the page cache need not keep it.
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  for (size_t i = 0; err.empty() && i < arrays.size(); ++i) {
    if (headers[i].codec != static_cast<uint32_t>(Codec::kBitmap)) continue;
    if (!DecodeBitmap(packed[i].data(), packed[i].size(), arrays[i].bytes / arrays[i].elem, arrays[i].elem,
                      arrays[i].data)) {
      err = "spilled activations " + path + " are damaged (array " + std::to_string(i) + "'s sparse form)";
    }
  }
  return err;
}

void SpillArea::QueueReadAhead(size_t position) {
  for (size_t back = 1; back <= static_cast<size_t>(read_ahead_) && back <= position; ++back) {
    const Entry& e = order_[position - back];
    const Key key{e.slot, e.depth};
    if (!e.imaged) {  // the kernel reads it into the page cache in the background
      const int fd = ::open(PathOf(e.slot, e.depth).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;  // a hint only: the read itself reports a missing file
      ::posix_fadvise(fd, 0, static_cast<off_t>(e.bytes), POSIX_FADV_WILLNEED);
      ::close(fd);
      stats_.read_ahead += 1;
      continue;
    }
    if (auto it = held_.find(key); it != held_.end()) {
      it->second->wanted = true;  // in memory still (written behind), or already on its way
      continue;
    }
    auto held = std::make_shared<Held>();
    held->pool = pool_;
    held->bytes = e.bytes;
    held->path = PathOf(e.slot, e.depth);
    held->state = State::kQueuedRead;
    held->wanted = true;
    held_[key] = std::move(held);
    tasks_.push_back(key);
  }
  cv_.notify_all();
}

std::string SpillArea::Load(int64_t slot, int32_t depth, const std::vector<SpillOut>& arrays) {
  const std::string path = PathOf(slot, depth);
  const Key key{slot, depth};
  std::shared_ptr<Held> held;
  size_t bytes;
  bool imaged;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stop_) return "spill area " + dir_ + " is closed";
    if (!write_error_.empty()) return write_error_;
    const int32_t top = depth_[slot] - 1;
    if (top != depth) {
      return "spilled activations of call site " + std::to_string(slot) + " read out of order: entry " +
             std::to_string(depth) + " asked for, " +
             (top < 0 ? std::string("none") : "entry " + std::to_string(top)) + " on top (in " + dir_ + ")";
    }
    auto it = std::find_if(order_.rbegin(), order_.rend(),
                           [&](const Entry& e) { return e.slot == slot && e.depth == depth; });
    bytes = it->bytes;
    imaged = it->imaged;
    if (auto h = held_.find(key); h != held_.end()) {
      held = h->second;
      held_.erase(h);
      if (held->state == State::kQueuedRead) {
        held.reset();  // its read ahead has not started: read here, now
      } else {
        // Written behind (its write, queued, is dropped; under way, it reads the image beside us) or read ahead.
        cv_.wait(lock, [&] { return held->state != State::kReading; });
        if (!held->error.empty()) return held->error;
        stats_.loads_from_memory += 1;
      }
    }
  }
  AlignedBuffer own;
  if (!imaged) {
    if (std::string err = ReadThrough(path, arrays); !err.empty()) return err;
  } else {
    const uint8_t* image = held ? held->image.data() : nullptr;
    if (!held) {
      if (std::string err = ReadFile(path, bytes, &own); !err.empty()) return err;
      image = own.data();
    }
    if (std::string err = ReadImage(image, bytes, arrays, path); !err.empty()) return err;
  }
  // The image goes back to the pool before the next entries are read ahead into it: the backward holds one
  // image per entry read ahead, none beside them for the entry it is at.
  const bool from_disk = !held;
  held.reset();
  if (from_disk) pool_->Give(std::move(own));
  std::lock_guard<std::mutex> lock(mu_);
  // Found again: other stacks (another device's replica) may have pushed or popped meanwhile.
  auto it = std::find_if(order_.begin(), order_.end(),
                         [&](const Entry& e) { return e.slot == slot && e.depth == depth; });
  if (it != order_.end()) {
    const size_t position = static_cast<size_t>(it - order_.begin());
    order_.erase(it);
    QueueReadAhead(position);  // the entries pushed just before this one (now at position - 1, - 2, ...)
  }
  depth_[slot] = depth;
  stats_.loads += 1;
  stats_.bytes_read += static_cast<int64_t>(bytes);
  if (from_disk) {
    stats_.disk_bytes_read += static_cast<int64_t>(imaged && direct_ ? page_file::RoundUp(bytes) : bytes);
  }
  return "";
}

void SpillArea::IoLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (stop_) return;
    const Key key = tasks_.front();
    tasks_.pop_front();
    auto it = held_.find(key);
    if (it == held_.end()) continue;  // popped (or reset) before its turn
    std::shared_ptr<Held> held = it->second;
    if (held->state == State::kQueuedWrite) {
      held->state = State::kWriting;
      lock.unlock();
      std::string err = WriteFile(*held);
      lock.lock();
      if (err.empty()) {
        stats_.disk_bytes_written += static_cast<int64_t>(direct_ ? page_file::RoundUp(held->bytes) : held->bytes);
      } else if (write_error_.empty()) {
        write_error_ = err;
      }
      if (auto now = held_.find(key); now != held_.end() && now->second == held) {
        if (held->wanted) {
          held->state = State::kReady;  // read ahead already: its pop is near, keep the image
        } else {
          held_.erase(now);
        }
      }
    } else if (held->state == State::kQueuedRead) {
      held->state = State::kReading;
      lock.unlock();
      AlignedBuffer image;
      std::string err = ReadFile(held->path, held->bytes, &image);
      lock.lock();
      held->image = std::move(image);
      held->error = err;
      held->state = State::kReady;
      if (err.empty()) {
        stats_.read_ahead += 1;
        stats_.disk_bytes_read += static_cast<int64_t>(direct_ ? page_file::RoundUp(held->bytes) : held->bytes);
      }
    }
    cv_.notify_all();
  }
}

void SpillArea::Reset() {
  std::map<Key, std::shared_ptr<Held>> dropped;  // let go of after the lock
  std::lock_guard<std::mutex> lock(mu_);
  order_.clear();
  depth_.clear();
  tasks_.clear();
  dropped.swap(held_);
  write_error_.clear();
  cv_.notify_all();
}

SpillStats SpillArea::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  SpillStats s = stats_;
  s.direct_io = direct_ ? 1 : 0;
  return s;
}

void SpillArea::RemoveFiles() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  io_.Join();
  {
    std::map<Key, std::shared_ptr<Held>> dropped;
    std::lock_guard<std::mutex> lock(mu_);
    for (const Entry& e : written_) ::unlink(PathOf(e.slot, e.depth).c_str());
    written_.clear();
    order_.clear();
    depth_.clear();
    tasks_.clear();
    dropped.swap(held_);
  }
  pool_->Clear();
}

}  // namespace nsp::spill
