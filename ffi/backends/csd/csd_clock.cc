// The csd device's model clock (csd_clock.h).
#include "backends/csd/csd_clock.h"

#include <algorithm>
#include <vector>

namespace nsp::csd {

namespace {
constexpr double kGB = 1e9;  // the GB of every figure (decimal, as nsp.csd.figures.GB)
}

ModelClock::ModelClock(const Figures& figures, int64_t num_devices, int pages_in_flight)
    : figures_(figures),
      num_devices_(std::max<int64_t>(1, num_devices)),
      pages_in_flight_(std::max(1, pages_in_flight)),
      host_rate_(std::min(figures.device_link_gbps, figures.shared_gbps / static_cast<double>(num_devices_)) * kGB) {}

double ModelClock::Seconds(Stage stage, int64_t bytes) const {
  const double b = static_cast<double>(bytes);
  switch (stage) {
    case kRead:
      return b / (figures_.p2p_read_gbps * kGB);
    case kWrite:
      return b / (figures_.p2p_write_gbps * kGB);
    case kUpdate:
      return b / (figures_.updater_gbps * kGB);
    default:
      return b / host_rate_;
  }
}

void ModelClock::AddToPage(int64_t page, Stage stage, int64_t bytes) {
  if (in_update_ && page >= 0) pages_[page][stage] += bytes;
}

void ModelClock::ChargeRead(int64_t page, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  read_bytes_ += bytes;
  AddToPage(page, kRead, bytes);
}

void ModelClock::ChargeWrite(int64_t page, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  write_bytes_ += bytes;
  AddToPage(page, kWrite, bytes);
}

void ModelClock::ChargeKernel(int64_t page, int64_t host_in, int64_t updater, int64_t host_out) {
  std::lock_guard<std::mutex> lock(mu_);
  host_in_bytes_ += host_in;
  host_out_bytes_ += host_out;
  updater_bytes_ += updater;
  AddToPage(page, kGradIn, host_in);
  AddToPage(page, kUpdate, updater);
  AddToPage(page, kParamsOut, host_out);
}

void ModelClock::BeginUpdate() {
  std::lock_guard<std::mutex> lock(mu_);
  in_update_ = true;
  pages_.clear();
}

double ModelClock::StageSeconds(Stage stage, const PageBytes& bytes) const {
  double s = Seconds(stage, bytes[stage]);
  // Reads and writes share the SSD, except the overlap fraction of the shorter of the page's two, which runs
  // beside the longer (nsp.csd.clock's ssd resource, page by page).
  if (stage == kRead || stage == kWrite) {
    const double read = Seconds(kRead, bytes[kRead]), write = Seconds(kWrite, bytes[kWrite]);
    const bool shorter = stage == kRead ? read < write : write <= read;
    if (shorter) s *= 1.0 - figures_.ssd_overlap;
  }
  return s;
}

double ModelClock::Pipeline() const {
  // The resource each stage occupies: the SSD (reads and writes), the host link (gradient in, params out: both
  // directions draw on one link, as nsp.csd.clock counts it), the updater.
  constexpr int kSsd = 0, kHost = 1, kUpdater = 2;
  constexpr int kResourceOf[kStages] = {kSsd, kHost, kUpdater, kHost, kSsd};
  const size_t n = pages_.size(), window = static_cast<size_t>(pages_in_flight_);
  std::vector<std::array<double, kStages>> seconds;
  seconds.reserve(n);
  for (const auto& entry : pages_) {
    std::array<double, kStages> d{};
    for (int k = 0; k < kStages; ++k) d[k] = StageSeconds(static_cast<Stage>(k), entry.second);
    seconds.push_back(d);
  }
  // List scheduling: each stage takes pages in page order; of the operations that could start next (the next
  // page of each stage, once its previous stage is done and, for a read, a buffer set is free), the one that can
  // start earliest on its resource goes first (ties: the later stage, which frees a buffer set sooner).
  std::vector<std::array<double, kStages>> end(n);
  std::array<size_t, kStages> next{};
  std::array<double, 3> free_at{};
  while (next[kWrite] < n) {
    int pick = -1;
    double pick_start = 0;
    for (int k = kStages - 1; k >= 0; --k) {
      const size_t i = next[k];
      if (i >= n) continue;
      double ready;
      if (k == 0) {
        if (i >= window && next[kWrite] <= i - window) continue;  // no buffer set free yet
        ready = i >= window ? end[i - window][kWrite] : 0.0;
      } else {
        if (next[k - 1] <= i) continue;  // the page has not left the stage before
        ready = end[i][k - 1];
      }
      const double start = std::max(ready, free_at[kResourceOf[k]]);
      if (pick < 0 || start < pick_start) {
        pick = k;
        pick_start = start;
      }
    }
    const size_t i = next[pick];
    end[i][pick] = pick_start + seconds[i][pick];
    free_at[kResourceOf[pick]] = end[i][pick];
    ++next[pick];
  }
  return n == 0 ? 0.0 : end[n - 1][kWrite];
}

void ModelClock::EndUpdate(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!in_update_) return;
  in_update_ = false;
  last_update_s_ = Pipeline();
  total_s_ += last_update_s_;
  updates_ += 1;
  if (!ok) failed_updates_ += 1;
  pages_.clear();
}

std::vector<std::pair<std::string, double>> ModelClock::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  auto d = [](int64_t v) { return static_cast<double>(v); };
  const double host = d(host_in_bytes_ + host_out_bytes_);
  return {
      {"model_seconds_last_update", last_update_s_},
      {"model_seconds_total", total_s_},
      {"model_updates", d(updates_)},
      {"model_failed_updates", d(failed_updates_)},
      {"busy_seconds_read_link", Seconds(kRead, read_bytes_)},
      {"busy_seconds_write_link", Seconds(kWrite, write_bytes_)},
      {"busy_seconds_updater", Seconds(kUpdate, updater_bytes_)},
      {"busy_seconds_shared_link", host / (figures_.shared_gbps * kGB / d(num_devices_))},
      {"busy_seconds_device_link", host / (figures_.device_link_gbps * kGB)},
      {"bytes_read_link", d(read_bytes_)},
      {"bytes_write_link", d(write_bytes_)},
      {"bytes_updater", d(updater_bytes_)},
      {"bytes_host_in", d(host_in_bytes_)},
      {"bytes_host_out", d(host_out_bytes_)},
      {"devices", d(num_devices_)},
      {"pages_in_flight", static_cast<double>(pages_in_flight_)},
      {"device_link_gbps", figures_.device_link_gbps},
      {"p2p_read_gbps", figures_.p2p_read_gbps},
      {"p2p_write_gbps", figures_.p2p_write_gbps},
      {"updater_gbps", figures_.updater_gbps},
      {"shared_gbps", figures_.shared_gbps},
      {"ssd_overlap", figures_.ssd_overlap},
  };
}

}  // namespace nsp::csd
