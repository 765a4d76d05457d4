// NSP_ENGINE_CPUS (engine_cpus.h): parsing the CPU list, checking it against this process's CPUs, and pinning.
#include "util/engine_cpus.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>

namespace nsp {
namespace {

struct Parsed {
  std::vector<int> cpus;
  std::string error;
};

// Parses "a", "a-b" and comma-separated lists of them; checks each CPU against the process's affinity.
Parsed Parse() {
  Parsed out;
  const char* env = std::getenv("NSP_ENGINE_CPUS");
  if (env == nullptr || *env == '\0') return out;
  const std::string text(env);
  auto bad = [&](const std::string& why) {
    out.cpus.clear();
    out.error = "NSP_ENGINE_CPUS='" + text + "' " + why;
    return out;
  };
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    const size_t dash = item.find('-');
    char* end = nullptr;
    const long lo = std::strtol(item.c_str(), &end, 10);
    long hi = lo;
    bool ok = !item.empty() && end != item.c_str() && (*end == '\0' || end == item.c_str() + dash);
    if (ok && dash != std::string::npos) {
      const char* hi_text = item.c_str() + dash + 1;
      hi = std::strtol(hi_text, &end, 10);
      ok = end != hi_text && *end == '\0';
    }
    if (!ok || lo < 0 || hi < lo || hi >= CPU_SETSIZE) {
      return bad("is not a CPU list such as '1' or '2-3,6'");
    }
    for (long c = lo; c <= hi; ++c) out.cpus.push_back(static_cast<int>(c));
    at = comma + 1;
  }
  std::sort(out.cpus.begin(), out.cpus.end());
  out.cpus.erase(std::unique(out.cpus.begin(), out.cpus.end()), out.cpus.end());
  // Each CPU must be one this process may run on (a container's cpuset, taskset): try pinning to it. The
  // calling thread's own mask may be narrower than the process's, so that mask is no guide.
  cpu_set_t before;
  CPU_ZERO(&before);
  if (::sched_getaffinity(0, sizeof(before), &before) == 0) {
    for (int c : out.cpus) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(c, &one);
      if (::sched_setaffinity(0, sizeof(one), &one) != 0) {
        ::sched_setaffinity(0, sizeof(before), &before);
        return bad("names CPU " + std::to_string(c) + ", which this process may not run on (see taskset, or the "
                   "container's cpuset)");
      }
    }
    ::sched_setaffinity(0, sizeof(before), &before);
  }
  return out;
}

const Parsed& Get() {
  static const Parsed* parsed = new Parsed(Parse());  // read once; leaked, like the thread pool
  return *parsed;
}

}  // namespace

const std::vector<int>& EngineCpus() { return Get().cpus; }
const std::string& EngineCpusError() { return Get().error; }

bool PinToEngineCpus() {
  const std::vector<int>& cpus = EngineCpus();
  if (cpus.empty()) return false;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  return ::sched_setaffinity(0, sizeof(set), &set) == 0;
}

EngineCpuScope::EngineCpuScope() {
  CPU_ZERO(&previous_);
  if (EngineCpus().empty() || ::sched_getaffinity(0, sizeof(previous_), &previous_) != 0) return;
  pinned_ = PinToEngineCpus();
}

EngineCpuScope::~EngineCpuScope() {
  if (pinned_) ::sched_setaffinity(0, sizeof(previous_), &previous_);
}

}  // namespace nsp
