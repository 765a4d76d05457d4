// The module's backends: the engine of one shard over its backend, built in (memory, file, the file tier's fault
// injection) or a plugin loaded by name (plugin_backend.h), and the module functions that find a plugin.
#include <nanobind/stl/string.h>

#include <dlfcn.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/plugin_backend.h"
#include "xla/module_common.h"

namespace nsp::module {
namespace {

// nsp's own backends/ directory, beside this module's file: where backends shipped with the package (csd) live.
// Found from the loaded module itself (its __file__ is set only after its initialisation).
const std::string& PackageBackendDir() {
  static const std::string dir = [] {
    Dl_info info;
    if (::dladdr(reinterpret_cast<void*>(&PackageBackendDir), &info) == 0 || info.dli_fname == nullptr) {
      return std::string();
    }
    const std::string file = info.dli_fname;
    const size_t slash = file.find_last_of('/');
    return (slash == std::string::npos ? std::string(".") : file.substr(0, slash)) + "/backends";
  }();
  return dir;
}

bool BuiltIn(const std::string& backend) { return backend == "memory" || backend == "file"; }

// Loads plugin `name` (its library and ABI version, no device opened); raises RuntimeError("backend <name> not
// available: <why>") when it cannot be had.
LoadedPlugin LoadPluginOrThrow(const std::string& name) {
  LoadedPlugin plugin;
  if (std::string err = LoadPlugin(name, PluginSearch::FromEnv(PackageBackendDir()), &plugin); !err.empty()) {
    throw std::runtime_error(err);
  }
  return plugin;
}

std::unique_ptr<Backend> MakeBuiltInBackend(const BackendSpec& b) {
  const PluginConfig& s = b.shard;
  if (b.name == "memory") return MakeMemoryBackend(s.size, s.page_elems, s.states_used, b.in_place);
  // The file tier's I/O settings and its fault injection (tests, bench/fault_campaign.py: it wraps the file
  // tier, whose page writes and commits are the ones a full disk or a crash interrupts) come from environment
  // variables, read here, once per engine: a value the tier does not take fails the store's opening.
  FileIoSettings io;
  if (std::string err = FileIoSettingsFromEnv(&io); !err.empty()) throw nb::value_error(err.c_str());
  io.one_slot = b.slots == 1;
  std::unique_ptr<Backend> backend = MakeFileBackend(s.shard_dir, s.size, s.page_elems, s.checksum, io);
  const FaultPlan faults = FaultPlanFromEnv();
  return faults.any() ? MakeFaultInjectingBackend(std::move(backend), faults) : std::move(backend);
}

// A plugin's device for the shard. Every reason it cannot be had (not found, not loadable, another ABI, its open
// failing) raises RuntimeError("backend <name> not available: <why>"). Plugins inject their own faults (their
// options), not the environment's.
std::unique_ptr<PluginBackend> MakePluginBackend(const BackendSpec& b) {
  const LoadedPlugin plugin = LoadPluginOrThrow(b.name);
  std::string err;
  std::unique_ptr<PluginBackend> backend = PluginBackend::Open(plugin, b.shard, &err);
  if (!backend) throw std::runtime_error(err);
  return backend;
}

}  // namespace

std::shared_ptr<ShardEngine> MakeEngine(const BackendSpec& b) {
  const PluginConfig& s = b.shard;
  if (s.size < 1 || s.page_elems < 1) throw nb::value_error("size and page_elems must be >= 1");
  if (b.in_place && b.name != "memory") throw nb::value_error("only the memory tier updates in place");
  if (b.slots != 1 && b.slots != 2) throw nb::value_error("a store keeps 1 or 2 version slots");
  if (b.slots == 1 && b.name != "file") {
    throw nb::value_error("one version slot (a redo journal) is the file tier's: its backend renames pages in");
  }
  if (s.shard_index < 0 || s.num_devices < 1 || s.shard_index >= s.num_devices) {
    throw nb::value_error(("shard " + std::to_string(s.shard_index) + " of " + std::to_string(s.num_devices) +
                           " shards does not exist").c_str());
  }
  std::array<bool, kNumStates> used{};
  for (size_t i = 0; i < used.size() && i < s.states_used.size(); ++i) used[i] = s.states_used[i];
  if (BuiltIn(b.name)) {
    return std::make_shared<ShardEngine>(MakeBuiltInBackend(b), s.size, s.page_elems, s.pages_in_flight, used);
  }
  std::unique_ptr<PluginBackend> plugin = MakePluginBackend(b);
  PluginBackend* adapter = plugin.get();
  auto engine = std::make_shared<ShardEngine>(std::move(plugin), s.size, s.page_elems, s.pages_in_flight, used);
  // The device is told each page's host-link bytes as the engine counts them (the engine owns the adapter, so it
  // outlives every call of this reader).
  ShardEngine* counted = engine.get();
  adapter->SetHostTraffic([counted](int64_t* in, int64_t* out) {
    *in = counted->stats().shared_in_bytes;
    *out = counted->stats().shared_out_bytes;
  });
  return engine;
}

void DefineBackendFunctions(nb::module_& m) {
  m.def(
      "find_backend",
      [](const std::string& name) -> std::string { return BuiltIn(name) ? "" : LoadPluginOrThrow(name).path; },
      nb::arg("name"),
      "Loads backend `name` (checking its library and ABI version, opening no device) and returns its library's "
      "path ('' for the built-in memory and file). RuntimeError \"backend <name> not available: <why>\" when it "
      "cannot be had.");
  m.def("backend_dir", []() { return PackageBackendDir(); },
        "nsp's own directory of backend libraries, searched after NSP_BACKEND_PATH.");
}

}  // namespace nsp::module
