// GradientStage (gradient_stage.h): positional reads and writes of one shard's staged gradient.
#include "engine/gradient_stage.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace nsp {

namespace {

std::string Failed(const char* what, const std::string& path) {
  return std::string("gradient stage ") + path + ": " + what + ": " + std::strerror(errno);
}

}  // namespace

std::string GradientStage::Open(const std::string& path, std::unique_ptr<GradientStage>* out) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Failed("cannot open", path);
  out->reset(new GradientStage(fd, path));
  return {};
}

GradientStage::~GradientStage() { ::close(fd_); }

std::string GradientStage::Write(int64_t at, const void* src, int64_t n, int64_t elem_bytes) const {
  const char* p = static_cast<const char*>(src);
  size_t left = static_cast<size_t>(n * elem_bytes);
  off_t offset = static_cast<off_t>(at * elem_bytes);
  while (left > 0) {
    const ssize_t done = ::pwrite(fd_, p, left, offset);
    if (done < 0) {
      if (errno == EINTR) continue;
      return Failed("write failed", path_);
    }
    p += done;
    left -= static_cast<size_t>(done);
    offset += done;
  }
  return {};
}

std::string GradientStage::Read(int64_t at, void* dst, int64_t n, int64_t elem_bytes) const {
  char* p = static_cast<char*>(dst);
  size_t left = static_cast<size_t>(n * elem_bytes);
  off_t offset = static_cast<off_t>(at * elem_bytes);
  while (left > 0) {
    const ssize_t done = ::pread(fd_, p, left, offset);
    if (done < 0) {
      if (errno == EINTR) continue;
      return Failed("read failed", path_);
    }
    if (done == 0) {
      return "gradient stage " + path_ + ": elements from " + std::to_string(offset / elem_bytes) +
             " were never staged (the file ends there)";
    }
    p += done;
    left -= static_cast<size_t>(done);
    offset += done;
  }
  return {};
}

std::string GradientStage::Sync() const {
  if (::fdatasync(fd_) != 0) return Failed("cannot sync", path_);
  return {};
}

int64_t GradientStage::Bytes() const {
  struct stat st;
  return ::fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

}  // namespace nsp
