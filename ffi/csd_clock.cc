// The csd device's model clock (csd_clock.h).
#include "csd_clock.h"

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

double ModelClock::Pipeline() const {
  const size_t window = static_cast<size_t>(pages_in_flight_);
  std::vector<std::array<double, kStages>> end;  // end[i][k]: when page i (in page order) leaves stage k
  end.reserve(pages_.size());
  for (const auto& [page, bytes] : pages_) {
    const size_t i = end.size();
    std::array<double, kStages> e{};
    for (int k = 0; k < kStages; ++k) {
      // A page enters the first stage once a buffer set is free: the page F before it has left the last stage.
      const double ready = k == 0 ? (i >= window ? end[i - window][kWrite] : 0.0) : e[k - 1];
      const double free = i > 0 ? end[i - 1][k] : 0.0;
      e[k] = std::max(ready, free) + Seconds(static_cast<Stage>(k), bytes[k]);
    }
    end.push_back(e);
  }
  return end.empty() ? 0.0 : end.back()[kWrite];
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
  };
}

}  // namespace nsp::csd
