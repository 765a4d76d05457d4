// axdimm: an AXDIMM module (a DDR4 DIMM with an FPGA and two DRAM channels, each with its own Adam kernel) per
// store shard, with the shard's NVMe directory behind it, behind the backend ABI (nsp_backend_abi.h).
//
// nsp never links the AXDIMM runtime: each device dlopens it at open (option library=, else NSP_AXDIMM_LIBRARY,
// else libaxdimm.so) and looks up the calls of ffi/backends/axdimm/vendor/axdimm_api.h by name. Where no module is
// present the tests point library= at libaxdimm_model.so, the software model of ffi/backends/axdimm/axdimm_model.cc.
//
// Design: the NVMe page files are the truth, the module is a cache.
//   - every page of state lives in the shard directory as the file tier's page files (two version slots, CRC-32C
//     trailers), read and written by the file tier's own code: manifests, snapshots and checks work unchanged;
//   - the module holds whole pages (p, m, v side by side, one allocation) on channel page % 2. A page's state is
//     loaded into the module when it is read for an update (opportunistically: only into free room or over a page
//     already updated in this step), or when its kernel starts if it is not there by then;
//   - the kernel updates the page in place on its channel (acceleration mode), and its new p, m, v come back to the
//     engine's buffers, which the engine writes to the page files of the version being made: write-through. So a
//     version is whole on NVMe when sync returns (a crash leaves version t or t + 1), and evicting a page never
//     writes anything: its copy on NVMe is current. Eviction takes pages already updated in this step first
//     (least recently used first), then the others;
//   - the two channels overlap as the hardware allows: while one channel computes page i (its arbiter in
//     acceleration mode), the engine's readers load the next page's state into the other channel (normal mode);
//   - a later update whose page is still in the module, and holds the committed slot's version, reads it from the
//     module instead of NVMe and does not copy the state back in.
// The module's kernel runs Adam and AdamW (the paper's kernel, with nsp's extensions). A store of another kind
// (SGD, AdaGrad) keeps no second moment or no first moment for it: its pages are updated by nsp's CPU kernel on the
// host, which the stats count (host_kernels).
//
// Built as libnsp_backend_axdimm.so, which exports nothing but nsp_backend_entry_v1.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backends/axdimm/vendor/axdimm_api.h"
#include "backends/backend.h"
#include "backends/hls/nsp_updater_hls.h"
#include "backends/plugin_device.h"
#include "kernels/update_kernel.h"
#include "nsp_backend_abi.h"

namespace {

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

// Loads the runtime and resolves every call; returns "" or why not. The library stays loaded for the process's
// life (its kernel threads may outlive a device).
std::string LoadRuntime(const std::string& library, AxdimmApi* api) {
  void* handle = nullptr;
  if (std::string e = nsp::plugin::LoadLibrary(library, "the AXDIMM runtime", "NSP_AXDIMM_LIBRARY", kDefaultLibrary,
                                               &handle);
      !e.empty()) {
    return e;
  }
  std::string missing;
#define NSP_AX_REQUIRE(name)                                                 \
  api->name = reinterpret_cast<nsp_##name##_fn>(::dlsym(handle, #name));   \
  if (api->name == nullptr && missing.empty()) missing = #name;
  NSP_AXDIMM_SYMBOLS(NSP_AX_REQUIRE)
#undef NSP_AX_REQUIRE
  if (!missing.empty()) return "the AXDIMM runtime '" + library + "' lacks the symbol " + missing;
  return {};
}

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

}  // namespace

// The shard and its page files (the NVMe) are PluginDevice's; the rest is the module's.
struct nsp_backend_device : nsp::plugin::PluginDevice {
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

namespace {

int ChannelOf(int64_t page) { return static_cast<int>((page < 0 ? 0 : page) % kChannels); }

// ---- Channels ----

// Exclusive use of a channel: its copies, its arbiter mode, its allocations and evictions, its kernel.
void AcquireChannel(nsp_backend_device* d, int c) {
  std::unique_lock<std::mutex> lock(d->mu);
  d->cv.wait(lock, [&] { return !d->channel_busy[c]; });
  d->channel_busy[c] = true;
}

void ReleaseChannel(nsp_backend_device* d, int c) {
  {
    std::lock_guard<std::mutex> lock(d->mu);
    d->channel_busy[c] = false;
  }
  d->cv.notify_all();
}

// The page to evict from channel c (not `keep`): updated in this step first, least recently used first; with
// `updated_only`, none when no updated page is there. Returns -1 when none. Caller holds mu.
int64_t PickVictim(nsp_backend_device* d, int c, int64_t keep, bool updated_only) {
  int64_t best = -1;
  bool best_updated = false;
  uint64_t best_use = 0;
  for (const auto& [page, r] : d->resident) {
    if (page == keep || ChannelOf(page) != c) continue;
    if (updated_only && !r.updated) continue;
    const bool better = best < 0 || (r.updated && !best_updated) ||
                        (r.updated == best_updated && r.last_use < best_use);
    if (better) {
      best = page;
      best_updated = r.updated;
      best_use = r.last_use;
    }
  }
  return best;
}

// Frees a resident page's module memory. Write-through: its page files are already current. Holder of its channel.
std::string Evict(nsp_backend_device* d, int64_t page) {
  nspAxdimmAddr base;
  bool updated;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    auto it = d->resident.find(page);
    base = it->second.base;
    updated = it->second.updated;
    d->resident.erase(it);
  }
  (updated ? d->evicted_updated : d->evicted_other).fetch_add(1);
  d->evicted.fetch_add(1);
  if (int rc = d->api.nspAxdimmFreeX(d->module, base)) {
    return "freeing page " + std::to_string(page) + " failed (" + std::to_string(rc) + "): " + d->LastError();
  }
  return {};
}

// Allocates `bytes` on channel c, evicting (never `keep`) until it fits. *fits is false when it cannot: with
// `updated_only`, when no page updated in this step is left to evict; else when nothing is left at all.
std::string Allocate(nsp_backend_device* d, int c, size_t bytes, int64_t keep, bool updated_only, nspAxdimmAddr* out,
                     bool* fits) {
  *fits = true;
  for (;;) {
    const int rc = d->api.nspAxdimmMallocX(d->module, bytes, c, out);
    if (rc == NSP_AXDIMM_OK) return {};
    if (rc != NSP_AXDIMM_ENOMEM) return "nspAxdimmMallocX failed (" + std::to_string(rc) + "): " + d->LastError();
    int64_t victim;
    {
      std::lock_guard<std::mutex> lock(d->mu);
      victim = PickVictim(d, c, keep, updated_only);
    }
    if (victim < 0) {
      *fits = false;
      if (updated_only) return {};
      size_t capacity = 0, free_bytes = 0;
      d->api.nspAxdimmMemInfo(d->module, c, &capacity, &free_bytes);
      return "channel " + std::to_string(c) + " has no room for " + std::to_string(bytes) + " bytes with every other "
             "page evicted (" + std::to_string(free_bytes) + " of " + std::to_string(capacity) + " bytes free)";
    }
    if (std::string e = Evict(d, victim); !e.empty()) return e;
  }
}

// The page's resident entry, allocated if absent. Holder of its channel. *present false: not resident and no room
// (only with `updated_only`).
std::string EnsureResident(nsp_backend_device* d, int64_t page, bool updated_only, bool* present) {
  *present = true;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    auto it = d->resident.find(page);
    if (it != d->resident.end()) {
      it->second.last_use = ++d->clock;
      return {};
    }
  }
  nspAxdimmAddr base = 0;
  bool fits = true;
  if (std::string e = Allocate(d, ChannelOf(page), d->ResidentBytes(), page, updated_only, &base, &fits); !e.empty()) {
    return e;
  }
  if (!fits) {
    *present = false;
    return {};
  }
  std::lock_guard<std::mutex> lock(d->mu);
  Resident& r = d->resident[page];
  r.base = base;
  r.last_use = ++d->clock;
  return {};
}

std::string CopyToModule(nsp_backend_device* d, nspAxdimmAddr dst, const void* src, size_t bytes) {
  if (int rc = d->api.nspAxdimmMemcpyH2X(d->module, dst, src, bytes)) {
    return "the copy into the module failed (" + std::to_string(rc) + "): " + d->LastError();
  }
  d->h2x_bytes.fetch_add(static_cast<int64_t>(bytes));
  return {};
}

std::string CopyFromModule(nsp_backend_device* d, void* dst, nspAxdimmAddr src, size_t bytes) {
  if (int rc = d->api.nspAxdimmMemcpyX2H(d->module, dst, src, bytes)) {
    return "the copy out of the module failed (" + std::to_string(rc) + "): " + d->LastError();
  }
  d->x2h_bytes.fetch_add(static_cast<int64_t>(bytes));
  return {};
}

// Marks every state of a page as not held (a failed copy or kernel may have left anything there).
void Invalidate(nsp_backend_device* d, int64_t page) {
  std::lock_guard<std::mutex> lock(d->mu);
  auto it = d->resident.find(page);
  if (it == d->resident.end()) return;
  for (int s = 0; s < NSP_BACKEND_NUM_STATES; ++s) {
    it->second.valid_slot[s] = -1;
    it->second.fresh[s] = false;
  }
}

// ---- Opening ----

// The runtime and the module: "" or why not (nothing is left open on failure).
std::string OpenModule(nsp_backend_device* d, const nsp_backend_config* c) {
  OptionMap opts;
  if (std::string e = nsp::plugin::ParseOptions(c->options ? c->options : "", &opts); !e.empty()) return e;
  if (std::string e = nsp::plugin::CheckOptionKeys(opts, {"library", "device"}); !e.empty()) return e;
  d->library = nsp::plugin::LibraryPath(opts, "NSP_AXDIMM_LIBRARY", kDefaultLibrary);
  d->device_path = opts.count("device") ? opts["device"] : kDefaultDevice;
  if (std::string e = LoadRuntime(d->library, &d->api); !e.empty()) return e;
  if (int rc = d->api.nspAxdimmOpen(d->device_path.c_str(), &d->module)) {
    return "opening the module " + d->device_path + " failed (" + std::to_string(rc) + "): " + d->LastError();
  }
  return {};
}

int Open(const nsp_backend_config* c, nsp_backend_device** out, char* err, size_t err_len) {
  auto d = std::make_unique<nsp_backend_device>();
  if (nsp::plugin::CheckConfig(c, "axdimm", "", d.get(), err, err_len) != 0) return 1;
  if (std::string e = OpenModule(d.get(), c); !e.empty()) return d->Fail(err, err_len, e);
  if (std::string e = nsp::plugin::OpenPages(c, d.get()); !e.empty()) {
    d->api.nspAxdimmClose(d->module);
    return d->Fail(err, err_len, e);
  }
  d->module_kernel = d->used[0] && d->used[1] && d->used[2];
  *out = d.release();
  return 0;
}

void Close(nsp_backend_device* d) {
  for (int c = 0; c < kChannels; ++c) d->api.nspAxdimmWait(d->module, c);  // no kernel outlives its device
  d->api.nspAxdimmClose(d->module);  // frees every allocation
  delete d;
}

// The engine's page buffers are host memory (the module is on the memory bus: the host copies in and out), the
// file tier's own (nsp::plugin::AllocHostBuffer).

// ---- Pages ----

// A page the module holds for this slot comes from the module. Returns true when it did (or failed: *e set).
bool ReadFromModule(nsp_backend_device* d, int32_t slot, int32_t state, int64_t page, float* dst, int64_t n,
                    std::string* e) {
  const int c = ChannelOf(page);
  {
    // Most reads miss: they go to NVMe without waiting for the channel (its kernel may be running).
    std::lock_guard<std::mutex> lock(d->mu);
    auto it = d->resident.find(page);
    if (it == d->resident.end() || it->second.valid_slot[state] != slot) return false;
  }
  AcquireChannel(d, c);
  nspAxdimmAddr addr = 0;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    auto it = d->resident.find(page);
    if (it != d->resident.end() && it->second.valid_slot[state] == slot) {
      addr = it->second.base + d->StateOffset(state);
      it->second.last_use = ++d->clock;
    }
  }
  if (addr != 0) {
    *e = CopyFromModule(d, dst, addr, static_cast<size_t>(n) * 4);
    if (!e->empty()) Invalidate(d, page);
    else d->hits.fetch_add(1);
  }
  ReleaseChannel(d, c);
  return addr != 0;
}

// After an NVMe read for an update: the state into the module too, if there is room without evicting a page that
// is still to be updated in this step (the kernel loads it otherwise).
std::string LoadIntoModule(nsp_backend_device* d, int32_t slot, int32_t state, int64_t page, const float* src,
                           int64_t n) {
  const int c = ChannelOf(page);
  AcquireChannel(d, c);
  bool present = false;
  std::string e = EnsureResident(d, page, /*updated_only=*/true, &present);
  if (e.empty() && present) {
    nspAxdimmAddr addr;
    {
      std::lock_guard<std::mutex> lock(d->mu);
      addr = d->resident[page].base + d->StateOffset(state);
    }
    e = CopyToModule(d, addr, src, static_cast<size_t>(n) * 4);
    std::lock_guard<std::mutex> lock(d->mu);
    Resident& r = d->resident[page];
    r.valid_slot[state] = e.empty() ? slot : -1;
    r.fresh[state] = false;
    if (e.empty()) d->loaded.fetch_add(1);
  } else if (e.empty()) {
    d->prefetch_skipped.fetch_add(1);
  }
  ReleaseChannel(d, c);
  if (!e.empty()) e = "loading it into channel " + std::to_string(c) + " failed: " + e;
  return e;
}

int ReadPage(nsp_backend_device* d, int32_t slot, int32_t state, int64_t page, float* dst, int64_t n, int32_t scratch,
             char* err, size_t err_len) {
  const bool for_update = scratch != 0 && d->module_kernel && d->in_update;
  std::string e;
  if (for_update && ReadFromModule(d, slot, state, page, dst, n, &e)) {
    // from the module (or failed there)
  } else {
    e = d->pages->ReadPage(slot, state, page, dst, n, scratch != 0);
    if (e.empty() && for_update) e = LoadIntoModule(d, slot, state, page, dst, n);
  }
  if (!e.empty()) return d->Fail(err, err_len, "reading " + PageName(slot, state, page) + " failed: " + e);
  if (for_update) {
    std::lock_guard<std::mutex> lock(d->mu);
    d->sources[dst] = BufferSource{page, state, slot};
  }
  return 0;
}

// Write-through: the page file first; then the module's copy of this state names this slot if it is what was just
// written (the kernel's output), and no longer names it otherwise (a page written from anywhere else).
int WritePage(nsp_backend_device* d, int32_t slot, int32_t state, int64_t page, float* src, int64_t n,
              int32_t scratch, char* err, size_t err_len) {
  if (std::string e = d->pages->WritePage(slot, state, page, src, n, scratch != 0); !e.empty()) {
    return d->Fail(err, err_len, "writing " + PageName(slot, state, page) + " failed: " + e);
  }
  std::lock_guard<std::mutex> lock(d->mu);
  auto it = d->resident.find(page);
  if (it == d->resident.end()) return 0;
  Resident& r = it->second;
  if (r.fresh[state]) {
    r.valid_slot[state] = slot;
    r.fresh[state] = false;
  } else if (r.valid_slot[state] == slot) {
    r.valid_slot[state] = -1;
  }
  return 0;
}

// ---- Kernels ----

// A kind the module's kernel does not run: nsp's CPU kernel on the engine's buffers.
std::string HostKernel(nsp_backend_device* d, const nsp_hyper_params& h, const nsp_state_span& s,
                       const nsp_page_grad& g, int64_t page) {
  const nsp::StateSpan span = nsp::plugin::ToSpan(s);
  const nsp::UpdateHyperParams hp = nsp::plugin::ToHyper(h);
  const nsp::GradType type = g.grad_type == NSP_GRAD_BF16 ? nsp::GradType::kBF16 : nsp::GradType::kF32;
  try {
    if (g.dense != nullptr) nsp::UpdateDense(hp, span, g.dense, type);
    else nsp::UpdateSparse(hp, span, g.indices, g.values, type, g.count, g.index_base);
  } catch (const std::exception& e) {
    return e.what();
  }
  d->host_kernels.fetch_add(1);
  Invalidate(d, page);
  return {};
}

// Brings the page's state into its resident allocation unless the module already holds what the span's inputs
// hold (the buffer a read filled from, or into, the module). Holder of the channel.
std::string StageState(nsp_backend_device* d, const nsp_state_span& s, int64_t page, nspAxdimmAddr base) {
  const float* ins[3] = {s.param_in, s.mu_in, s.nu_in};
  for (int state = 0; state < 3; ++state) {
    bool held = false;
    {
      std::lock_guard<std::mutex> lock(d->mu);
      auto src = d->sources.find(ins[state]);
      const Resident& r = d->resident[page];
      held = src != d->sources.end() && src->second.page == page && src->second.state == state &&
             r.valid_slot[state] == src->second.slot && r.valid_slot[state] >= 0;
    }
    if (held) continue;
    if (std::string e = CopyToModule(d, base + d->StateOffset(state), ins[state], static_cast<size_t>(s.size) * 4);
        !e.empty()) {
      return "state '" + std::string(nsp::StateName(state)) + "': " + e;
    }
  }
  return {};
}

size_t Align64(size_t bytes) { return (bytes + 63) / 64 * 64; }

// Copies the gradient (and indices) into a staging allocation on the channel and fills the launch's arguments.
std::string StageGradient(nsp_backend_device* d, const nsp_page_grad& g, const nsp_state_span& s, int c,
                          int64_t page, Launch* l, nspAxdimmAdamArgs* a) {
  const size_t gsize = g.grad_type == NSP_GRAD_BF16 ? 2 : 4;
  const bool topk = g.dense == nullptr;
  const size_t n = static_cast<size_t>(s.size), count = topk ? static_cast<size_t>(g.count) : 0;
  const size_t grad_bytes = Align64(gsize * (topk ? count : n)), idx_bytes = Align64(4 * count);
  const size_t p16_bytes = s.param_bf16_out ? Align64(2 * n) : 0;
  const size_t total = std::max<size_t>(64, grad_bytes + idx_bytes + p16_bytes);
  bool fits = true;
  if (std::string e = Allocate(d, c, total, page, false, &l->staging, &fits); !e.empty()) return "the gradient: " + e;
  a->grad_format = topk ? (gsize == 2 ? NSP_HLS_TOPK_BF16 : NSP_HLS_TOPK_F32)
                        : (gsize == 2 ? NSP_HLS_GRAD_BF16 : NSP_HLS_GRAD_F32);
  if (!topk || count > 0) {
    a->grad = l->staging;
    if (std::string e = CopyToModule(d, a->grad, topk ? g.values : g.dense, gsize * (topk ? count : n)); !e.empty()) {
      return "the gradient: " + e;
    }
  }
  if (count > 0) {
    a->indices = l->staging + grad_bytes;
    if (std::string e = CopyToModule(d, a->indices, g.indices, 4 * count); !e.empty()) return "the indices: " + e;
  }
  if (p16_bytes > 0) l->p16 = a->p_bf16 = l->staging + grad_bytes + idx_bytes;
  a->topk_count = static_cast<int64_t>(count);
  a->index_base = topk ? g.index_base : 0;
  return {};
}

// Everything up to the kernel's start on channel c (which the caller holds). Returns "" or why not.
std::string StartKernel(nsp_backend_device* d, const nsp_hyper_params& h, const nsp_state_span& s,
                        const nsp_page_grad& g, int c, Launch* l) {
  const int64_t page = l->page;
  if (h.kind != NSP_KIND_ADAM && h.kind != NSP_KIND_ADAMW) return "the module's kernel runs Adam or AdamW only";
  if (s.size < 1 || s.size > d->page_elems) return "a span of " + std::to_string(s.size) + " elements is not a page";
  bool present = true;
  if (std::string e = EnsureResident(d, page, false, &present); !e.empty()) return "the page's state: " + e;
  nspAxdimmAddr base;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    base = d->resident[page].base;
  }
  if (std::string e = StageState(d, s, page, base); !e.empty()) return e;
  nspAxdimmAdamArgs a{};
  a.struct_size = sizeof a;
  a.kind = h.kind == NSP_KIND_ADAM ? NSP_HLS_ADAM : NSP_HLS_ADAMW;
  a.lazy = h.lazy;
  a.p = base + d->StateOffset(0);
  a.m = base + d->StateOffset(1);
  a.v = base + d->StateOffset(2);
  a.nparams = s.size;
  a.step = h.step;
  a.lr = h.lr;
  a.b1 = h.b1;
  a.b2 = h.b2;
  a.eps = h.eps;
  a.weight_decay = h.weight_decay;
  if (std::string e = StageGradient(d, g, s, c, page, l, &a); !e.empty()) return e;
  {
    // From here the module's copy is the new version (or, if the kernel fails, nothing anyone may read).
    std::lock_guard<std::mutex> lock(d->mu);
    Resident& r = d->resident[page];
    for (int state = 0; state < 3; ++state) {
      r.valid_slot[state] = -1;
      r.fresh[state] = true;
    }
    r.updated = true;
    for (const void* out : {static_cast<const void*>(s.param_out), static_cast<const void*>(s.mu_out),
                            static_cast<const void*>(s.nu_out)}) {
      d->sources.erase(out);
    }
  }
  if (d->api.nspAxdimmSetArbiterAcc(d->module, c) != NSP_AXDIMM_OK) {
    return "switching channel " + std::to_string(c) + " to acceleration mode failed: " + d->LastError();
  }
  if (int rc = d->api.nspAxdimmRunAdamAsync(d->module, &a, c)) {
    const std::string e = d->LastError();
    d->api.nspAxdimmSetArbiterNormal(d->module, c);
    return "the launch failed (" + std::to_string(rc) + "): " + e;
  }
  d->channel_launches[c].fetch_add(1);
  return {};
}

std::string KernelMessage(const nsp_backend_device* d, int64_t page, int c, const std::string& why) {
  const std::string where = c < 0 ? " (on the host)" : " (channel " + std::to_string(c) + ")";
  return d->Name() + ": the update kernel on page " + std::to_string(page) + where + " failed: " + why;
}

// Frees a launch's staging and gives its channel back.
void EndLaunch(nsp_backend_device* d, const Launch& l) {
  if (l.staging != 0) d->api.nspAxdimmFreeX(d->module, l.staging);
  ReleaseChannel(d, l.channel);
}

std::string FinishKernel(nsp_backend_device* d, const Launch& l);

// Completes a launch: its outputs back, its channel given back; "" or the message naming device, page and cause.
std::string Complete(nsp_backend_device* d, const Launch& l) {
  std::string e = FinishKernel(d, l);
  if (!e.empty()) {
    Invalidate(d, l.page);
    d->failed_kernels.fetch_add(1);
    e = KernelMessage(d, l.page, l.channel, e);
  }
  EndLaunch(d, l);
  return e;
}

// One kernel per channel: a launch on a channel whose last kernel nobody has waited for yet completes that one
// first (its result is kept for its compute_wait). The engine waits for every page at once, so this is rare.
void CompletePendingOn(nsp_backend_device* d, int c) {
  uint64_t ticket = 0;
  Launch l;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    for (auto it = d->launches.begin(); it != d->launches.end(); ++it) {
      if (it->second.channel != c) continue;
      ticket = it->first;
      l = it->second;
      d->launches.erase(it);
      break;
    }
  }
  if (ticket == 0) return;
  std::string e = Complete(d, l);
  std::lock_guard<std::mutex> lock(d->mu);
  d->done[ticket] = std::move(e);
}

int ComputeLaunch(nsp_backend_device* d, const nsp_hyper_params* hp, const nsp_state_span* span,
                  const nsp_page_grad* grad, const nsp_page_info* info, uint64_t* ticket, char* err, size_t err_len) {
  if (nsp::plugin::CheckLaunch(*d, hp, span, grad, ticket, err, err_len) != 0) return 1;
  Launch l;
  l.page = nsp::plugin::PageOf(info);
  l.channel = ChannelOf(l.page);
  l.n = span->size;
  l.span = *span;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    *ticket = d->next_ticket++;
  }
  // A kind the module cannot run, or a page the host cannot name (the cache is by page): on the host.
  if (!d->module_kernel || (hp->kind != NSP_KIND_ADAM && hp->kind != NSP_KIND_ADAMW) || l.page < 0) {
    std::string e = HostKernel(d, *hp, *span, *grad, l.page);
    if (!e.empty()) e = KernelMessage(d, l.page, -1, e);
    std::lock_guard<std::mutex> lock(d->mu);
    d->done[*ticket] = e;
    return 0;
  }
  CompletePendingOn(d, l.channel);
  AcquireChannel(d, l.channel);  // held until compute_wait: the kernel owns the channel meanwhile
  if (std::string e = StartKernel(d, *hp, *span, *grad, l.channel, &l); !e.empty()) {
    Invalidate(d, l.page);
    d->failed_kernels.fetch_add(1);
    EndLaunch(d, l);
    std::lock_guard<std::mutex> lock(d->mu);
    d->done[*ticket] = KernelMessage(d, l.page, l.channel, e);
    return 0;
  }
  std::lock_guard<std::mutex> lock(d->mu);
  d->launches[*ticket] = l;
  return 0;
}

// The kernel's end, then its outputs back into the engine's buffers (which the engine writes through to NVMe).
std::string FinishKernel(nsp_backend_device* d, const Launch& l) {
  const int c = l.channel;
  const int rc = d->api.nspAxdimmWait(d->module, c);
  std::string e = rc == NSP_AXDIMM_OK ? "" : d->LastError();
  if (d->api.nspAxdimmSetArbiterNormal(d->module, c) != 0 && e.empty()) {
    e = "switching channel " + std::to_string(c) + " back to normal mode failed: " + d->LastError();
  }
  if (!e.empty()) return e;
  nspAxdimmAddr base;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    base = d->resident[l.page].base;
  }
  const size_t bytes = static_cast<size_t>(l.n) * 4;
  float* outs[3] = {l.span.param_out, l.span.mu_out, l.span.nu_out};
  for (int state = 0; state < 3; ++state) {
    if (std::string e2 = CopyFromModule(d, outs[state], base + d->StateOffset(state), bytes); !e2.empty()) {
      return "state '" + std::string(nsp::StateName(state)) + "': " + e2;
    }
  }
  if (l.p16 != 0) {
    if (std::string e2 = CopyFromModule(d, l.span.param_bf16_out, l.p16, static_cast<size_t>(l.n) * 2); !e2.empty()) {
      return "the bf16 params: " + e2;
    }
  }
  if (l.span.param_copy_out != nullptr) std::memcpy(l.span.param_copy_out, l.span.param_out, bytes);
  return {};
}

int ComputeWait(nsp_backend_device* d, uint64_t ticket, char* err, size_t err_len) {
  Launch l;
  bool running = false;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    auto it = d->launches.find(ticket);
    if (it != d->launches.end()) {
      l = it->second;
      d->launches.erase(it);
      running = true;
    }
  }
  if (running) {
    const std::string e = Complete(d, l);
    return e.empty() ? 0 : Fail(err, err_len, e);
  }
  std::lock_guard<std::mutex> lock(d->mu);
  return nsp::plugin::TakeResult(*d, &d->done, ticket, err, err_len);
}

// ---- Checksums, counters, updates ----

// Checksums set from a manifest mean the page files may have been put there by someone else (a restore): the
// module's copies of that slot are not trusted any more.
int ChecksumsSet(nsp_backend_device* d, int32_t slot, int32_t state, const uint32_t* crcs, int64_t pages, char* err,
                 size_t err_len) {
  if (int rc = nsp::plugin::ChecksumsSet(d, slot, state, crcs, pages, err, err_len); rc != 0) return rc;
  std::lock_guard<std::mutex> lock(d->mu);
  for (auto& [page, r] : d->resident) {
    if (r.valid_slot[state] == slot) r.valid_slot[state] = -1;
  }
  return 0;
}

// The NVMe's counters (the module's copies are in the stats).
void IoCounts(nsp_backend_device* d, nsp_io_counts* out) { nsp::plugin::WriteIoCounts(d->pages->Io(), out); }

int64_t Stats(nsp_backend_device* d, nsp_backend_stat* out, int64_t capacity, char*, size_t) {
  size_t cap[kChannels] = {0, 0}, free_bytes[kChannels] = {0, 0};
  for (int c = 0; c < kChannels; ++c) d->api.nspAxdimmMemInfo(d->module, c, &cap[c], &free_bytes[c]);
  int64_t resident;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    resident = static_cast<int64_t>(d->resident.size());
  }
  return nsp::plugin::WriteStats({
      {"pages_loaded", static_cast<double>(d->loaded.load())},
      {"pages_evicted", static_cast<double>(d->evicted.load())},
      {"pages_evicted_updated", static_cast<double>(d->evicted_updated.load())},
      {"pages_evicted_other", static_cast<double>(d->evicted_other.load())},
      {"module_hits", static_cast<double>(d->hits.load())},
      {"loads_skipped", static_cast<double>(d->prefetch_skipped.load())},
      {"bytes_host_to_module", static_cast<double>(d->h2x_bytes.load())},
      {"bytes_module_to_host", static_cast<double>(d->x2h_bytes.load())},
      {"launches_channel0", static_cast<double>(d->channel_launches[0].load())},
      {"launches_channel1", static_cast<double>(d->channel_launches[1].load())},
      {"host_kernels", static_cast<double>(d->host_kernels.load())},
      {"failed_kernels", static_cast<double>(d->failed_kernels.load())},
      {"resident_pages", static_cast<double>(resident)},
      {"module_bytes", static_cast<double>(cap[0] + cap[1])},
      {"module_free_bytes", static_cast<double>(free_bytes[0] + free_bytes[1])},
  }, out, capacity);
}

// A new step: no page is updated in it yet.
void UpdateBegin(nsp_backend_device* d) {
  d->pages->StreamStarted();
  std::lock_guard<std::mutex> lock(d->mu);
  for (auto& [page, r] : d->resident) r.updated = false;
  d->sources.clear();
  d->in_update = true;
}

// A failed update leaves kernel outputs that were never written through: not to be read as any slot's.
void UpdateEnd(nsp_backend_device* d, int32_t ok) {
  {
    std::lock_guard<std::mutex> lock(d->mu);
    for (auto& [page, r] : d->resident) {
      for (int s = 0; s < NSP_BACKEND_NUM_STATES; ++s) {
        if (r.fresh[s]) r.valid_slot[s] = -1;
        r.fresh[s] = false;
      }
    }
    d->sources.clear();
    d->in_update = false;
  }
  d->pages->StreamFinished(ok != 0);
}

const nsp_backend_v1 kTable = {
    NSP_BACKEND_ABI_VERSION,
    sizeof(nsp_backend_v1),
    "axdimm",
    Open,
    Close,
    nsp::plugin::PageBufferBytesOf<nsp_backend_device>,
    nsp::plugin::AllocHostBufferOf<nsp_backend_device>,
    nsp::plugin::FreeHostBufferOf<nsp_backend_device>,
    ReadPage,
    WritePage,
    nsp::plugin::SyncOf<nsp_backend_device>,  // every page of the version was written through: the files' sync
    ComputeLaunch,
    ComputeWait,
    nsp::plugin::ChecksumsGetOf<nsp_backend_device>,
    ChecksumsSet,
    IoCounts,
    Stats,
    UpdateBegin,
    UpdateEnd,
};

}  // namespace

extern "C" NSP_BACKEND_EXPORT const nsp_backend_v1* nsp_backend_entry_v1(uint32_t host_abi_version) {
  return host_abi_version == NSP_BACKEND_ABI_VERSION ? &kTable : nullptr;
}
