// Where the update work runs: NSP_ENGINE_CPUS, a CPU list such as "1" or "2-3,6", reserves CPUs for the update
// kernels and the store engine (its page readers and writers, a staleness-1 step in the background), apart from
// the cores the training step's own compute uses. Unset: they run wherever their caller runs.
//
// Why: on a host whose forward/backward runs on an accelerator, the update has the host's cores to itself; on a
// CPU-only machine the two fight for the same cores unless they are split (and a host with storage on one NUMA
// node wants its update on that node's cores).
#pragma once

#include <sched.h>

#include <string>
#include <vector>

namespace nsp {

// The CPUs NSP_ENGINE_CPUS names (sorted, without repeats); empty when it is unset or invalid.
const std::vector<int>& EngineCpus();
// "" when NSP_ENGINE_CPUS is unset or usable, else a message naming the problem (not a CPU list, or a CPU this
// process may not run on).
const std::string& EngineCpusError();

// Pins the calling thread to the engine CPUs while alive and restores its affinity after; threads it starts
// meanwhile inherit the pinning. Does nothing when NSP_ENGINE_CPUS is unset.
class EngineCpuScope {
 public:
  EngineCpuScope();
  ~EngineCpuScope();
  EngineCpuScope(const EngineCpuScope&) = delete;
  EngineCpuScope& operator=(const EngineCpuScope&) = delete;

 private:
  bool pinned_ = false;
  cpu_set_t previous_;  // the thread's affinity before pinning
};

// Pins the calling thread to the engine CPUs for good (a kernel pool worker). Returns whether it did: false when
// NSP_ENGINE_CPUS is unset or the pinning was refused.
bool PinToEngineCpus();

}  // namespace nsp
