// A spill area: a directory where the forward pass leaves the activations the backward pass will need again
// (nsp.offload). Each stack (`slot`: one wrapped layer function on one device) has entries, one file each: the
// forward pushes, the backward pops, so a layer function called N times inside a scan needs no key (the scan's
// backward runs its iterations in the reverse order of the forward's). A pop names the depth its push returned,
// and a mismatch is an error, never a wrong tensor. Files are scratch, never state: rewritten every step, removed
// when the area closes.
//
// Reads come back in the reverse order of the writes. When an entry is read, the `read_ahead` entries written
// just before it are handed to the kernel to read in the background
// (posix_fadvise WILLNEED): they are in the page cache by the time the backward reaches them, and the process
// holds none of that memory meanwhile. Writes go through the page cache too (the kernel writes them back under
// memory pressure); the process's own memory never holds a spilled tensor once its write returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "util/handle_registry.h"

namespace nsp::spill {

struct SpillStats {
  int64_t saves = 0;           // entries written
  int64_t loads = 0;           // entries read back
  int64_t bytes_written = 0;   // to the files (headers and the sparse format included)
  int64_t bytes_read = 0;
  int64_t array_bytes = 0;     // of the arrays saved, as they are in memory
  int64_t arrays_sparse = 0;   // arrays stored in the bit-vector sparse format (spill_codec.h)
  int64_t read_ahead_hints = 0;  // entries handed to the kernel to read ahead
};

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

class SpillArea {
 public:
  // `dir` must exist and be writable (checked here: a clear error at open, not mid-step).
  static std::pair<std::shared_ptr<SpillArea>, std::string> Open(const std::string& dir, int read_ahead);
  ~SpillArea();

  // Pushes the `arrays` onto `slot`'s stack as one file (a header naming each array's format and size, then the
  // arrays one after another); `*depth` gets the entry's depth. Returns "" or an error naming the file.
  std::string Save(int64_t slot, const std::vector<SpillArray>& arrays, int32_t* depth);
  // Pops the top of `slot`'s stack, which must be at `depth`, into `arrays` (sizes as saved).
  std::string Load(int64_t slot, int32_t depth, const std::vector<SpillOut>& arrays);
  // Forgets every entry (after a step that failed between its pushes and its pops).
  void Reset();

  SpillStats Stats();
  const std::string& dir() const { return dir_; }
  // Removes every file the area wrote (at close).
  void RemoveFiles();

 private:
  SpillArea(std::string dir, int read_ahead) : dir_(std::move(dir)), read_ahead_(read_ahead) {}
  std::string PathOf(int64_t slot, int32_t depth) const;
  void HintReadAhead(size_t position);  // holds mu_
  std::string ReadEntry(int fd, const std::string& path, const std::vector<SpillOut>& arrays);

  struct Entry {
    int64_t slot;
    int32_t depth;
    size_t bytes;
  };

  const std::string dir_;
  const int read_ahead_;
  std::mutex mu_;
  std::vector<Entry> order_;        // the entries on the stacks, in the order they were pushed
  std::vector<Entry> written_;      // every file written (removed at close)
  SpillStats stats_;
  std::map<int64_t, int32_t> depth_;  // each slot's stack height
};

// The process's open areas by id, for the XLA handlers (an attribute carries the id).
inline HandleRegistry<SpillArea>& Areas() { return HandleRegistry<SpillArea>::Global(); }

}  // namespace nsp::spill
