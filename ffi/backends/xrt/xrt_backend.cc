// xrt: one SmartSSD (an NVMe SSD with an FPGA beside it) per store shard, driven through the Xilinx Runtime's C API,
// behind the backend ABI (nsp_backend_abi.h).
//
// nsp never links XRT: each device dlopens the XRT library at open (option library=, else NSP_XRT_LIBRARY, else
// libxrt_coreutil.so.2) and looks up the calls of ffi/backends/xrt/vendor/xrt_c_api.h by name. Where no SmartSSD is
// present the tests point library= at libxrt_model.so, the software model of ffi/backends/xrt/xrt_model.cc.
//
// Data path, per page:
//   - the state's pages stay the file tier's page files in the shard directory (zarr chunks with CRC-32C trailers,
//     two version slots), so manifests, checksums, snapshots and plain tensorstore reads keep working;
//   - the engine's page buffers are P2P buffer objects in the FPGA's DDR, mapped for the host. A page read moves the
//     page file into one by the SSD's DMA (nspXrtP2PRead where the library exports it; else pread into the BO's
//     mapping, which on a SmartSSD is the P2P transfer itself), then checks its CRC-32C and its place;
//   - the updater kernel nsp_update_page (ffi/backends/hls) runs on the FPGA through the XRT run API, on the P2P
//     buffers in place; the gradient, Top-K indices and coefficients go in through normal BOs (written, synced to the
//     device), the bf16 params copy comes back through one (synced back, read);
//   - a page write goes from the P2P buffer's mapping to its page file by the file tier's own write protocol
//     (direct I/O from the BO: the SSD's DMA reads the FPGA's DDR), so a version is committed exactly as the file
//     tier commits one. The params the host asked for are read out of the P2P buffer.
//
// Built as libnsp_backend_xrt.so, which exports nothing but nsp_backend_entry_v1.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "backends/page_file.h"
#include "backends/xrt/xrt_device.h"
#include "util/crc32c.h"

namespace nsp::xrt {
namespace {

// Loads `library` and resolves every symbol; returns "" or why not (the library's name and dlerror, or the first
// missing symbol). The library stays loaded for the process's life: its threads may outlive a device's close.
std::string LoadXrt(const std::string& library, XrtApi* api) {
  return nsp::plugin::LoadVendorLibrary(library, "the XRT library", "NSP_XRT_LIBRARY", kDefaultLibrary,
                                        " (not an XRT C API of 2020.2 or later)", [api](nsp::plugin::Symbols& symbols) {
#define NSP_XRT_REQUIRE(name) symbols.Require(api->name, #name);
#define NSP_XRT_OPTIONAL(name) symbols.Optional(api->name, #name);
                                          NSP_XRT_SYMBOLS(NSP_XRT_REQUIRE, NSP_XRT_OPTIONAL)
#undef NSP_XRT_REQUIRE
#undef NSP_XRT_OPTIONAL
                                        });
}


// ---- Opening ----

std::string ProgramDevice(nsp_backend_device* d, const OptionMap& opts) {
  auto xclbin = opts.find("xclbin");
  if (xclbin == opts.end() || xclbin->second.empty()) {
    return "option xclbin=<path> is required: the updater bitstream built from ffi/backends/hls "
           "(docs/fpga_updater.md)";
  }
  d->dev = d->api.xrtDeviceOpen(d->device_index);
  if (d->dev == nullptr) {
    const int code = errno;
    return "xrtDeviceOpen(" + std::to_string(d->device_index) + ") failed: " + d->XrtError(code);
  }
  if (int rc = d->api.xrtDeviceLoadXclbinFile(d->dev, xclbin->second.c_str())) {
    return "loading the xclbin '" + xclbin->second + "' failed: " + d->XrtError(rc);
  }
  nsp_xrt_uuid uuid = {};
  if (int rc = d->api.xrtDeviceGetXclbinUUID(d->dev, uuid)) return "xrtDeviceGetXclbinUUID failed: " + d->XrtError(rc);
  d->kernel = d->api.xrtPLKernelOpen(d->dev, uuid, NSP_XRT_KERNEL_NAME);
  if (d->kernel == nullptr) {
    const int code = errno;
    return std::string("opening the kernel " NSP_XRT_KERNEL_NAME " failed: ") + d->XrtError(code);
  }
  d->run = d->api.xrtRunOpen(d->kernel);
  if (d->run == nullptr) {
    const int code = errno;
    return "xrtRunOpen failed: " + d->XrtError(code);
  }
  d->dummy.handle = d->api.xrtBOAlloc(d->dev, 4096, NSP_XRT_BO_FLAGS_NONE, 0);
  if (d->dummy.handle == nullptr) {
    const int code = errno;
    return "allocating a 4096-byte buffer failed: " + d->XrtError(code);
  }
  d->dummy.bytes = 4096;
  return {};
}

// Picks this shard's card from device=<i>[,<j>...] (shard k takes entry k mod count; default 0).
std::string DeviceIndex(const OptionMap& opts, int64_t shard, unsigned* out) {
  auto it = opts.find("device");
  if (it == opts.end()) return {};
  std::vector<unsigned> list;
  size_t pos = 0;
  const std::string& s = it->second;
  while (pos <= s.size()) {
    const size_t end = std::min(s.find(',', pos), s.size());
    const std::string item = s.substr(pos, end - pos);
    char* stop = nullptr;
    const long v = std::strtol(item.c_str(), &stop, 10);
    if (item.empty() || *stop != '\0' || v < 0) return "option device=" + s + " is not a list of card indices";
    list.push_back(static_cast<unsigned>(v));
    pos = end + 1;
  }
  *out = list[static_cast<size_t>(shard) % list.size()];
  return {};
}

void ReleaseXrt(nsp_backend_device* d) {
  for (Bo& b : d->staging) {
    if (b.handle != nullptr) d->api.xrtBOFree(b.handle);
  }
  if (d->dummy.handle != nullptr) d->api.xrtBOFree(d->dummy.handle);
  if (d->run != nullptr) d->api.xrtRunClose(d->run);
  if (d->kernel != nullptr) d->api.xrtKernelClose(d->kernel);
  if (d->dev != nullptr) d->api.xrtDeviceClose(d->dev);
}

// The library, the card and its bitstream: "" or why not (what the card holds so far is released by the caller).
std::string OpenCard(nsp_backend_device* d, const nsp_backend_config* c) {
  OptionMap opts;
  if (std::string e = nsp::plugin::ParseOptions(c->options ? c->options : "", &opts); !e.empty()) return e;
  if (std::string e = nsp::plugin::CheckOptionKeys(opts, {"library", "xclbin", "device"}); !e.empty()) return e;
  d->library = nsp::plugin::LibraryPath(opts, "NSP_XRT_LIBRARY", kDefaultLibrary);
  if (std::string e = LoadXrt(d->library, &d->api); !e.empty()) return e;
  if (std::string e = DeviceIndex(opts, d->shard, &d->device_index); !e.empty()) return e;
  return ProgramDevice(d, opts);
}

int Open(const nsp_backend_config* c, nsp_backend_device** out, char* err, size_t err_len) {
  auto d = std::make_unique<nsp_backend_device>();
  if (nsp::plugin::CheckConfig(c, "xrt", "", d.get(), err, err_len) != 0) return 1;
  std::string e = OpenCard(d.get(), c);
  if (e.empty()) e = nsp::plugin::OpenPages(c, d.get());
  if (!e.empty()) {
    ReleaseXrt(d.get());  // only what was opened: the handles start null
    return d->Fail(err, err_len, e);
  }
  const size_t pages = static_cast<size_t>((d->size + d->page_elems - 1) / d->page_elems);
  for (int slot = 0; slot < 2; ++slot) {
    for (int s = 0; s < NSP_BACKEND_NUM_STATES; ++s) {
      d->crc[slot][s].assign(pages, 0);
      d->known[slot][s].assign(pages, 0);
    }
  }
  *out = d.release();
  return 0;
}

void Close(nsp_backend_device* d) {
  {
    std::lock_guard<std::mutex> lock(d->run_mu);
    if (d->have_pending) FinishRun(d);  // no run outlives its device
  }
  ReleaseXrt(d);
  delete d;
}

// ---- Buffers ----

// A P2P BO in the FPGA's DDR, mapped: the SSD's DMA fills it and the kernel works on it where it lies.
void* AllocBuffer(nsp_backend_device* d, size_t bytes, char* err, size_t err_len) {
  xrtBufferHandle bo = d->api.xrtBOAlloc(d->dev, bytes, NSP_XRT_BO_FLAGS_P2P, 0);
  if (bo == nullptr) {
    const int code = errno;
    SetError(err, err_len, d->Name() + ": allocating a P2P buffer of " + std::to_string(bytes) + " bytes failed: " +
                               d->XrtError(code));
    return nullptr;
  }
  char* mapped = static_cast<char*>(d->api.xrtBOMap(bo));
  if (mapped == nullptr || reinterpret_cast<uintptr_t>(mapped) % 4096 != 0) {
    const int code = errno;
    d->api.xrtBOFree(bo);
    SetError(err, err_len, d->Name() + ": mapping a P2P buffer failed: " +
                               (mapped ? std::string("not 4096-byte aligned") : d->XrtError(code)));
    return nullptr;
  }
  std::memset(mapped, 0, bytes);
  std::lock_guard<std::mutex> lock(d->bo_mu);
  d->buffers[mapped] = Bo{bo, bytes};
  return mapped;
}

void FreeBuffer(nsp_backend_device* d, void* buffer, size_t) {
  Bo bo;
  {
    std::lock_guard<std::mutex> lock(d->bo_mu);
    auto it = d->buffers.find(static_cast<char*>(buffer));
    if (it == d->buffers.end()) return;
    bo = it->second;
    d->buffers.erase(it);
  }
  d->api.xrtBOFree(bo.handle);
}

}  // namespace

// The P2P BO whose mapping starts at `p` and holds `bytes`, or null.
xrtBufferHandle BufferAt(nsp_backend_device* d, const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(d->bo_mu);
  auto it = d->buffers.find(static_cast<char*>(const_cast<void*>(p)));
  return it == d->buffers.end() || it->second.bytes < bytes ? nullptr : it->second.handle;
}

namespace {

// ---- Pages ----

std::string CheckPlace(nsp_backend_device* d, int slot, int state, int64_t page, uint32_t stored) {
  std::lock_guard<std::mutex> lock(d->crc_mu);
  const size_t i = static_cast<size_t>(page);
  if (!d->checksum || !d->known[slot][state][i] || d->crc[slot][state][i] == stored) return {};
  char got[16], want[16];
  std::snprintf(got, sizeof got, "%08x", stored);
  std::snprintf(want, sizeof want, "%08x", d->crc[slot][state][i]);
  return "page " + std::to_string(page) + " of state '" + nsp::StateName(state) + "' in slot " +
         std::to_string(slot) + " is intact but is not the page written there (checksum " + got +
         ", the manifest records " + want + "): the store is damaged";
}

// Page file -> P2P BO by the SSD's DMA, then the file tier's checks on what landed.
std::string ReadP2P(nsp_backend_device* d, xrtBufferHandle bo, int slot, int state, int64_t page, float* dst) {
  const std::string path = d->PagePath(slot, state, page);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    // An absent page is damage, never zeros: every version the engine reads had all its pages written.
    return errno == ENOENT ? nsp::page_file::MissingMessage(path) : nsp::page_file::ErrnoMessage("cannot open", path);
  }
  // The DMA moves whole page files only: one of another length is refused before it lands in the FPGA's DDR.
  struct stat st;
  const ssize_t length = ::fstat(fd, &st) == 0 ? static_cast<ssize_t>(st.st_size) : -1;
  if (length != static_cast<ssize_t>(d->FileBytes())) {
    ::close(fd);
    return nsp::page_file::TruncatedMessage(path, length, d->FileBytes());
  }
  const int rc = d->api.nspXrtP2PRead(bo, fd, d->FileBytes(), 0, 0);
  nsp::page_file::DropFromCache(fd, d->FileBytes());
  ::close(fd);
  if (rc != 0) return "the P2P read of " + path + " failed: " + d->XrtError(rc);
  d->p2p_reads.fetch_add(1);
  d->p2p_read_bytes.fetch_add(static_cast<int64_t>(d->FileBytes()));
  if (!d->checksum) return {};
  // The last page's padding is zeros in the file and part of its checksum, as the file tier writes it.
  const char* bytes = reinterpret_cast<const char*>(dst);
  uint32_t stored = 0;
  std::memcpy(&stored, bytes + d->ChunkBytes(), 4);
  if (nsp::Crc32c(bytes, d->ChunkBytes()) != stored) {
    return "checksum mismatch: state '" + std::string(nsp::StateName(state)) + "', page " + std::to_string(page) +
           " (" + path + ") is corrupt";
  }
  return CheckPlace(d, slot, state, page, stored);
}

int ReadPage(nsp_backend_device* d, int32_t slot, int32_t state, int64_t page, float* dst, int64_t n, int32_t scratch,
             char* err, size_t err_len) {
  xrtBufferHandle bo = scratch ? BufferAt(d, dst, d->FileBytes()) : nullptr;
  std::string e;
  if (bo != nullptr && d->api.nspXrtP2PRead != nullptr) {
    e = ReadP2P(d, bo, slot, state, page, dst);
  } else {
    // Without nspXrtP2PRead (real XRT), a pread into the P2P BO's mapping is the P2P transfer; a host buffer
    // (a snapshot's, a check's) is read as the file tier reads it.
    e = d->pages->ReadPage(slot, state, page, dst, n, scratch != 0);
    if (e.empty()) d->host_reads.fetch_add(1);
  }
  if (!e.empty()) {
    return d->Fail(err, err_len, "reading " + nsp::plugin::PageName(slot, state, page) + " failed: " + e);
  }
  return 0;
}

uint32_t PageCrc(nsp_backend_device* d, const float* src, int64_t n) {
  static const std::vector<char> zeros(1 << 22, 0);
  const size_t data = static_cast<size_t>(n) * 4;
  uint32_t crc = nsp::Crc32c(src, data);
  for (size_t pad = d->ChunkBytes() - data; pad > 0;) {
    const size_t k = std::min(pad, zeros.size());
    crc = nsp::Crc32cExtend(crc, zeros.data(), k);
    pad -= k;
  }
  return crc;
}

int WritePage(nsp_backend_device* d, int32_t slot, int32_t state, int64_t page, float* src, int64_t n,
              int32_t scratch, char* err, size_t err_len) {
  // The CRC first: a direct write may use the buffer's tail for the trailer.
  const uint32_t crc = d->checksum ? PageCrc(d, src, n) : 0;
  if (std::string e = d->pages->WritePage(slot, state, page, src, n, scratch != 0); !e.empty()) {
    return d->Fail(err, err_len, "writing " + nsp::plugin::PageName(slot, state, page) + " failed: " + e);
  }
  if (d->checksum) {
    std::lock_guard<std::mutex> lock(d->crc_mu);
    d->crc[slot][state][static_cast<size_t>(page)] = crc;
    d->known[slot][state][static_cast<size_t>(page)] = 1;
  }
  return 0;
}

// ---- Checksums, counters ----

int ChecksumsSet(nsp_backend_device* d, int32_t slot, int32_t state, const uint32_t* crcs, int64_t pages, char* err,
                 size_t err_len) {
  if (int rc = nsp::plugin::ChecksumsSet(d, slot, state, crcs, pages, err, err_len); rc != 0) return rc;
  // What the P2P reads check against from now on.
  std::lock_guard<std::mutex> lock(d->crc_mu);
  const std::vector<uint32_t> v(crcs, crcs + pages);
  d->crc[slot][state] = v;
  d->known[slot][state].assign(v.size(), 1);
  return 0;
}

// The file tier's counters (page writes, host reads) plus the P2P reads that bypassed it.
void IoCounts(nsp_backend_device* d, nsp_io_counts* out) {
  nsp::IoCounts c = d->pages->Io();
  const int64_t p2p = d->p2p_reads.load();
  c.read_bytes += d->p2p_read_bytes.load();
  c.pages_read += p2p;
  c.pages_read_direct += p2p;  // the SSD's DMA bypasses the page cache, as a direct read does
  nsp::plugin::WriteIoCounts(c, out);
}

int64_t Stats(nsp_backend_device* d, nsp_backend_stat* out, int64_t capacity, char*, size_t) {
  return nsp::plugin::WriteStats({
      {"p2p_page_reads", nsp::plugin::Stat(d->p2p_reads)},
      {"p2p_read_bytes", nsp::plugin::Stat(d->p2p_read_bytes)},
      {"host_page_reads", nsp::plugin::Stat(d->host_reads)},
      {"kernel_runs", nsp::plugin::Stat(d->runs)},
      {"failed_runs", nsp::plugin::Stat(d->failed_runs)},
      {"bytes_to_device", nsp::plugin::Stat(d->bytes_to_device)},
      {"bytes_from_device", nsp::plugin::Stat(d->bytes_from_device)},
      {"p2p_read_call", d->api.nspXrtP2PRead != nullptr ? 1.0 : 0.0},
      {"card", static_cast<double>(d->device_index)},
  }, out, capacity);
}

void UpdateBegin(nsp_backend_device* d) { d->pages->StreamStarted(); }
void UpdateEnd(nsp_backend_device* d, int32_t ok) { d->pages->StreamFinished(ok != 0); }

// Page buffers are the card's P2P buffers; sync is the page files'.
constexpr nsp_backend_v1 kTable = nsp::plugin::MakeTable<nsp_backend_device>(
    {"xrt", Open, Close, ReadPage, WritePage, ComputeLaunch, ComputeWait, IoCounts, Stats, UpdateBegin, UpdateEnd,
     AllocBuffer, FreeBuffer, ChecksumsSet});

}  // namespace
}  // namespace nsp::xrt

NSP_PLUGIN_ENTRY(nsp::xrt::kTable)
