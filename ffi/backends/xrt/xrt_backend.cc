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
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/hls/nsp_updater_hls.h"
#include "backends/page_file.h"
#include "backends/plugin_device.h"
#include "backends/xrt/vendor/xrt_c_api.h"
#include "kernels/update_kernel.h"
#include "nsp_backend_abi.h"
#include "util/crc32c.h"

namespace {

constexpr const char* kDefaultLibrary = "libxrt_coreutil.so.2";

using nsp::plugin::Fail;
using nsp::plugin::OptionMap;
using nsp::plugin::SetError;

// The XRT calls, resolved from the loaded library (optional ones may stay null).
struct XrtApi {
#define NSP_XRT_DECLARE(name) nsp_##name##_fn name = nullptr;
  NSP_XRT_SYMBOLS(NSP_XRT_DECLARE, NSP_XRT_DECLARE)
#undef NSP_XRT_DECLARE
};

// Loads `library` and resolves every symbol; returns "" or why not (the library's name and dlerror, or the first
// missing symbol). The library stays loaded for the process's life: its threads may outlive a device's close.
std::string LoadXrt(const std::string& library, XrtApi* api) {
  void* handle = nullptr;
  if (std::string e = nsp::plugin::LoadLibrary(library, "the XRT library", "NSP_XRT_LIBRARY", kDefaultLibrary, &handle);
      !e.empty()) {
    return e;
  }
  std::string missing;
#define NSP_XRT_REQUIRE(name)                                                     \
  api->name = reinterpret_cast<nsp_##name##_fn>(::dlsym(handle, #name));        \
  if (api->name == nullptr && missing.empty()) missing = #name;
#define NSP_XRT_OPTIONAL(name) api->name = reinterpret_cast<nsp_##name##_fn>(::dlsym(handle, #name));
  NSP_XRT_SYMBOLS(NSP_XRT_REQUIRE, NSP_XRT_OPTIONAL)
#undef NSP_XRT_REQUIRE
#undef NSP_XRT_OPTIONAL
  if (!missing.empty()) {
    return "the XRT library '" + library + "' lacks the symbol " + missing + " (not an XRT C API of 2020.2 or later)";
  }
  return {};
}

// One BO the device allocated: the engine's page buffers are P2P ones (by their mapped address).
struct Bo {
  xrtBufferHandle handle = nullptr;
  size_t bytes = 0;
};

// A kernel run in flight: what comes back once it completes.
struct PendingRun {
  uint64_t ticket = 0;
  int64_t page = -1;
  int64_t n = 0;
  struct CopyBack {
    xrtBufferHandle bo;
    void* dst;
    size_t bytes;
  };
  std::vector<CopyBack> copies;  // staged outputs: synced from the device, then read into host memory
  const float* p_out = nullptr;   // where the new params are once copies are done
  float* param_copy_out = nullptr;
};

}  // namespace

// The shard and its page files are PluginDevice's; the rest is the card's.
struct nsp_backend_device : nsp::plugin::PluginDevice {
  std::string library;
  XrtApi api;
  unsigned device_index = 0;
  xrtDeviceHandle dev = nullptr;
  xrtKernelHandle kernel = nullptr;
  xrtRunHandle run = nullptr;

  // The engine's page buffers, by mapped address (P2P BOs), and the staging BOs of one run (normal BOs, grown as
  // needed) by kernel argument.
  std::mutex bo_mu;
  std::map<char*, Bo> buffers;
  Bo staging[NSP_XRT_NUM_ARGS];
  Bo dummy;  // bound to the buffer arguments a run does not use

  // What each page of each slot must hold (as the file tier's own table: written here or set from a manifest), for
  // the P2P reads that bypass the file tier.
  std::mutex crc_mu;
  std::vector<uint32_t> crc[2][NSP_BACKEND_NUM_STATES];
  std::vector<uint8_t> known[2][NSP_BACKEND_NUM_STATES];

  // Kernel runs: one at a time (the engine waits for each page), results kept by ticket.
  std::mutex run_mu;
  uint64_t next_ticket = 1;
  bool have_pending = false;
  PendingRun pending;
  std::map<uint64_t, std::string> done;

  // Counters.
  std::atomic<int64_t> p2p_reads{0}, p2p_read_bytes{0}, host_reads{0}, runs{0}, failed_runs{0};
  std::atomic<int64_t> bytes_to_device{0}, bytes_from_device{0};

  size_t ChunkBytes() const { return static_cast<size_t>(page_elems) * 4; }
  size_t FileBytes() const { return ChunkBytes() + (checksum ? 4 : 0); }
  std::string PagePath(int slot, int state, int64_t page) const {
    return dir + "/slot" + std::to_string(slot) + "/" + nsp::StateName(state) + "/c/" + std::to_string(page);
  }
  // XRT's text for an error code (the model's message for the call that just failed on this thread).
  std::string XrtError(int code) const {
    char text[512] = {0};
    size_t need = 0;
    if (api.xrtErrorGetString != nullptr && api.xrtErrorGetString(dev, static_cast<xrtErrorCode>(code), text,
                                                                  sizeof text, &need) == 0 && text[0] != '\0') {
      return text;
    }
    return std::strerror(code);
  }
};

namespace {

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

std::string FinishRun(nsp_backend_device* d);

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

// The P2P BO whose mapping starts at `p` and holds `bytes`, or null.
xrtBufferHandle BufferAt(nsp_backend_device* d, const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(d->bo_mu);
  auto it = d->buffers.find(static_cast<char*>(const_cast<void*>(p)));
  return it == d->buffers.end() || it->second.bytes < bytes ? nullptr : it->second.handle;
}

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

// ---- Kernel runs ----

// A normal BO of at least `bytes` for kernel argument `arg`, grown (freed and allocated again) when too small.
std::string StagingBo(nsp_backend_device* d, int arg, size_t bytes, xrtBufferHandle* out) {
  Bo& b = d->staging[arg];
  if (b.handle == nullptr || b.bytes < bytes) {
    if (b.handle != nullptr) d->api.xrtBOFree(b.handle);
    b = Bo{};
    const size_t want = std::max<size_t>(bytes, 4096);
    b.handle = d->api.xrtBOAlloc(d->dev, want, NSP_XRT_BO_FLAGS_NONE, 0);
    if (b.handle == nullptr) {
      const int code = errno;
      return "allocating a " + std::to_string(want) + "-byte buffer failed: " + d->XrtError(code);
    }
    b.bytes = want;
  }
  *out = b.handle;
  return {};
}

// Host memory -> a normal BO -> the device's DDR.
std::string CopyIn(nsp_backend_device* d, int arg, const void* src, size_t bytes, xrtBufferHandle* out) {
  if (std::string e = StagingBo(d, arg, bytes, out); !e.empty()) return e;
  if (bytes == 0) return {};
  if (int rc = d->api.xrtBOWrite(*out, src, bytes, 0)) return "xrtBOWrite failed: " + d->XrtError(rc);
  if (int rc = d->api.xrtBOSync(*out, NSP_XRT_BO_SYNC_TO_DEVICE, bytes, 0)) {
    return "xrtBOSync to the device failed: " + d->XrtError(rc);
  }
  d->bytes_to_device.fetch_add(static_cast<int64_t>(bytes));
  return {};
}

const char* const kArgNames[] = {"p_in", "m_in", "v_in", "p_out", "m_out", "v_out", "p_bf16_out",
                                 "grad_f32", "grad_bf16", "topk_idx", "coeffs"};

// Binds one state argument: the P2P buffer the pointer is, or a staged copy of host memory (inputs copied in,
// outputs copied back after the run; an output that is its input shares the input's BO).
std::string BindState(nsp_backend_device* d, int arg, const float* ptr, bool is_output, const float* in_ptr,
                      xrtBufferHandle in_bo, int64_t n, PendingRun* job, xrtBufferHandle* bound) {
  const size_t bytes = static_cast<size_t>(n) * 4;
  if (ptr == nullptr) {
    *bound = d->dummy.handle;
    return {};
  }
  if (xrtBufferHandle bo = BufferAt(d, ptr, bytes)) {
    *bound = bo;
    return {};
  }
  if (is_output && ptr == in_ptr) {
    *bound = in_bo;
  } else if (is_output) {
    if (std::string e = StagingBo(d, arg, bytes, bound); !e.empty()) return e;
  } else {
    return CopyIn(d, arg, ptr, bytes, bound);
  }
  job->copies.push_back({*bound, const_cast<float*>(ptr), bytes});
  return {};
}

int32_t GradFormat(const nsp_page_grad& g) {
  const bool bf16 = g.grad_type == NSP_GRAD_BF16;
  if (g.dense != nullptr) return bf16 ? NSP_HLS_GRAD_BF16 : NSP_HLS_GRAD_F32;
  return bf16 ? NSP_HLS_TOPK_BF16 : NSP_HLS_TOPK_F32;
}

// Stages everything a run reads, binds every argument and starts it. Returns "" or why not.
std::string StartRun(nsp_backend_device* d, const nsp_hyper_params& hp, const nsp_state_span& s,
                     const nsp_page_grad& g, PendingRun* job) {
  const int64_t n = s.size;
  if (n < 1 || n > d->page_elems) return "a span of " + std::to_string(n) + " elements is not a page";
  const int32_t fmt = GradFormat(g);
  const uint32_t flags = nsp_hls_flags(hp.kind, fmt, hp.lazy, hp.nesterov, hp.momentum, s.param_bf16_out != nullptr);
  float coeffs[NSP_HLS_NUM_COEFFS];
  if (const char* e = nsp_hls_make_coeffs(hp.kind, hp.lr, hp.step, hp.b1, hp.b2, hp.eps, hp.weight_decay, hp.momentum,
                                          coeffs)) {
    return e;
  }
  const bool um = nsp_hls_uses_m(flags), uv = nsp_hls_uses_v(flags);
  if ((um && (s.mu_in == nullptr || s.mu_out == nullptr)) || (uv && (s.nu_in == nullptr || s.nu_out == nullptr))) {
    return "the optimizer keeps a moment the span does not hold";
  }
  xrtBufferHandle bo[NSP_XRT_NUM_ARGS] = {};
  for (int a = 0; a <= NSP_XRT_ARG_COEFFS; ++a) bo[a] = d->dummy.handle;
  const float* ins[3] = {s.param_in, um ? s.mu_in : nullptr, uv ? s.nu_in : nullptr};
  const float* outs[3] = {s.param_out, um ? s.mu_out : nullptr, uv ? s.nu_out : nullptr};
  for (int k = 0; k < 3; ++k) {
    if (std::string e = BindState(d, NSP_XRT_ARG_P_IN + k, ins[k], false, nullptr, nullptr, n, job, &bo[k]);
        !e.empty()) {
      return std::string(kArgNames[k]) + ": " + e;
    }
  }
  for (int k = 0; k < 3; ++k) {
    const int arg = NSP_XRT_ARG_P_OUT + k;
    if (std::string e = BindState(d, arg, outs[k], true, ins[k], bo[k], n, job, &bo[arg]); !e.empty()) {
      return std::string(kArgNames[arg]) + ": " + e;
    }
  }
  int64_t count = 0;
  const size_t gsize = g.grad_type == NSP_GRAD_BF16 ? 2 : 4;
  const int garg = g.grad_type == NSP_GRAD_BF16 ? NSP_XRT_ARG_GRAD_BF16 : NSP_XRT_ARG_GRAD_F32;
  if (g.dense != nullptr) {
    if (std::string e = CopyIn(d, garg, g.dense, gsize * static_cast<size_t>(n), &bo[garg]); !e.empty()) {
      return "the gradient: " + e;
    }
  } else {
    count = g.count;
    if (nsp_hls_check_topk(g.indices, count, n, g.index_base) >= 0) {
      return "its Top-K indices are unsorted or outside the page";
    }
    if (count > 0) {
      if (std::string e = CopyIn(d, garg, g.values, gsize * static_cast<size_t>(count), &bo[garg]); !e.empty()) {
        return "the Top-K values: " + e;
      }
      if (std::string e = CopyIn(d, NSP_XRT_ARG_TOPK_IDX, g.indices, 4 * static_cast<size_t>(count),
                                 &bo[NSP_XRT_ARG_TOPK_IDX]);
          !e.empty()) {
        return "the Top-K indices: " + e;
      }
    }
  }
  if (std::string e = CopyIn(d, NSP_XRT_ARG_COEFFS, coeffs, sizeof coeffs, &bo[NSP_XRT_ARG_COEFFS]); !e.empty()) {
    return "the coefficients: " + e;
  }
  if (s.param_bf16_out != nullptr) {
    const size_t bytes = 2 * static_cast<size_t>(n);
    if (std::string e = StagingBo(d, NSP_XRT_ARG_P_BF16_OUT, bytes, &bo[NSP_XRT_ARG_P_BF16_OUT]); !e.empty()) {
      return "the bf16 params: " + e;
    }
    job->copies.push_back({bo[NSP_XRT_ARG_P_BF16_OUT], s.param_bf16_out, bytes});
  }
  for (int a = 0; a <= NSP_XRT_ARG_COEFFS; ++a) {
    if (int rc = d->api.xrtRunSetArg(d->run, a, bo[a])) return "xrtRunSetArg failed: " + d->XrtError(rc);
  }
  const int32_t scalars[] = {static_cast<int32_t>(n), static_cast<int32_t>(count),
                             static_cast<int32_t>(g.dense != nullptr ? 0 : g.index_base), static_cast<int32_t>(flags)};
  for (int k = 0; k < 4; ++k) {
    if (int rc = d->api.xrtRunSetArg(d->run, NSP_XRT_ARG_N + k, scalars[k])) {
      return "xrtRunSetArg failed: " + d->XrtError(rc);
    }
  }
  job->n = n;
  job->p_out = s.param_out;
  job->param_copy_out = s.param_copy_out;
  if (int rc = d->api.xrtRunStart(d->run)) return "xrtRunStart failed: " + d->XrtError(rc);
  d->runs.fetch_add(1);
  return {};
}

std::string KernelMessage(const nsp_backend_device* d, int64_t page, const std::string& why) {
  return d->Name() + ": the update kernel on page " + std::to_string(page) + " failed: " + why;
}

// Waits for the pending run and brings its outputs back; returns "" or the run's error (kept by ticket too).
// Caller holds run_mu.
std::string FinishRun(nsp_backend_device* d) {
  PendingRun& job = d->pending;
  d->have_pending = false;
  std::string e;
  const int state = d->api.xrtRunWait(d->run);
  if (state != NSP_ERT_CMD_STATE_COMPLETED) {
    const int code = errno;
    e = "the run ended in state " + std::to_string(state) + ": " + d->XrtError(code);
  }
  for (size_t i = 0; e.empty() && i < job.copies.size(); ++i) {
    const auto& c = job.copies[i];
    if (int rc = d->api.xrtBOSync(c.bo, NSP_XRT_BO_SYNC_FROM_DEVICE, c.bytes, 0)) {
      e = "xrtBOSync from the device failed: " + d->XrtError(rc);
    } else if (int rc2 = d->api.xrtBORead(c.bo, c.dst, c.bytes, 0)) {
      e = "xrtBORead failed: " + d->XrtError(rc2);
    } else {
      d->bytes_from_device.fetch_add(static_cast<int64_t>(c.bytes));
    }
  }
  // The params the host asked for: out of the params' P2P buffer (or the staged copy just read back).
  if (e.empty() && job.param_copy_out != nullptr) {
    const size_t bytes = static_cast<size_t>(job.n) * 4;
    if (xrtBufferHandle bo = BufferAt(d, job.p_out, bytes)) {
      if (int rc = d->api.xrtBORead(bo, job.param_copy_out, bytes, 0)) e = "xrtBORead failed: " + d->XrtError(rc);
      else d->bytes_from_device.fetch_add(static_cast<int64_t>(bytes));
    } else {
      std::memcpy(job.param_copy_out, job.p_out, bytes);
    }
  }
  if (!e.empty()) {
    d->failed_runs.fetch_add(1);
    e = KernelMessage(d, job.page, e);
  }
  d->done[job.ticket] = e;
  return e;
}

int ComputeLaunch(nsp_backend_device* d, const nsp_hyper_params* hp, const nsp_state_span* span,
                  const nsp_page_grad* grad, const nsp_page_info* info, uint64_t* ticket, char* err, size_t err_len) {
  if (nsp::plugin::CheckLaunch(*d, hp, span, grad, ticket, err, err_len) != 0) return 1;
  std::lock_guard<std::mutex> lock(d->run_mu);
  if (d->have_pending) FinishRun(d);  // one run handle: the last run completes first (its result is kept)
  PendingRun job;
  job.ticket = d->next_ticket++;
  job.page = nsp::plugin::PageOf(info);
  *ticket = job.ticket;
  if (std::string e = StartRun(d, *hp, *span, *grad, &job); !e.empty()) {
    d->failed_runs.fetch_add(1);
    d->done[job.ticket] = KernelMessage(d, job.page, e);
    return 0;  // reported by compute_wait, as a kernel's failure
  }
  d->pending = std::move(job);
  d->have_pending = true;
  return 0;
}

int ComputeWait(nsp_backend_device* d, uint64_t ticket, char* err, size_t err_len) {
  std::lock_guard<std::mutex> lock(d->run_mu);
  if (d->have_pending && d->pending.ticket == ticket) FinishRun(d);
  return nsp::plugin::TakeResult(*d, &d->done, ticket, err, err_len);
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
      {"p2p_page_reads", static_cast<double>(d->p2p_reads.load())},
      {"p2p_read_bytes", static_cast<double>(d->p2p_read_bytes.load())},
      {"host_page_reads", static_cast<double>(d->host_reads.load())},
      {"kernel_runs", static_cast<double>(d->runs.load())},
      {"failed_runs", static_cast<double>(d->failed_runs.load())},
      {"bytes_to_device", static_cast<double>(d->bytes_to_device.load())},
      {"bytes_from_device", static_cast<double>(d->bytes_from_device.load())},
      {"p2p_read_call", d->api.nspXrtP2PRead != nullptr ? 1.0 : 0.0},
      {"card", static_cast<double>(d->device_index)},
  }, out, capacity);
}

void UpdateBegin(nsp_backend_device* d) { d->pages->StreamStarted(); }
void UpdateEnd(nsp_backend_device* d, int32_t ok) { d->pages->StreamFinished(ok != 0); }

const nsp_backend_v1 kTable = {
    NSP_BACKEND_ABI_VERSION,
    sizeof(nsp_backend_v1),
    "xrt",
    Open,
    Close,
    nsp::plugin::PageBufferBytesOf<nsp_backend_device>,
    AllocBuffer,
    FreeBuffer,
    ReadPage,
    WritePage,
    nsp::plugin::SyncOf<nsp_backend_device>,
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
