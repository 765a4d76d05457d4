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
#include <memory>
#include <mutex>
#include <string>

#include "backends/axdimm/axdimm_device.h"
#include "backends/plugin_device.h"

namespace nsp::axdimm {
namespace {

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
      {"pages_loaded", nsp::plugin::Stat(d->loaded)},
      {"pages_evicted", nsp::plugin::Stat(d->evicted)},
      {"pages_evicted_updated", nsp::plugin::Stat(d->evicted_updated)},
      {"pages_evicted_other", nsp::plugin::Stat(d->evicted_other)},
      {"module_hits", nsp::plugin::Stat(d->hits)},
      {"loads_skipped", nsp::plugin::Stat(d->prefetch_skipped)},
      {"bytes_host_to_module", nsp::plugin::Stat(d->h2x_bytes)},
      {"bytes_module_to_host", nsp::plugin::Stat(d->x2h_bytes)},
      {"launches_channel0", nsp::plugin::Stat(d->channel_launches[0])},
      {"launches_channel1", nsp::plugin::Stat(d->channel_launches[1])},
      {"host_kernels", nsp::plugin::Stat(d->host_kernels)},
      {"failed_kernels", nsp::plugin::Stat(d->failed_kernels)},
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

// Page buffers are the host's (the module is on the memory bus), and sync is the page files': every page of the
// version was written through.
constexpr nsp_backend_v1 kTable = nsp::plugin::MakeTable<nsp_backend_device>(
    {"axdimm", Open, Close, ReadPage, WritePage, ComputeLaunch, ComputeWait, IoCounts, Stats, UpdateBegin, UpdateEnd,
     nullptr, nullptr, ChecksumsSet});


}  // namespace
}  // namespace nsp::axdimm

NSP_PLUGIN_ENTRY(nsp::axdimm::kTable)
