// The file tier's read-mode setting and calibration (read_mode.h).
#include "backends/read_mode.h"

#include <cstdlib>

namespace nsp {

std::string ReadModeFromEnv(ReadMode* mode) {
  const char* env = std::getenv("NSP_READ_MODE");
  const std::string value = env == nullptr ? "" : env;
  if (value.empty() || value == "auto") {
    *mode = ReadMode::kAuto;
  } else if (value == "direct") {
    *mode = ReadMode::kDirect;
  } else if (value == "buffered") {
    *mode = ReadMode::kBuffered;
  } else {
    return "NSP_READ_MODE='" + value + "' is not one of auto, direct, buffered";
  }
  return {};
}

void ReadModeChooser::StreamStarted(bool can_direct) {
  measuring_ = mode_ == ReadMode::kAuto && can_direct && streams_ > 0;
  trial_ = measuring_ && (streams_ == 2 || streams_ % kRetry == 0);
  const int way = mode_ == ReadMode::kAuto ? (trial_ ? 1 - way_ : way_)
                  : mode_ == ReadMode::kBuffered ? kBufferedWay : kDirectWay;
  reads_direct_.store(way == kDirectWay);
  bytes_read_.store(0);
  started_ = std::chrono::steady_clock::now();
}

void ReadModeChooser::StreamFinished(bool ok) {
  const int64_t bytes = bytes_read_.load();
  if (measuring_ && ok && bytes > 0) {
    const double per_byte = static_cast<double>(NsSince(started_)) / static_cast<double>(bytes);
    if (!trial_) {
      ns_per_byte_ = ns_per_byte_ == 0 ? per_byte : 0.5 * (ns_per_byte_ + per_byte);
    } else if (ns_per_byte_ > 0 && per_byte < (1.0 - kMargin) * ns_per_byte_) {
      // The trial's way was clearly faster than the way in use (a trial with no record to compare against, as
      // after a failed second update, decides nothing): use it, its update the first of its record.
      way_ = 1 - way_;
      ns_per_byte_ = per_byte;
    }
  }
  measuring_ = trial_ = false;
  ++streams_;
}

}  // namespace nsp
