// What every backend plugin (csd, xrt, axdimm) does the same way, compiled into each plugin (hidden there like the
// rest of its code): the ABI's error buffer, the "key=value;..." options string, the open-time checks of the config
// struct, and the shard's page files — the file tier's own page I/O — as the device's storage, with the checksum,
// I/O counter and buffer entries of the ABI table that only go through that storage.
//
// A plugin's nsp_backend_device derives from PluginDevice, so the table entries below (templates on the plugin's
// device type) fit its nsp_backend_v1 table as they are; MakeTable builds that table from the plugin's own calls
// and these, and NSP_PLUGIN_ENTRY defines the one symbol the plugin exports.
#pragma once

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/abi_structs.h"
#include "backends/backend.h"
#include "kernels/update_kernel.h"
#include "nsp_backend_abi.h"

namespace nsp::plugin {

// ---- Errors ----

// Writes `msg` into the caller's error buffer (truncated, always NUL-terminated).
void SetError(char* err, size_t err_len, const std::string& msg);
// SetError, then the ABI's failure status (1).
int Fail(char* err, size_t err_len, const std::string& msg);

// "page 3 of state 'mu' in slot 1", the way every plugin names a page in its messages.
std::string PageName(int32_t slot, int32_t state, int64_t page);

// ---- Options ----

using OptionMap = std::map<std::string, std::string>;

// "key=value;key=value" into `out` (empty items skipped, a later key overriding an earlier one); returns "" or the
// item that is not key=value.
std::string ParseOptions(const std::string& text, OptionMap* out);
// "" when every key of `opts` is one of `known`, else which one is not (and the keys the plugin takes).
std::string CheckOptionKeys(const OptionMap& opts, std::initializer_list<const char*> known);
// The vendor library to load: option library=, else the environment variable `env`, else `fallback`.
std::string LibraryPath(const OptionMap& opts, const char* env, const char* fallback);
// dlopens `library` (RTLD_NOW | RTLD_LOCAL) into *handle; returns "" or why not, naming it as `what` and where its
// path came from. The handle is never closed: a vendor library's threads may outlive a device's close.
std::string LoadLibrary(const std::string& library, const std::string& what, const char* env, const char* fallback,
                        void** handle);

// A loaded vendor library's calls, looked up by name: Require records the first one missing, Optional leaves a
// missing one null.
class Symbols {
 public:
  explicit Symbols(void* handle) : handle_(handle) {}
  template <typename FnPtr>
  void Require(FnPtr& fn, const char* name) {
    fn = reinterpret_cast<FnPtr>(Find(name));
    if (fn == nullptr && missing_.empty()) missing_ = name;
  }
  template <typename FnPtr>
  void Optional(FnPtr& fn, const char* name) {
    fn = reinterpret_cast<FnPtr>(Find(name));
  }
  const std::string& missing() const { return missing_; }

 private:
  void* Find(const char* name) const;
  void* handle_;
  std::string missing_;
};

// LoadLibrary, then `resolve` looks up the library's calls in it. Returns "" or why not: the loader's error, or
// "<what> '<library>' lacks the symbol <name>" followed by `hint`.
std::string LoadVendorLibrary(const std::string& library, const std::string& what, const char* env,
                              const char* fallback, const std::string& hint,
                              const std::function<void(Symbols&)>& resolve);

// ---- The device ----

// The part of a plugin's device that is the same in every plugin: which shard it serves, and that shard's page files.
struct PluginDevice {
  std::string kind;  // "csd", "xrt", "axdimm": the first word of every message
  std::string dir;
  int64_t shard = 0;
  int64_t size = 0, page_elems = 0;
  bool used[NSP_BACKEND_NUM_STATES] = {false, false, false};
  bool checksum = true;
  std::unique_ptr<nsp::Backend> pages;  // the file tier's page I/O on the shard directory

  // "xrt device 0 (/path/shards/00000)".
  std::string Name() const { return kind + " device " + std::to_string(shard) + " (" + dir + ")"; }
  bool GoodSlotState(int32_t slot, int32_t state) const {
    return slot >= 0 && slot <= 1 && state >= 0 && state < NSP_BACKEND_NUM_STATES && used[state];
  }
  // Fail with the device's name in front of `msg`.
  int Fail(char* err, size_t err_len, const std::string& msg) const {
    return plugin::Fail(err, err_len, Name() + ": " + msg);
  }
};

// The first checks of open, before the plugin touches its hardware: the config struct's ABI version, the shard's
// size, and that its directory exists (`missing_dir` says why that matters to this plugin, or is empty). Fills
// kind, dir and shard. Returns 0, or 1 with the message in `err`.
int CheckConfig(const nsp_backend_config* c, const char* kind, const char* missing_dir, PluginDevice* d, char* err,
                size_t err_len);
// The shard's page files as the device's storage, with the file tier's own settings (NSP_READ_MODE and the others
// apply to a plugin too). Fills size, page_elems, used, checksum and pages. Returns "" or why not.
std::string OpenPages(const nsp_backend_config* c, PluginDevice* d);

// ---- Kernel arguments ----

// The ABI's structs as the update kernel's: nsp::abi::FromAbi (backends/abi_structs.h).
// The page an nsp_page_info names, or -1 where the host gave none (or an older struct without it).
int64_t PageOf(const nsp_page_info* info);
// compute_launch's pointer arguments are all there: 0, or 1 with the message in `err`.
int CheckLaunch(const PluginDevice& d, const void* hp, const void* span, const void* grad, const void* ticket,
                char* err, size_t err_len);
// compute_wait's end: takes launch `ticket`'s result out of `done` (finished launches, by ticket: "" or the
// kernel's error) and returns 0, or 1 with the error (or "no kernel launch N") in `err`. The caller holds the lock
// that guards `done`.
int TakeResult(const PluginDevice& d, std::map<uint64_t, std::string>* done, uint64_t ticket, char* err,
               size_t err_len);

// ---- Counters ----

// Writes `counts` into the host's struct, as much as its struct_size has room for.
void WriteIoCounts(const nsp::IoCounts& counts, nsp_io_counts* out);
// A counter's value, as a stat.
inline double Stat(const std::atomic<int64_t>& counter) { return static_cast<double>(counter.load()); }
// Writes up to `capacity` stats into `out`; returns how many there are.
int64_t WriteStats(const std::vector<std::pair<std::string, double>>& stats, nsp_backend_stat* out,
                   int64_t capacity);

// ---- Table entries that only go through the page files ----

size_t PageBufferBytes(PluginDevice* d, int64_t page_elems);
// A page buffer from the file tier (4 KiB aligned: its direct I/O reads and writes there).
void* AllocHostBuffer(PluginDevice* d, size_t bytes, char* err, size_t err_len);
void FreeHostBuffer(PluginDevice* d, void* buffer, size_t bytes);
int Sync(PluginDevice* d, int32_t slot, char* err, size_t err_len);
int ChecksumsGet(PluginDevice* d, int32_t slot, int32_t state, uint32_t* out, int64_t pages, char* err,
                 size_t err_len);
// The file tier's part of checksums_set (the slot and state checked, the table set); a plugin that keeps copies of
// pages forgets what it knows about them after this succeeds.
int ChecksumsSet(PluginDevice* d, int32_t slot, int32_t state, const uint32_t* crcs, int64_t pages, char* err,
                 size_t err_len);

// The same entries with the plugin's own device type, as its nsp_backend_v1 table takes them.
template <typename Device>
size_t PageBufferBytesOf(Device* d, int64_t page_elems) {
  return PageBufferBytes(d, page_elems);
}
template <typename Device>
void* AllocHostBufferOf(Device* d, size_t bytes, char* err, size_t err_len) {
  return AllocHostBuffer(d, bytes, err, err_len);
}
template <typename Device>
void FreeHostBufferOf(Device* d, void* buffer, size_t bytes) {
  FreeHostBuffer(d, buffer, bytes);
}
template <typename Device>
int SyncOf(Device* d, int32_t slot, char* err, size_t err_len) {
  return Sync(d, slot, err, err_len);
}
template <typename Device>
int ChecksumsGetOf(Device* d, int32_t slot, int32_t state, uint32_t* out, int64_t pages, char* err, size_t err_len) {
  return ChecksumsGet(d, slot, state, out, pages, err, err_len);
}
template <typename Device>
int ChecksumsSetOf(Device* d, int32_t slot, int32_t state, const uint32_t* crcs, int64_t pages, char* err,
                   size_t err_len) {
  return ChecksumsSet(d, slot, state, crcs, pages, err, err_len);
}

// ---- The table ----

// The calls a plugin brings to its nsp_backend_v1 table. The optional ones left null are the page files' entries
// above (AllocHostBuffer, FreeHostBuffer, ChecksumsSet).
struct PluginCalls {
  const char* name;
  decltype(nsp_backend_v1::open) open;
  decltype(nsp_backend_v1::close) close;
  decltype(nsp_backend_v1::read_page) read_page;
  decltype(nsp_backend_v1::write_page) write_page;
  decltype(nsp_backend_v1::compute_launch) compute_launch;
  decltype(nsp_backend_v1::compute_wait) compute_wait;
  decltype(nsp_backend_v1::io_counts) io_counts;
  decltype(nsp_backend_v1::stats) stats;
  decltype(nsp_backend_v1::update_begin) update_begin;
  decltype(nsp_backend_v1::update_end) update_end;
  decltype(nsp_backend_v1::alloc_buffer) alloc_buffer = nullptr;
  decltype(nsp_backend_v1::free_buffer) free_buffer = nullptr;
  decltype(nsp_backend_v1::page_checksums_set) page_checksums_set = nullptr;
};

// The plugin's table: its calls, and for page buffer sizes, sync and reading checksums (and whatever optional call
// it leaves null) the page files' entries. `Device` is the plugin's nsp_backend_device.
template <typename Device>
constexpr nsp_backend_v1 MakeTable(const PluginCalls& c) {
  return nsp_backend_v1{
      NSP_BACKEND_ABI_VERSION,
      sizeof(nsp_backend_v1),
      c.name,
      c.open,
      c.close,
      PageBufferBytesOf<Device>,
      c.alloc_buffer != nullptr ? c.alloc_buffer : AllocHostBufferOf<Device>,
      c.free_buffer != nullptr ? c.free_buffer : FreeHostBufferOf<Device>,
      c.read_page,
      c.write_page,
      SyncOf<Device>,
      c.compute_launch,
      c.compute_wait,
      ChecksumsGetOf<Device>,
      c.page_checksums_set != nullptr ? c.page_checksums_set : ChecksumsSetOf<Device>,
      c.io_counts,
      c.stats,
      c.update_begin,
      c.update_end,
  };
}

}  // namespace nsp::plugin

// The plugin's one exported symbol: `table` (its MakeTable) for a host of this ABI version, else NULL.
#define NSP_PLUGIN_ENTRY(table)                                                                            \
  extern "C" NSP_BACKEND_EXPORT const nsp_backend_v1* nsp_backend_entry_v1(uint32_t host_abi_version) {  \
    return host_abi_version == NSP_BACKEND_ABI_VERSION ? &(table) : nullptr;                               \
  }
