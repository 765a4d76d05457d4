// The AXDIMM plugin's view of the module's memory (axdimm_device.h): loading the runtime and opening the module,
// exclusive use of a channel, the pages the module holds (allocation, and eviction: pages already updated in this
// step first, least recently used first; write-through, so evicting never writes), and copies in and out.
#include <string>

#include "backends/axdimm/axdimm_device.h"

namespace nsp::axdimm {
namespace {

// Loads the runtime and resolves every call; returns "" or why not. The library stays loaded for the process's
// life (its kernel threads may outlive a device).
std::string LoadRuntime(const std::string& library, AxdimmApi* api) {
  return nsp::plugin::LoadVendorLibrary(library, "the AXDIMM runtime", "NSP_AXDIMM_LIBRARY", kDefaultLibrary, "",
                                        [api](nsp::plugin::Symbols& symbols) {
#define NSP_AX_REQUIRE(name) symbols.Require(api->name, #name);
                                          NSP_AXDIMM_SYMBOLS(NSP_AX_REQUIRE)
#undef NSP_AX_REQUIRE
                                        });
}


}  // namespace

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

}  // namespace nsp::axdimm
