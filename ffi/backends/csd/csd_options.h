// The csd device's settings, parsed from its options string ("key=value;key=value"): the link figures of its
// model clock and the faults a test asks it to inject. Every figure must be given: the defaults, each cited,
// live in one place in Python (nsp.csd.device_options fills them from nsp.csd.LinkFigures), never here.
#pragma once

#include <cstdint>
#include <string>

namespace nsp::csd {

// Bandwidths in GB/s (1 GB = 1e9 bytes), as nsp.csd.LinkFigures names them.
struct Figures {
  double device_link_gbps = 0;  // the device's own link to the host
  double p2p_read_gbps = 0;     // storage -> the device's buffers (its internal read link)
  double p2p_write_gbps = 0;    // the device's buffers -> storage (its internal write link)
  double updater_gbps = 0;      // bytes of state and gradient the device's updater takes in per second
  double shared_gbps = 0;       // the host link all devices of the store share
  // Not a bandwidth: the fraction of the shorter of a page's SSD read and write that runs beside the longer
  // (0: the SSD serves them in turn; 1: both at once), as nsp.csd.LinkFigures.ssd_overlap.
  double ssd_overlap = 0;
};

// The k-th operation of a kind (1-based, counted from the device's open) fails once; 0: none.
struct Faults {
  int64_t kernel_at = 0;
  int64_t read_at = 0;
  int64_t write_at = 0;
};

struct Options {
  Figures figures;
  Faults faults;
};

// Parses `text` into `out`. Returns "" or a message naming the option: an item that is not key=value, a key the
// device does not take (the valid ones listed), one given twice, a figure missing or not a positive finite
// number, a fault count that is not a positive integer.
std::string ParseOptions(const std::string& text, Options* out);

}  // namespace nsp::csd
