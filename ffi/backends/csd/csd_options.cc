// Parsing the csd device's options string (csd_options.h).
#include "backends/csd/csd_options.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <utility>

namespace nsp::csd {

namespace {

struct FigureKey {
  const char* name;
  double Figures::*field;
};
constexpr FigureKey kFigures[] = {
    {"device_link_gbps", &Figures::device_link_gbps}, {"p2p_read_gbps", &Figures::p2p_read_gbps},
    {"p2p_write_gbps", &Figures::p2p_write_gbps},     {"updater_gbps", &Figures::updater_gbps},
    {"shared_gbps", &Figures::shared_gbps},
};

constexpr const char* kOverlap = "ssd_overlap";  // a fraction, not a bandwidth

struct FaultKey {
  const char* name;
  int64_t Faults::*field;
};
constexpr FaultKey kFaults[] = {
    {"fail_kernel_at", &Faults::kernel_at}, {"fail_read_at", &Faults::read_at}, {"fail_write_at", &Faults::write_at}};

std::string Trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

std::string ValidKeys() {
  std::string out;
  for (const FigureKey& k : kFigures) out += std::string(out.empty() ? "" : ", ") + k.name;
  out += std::string(", ") + kOverlap;
  for (const FaultKey& k : kFaults) out += std::string(", ") + k.name;
  return out;
}

// Splits "a=1;b=2" into its pairs; returns "" or the malformed item / repeated key.
std::string Split(const std::string& text, std::map<std::string, std::string>* items) {
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(';', begin), text.size());
    const std::string item = Trim(text.substr(begin, end - begin));
    begin = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) return "option '" + item + "' is not key=value";
    const std::string key = Trim(item.substr(0, eq));
    if (!items->emplace(key, Trim(item.substr(eq + 1))).second) return "option '" + key + "' is given twice";
  }
  return {};
}

bool ParseDouble(const std::string& s, double* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  *out = std::strtod(s.c_str(), &end);
  return errno == 0 && end == s.c_str() + s.size();
}

bool ParseCount(const std::string& s, int64_t* out) {
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 18) return false;
  *out = std::strtoll(s.c_str(), nullptr, 10);
  return *out > 0;
}

}  // namespace

std::string ParseOptions(const std::string& text, Options* out) {
  std::map<std::string, std::string> items;
  if (std::string err = Split(text, &items); !err.empty()) return err;
  for (const auto& [key, value] : items) {
    bool known = key == kOverlap;
    for (const FigureKey& k : kFigures) known = known || key == k.name;
    for (const FaultKey& k : kFaults) known = known || key == k.name;
    if (!known) return "unknown option '" + key + "' (the csd device takes " + ValidKeys() + ")";
  }
  for (const FigureKey& k : kFigures) {
    auto it = items.find(k.name);
    if (it == items.end()) {
      return std::string("figure '") + k.name + "' is missing (nsp.csd.device_options gives every figure of " +
             "nsp.csd.LinkFigures)";
    }
    double value = 0;
    if (!ParseDouble(it->second, &value) || !std::isfinite(value) || value <= 0) {
      return std::string("figure '") + k.name + "' must be a positive number of GB/s, got '" + it->second + "'";
    }
    out->figures.*k.field = value;
  }
  if (auto it = items.find(kOverlap); it == items.end()) {
    return std::string("figure '") + kOverlap + "' is missing (nsp.csd.device_options gives every figure of " +
           "nsp.csd.LinkFigures)";
  } else if (!ParseDouble(it->second, &out->figures.ssd_overlap) || !(out->figures.ssd_overlap >= 0) ||
             out->figures.ssd_overlap > 1) {
    return std::string("figure '") + kOverlap + "' must be a fraction in [0, 1], got '" + it->second + "'";
  }
  for (const FaultKey& k : kFaults) {
    auto it = items.find(k.name);
    if (it == items.end()) continue;
    if (!ParseCount(it->second, &(out->faults.*k.field))) {
      return std::string("option '") + k.name + "' must be a positive integer (the k-th such operation), got '" +
             it->second + "'";
    }
  }
  return {};
}

}  // namespace nsp::csd
