// The csd device's model clock: the time its real operations would take on a computational-storage device with
// the given link figures. Model seconds only, never wall time: the same configuration and the same sequence of
// pages always give the same seconds.
//
// Each operation is charged as it happens, to the link that carries it:
//   read link     page reads, storage -> the device's buffers (p2p_read_gbps)
//   write link    page writes, buffers -> storage (p2p_write_gbps)
//   updater       the kernel's intake: the page's state bytes and a dense gradient's (updater_gbps)
//   host link     the page's gradient coming in and its params going out. It passes the device's own link
//                 (device_link_gbps) and the link all N devices of the store share, of which this device gets a
//                 fair share (shared_gbps / N); the slower of the two sets its rate.
// A link's busy seconds are its bytes over its rate (the shared link: this device's bytes over its fair share).
//
// An update streams its pages through five stages, in page order:
//   read -> gradient in -> update -> params out -> write
// on three resources, as nsp.csd.clock counts them: the SSD serves reads and writes in turn (but for the
// `ssd_overlap` fraction of the shorter of a page's read and write, which runs beside the longer), the host link
// carries both directions, the updater computes. Each stage takes pages in order; a page enters a stage once it
// has left the one before; a read waits for a free buffer set (at most `pages_in_flight` pages between the
// first stage and the end of the last); and whichever operation can start earliest on its resource goes first
// (ties: the later stage). The update takes as long as its last page's write ends. Operations outside an update
// (initialisation, whole-state reads, verification) are charged to the links' bytes and busy seconds, not to any
// update's time.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backends/csd/csd_options.h"

namespace nsp::csd {

class ModelClock {
 public:
  ModelClock(const Figures& figures, int64_t num_devices, int pages_in_flight);

  // Each charge names its page (-1: unknown, charged to the links but to no page of the update).
  void ChargeRead(int64_t page, int64_t bytes);
  void ChargeWrite(int64_t page, int64_t bytes);
  // One kernel run: `host_in` bytes of gradient came in, `updater` bytes went through the updater, `host_out`
  // bytes of params go out.
  void ChargeKernel(int64_t page, int64_t host_in, int64_t updater, int64_t host_out);

  void BeginUpdate();
  // Ends the update begun last: its pages' pipeline gives its model seconds (also for a failed update: the time
  // of what it did).
  void EndUpdate(bool ok);

  // name, value pairs (see csd_backend.cc's stats for the names).
  std::vector<std::pair<std::string, double>> Stats() const;

 private:
  enum Stage { kRead = 0, kGradIn = 1, kUpdate = 2, kParamsOut = 3, kWrite = 4, kStages = 5 };
  // A page's bytes in each stage of the update under way. Bytes, not seconds, are summed as operations come (in
  // whatever order the engine's threads make them): integer sums do not depend on that order, so the seconds
  // worked out from them at the end are the same in every run.
  using PageBytes = std::array<int64_t, kStages>;
  void AddToPage(int64_t page, Stage stage, int64_t bytes);
  double Seconds(Stage stage, int64_t bytes) const;
  double StageSeconds(Stage stage, const PageBytes& bytes) const;  // a page's seconds in `stage`
  double Pipeline() const;  // when the last page of pages_ leaves the write stage (mutex held)

  const Figures figures_;
  const int64_t num_devices_;
  const int pages_in_flight_;
  const double host_rate_;  // bytes/s of the host link as this device sees it: min(device link, shared / N)

  mutable std::mutex mu_;
  bool in_update_ = false;
  std::map<int64_t, PageBytes> pages_;  // the update under way, in page order
  double last_update_s_ = 0, total_s_ = 0;
  int64_t updates_ = 0, failed_updates_ = 0;
  // Bytes per resource since open (busy seconds follow from them).
  int64_t read_bytes_ = 0, write_bytes_ = 0, updater_bytes_ = 0, host_in_bytes_ = 0, host_out_bytes_ = 0;
};

}  // namespace nsp::csd
