// How the file tier reads a page: direct (O_DIRECT: no page-cache copy) or buffered (the kernel's readahead),
// whichever this disk does faster. Which one wins depends on the device and its driver (a virtual disk served
// from its host's cache measured buffered reads up to 2x faster one day and 2x slower another), so
// NSP_READ_MODE=auto (the default) measures it inside updates: the second and third update (the first is cold)
// and every kRetry-th after them read alternate page files each way and time every read, so both ways meet the
// same disk at the same moment; the other updates read the way that was faster. NSP_READ_MODE=direct or
// buffered fixes it. Kept apart from the backend's I/O: this is the decision, file_backend.cc does the reads.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "elapsed.h"

namespace nsp {

enum class ReadMode { kAuto, kDirect, kBuffered };

// NSP_READ_MODE: auto (also when unset or empty), direct or buffered. Returns "" or an error naming the
// variable, its value and the valid choices.
std::string ReadModeFromEnv(ReadMode* mode);

// One backend's choice, update by update. StreamStarted and StreamFinished run on the updating thread, between
// streamed updates; the page readers of an update call the rest.
class ReadModeChooser {
 public:
  explicit ReadModeChooser(ReadMode mode) : mode_(mode) {}

  // `can_direct`: the file system has taken O_DIRECT so far (no calibration against a way it refuses).
  void StreamStarted(bool can_direct);
  // `ok` false: the update failed, its timings are not a fair measurement.
  void StreamFinished(bool ok);

  // Whether reads go direct, where the file system and the buffer allow it: the setting, and in auto mode what
  // the calibrations measured. The one source of that choice.
  bool PrefersDirect() const { return mode_ != ReadMode::kBuffered && !buffered_faster_.load(); }
  // Whether this update calibrates: its reads into engine page buffers go the way CalibrationReadsDirect says,
  // each one timed (Timed).
  bool calibrating() const { return calibrating_; }
  // Alternate page files each way, so both ways meet the same disk at the same moment.
  static bool CalibrationReadsDirect(int64_t page, int state) { return (page + state) % 2 == 0; }

  // Runs `read` (a page read of `bytes` the way `direct` says; returns "" or an error) and, when it succeeded,
  // counts its time toward that way.
  template <typename Read>
  std::string Timed(bool direct, int64_t bytes, Read read) {
    const auto start = std::chrono::steady_clock::now();
    std::string err = read();
    const int64_t ns = NsSince(start);
    if (err.empty()) {
      calib_ns_[direct ? kDirectWay : kBufferedWay].fetch_add(ns);
      calib_bytes_[direct ? kDirectWay : kBufferedWay].fetch_add(bytes);
    }
    return err;
  }

 private:
  enum Way { kDirectWay = 0, kBufferedWay = 1 };
  static constexpr int64_t kRetry = 32;  // calibrate again every kRetry-th update

  const ReadMode mode_;
  int64_t streams_ = 0;
  bool calibrating_ = false;  // set and cleared between streams, read by the readers during one
  std::atomic<bool> buffered_faster_{false};
  double ns_per_byte_[2] = {0, 0};  // each way's time per byte, over the calibrations so far
  std::atomic<int64_t> calib_ns_[2] = {0, 0}, calib_bytes_[2] = {0, 0};  // this calibration's timed reads
};

}  // namespace nsp
