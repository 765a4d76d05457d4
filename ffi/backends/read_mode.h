// How the file tier reads a page: direct (O_DIRECT: no page-cache copy) or buffered (the kernel's readahead),
// whichever makes this disk's updates faster. Which one wins depends on the device and its driver (a virtual disk
// served from its host's cache measured buffered reads up to 2x faster one day and 2x slower another), so
// NSP_READ_MODE=auto (the default) measures it: every update after the first is timed (its time per byte read),
// and the third update and every kRetry-th after it read all their pages the other way, a trial. The way a trial
// measured is taken when its update was at least kMargin faster than the recent updates of the way in use.
// Whole updates are compared, not single reads: with the page writes in flight beside them, direct and buffered
// reads each waited about as long (their times per read differed by less than 10% either way, at random), while
// whole updates reading buffered took twice as long. NSP_READ_MODE=direct or buffered fixes the way. Kept apart
// from the backend's I/O: this is the decision, file_backend.cc does the reads.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "util/elapsed.h"

namespace nsp {

enum class ReadMode { kAuto, kDirect, kBuffered };

// NSP_READ_MODE: auto (also when unset or empty), direct or buffered. Returns "" or an error naming the
// variable, its value and the valid choices.
std::string ReadModeFromEnv(ReadMode* mode);

// One backend's choice, update by update. StreamStarted and StreamFinished run on the updating thread, between
// streamed updates; the page readers of an update call ReadsDirect and CountRead.
class ReadModeChooser {
 public:
  explicit ReadModeChooser(ReadMode mode) : mode_(mode) {}

  // `can_direct`: the file system has taken O_DIRECT so far (no measuring against a way it refuses).
  void StreamStarted(bool can_direct);
  // `ok` false: the update failed, its time is not a fair measurement.
  void StreamFinished(bool ok);

  // Whether this update's page reads go direct, where the file system and the buffer allow it: the setting, in
  // auto mode the way in use or, in a trial, the other one. The one source of that choice.
  bool ReadsDirect() const { return reads_direct_.load(std::memory_order_relaxed); }
  // Counts a page read of this update toward its time per byte.
  void CountRead(int64_t bytes) { bytes_read_.fetch_add(bytes, std::memory_order_relaxed); }

 private:
  enum Way { kDirectWay = 0, kBufferedWay = 1 };
  static constexpr int64_t kRetry = 32;  // a trial every kRetry-th update (and the third)
  static constexpr double kMargin = 0.10;  // a trial's way is taken when this much faster

  const ReadMode mode_;
  int64_t streams_ = 0;
  bool measuring_ = false;  // this update's time counts (auto mode, O_DIRECT possible, not the first update)
  bool trial_ = false;
  int way_ = kDirectWay;  // the way in use (auto mode)
  std::atomic<bool> reads_direct_{true};  // this update's way, read by the page readers
  double ns_per_byte_ = 0;  // recent updates of the way in use: each weighs half, the ones before the other half
  std::chrono::steady_clock::time_point started_;
  std::atomic<int64_t> bytes_read_{0};
};

}  // namespace nsp
