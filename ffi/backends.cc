// The cpu backends: host memory and files (NVMe/SSD).
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "backend.h"
#include "crc32c.h"

namespace nsp {

const char* StateName(int state) {
  static const char* const kNames[kNumStates] = {"param", "mu", "nu"};
  return state >= 0 && state < kNumStates ? kNames[state] : "?";
}

void Backend::Compute(const UpdateHyperParams& hp, const StateSpan& span, const PageGrad& grad) {
  if (grad.dense != nullptr) {
    UpdateDense(hp, span, grad.dense, grad.type);
  } else {
    UpdateSparse(hp, span, grad.indices, grad.values, grad.type, grad.count, grad.index_base);
  }
}

namespace {

class MemoryBackend final : public Backend {
 public:
  MemoryBackend(int64_t size, int64_t page_elems, std::vector<bool> states_used)
      : page_elems_(page_elems) {
    for (int slot = 0; slot < 2; ++slot) {
      for (int s = 0; s < kNumStates; ++s) {
        if (states_used[s]) data_[slot][s].assign(static_cast<size_t>(size), 0.0f);
      }
    }
  }
  std::string name() const override { return "memory"; }
  float* PageAddress(int slot, int state, int64_t page) override {
    auto& v = data_[slot][state];
    return v.empty() ? nullptr : v.data() + page * page_elems_;
  }
  std::string ReadPage(int slot, int state, int64_t page, float* dst, int64_t n) override {
    std::memcpy(dst, PageAddress(slot, state, page), sizeof(float) * n);
    return {};
  }
  std::string WritePage(int slot, int state, int64_t page, const float* src, int64_t n) override {
    float* dst = PageAddress(slot, state, page);
    if (dst != src) std::memcpy(dst, src, sizeof(float) * n);
    return {};
  }
  std::string Sync(int) override { return {}; }

 private:
  int64_t page_elems_;
  std::vector<float> data_[2][kNumStates];
};

std::string ErrnoMessage(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

class FileBackend final : public Backend {
 public:
  FileBackend(std::string root, int64_t size, int64_t page_elems, bool checksum)
      : root_(std::move(root)), size_(size), page_elems_(page_elems), checksum_(checksum) {
    chunk_bytes_ = static_cast<size_t>(page_elems_) * sizeof(float);
    file_bytes_ = chunk_bytes_ + (checksum_ ? 4 : 0);
    if (const char* env = std::getenv("NSP_DEBUG_FAIL_WRITES_AFTER")) fail_writes_after_ = std::atoll(env);
    // Only a shard's last page is partial; its padding needs these (allocated once, never in the update).
    const size_t last = static_cast<size_t>(size_ % page_elems_ == 0 ? page_elems_ : size_ % page_elems_);
    zeros_.assign(chunk_bytes_ - last * sizeof(float), 0);
    read_pad_.resize(zeros_.size());
  }
  std::string name() const override { return "file"; }

  std::string ReadPage(int slot, int state, int64_t page, float* dst, int64_t n) override {
    const std::string path = PagePath(slot, state, page);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) {  // zarr: a chunk never written holds the fill value
        std::memset(dst, 0, sizeof(float) * n);
        return {};
      }
      return ErrnoMessage("cannot open", path);
    }
    // Straight into the engine's buffer; the last page's padding and the CRC trailer go to a side buffer.
    const size_t data_bytes = sizeof(float) * static_cast<size_t>(n);
    const size_t pad_bytes = chunk_bytes_ - data_bytes;
    uint32_t stored_crc = 0;
    iovec iov[3] = {{dst, data_bytes}, {read_pad_.data(), pad_bytes}, {&stored_crc, checksum_ ? 4u : 0u}};
    const ssize_t got = ReadFullV(fd, iov, 3);
    const int read_errno = errno;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  // the state is bigger than RAM by design: don't cache it
    ::close(fd);
    if (got < 0) {
      errno = read_errno;
      return ErrnoMessage("cannot read", path);
    }
    if (static_cast<size_t>(got) != file_bytes_) {
      return "page file " + path + " is truncated: " + std::to_string(got) + " bytes, expected " +
             std::to_string(file_bytes_);
    }
    if (checksum_ && Crc32cExtend(Crc32c(dst, data_bytes), read_pad_.data(), pad_bytes) != stored_crc) {
      return std::string("checksum mismatch: state '") + StateName(state) + "', page " + std::to_string(page) +
             " of shard " + root_ + " (" + path + ") is corrupt";
    }
    return {};
  }

  std::string WritePage(int slot, int state, int64_t page, const float* src, int64_t n) override {
    const std::string path = PagePath(slot, state, page);
    const std::string tmp = path + ".nsp-tmp";
    if (fail_writes_after_ >= 0 && writes_done_.fetch_add(1) >= fail_writes_after_) {
      errno = ENOSPC;  // debug fault injection (NSP_DEBUG_FAIL_WRITES_AFTER), off unless that variable is set
      return ErrnoMessage("cannot write", tmp);
    }
    const size_t data_bytes = sizeof(float) * static_cast<size_t>(n);
    const size_t pad_bytes = chunk_bytes_ - data_bytes;  // the last chunk is padded with the fill value (0)
    uint32_t crc = checksum_ ? Crc32cExtend(Crc32c(src, data_bytes), zeros_.data(), pad_bytes) : 0;
    iovec iov[3] = {{const_cast<float*>(src), data_bytes}, {zeros_.data(), pad_bytes}, {&crc, checksum_ ? 4u : 0u}};
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoMessage("cannot create", tmp);
    const ssize_t put = WriteFullV(fd, iov, 3);
    const int write_errno = errno;
    const bool complete = put == static_cast<ssize_t>(file_bytes_);
    // Start write-back now so the commit's sync finds little left to do.
    if (complete) ::sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);
    const bool closed = ::close(fd) == 0;
    if (!complete || !closed) {
      ::unlink(tmp.c_str());
      errno = !complete ? (put < 0 ? write_errno : ENOSPC) : errno;
      return ErrnoMessage("cannot write", tmp);
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      const std::string err = ErrnoMessage("cannot rename into", path);
      ::unlink(tmp.c_str());
      return err;
    }
    std::lock_guard<std::mutex> lock(written_mu_);
    written_[slot].push_back(path);
    return {};
  }

  std::string Sync(int slot) override {
    std::vector<std::string> paths;
    {
      std::lock_guard<std::mutex> lock(written_mu_);
      paths.swap(written_[slot]);
    }
    if (paths.empty()) return {};
    // One pass per commit: flush the whole file system the shard lives on (data and the renames' metadata).
    const int dirfd = ::open(root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dirfd < 0) return ErrnoMessage("cannot open", root_);
    const int rc = ::syncfs(dirfd);
    const int sync_errno = errno;
    ::close(dirfd);
    if (rc != 0) {
      errno = sync_errno;
      return ErrnoMessage("cannot sync", root_);
    }
    for (const std::string& path : paths) {  // now clean: drop them from the page cache
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0) {
        ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        ::close(fd);
      }
    }
    return {};
  }

 private:
  std::string PagePath(int slot, int state, int64_t page) const {
    return root_ + "/slot" + std::to_string(slot) + "/" + StateName(state) + "/c/" + std::to_string(page);
  }

  // Reads or writes all of `iov`, retrying short transfers; returns the bytes moved, or -1 on error.
  template <typename Op>
  static ssize_t TransferV(Op op, int fd, iovec* iov, int count) {
    size_t done = 0;
    int first = 0;
    while (first < count) {
      if (iov[first].iov_len == 0) {
        ++first;
        continue;
      }
      const ssize_t r = op(fd, iov + first, count - first);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return -1;
      if (r == 0) break;
      done += static_cast<size_t>(r);
      size_t left = static_cast<size_t>(r);
      while (first < count && left >= iov[first].iov_len) left -= iov[first++].iov_len;
      if (left > 0) {
        iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
        iov[first].iov_len -= left;
      }
    }
    return static_cast<ssize_t>(done);
  }
  static ssize_t ReadFullV(int fd, iovec* iov, int count) { return TransferV(::readv, fd, iov, count); }
  static ssize_t WriteFullV(int fd, iovec* iov, int count) {
    return TransferV([](int f, const iovec* v, int c) { return ::writev(f, v, c); }, fd, iov, count);
  }

  std::string root_;
  int64_t size_;
  int64_t page_elems_;
  bool checksum_;
  size_t chunk_bytes_ = 0, file_bytes_ = 0;
  int64_t fail_writes_after_ = -1;
  std::atomic<int64_t> writes_done_{0};
  std::vector<char> zeros_;     // written as the last page's padding
  std::vector<char> read_pad_;  // receives the last page's padding on reads (one reader thread per shard)
  std::mutex written_mu_;
  std::vector<std::string> written_[2];
};

}  // namespace

std::unique_ptr<Backend> MakeMemoryBackend(int64_t size, int64_t page_elems, std::vector<bool> states_used) {
  return std::make_unique<MemoryBackend>(size, page_elems, std::move(states_used));
}

std::unique_ptr<Backend> MakeFileBackend(std::string root, int64_t size, int64_t page_elems, bool checksum) {
  return std::make_unique<FileBackend>(std::move(root), size, page_elems, checksum);
}

}  // namespace nsp
