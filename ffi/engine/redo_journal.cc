// The redo journal of a one-slot shard: writing it durably, appending a window's record, reading it back for
// recovery, and the barrier that keeps a store's shards from switching pages before all their journals exist.
// The format and the protocol are redo_journal.h's.
#include "engine/redo_journal.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "util/crc32c.h"

namespace nsp {
namespace {

// 2: the header names the payload's kind and a staged gradient's scale (format 1's journals are refused).
constexpr char kMagic[8] = {'N', 'S', 'P', 'R', 'E', 'D', 'O', '2'};
constexpr int64_t kRecordMagic = 0x44524345524f444eLL;  // "NODRECRD"

std::string Errno(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

bool WriteAll(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t put = ::write(fd, p, bytes);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      if (put == 0) errno = ENOSPC;
      return false;
    }
    p += put;
    bytes -= static_cast<size_t>(put);
  }
  return true;
}

std::string FsyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("cannot open", dir);
  const bool ok = ::fsync(fd) == 0;
  ::close(fd);
  return ok ? std::string() : Errno("cannot sync", dir);
}

}  // namespace

void MaybeKillInJournal() {
  static const int64_t at = [] {
    const char* env = std::getenv("NSP_DEBUG_KILL_IN_JOURNAL");
    return env ? std::atoll(env) : int64_t{-1};
  }();
  static std::atomic<int64_t> journals{0};
  if (at >= 0 && journals.fetch_add(1) + 1 >= at) ::raise(SIGKILL);
}

RedoJournal::~RedoJournal() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

namespace {

JournalHeader MakeHeader(int64_t version, int64_t size, int64_t page_elems, const UpdateHyperParams& hp,
                         GradType type, JournalPayload payload, int64_t count, float scale) {
  JournalHeader h;
  std::memset(&h, 0, sizeof h);  // padding included: the header's CRC covers its bytes
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.version = version;
  h.size = size;
  h.page_elems = page_elems;
  h.compressed = static_cast<int32_t>(payload);
  h.grad_type = static_cast<int32_t>(type);
  h.count = count;
  h.stage_scale = scale;
  h.hp_bytes = static_cast<int64_t>(sizeof(UpdateHyperParams));
  std::memcpy(&h.hp, &hp, sizeof hp);
  return h;
}

// Writes header `h`, the payload `body` writes to `fd` (the temporary file `tmp`; it extends *crc over what it
// writes and returns "" or an error), and the CRC to that file, makes it durable and renames it in: the journal
// in `dir` exists whole or not at all.
using PayloadWriter = std::function<std::string(int fd, const std::string& tmp, uint32_t* crc)>;
std::string WriteJournalFile(const std::string& dir, const JournalHeader& h, const PayloadWriter& body) {
  const std::string path = dir + "/" + kJournalFile;
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot create", tmp);
  uint32_t crc = Crc32c(&h, sizeof h);
  bool ok = WriteAll(fd, &h, sizeof h);
  std::string err = ok ? body(fd, tmp, &crc) : std::string();
  ok = ok && err.empty() && WriteAll(fd, &crc, sizeof crc) && ::fsync(fd) == 0;
  const int write_errno = errno;
  ::close(fd);
  if (!ok) {
    ::unlink(tmp.c_str());
    if (!err.empty()) return err;
    errno = write_errno;
    return Errno("cannot write the redo journal", tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string e = Errno("cannot put the redo journal in place at", path);
    ::unlink(tmp.c_str());
    return e;
  }
  return FsyncDir(dir);
}

}  // namespace

std::string RedoJournal::Write(const std::string& dir, int64_t version, int64_t size, int64_t page_elems,
                               const UpdateHyperParams& hp, GradType type, const PageFill& fill,
                               const int32_t* indices, const void* values, int64_t count) {
  const JournalHeader h = MakeHeader(version, size, page_elems, hp, type,
                                     fill ? JournalPayload::kDense : JournalPayload::kCompressed, fill ? 0 : count,
                                     1.0f);
  const int64_t gbytes = GradBytes(type);
  return WriteJournalFile(dir, h, [&](int fd, const std::string& tmp, uint32_t* crc) -> std::string {
    if (fill) {
      std::vector<char> page(static_cast<size_t>(page_elems * gbytes));
      const int64_t pages = (size + page_elems - 1) / page_elems;
      for (int64_t i = 0; i < pages; ++i) {
        if (i == pages / 2) MaybeKillInJournal();  // a kill halfway through the journal (the fault campaign)
        const size_t bytes = static_cast<size_t>(std::min(page_elems, size - i * page_elems) * gbytes);
        if (std::string err = fill(i, page.data()); !err.empty()) return err;
        *crc = Crc32cExtend(*crc, page.data(), bytes);
        if (!WriteAll(fd, page.data(), bytes)) return Errno("cannot write the redo journal", tmp);
      }
      return {};
    }
    MaybeKillInJournal();
    const size_t ibytes = static_cast<size_t>(count) * sizeof(int32_t), vbytes = static_cast<size_t>(count * gbytes);
    *crc = Crc32cExtend(Crc32cExtend(*crc, indices, ibytes), values, vbytes);
    if (!WriteAll(fd, indices, ibytes) || !WriteAll(fd, values, vbytes)) {
      return Errno("cannot write the redo journal", tmp);
    }
    return {};
  });
}

std::string RedoJournal::WriteStaged(const std::string& dir, int64_t version, int64_t size, int64_t page_elems,
                                     const UpdateHyperParams& hp, GradType type, int64_t staged, float scale,
                                     const std::vector<uint32_t>& page_crcs) {
  if (static_cast<int64_t>(page_crcs.size()) != (size + page_elems - 1) / page_elems) {
    return "internal error: a staged journal needs a checksum per page";
  }
  const JournalHeader h = MakeHeader(version, size, page_elems, hp, type, JournalPayload::kStaged, staged, scale);
  return WriteJournalFile(dir, h, [&](int fd, const std::string& tmp, uint32_t* crc) -> std::string {
    const size_t bytes = page_crcs.size() * sizeof(uint32_t);
    *crc = Crc32cExtend(*crc, page_crcs.data(), bytes);
    if (!WriteAll(fd, page_crcs.data(), bytes)) return Errno("cannot write the redo journal", tmp);
    return {};
  });
}

std::string RedoJournal::Append(const std::string& dir, const JournalRecord& record, int states) {
  const std::string path = dir + "/" + kJournalFile;
  const size_t n = static_cast<size_t>((record.end - record.first) * states);
  if (record.crcs.size() != n) return "internal error: a journal record's checksums do not cover its pages";
  std::vector<char> bytes(3 * sizeof(int64_t) + n * sizeof(uint32_t) + sizeof(uint32_t));
  char* p = bytes.data();
  for (int64_t v : {kRecordMagic, record.first, record.end}) {
    std::memcpy(p, &v, sizeof v);
    p += sizeof v;
  }
  std::memcpy(p, record.crcs.data(), n * sizeof(uint32_t));
  p += n * sizeof(uint32_t);
  const uint32_t crc = Crc32c(bytes.data(), static_cast<size_t>(p - bytes.data()));
  std::memcpy(p, &crc, sizeof crc);
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return Errno("cannot open the redo journal", path);
  const bool ok = WriteAll(fd, bytes.data(), bytes.size()) && ::fdatasync(fd) == 0;
  const int write_errno = errno;
  ::close(fd);
  if (!ok) {
    errno = write_errno;
    return Errno("cannot append to the redo journal", path);
  }
  return {};
}

std::string RedoJournal::Read(const std::string& dir, int states, std::unique_ptr<RedoJournal>* out,
                              bool check_gradient) {
  out->reset();
  const std::string path = dir + "/" + kJournalFile;
  ::unlink((path + ".tmp").c_str());  // a journal a kill interrupted was never in force
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? std::string() : Errno("cannot open the redo journal", path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const std::string e = Errno("cannot stat the redo journal", path);
    ::close(fd);
    return e;
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  std::unique_ptr<RedoJournal> j(new RedoJournal);
  if (bytes < sizeof(JournalHeader) + sizeof(uint32_t)) {
    ::close(fd);
    return "the redo journal " + path + " is truncated (" + std::to_string(bytes) + " bytes): the shard is damaged";
  }
  j->map_ = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (j->map_ == MAP_FAILED) {
    j->map_ = nullptr;
    return Errno("cannot map the redo journal", path);
  }
  j->map_bytes_ = bytes;
  const char* base = static_cast<const char*>(j->map_);
  j->header_ = reinterpret_cast<const JournalHeader*>(base);
  const JournalHeader& h = *j->header_;
  const int64_t gbytes = h.grad_type == static_cast<int32_t>(GradType::kF32) ? 4 : 2;
  int64_t payload = -1;
  if (h.size > 0 && h.page_elems > 0) {
    switch (static_cast<JournalPayload>(h.compressed)) {
      case JournalPayload::kDense: payload = h.size * gbytes; break;
      case JournalPayload::kCompressed: payload = h.count * (4 + gbytes); break;
      case JournalPayload::kStaged:
        payload = h.count >= 0 && h.count <= h.size ? (h.size + h.page_elems - 1) / h.page_elems * 4 : -1;
        break;
    }
  }
  const bool header_ok = std::memcmp(h.magic, kMagic, sizeof kMagic) == 0 &&
                         h.hp_bytes == static_cast<int64_t>(sizeof(UpdateHyperParams)) && payload >= 0 &&
                         static_cast<size_t>(payload) + sizeof h + sizeof(uint32_t) <= bytes;
  if (!header_ok) return "the redo journal " + path + " has a header this build does not read: the shard is damaged";
  j->payload_ = base + sizeof h;
  const size_t body = sizeof h + static_cast<size_t>(payload);
  uint32_t stored;
  std::memcpy(&stored, base + body, sizeof stored);
  if (check_gradient && Crc32c(base, body) != stored) {
    return "the redo journal " + path + " fails its checksum: the shard is damaged (its gradient is lost)";
  }
  // The records: each checked by its own CRC; the first that is torn (or absent) ends them.
  size_t at = body + sizeof stored;
  while (at + 3 * sizeof(int64_t) <= bytes) {
    int64_t head[3];
    std::memcpy(head, base + at, sizeof head);
    if (head[0] != kRecordMagic || head[1] < 0 || head[2] <= head[1]) break;
    const size_t n = static_cast<size_t>((head[2] - head[1]) * states);
    const size_t len = sizeof head + n * sizeof(uint32_t);
    if (at + len + sizeof(uint32_t) > bytes) break;
    std::memcpy(&stored, base + at + len, sizeof stored);
    if (Crc32c(base + at, len) != stored) break;
    JournalRecord r;
    r.first = head[1];
    r.end = head[2];
    r.crcs.resize(n);
    std::memcpy(r.crcs.data(), base + at + sizeof head, n * sizeof(uint32_t));
    j->records_.push_back(std::move(r));
    at += len + sizeof(uint32_t);
  }
  *out = std::move(j);
  return {};
}

std::string RedoJournal::Remove(const std::string& dir) {
  const std::string path = dir + "/" + kJournalFile;
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return Errno("cannot remove the redo journal", path);
  return {};
}

struct JournalBarrier::Round {
  int arrived = 0;
  bool failed = false;
};

std::shared_ptr<JournalBarrier> JournalBarrier::For(const std::string& store_id, int count) {
  static std::mutex mu;
  static auto* barriers = new std::vector<std::pair<std::string, std::weak_ptr<JournalBarrier>>>();  // leaked
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [id, weak] : *barriers) {
    if (id != store_id) continue;
    std::shared_ptr<JournalBarrier> b = weak.lock();
    if (b && b->count_ == count) return b;
    b = std::shared_ptr<JournalBarrier>(new JournalBarrier(count));
    weak = b;
    return b;
  }
  std::shared_ptr<JournalBarrier> b(new JournalBarrier(count));
  barriers->emplace_back(store_id, b);
  return b;
}

std::shared_ptr<JournalBarrier::Round> JournalBarrier::RoundOf(int64_t version) {
  for (auto& [v, r] : rounds_) {
    if (v == version) return r;
  }
  // Rounds of versions two or more behind are over (every shard of them has arrived and gone on).
  rounds_.erase(std::remove_if(rounds_.begin(), rounds_.end(), [&](const auto& e) { return e.first < version - 1; }),
                rounds_.end());
  rounds_.emplace_back(version, std::make_shared<Round>());
  return rounds_.back().second;
}

void JournalBarrier::Arrive(int64_t version, bool ok) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<Round> r = RoundOf(version);
    r->arrived += 1;
    r->failed = r->failed || !ok;
  }
  cv_.notify_all();
}

bool JournalBarrier::Wait(int64_t version, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  std::shared_ptr<Round> r = RoundOf(version);
  const bool done = cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                 [&] { return r->failed || r->arrived >= count_; });
  if (!done) r->failed = true;  // a late shard then finds the round failed, and changes nothing either
  return done && !r->failed;
}

}  // namespace nsp
