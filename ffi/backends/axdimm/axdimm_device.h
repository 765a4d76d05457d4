// The AXDIMM plugin's device (axdimm_backend.cc says what the plugin does and how): the runtime's calls, the
// module's memory as the device keeps track of it (which pages it holds, on which channel, for which slot) and
// the kernels in flight; and what the plugin's files share: the module's memory and its channels
// (axdimm_module.cc), the kernels (axdimm_kernels.cc).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "backends/axdimm/vendor/axdimm_api.h"
#include "backends/plugin_device.h"
#include "nsp_backend_abi.h"

namespace nsp::axdimm {

constexpr const char* kDefaultLibrary = "libaxdimm.so";
constexpr const char* kDefaultDevice = "/dev/axdimm0";
constexpr int kChannels = NSP_AXDIMM_NUM_CHANNELS;

using nsp::plugin::Fail;
using nsp::plugin::OptionMap;
using nsp::plugin::PageName;

struct AxdimmApi {
#define NSP_AX_DECLARE(name) nsp_##name##_fn name = nullptr;
  NSP_AXDIMM_SYMBOLS(NSP_AX_DECLARE)
#undef NSP_AX_DECLARE
};


// One page in the module: its states side by side in one allocation on channel page % 2.
struct Resident {
  nspAxdimmAddr base = 0;
  int valid_slot[NSP_BACKEND_NUM_STATES] = {-1, -1, -1};  // the slot whose page file this state's copy equals
  bool fresh[NSP_BACKEND_NUM_STATES] = {false, false, false};  // the kernel's output, not yet written through
  bool updated = false;  // updated in the current update: evicted first
  uint64_t last_use = 0;
};

// What an engine buffer was last filled with by a read (so a kernel can tell the module already holds it).
struct BufferSource {
  int64_t page;
  int state;
  int slot;
};

// A kernel started on a channel, until compute_wait brings its outputs back.
struct Launch {
  int channel = 0;
  int64_t page = -1;
  int64_t n = 0;
  nspAxdimmAddr staging = 0;  // gradient, indices, bf16 params: freed after the kernel
  nspAxdimmAddr p16 = 0;
  nsp_state_span span{};
};

// The shard and its page files (the NVMe) are PluginDevice's; the rest is the module's.
struct Device : nsp::plugin::PluginDevice {
  bool module_kernel = false;  // the kind keeps p, m and v: the module's Adam kernel can run it
  std::string library, device_path;
  AxdimmApi api;
  nspAxdimmHandle module = nullptr;

  // Guards the cache map, the buffer sources, the channels' ownership and the launches.
  std::mutex mu;
  std::condition_variable cv;
  bool channel_busy[kChannels] = {false, false};
  std::map<int64_t, Resident> resident;
  std::unordered_map<const void*, BufferSource> sources;
  std::map<uint64_t, Launch> launches;
  std::map<uint64_t, std::string> done;
  uint64_t next_ticket = 1, clock = 0;
  std::atomic<bool> in_update{false};  // between update_begin and update_end

  std::atomic<int64_t> loaded{0}, evicted{0}, evicted_updated{0}, evicted_other{0}, hits{0}, prefetch_skipped{0};
  std::atomic<int64_t> h2x_bytes{0}, x2h_bytes{0}, host_kernels{0}, failed_kernels{0};
  std::atomic<int64_t> channel_launches[kChannels] = {{0}, {0}};

  size_t PageBytes() const { return static_cast<size_t>(page_elems) * 4; }
  // Offset of a state's page in its resident allocation (states side by side, p, m, v).
  size_t StateOffset(int state) const { return static_cast<size_t>(state) * PageBytes(); }
  size_t ResidentBytes() const { return 3 * PageBytes(); }
  std::string LastError() const {
    const char* e = api.nspAxdimmLastError ? api.nspAxdimmLastError() : nullptr;
    return e && *e ? e : "no message";
  }
};

}  // namespace nsp::axdimm

// The ABI's device: the AXDIMM device as it is.
struct nsp_backend_device : nsp::axdimm::Device {};

namespace nsp::axdimm {

// ---- The module's memory (axdimm_module.cc) ----

// The channel a page lives on.
inline int ChannelOf(int64_t page) { return static_cast<int>((page < 0 ? 0 : page) % kChannels); }
// The runtime and the module: "" or why not (nothing is left open on failure).
std::string OpenModule(nsp_backend_device* d, const nsp_backend_config* c);
// Exclusive use of a channel: its copies, its arbiter mode, its allocations and evictions, its kernel.
void AcquireChannel(nsp_backend_device* d, int c);
void ReleaseChannel(nsp_backend_device* d, int c);
// Allocates `bytes` on channel c, evicting (never `keep`) until it fits. *fits is false when it cannot: with
// `updated_only`, when no page updated in this step is left to evict; else when nothing is left at all.
std::string Allocate(nsp_backend_device* d, int c, size_t bytes, int64_t keep, bool updated_only, nspAxdimmAddr* out,
                     bool* fits);
// The page's resident entry, allocated if absent. Holder of its channel. *present false: not resident and no room
// (only with `updated_only`).
std::string EnsureResident(nsp_backend_device* d, int64_t page, bool updated_only, bool* present);
std::string CopyToModule(nsp_backend_device* d, nspAxdimmAddr dst, const void* src, size_t bytes);
std::string CopyFromModule(nsp_backend_device* d, void* dst, nspAxdimmAddr src, size_t bytes);
// Marks every state of a page as not held (a failed copy or kernel may have left anything there).
void Invalidate(nsp_backend_device* d, int64_t page);

// ---- Kernels (axdimm_kernels.cc) ----

int ComputeLaunch(nsp_backend_device* d, const nsp_hyper_params* hp, const nsp_state_span* span,
                  const nsp_page_grad* grad, const nsp_page_info* info, uint64_t* ticket, char* err, size_t err_len);
int ComputeWait(nsp_backend_device* d, uint64_t ticket, char* err, size_t err_len);

}  // namespace nsp::axdimm
