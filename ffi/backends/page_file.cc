// Page-file I/O primitives of the file tier (page_file.h): transfers, cache dropping, the group-committed sync.
#include "backends/page_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

namespace nsp::page_file {

namespace {

constexpr int kRequestBuffers = 8;  // buffers one request gathers at most (the file tier's have up to 3)

// Reads or writes all of `iov` with `op` (readv or writev), kMaxRequestBytes at most per call, retrying short
// transfers; returns the bytes moved, or -1 on error.
template <typename Op>
ssize_t TransferV(Op op, int fd, iovec* iov, int count) {
  size_t done = 0;
  int first = 0;
  while (first < count) {
    if (iov[first].iov_len == 0) {
      ++first;
      continue;
    }
    // This call's request: the buffers from `first` on, cut at kMaxRequestBytes (a multiple of kAlign, so that a
    // direct transfer's pieces stay aligned).
    iovec request[kRequestBuffers];
    int n = 0;
    for (size_t room = kMaxRequestBytes; first + n < count && n < kRequestBuffers && room > 0; ++n) {
      request[n] = iov[first + n];
      request[n].iov_len = std::min(request[n].iov_len, room);
      room -= request[n].iov_len;
    }
    const ssize_t r = op(fd, request, n);
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

}  // namespace

ssize_t ReadAll(int fd, iovec* iov, int count) { return TransferV(::readv, fd, iov, count); }

ssize_t WriteAll(int fd, iovec* iov, int count) {
  return TransferV([](int f, const iovec* v, int c) { return ::writev(f, v, c); }, fd, iov, count);
}

bool StopDirect(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags & ~O_DIRECT) == 0;
}

void DropFromCache(int fd, size_t file_bytes) {
  const off_t whole_blocks = static_cast<off_t>(WholeBlocks(file_bytes));
  if (whole_blocks > 0) ::posix_fadvise(fd, 0, whole_blocks, POSIX_FADV_DONTNEED);
}

// Group commit of syncfs: shards on one file system that commit together (one step, several shards) share a
// flush instead of each paying for one. A caller takes a ticket once its writes are done; a syncfs that starts
// after that covers it, so a caller whose ticket an earlier flush already covered returns at once.
std::string GroupSync(const std::string& dir) {
  struct Device {
    std::mutex mu;
    uint64_t requested = 0;  // tickets handed out
    uint64_t synced = 0;     // every ticket up to this one is durable
  };
  static std::mutex devices_mu;
  static auto* devices = new std::map<dev_t, std::unique_ptr<Device>>();  // leaked: outlives every shard
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return ErrnoMessage("cannot stat", dir);
  Device* device;
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(devices_mu);
    auto& slot = (*devices)[st.st_dev];
    if (!slot) slot = std::make_unique<Device>();
    device = slot.get();
    ticket = ++device->requested;
  }
  std::lock_guard<std::mutex> lock(device->mu);
  if (device->synced >= ticket) return {};
  uint64_t covered;
  {
    std::lock_guard<std::mutex> count_lock(devices_mu);
    covered = device->requested;  // every ticket taken so far had its writes done before taking it
  }
  const int dirfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) return ErrnoMessage("cannot open", dir);
  const int rc = ::syncfs(dirfd);
  const int sync_errno = errno;
  ::close(dirfd);
  if (rc != 0) {
    errno = sync_errno;
    return ErrnoMessage("cannot sync", dir);
  }
  device->synced = covered;
  return {};
}

std::string RenameInto(const std::string& tmp, const std::string& path) {
  if (::rename(tmp.c_str(), path.c_str()) == 0) return {};
  const std::string err = ErrnoMessage("cannot rename into", path);
  ::unlink(tmp.c_str());
  return err;
}

std::string ErrnoMessage(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

std::string MissingMessage(const std::string& path) {
  return "page file " + path + " is missing: the store is damaged (every version holds all its pages)";
}

std::string TruncatedMessage(const std::string& path, ssize_t got, size_t expected) {
  return "page file " + path + " is truncated: " + std::to_string(got) + " bytes, expected " +
         std::to_string(expected);
}

}  // namespace nsp::page_file
