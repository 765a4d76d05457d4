// The file tier's read-mode setting and calibration (read_mode.h).
#include "read_mode.h"

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
  calibrating_ = can_direct && mode_ == ReadMode::kAuto && streams_ > 0 && (streams_ <= 2 || streams_ % kRetry == 0);
  for (int way = 0; way < 2; ++way) {
    calib_ns_[way].store(0);
    calib_bytes_[way].store(0);
  }
}

void ReadModeChooser::StreamFinished(bool ok) {
  if (calibrating_ && ok && calib_bytes_[kDirectWay].load() > 0 && calib_bytes_[kBufferedWay].load() > 0) {
    // Each way's time per byte weighs this measurement half and the earlier ones the other half, so that one
    // disturbed update does not decide alone.
    for (int way = 0; way < 2; ++way) {
      const double per_byte =
          static_cast<double>(calib_ns_[way].load()) / static_cast<double>(calib_bytes_[way].load());
      ns_per_byte_[way] = ns_per_byte_[way] == 0 ? per_byte : 0.5 * (ns_per_byte_[way] + per_byte);
    }
    buffered_faster_.store(ns_per_byte_[kBufferedWay] < ns_per_byte_[kDirectWay]);
  }
  calibrating_ = false;
  ++streams_;
}

}  // namespace nsp
