// A spill area: a directory where the forward pass leaves the activations the backward pass will need again
// (nsp.offload). Each stack (`slot`: one wrapped layer function on one device) has entries, one file each: the
// forward pushes, the backward pops, so a layer function called N times inside a scan needs no key (the scan's
// backward runs its iterations in the reverse order of the forward's). A pop names the depth its push returned,
// and a mismatch is an error, never a wrong tensor. Files are scratch, never state: rewritten every step, removed
// when the area closes.
//
// An entry of at most `image_limit` bytes moves as an image (spill_image.h), the disk's work on the area's I/O
// thread, so that the step's threads only copy:
// - A push copies its arrays into the entry's image and returns; the I/O thread writes the image behind the
//   forward pass. At most `write_behind` images wait in memory: a push waits for the oldest write beyond that.
//   An entry popped before its write is done is read from its image, and its write dropped (the backward starts
//   with the entries the forward pushed last).
// - A pop copies from its entry's image (read ahead, or still in memory), then has the I/O thread read the
//   `read_ahead` entries the backward needs next while the step computes.
// - Where the file system takes it, images move by direct I/O (O_DIRECT): no page-cache copy, and none of the
//   kernel's time writing dirty pages back, which on a 2-core machine is time the step's compute loses.
//   Otherwise (tmpfs) through the page cache, dropped from it once read.
// A larger entry (or any, with write_behind 0) moves on the calling thread through the page cache, straight
// between the step's arrays and the file, its read ahead left to the kernel (posix_fadvise): the area holds none
// of its bytes, so the memory an area holds stays under max(read_ahead, write_behind, 1) x image_limit.
// A write that fails (a full disk, a directory turned read-only) is reported by the next push or pop; a missing
// or read-only directory by the push itself, which opens its file.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "offload/spill_image.h"
#include "util/handle_registry.h"
#include "util/worker_thread.h"

namespace nsp::spill {

struct SpillStats {
  int64_t saves = 0;              // entries pushed
  int64_t loads = 0;              // entries popped
  int64_t bytes_written = 0;      // of the entries pushed (their images: headers and the sparse format included)
  int64_t bytes_read = 0;         // of the entries popped
  int64_t array_bytes = 0;        // of the arrays saved, as they are in memory
  int64_t arrays_sparse = 0;      // arrays stored in the bit-vector sparse format (spill_codec.h)
  int64_t disk_bytes_written = 0; // that reached the disk (entries popped before their write never do)
  int64_t disk_bytes_read = 0;
  int64_t read_ahead = 0;         // entries read ahead of their pop (by the I/O thread, or hinted to the kernel)
  int64_t loads_from_memory = 0;  // pops served from an image written behind or read ahead
  int64_t save_waits = 0;         // pushes that waited for a write (write_behind images were in memory)
  int64_t direct_io = 0;          // 1: the files move by O_DIRECT
};

enum class IoMode { kAuto, kDirect, kBuffered };

struct SpillOptions {
  int read_ahead = 1;    // entries read ahead of the backward
  int write_behind = 1;  // images waiting to be written (0: each push writes on the calling thread)
  size_t image_limit = size_t{256} << 20;  // the largest entry that moves as an image
  IoMode io = IoMode::kAuto;  // auto: direct where the file system takes it
};

class SpillArea {
 public:
  // `dir` must exist and be writable (checked here: a clear error at open, not mid-step).
  static std::pair<std::shared_ptr<SpillArea>, std::string> Open(const std::string& dir, const SpillOptions& options);
  ~SpillArea();

  // Pushes the `arrays` onto `slot`'s stack as one entry; `*depth` gets its depth. Returns "" or an error naming
  // the file.
  std::string Save(int64_t slot, const std::vector<SpillArray>& arrays, int32_t* depth);
  // Pops the top of `slot`'s stack, which must be at `depth`, into `arrays` (sizes as saved).
  std::string Load(int64_t slot, int32_t depth, const std::vector<SpillOut>& arrays);
  // Forgets every entry and pending write (after a step that failed between its pushes and its pops).
  void Reset();

  SpillStats Stats();
  const std::string& dir() const { return dir_; }
  bool direct() const { return direct_; }
  // Stops the I/O thread and removes every file the area wrote (at close).
  void RemoveFiles();

 private:
  using Key = std::pair<int64_t, int32_t>;  // (stack, depth)
  enum class State { kQueuedWrite, kWriting, kQueuedRead, kReading, kReady };
  // An entry's image in memory: written behind, or read ahead. Its buffer goes back to the pool when the last
  // holder (the map, a pop copying from it, the I/O thread writing it) lets go.
  struct Held {
    std::shared_ptr<BufferPool> pool;
    AlignedBuffer image;
    size_t bytes = 0;     // of the image (its file holds it rounded up to whole blocks when direct)
    std::string path;
    int fd = -1;          // opened for writing by the push
    State state = State::kQueuedWrite;
    bool wanted = false;  // a pop is coming: keep the image once written
    std::string error;    // of its read ahead
    ~Held();
  };
  struct Entry {
    int64_t slot;
    int32_t depth;
    size_t bytes;
    bool imaged;  // written as an image (direct where the area is), else through the page cache
  };

  SpillArea(std::string dir, const SpillOptions& options, bool direct);
  std::string PathOf(int64_t slot, int32_t depth) const;
  int OpenToWrite(const std::string& path) const;
  std::string WriteFile(Held& held);                        // the calling thread holds no lock
  std::string ReadFile(const std::string& path, size_t bytes, AlignedBuffer* image);  // likewise
  // A large entry, on the calling thread through the page cache: straight from the arrays, straight to them.
  std::string WriteThrough(const std::string& path, const std::vector<SpillArray>& arrays,
                           const ImageLayout& layout);
  std::string ReadThrough(const std::string& path, const std::vector<SpillOut>& arrays);
  void QueueReadAhead(size_t position);                     // holds mu_
  int WritesInMemory() const;                               // holds mu_
  void IoLoop();

  const std::string dir_;
  const int read_ahead_;
  const int write_behind_;
  const size_t image_limit_;
  const bool direct_;
  std::shared_ptr<BufferPool> pool_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Entry> order_;                    // the entries on the stacks, in the order they were pushed
  std::vector<Entry> written_;                  // every file written (removed at close)
  std::map<int64_t, int32_t> depth_;            // each slot's stack height
  std::map<Key, std::shared_ptr<Held>> held_;   // entries whose image is in memory
  std::deque<Key> tasks_;                       // for the I/O thread: entries to write or read, in order
  std::string write_error_;                     // the first failed write since the last Reset
  SpillStats stats_;
  bool stop_ = false;
  WorkerThread io_;
};

// The process's open areas by id, for the XLA handlers (an attribute carries the id).
inline HandleRegistry<SpillArea>& Areas() { return HandleRegistry<SpillArea>::Global(); }

}  // namespace nsp::spill
