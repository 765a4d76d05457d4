// Backends in shared objects: finding a library by backend name, loading it, checking its ABI version, and an
// nsp::Backend over the C function table it exports (nsp_backend_abi.h). Everything but `memory` and `file`
// loads this way, the csd device shipped with nsp included.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backends/backend.h"
#include "nsp_backend_abi.h"

namespace nsp {

// Where backend libraries are looked for, in order: each entry of NSP_BACKEND_PATH (colon-separated; a
// directory, or a direct path to a library file), then `package_dir` (nsp's own backends/ directory).
struct PluginSearch {
  std::string env_path;     // NSP_BACKEND_PATH's value ("" when unset)
  std::string package_dir;  // "" when unknown
  static PluginSearch FromEnv(std::string package_dir);
};

// The file name of backend `name`'s library: libnsp_backend_<name>.so.
std::string PluginFileName(const std::string& name);

// A loaded backend library: its path and its function table (the library stays loaded for the process's life:
// a device's threads may run its code until the device is closed, and nothing is gained by unloading).
struct LoadedPlugin {
  std::string name;
  std::string path;
  const nsp_backend_v1* table = nullptr;
};

// Finds and loads backend `name` and checks its table. Returns "" or the reason it is not available, beginning
// "backend <name> not available: " (not found: where it looked; the loader's error; no entry symbol; another ABI
// version, both named; an incomplete table).
std::string LoadPlugin(const std::string& name, const PluginSearch& search, LoadedPlugin* out);

// What one device is opened for (nsp_backend_config, in C++ types).
struct PluginConfig {
  std::string shard_dir;
  int64_t shard_index = 0;
  int64_t num_devices = 1;
  int64_t size = 0;
  int64_t page_elems = 0;
  std::vector<bool> states_used;
  bool checksum = true;
  int pages_in_flight = 8;
  std::string options;
};

// Reads the host-link bytes the engine has counted so far (gradient in, params out); see SetHostTraffic.
using HostTrafficReader = std::function<void(int64_t* in_bytes, int64_t* out_bytes)>;

// An nsp::Backend over a plugin's device. Its Compute launches the device's kernel and waits for it: the ABI is
// asynchronous, the engine calls a backend's Compute synchronously (for now), one page at a time.
class PluginBackend final : public Backend {
 public:
  // Opens the device; returns null with *error set ("backend <name> not available: <the device's message>")
  // when it cannot.
  static std::unique_ptr<PluginBackend> Open(const LoadedPlugin& plugin, const PluginConfig& config,
                                             std::string* error);
  ~PluginBackend() override;
  PluginBackend(const PluginBackend&) = delete;
  PluginBackend& operator=(const PluginBackend&) = delete;

  // The host-link bytes of each page: the engine counts them (its shared-link counters) on the computing thread
  // just before it calls Compute, so the difference since the last Compute is that page's. They go to the
  // device with the kernel's launch (nsp_page_info), as a device sees its host DMA.
  void SetHostTraffic(HostTrafficReader reader) { host_traffic_ = std::move(reader); }

  std::string name() const override { return plugin_.name; }
  size_t PageBufferBytes(int64_t page_elems) const override;
  void* AllocPageBuffer(size_t bytes) override;
  void FreePageBuffer(void* buffer, size_t bytes) override;
  std::string ReadPage(int slot, int state, int64_t page, float* dst, int64_t n, bool scratch) override;
  std::string WritePage(int slot, int state, int64_t page, float* src, int64_t n, bool scratch) override;
  std::string Sync(int slot) override;
  std::vector<uint32_t> PageChecksums(int slot, int state) const override;
  std::string SetPageChecksums(int slot, int state, const std::vector<uint32_t>& crcs) override;
  IoCounts Io() const override;
  void StreamStarted() override;
  void StreamFinished(bool ok) override;
  std::string Stats(std::vector<std::pair<std::string, double>>* out) const override;
  // Backend::Compute returns nothing: a kernel's failure is kept, and the write of that page (which the engine
  // makes only after its kernel) returns it instead, so the update fails and its version is never committed.
  void Compute(const UpdateHyperParams& hp, const StateSpan& span, const PageGrad& grad) override;
  // The device's kernel has no finiteness check of its own: the page's gradient is checked on the host (one
  // pass over the page, not over the whole gradient before the update), then the device updates it.
  bool ComputeIfFinite(const UpdateHyperParams& hp, const StateSpan& span, const void* grad, GradType type) override;

 private:
  PluginBackend(LoadedPlugin plugin, nsp_backend_device* device, int64_t num_pages);
  // "<what> failed: <the device's message>" (or the call's name when the device gave none).
  static std::string Message(const char* what, const char* err);
  // The page an engine buffer holds (its last read), or -1.
  int64_t PageIn(const void* buffer);
  std::string TakeKernelError(const void* param_buffer);

  LoadedPlugin plugin_;
  nsp_backend_device* device_;
  int64_t num_pages_;
  HostTrafficReader host_traffic_;
  int64_t host_in_seen_ = 0, host_out_seen_ = 0;
  std::mutex mu_;
  // Which page each engine buffer holds: the kernel is told its page (a device names it in its messages).
  std::unordered_map<const void*, int64_t> buffer_page_;
  // Kernels that failed, by the params buffer of their page (set by Compute, taken by that buffer's write).
  std::unordered_map<const void*, std::string> kernel_errors_;
};

}  // namespace nsp
