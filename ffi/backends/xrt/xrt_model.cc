// libxrt_model.so: a software model of the XRT C API calls in ffi/backends/xrt/vendor/xrt_c_api.h, standing in for a
// SmartSSD's FPGA where there is none. It is a model, not XRT: buffers live in host memory, the "FPGA DDR" is an
// allocation budget, and a kernel run executes the HLS updater's C++ source (nsp_update_page, ffi/backends/hls) on a
// worker thread.
//
// What it keeps of the real thing, so a backend written against it behaves on hardware:
//   - a normal BO has a host buffer and a device buffer; only xrtBOSync moves data between them, so a backend that
//     forgets a sync reads stale data here too. P2P BOs have device memory only, mapped for P2P transfers.
//   - device memory is finite: NSP_XRT_MODEL_DDR_BYTES (default 4 GiB, the SmartSSD's DDR4); beyond it, xrtBOAlloc
//     fails with ENOMEM.
//   - runs are asynchronous: xrtRunStart returns at once, xrtRunWait joins, and a run in flight cannot be restarted.
//   - a device cannot close while buffers are allocated on it.
// Fault injection, read when a device opens: NSP_XRT_MODEL_FAIL_RUN_AT=k makes the device's k-th run end in
// ERT_CMD_STATE_ERROR without touching memory; NSP_XRT_MODEL_FAIL_DMA_AT=k makes its k-th transfer (xrtBOSync,
// xrtBOWrite, xrtBORead, nspXrtP2PRead, nspXrtP2PWrite) fail with EIO, moving nothing. Each fails once; the next call
// succeeds. Errors set errno (or are returned) and leave a message that xrtErrorGetString renders.
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "backends/hls/nsp_updater_hls.h"
#include "backends/xrt/vendor/xrt_c_api.h"
#include "util/model_common.h"

namespace {

// ---- Errors ----

thread_local int g_last_code = 0;
thread_local std::string g_last_message;

// Records the message for `code` on this thread and returns the code.
int Fail(int code, const std::string& message) {
  g_last_code = code;
  g_last_message = "xrt model: " + message;
  errno = code;
  return code;
}

template <typename T>
T* FailNull(int code, const std::string& message) {
  Fail(code, message);
  return nullptr;
}

using nsp_model::EnvInt;

// ---- Objects ----

// A card, with its knobs read from the environment when it opens.
struct Device {
  std::mutex mu;
  size_t capacity = static_cast<size_t>(EnvInt("NSP_XRT_MODEL_DDR_BYTES", int64_t{4} << 30));
  size_t used = 0;       // device bytes allocated (guarded by mu)
  int live_buffers = 0;  // guarded by mu
  bool programmed = false;
  nsp_xrt_uuid uuid = {};
  int64_t fail_run_at = EnvInt("NSP_XRT_MODEL_FAIL_RUN_AT", 0);
  int64_t fail_dma_at = EnvInt("NSP_XRT_MODEL_FAIL_DMA_AT", 0);
  std::atomic<int64_t> runs{0}, transfers{0};
};

struct Buffer {
  Device* dev = nullptr;
  size_t size = 0;
  uint64_t flags = 0;
  char* device_mem = nullptr;  // what the kernel reads and writes
  char* host_mem = nullptr;    // what the host maps; == device_mem for P2P and host-only BOs
  bool owner = true;           // false for a sub-buffer, which views its parent's memory
};

struct Kernel {
  Device* dev = nullptr;
};

struct Run {
  Kernel* kernel = nullptr;
  Buffer* buffers[NSP_XRT_ARG_COEFFS + 1] = {};
  int32_t n = 0, topk_count = 0, index_base = 0;
  uint32_t flags = 0;
  std::thread worker;
  std::atomic<int> state{NSP_ERT_CMD_STATE_NEW};
  std::string error;  // set by the worker before it ends in an error state
};

bool IsBufferArg(int index) { return index >= NSP_XRT_ARG_P_IN && index <= NSP_XRT_ARG_COEFFS; }

// Whether this transfer is the injected fault (counted per device, failing once).
bool InjectedDmaFault(Device* dev) {
  const int64_t k = ++dev->transfers;
  return dev->fail_dma_at > 0 && k == dev->fail_dma_at;
}

int CheckRange(const Buffer* bo, size_t size, size_t offset, const char* what) {
  if (offset > bo->size || size > bo->size - offset) {
    return Fail(EINVAL, std::string(what) + ": " + std::to_string(size) + " bytes at offset " + std::to_string(offset) +
                            " exceed the buffer's " + std::to_string(bo->size) + " bytes");
  }
  return 0;
}

char* AllocZeroed(size_t size) {
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, size == 0 ? 1 : size) != 0) return nullptr;
  std::memset(mem, 0, size);
  return static_cast<char*>(mem);
}

// ---- Kernel runs ----

// The bytes a buffer argument must hold for this run, or 0 when the run does not use it.
size_t BytesNeeded(const Run& r, int arg) {
  const int fmt = static_cast<int>((r.flags >> NSP_HLS_FLAG_GRAD_SHIFT) & NSP_HLS_FLAG_GRAD_MASK);
  const size_t n = static_cast<size_t>(r.n), pairs = static_cast<size_t>(r.topk_count);
  const bool um = nsp_hls_uses_m(r.flags), uv = nsp_hls_uses_v(r.flags);
  switch (arg) {
    case NSP_XRT_ARG_P_IN:
    case NSP_XRT_ARG_P_OUT: return 4 * n;
    case NSP_XRT_ARG_M_IN:
    case NSP_XRT_ARG_M_OUT: return um ? 4 * n : 0;
    case NSP_XRT_ARG_V_IN:
    case NSP_XRT_ARG_V_OUT: return uv ? 4 * n : 0;
    case NSP_XRT_ARG_P_BF16_OUT: return (r.flags & NSP_HLS_FLAG_BF16_OUT) ? 2 * n : 0;
    case NSP_XRT_ARG_GRAD_F32: return fmt == NSP_HLS_GRAD_F32 ? 4 * n : fmt == NSP_HLS_TOPK_F32 ? 4 * pairs : 0;
    case NSP_XRT_ARG_GRAD_BF16: return fmt == NSP_HLS_GRAD_BF16 ? 2 * n : fmt == NSP_HLS_TOPK_BF16 ? 2 * pairs : 0;
    case NSP_XRT_ARG_TOPK_IDX: return fmt >= NSP_HLS_TOPK_F32 ? 4 * pairs : 0;
    case NSP_XRT_ARG_COEFFS: return 4 * NSP_HLS_NUM_COEFFS;
    default: return 0;
  }
}

const char* const kArgNames[] = {"p_in", "m_in", "v_in", "p_out", "m_out", "v_out", "p_bf16_out",
                                  "grad_f32", "grad_bf16", "topk_idx", "coeffs"};

// What the hardware would do with bad arguments is undefined (a hang or corrupted DDR); the model refuses them at
// xrtRunStart with a message naming the argument, so a backend bug shows up here first.
int ValidateRun(const Run& r) {
  if (r.n < 0 || r.topk_count < 0) return Fail(EINVAL, "n and topk_count must be >= 0");
  for (int arg = 0; arg <= NSP_XRT_ARG_COEFFS; ++arg) {
    const size_t need = BytesNeeded(r, arg);
    if (need == 0) continue;
    const Buffer* bo = r.buffers[arg];
    if (bo == nullptr) return Fail(EINVAL, std::string("argument ") + kArgNames[arg] + " has no buffer set");
    if (bo->dev != r.kernel->dev) {
      return Fail(EINVAL, std::string("argument ") + kArgNames[arg] + " is on another device");
    }
    if (bo->size < need) {
      return Fail(EINVAL, std::string("argument ") + kArgNames[arg] + " holds " + std::to_string(bo->size) +
                              " bytes, the run needs " + std::to_string(need));
    }
  }
  const int fmt = static_cast<int>((r.flags >> NSP_HLS_FLAG_GRAD_SHIFT) & NSP_HLS_FLAG_GRAD_MASK);
  if (fmt >= NSP_HLS_TOPK_F32 && r.topk_count > 0) {
    const auto* idx = reinterpret_cast<const int32_t*>(r.buffers[NSP_XRT_ARG_TOPK_IDX]->device_mem);
    const int64_t bad = nsp_hls_check_topk(idx, r.topk_count, r.n, r.index_base);
    if (bad >= 0) {
      return Fail(EINVAL, "Top-K index " + std::to_string(idx[bad]) + " at position " + std::to_string(bad) +
                              " is unsorted or outside the page [" + std::to_string(r.index_base) + ", " +
                              std::to_string(int64_t{r.index_base} + r.n) + ")");
    }
  }
  return 0;
}

template <typename T>
T* DeviceArg(const Run& r, int arg) {
  return r.buffers[arg] == nullptr ? nullptr : reinterpret_cast<T*>(r.buffers[arg]->device_mem);
}

void ExecuteRun(Run* r, bool inject_fault, int64_t run_number) {
  if (inject_fault) {
    r->error = "injected kernel fault in run " + std::to_string(run_number) + " (NSP_XRT_MODEL_FAIL_RUN_AT)";
    r->state.store(NSP_ERT_CMD_STATE_ERROR);
    return;
  }
  nsp_update_page(DeviceArg<const float>(*r, NSP_XRT_ARG_P_IN), DeviceArg<const float>(*r, NSP_XRT_ARG_M_IN),
                  DeviceArg<const float>(*r, NSP_XRT_ARG_V_IN), DeviceArg<float>(*r, NSP_XRT_ARG_P_OUT),
                  DeviceArg<float>(*r, NSP_XRT_ARG_M_OUT), DeviceArg<float>(*r, NSP_XRT_ARG_V_OUT),
                  DeviceArg<uint16_t>(*r, NSP_XRT_ARG_P_BF16_OUT), DeviceArg<const float>(*r, NSP_XRT_ARG_GRAD_F32),
                  DeviceArg<const uint16_t>(*r, NSP_XRT_ARG_GRAD_BF16),
                  DeviceArg<const int32_t>(*r, NSP_XRT_ARG_TOPK_IDX), DeviceArg<const float>(*r, NSP_XRT_ARG_COEFFS),
                  r->n, r->topk_count, r->index_base, r->flags);
  r->state.store(NSP_ERT_CMD_STATE_COMPLETED);
}

int TransferFile(Buffer* bo, int fd, size_t size, size_t bo_offset, off_t file_offset, bool to_buffer) {
  const char* what = to_buffer ? "nspXrtP2PRead" : "nspXrtP2PWrite";
  if (bo == nullptr) return Fail(EINVAL, std::string(what) + ": null buffer");
  if (!(bo->flags & NSP_XRT_BO_FLAGS_P2P)) {
    return Fail(EINVAL, std::string(what) + ": the buffer was not allocated P2P");
  }
  if (int err = CheckRange(bo, size, bo_offset, what)) return err;
  if (InjectedDmaFault(bo->dev)) {
    return Fail(EIO, std::string(what) + ": injected DMA fault (NSP_XRT_MODEL_FAIL_DMA_AT)");
  }
  char* mem = bo->device_mem + bo_offset;
  size_t done = 0;
  while (done < size) {
    const ssize_t got = to_buffer ? pread(fd, mem + done, size - done, file_offset + static_cast<off_t>(done))
                                  : pwrite(fd, mem + done, size - done, file_offset + static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return Fail(errno, std::string(what) + ": " + std::strerror(errno));
    if (got == 0) {
      return Fail(EIO, std::string(what) + ": the file ends " + std::to_string(done) + " bytes into a " +
                           std::to_string(size) + "-byte transfer at offset " + std::to_string(file_offset));
    }
    done += static_cast<size_t>(got);
  }
  return 0;
}

}  // namespace

extern "C" {

// ---- Device ----

xrtDeviceHandle xrtDeviceOpen(unsigned int index) {
  if (index != 0) {
    return FailNull<void>(ENODEV, "device " + std::to_string(index) + " does not exist (the model has one)");
  }
  return new Device;
}

int xrtDeviceClose(xrtDeviceHandle dhdl) {
  auto* dev = static_cast<Device*>(dhdl);
  if (dev == nullptr) return Fail(EINVAL, "xrtDeviceClose: null device");
  {
    std::lock_guard<std::mutex> lock(dev->mu);
    if (dev->live_buffers != 0) {
      return Fail(EBUSY, "xrtDeviceClose: " + std::to_string(dev->live_buffers) + " buffers are still allocated");
    }
  }
  delete dev;
  return 0;
}

int xrtDeviceLoadXclbinFile(xrtDeviceHandle dhdl, const char* xclbin_path) {
  auto* dev = static_cast<Device*>(dhdl);
  if (dev == nullptr || xclbin_path == nullptr) return Fail(EINVAL, "xrtDeviceLoadXclbinFile: null argument");
  std::ifstream file(xclbin_path, std::ios::binary);
  if (!file) return Fail(ENOENT, std::string("xrtDeviceLoadXclbinFile: cannot read ") + xclbin_path);
  // The model does not parse xclbins: any readable file programs the updater; its uuid is derived from the path.
  const size_t h = std::hash<std::string>{}(xclbin_path);
  for (int i = 0; i < 16; ++i) dev->uuid[i] = static_cast<unsigned char>(h >> (8 * (i % 8)));
  dev->programmed = true;
  return 0;
}

int xrtDeviceGetXclbinUUID(xrtDeviceHandle dhdl, nsp_xrt_uuid out) {
  auto* dev = static_cast<Device*>(dhdl);
  if (dev == nullptr || !dev->programmed) return Fail(EINVAL, "xrtDeviceGetXclbinUUID: no xclbin loaded");
  std::memcpy(out, dev->uuid, sizeof dev->uuid);
  return 0;
}

// ---- Kernel ----

xrtKernelHandle xrtPLKernelOpen(xrtDeviceHandle dhdl, const nsp_xrt_uuid xclbin_id, const char* name) {
  auto* dev = static_cast<Device*>(dhdl);
  if (dev == nullptr || !dev->programmed) return FailNull<void>(EINVAL, "xrtPLKernelOpen: load an xclbin first");
  if (std::memcmp(xclbin_id, dev->uuid, sizeof dev->uuid) != 0) {
    return FailNull<void>(EINVAL, "xrtPLKernelOpen: the uuid is not the loaded xclbin's");
  }
  if (name == nullptr || std::strcmp(name, NSP_XRT_KERNEL_NAME) != 0) {
    return FailNull<void>(ENOENT, std::string("xrtPLKernelOpen: no kernel '") + (name ? name : "") +
                                      "' (the model's xclbin has " NSP_XRT_KERNEL_NAME ")");
  }
  auto* kernel = new Kernel;
  kernel->dev = dev;
  return kernel;
}

int xrtKernelClose(xrtKernelHandle khdl) {
  if (khdl == nullptr) return Fail(EINVAL, "xrtKernelClose: null kernel");
  delete static_cast<Kernel*>(khdl);
  return 0;
}

int xrtKernelArgGroupId(xrtKernelHandle khdl, int argno) {
  if (khdl == nullptr || !IsBufferArg(argno)) {
    Fail(EINVAL, "xrtKernelArgGroupId: argument " + std::to_string(argno) + " is not a buffer argument");
    return -EINVAL;
  }
  return 0;  // one DDR bank: every buffer argument lives in group 0
}

// ---- Buffer objects ----

xrtBufferHandle xrtBOAlloc(xrtDeviceHandle dhdl, size_t size, xrtBufferFlags flags, xrtMemoryGroup grp) {
  auto* dev = static_cast<Device*>(dhdl);
  if (dev == nullptr) return FailNull<void>(EINVAL, "xrtBOAlloc: null device");
  if (grp != 0) return FailNull<void>(EINVAL, "xrtBOAlloc: memory group " + std::to_string(grp) + " does not exist");
  const bool host_only = flags & NSP_XRT_BO_FLAGS_HOST_ONLY;
  {
    std::lock_guard<std::mutex> lock(dev->mu);
    if (!host_only && size > dev->capacity - dev->used) {
      return FailNull<void>(ENOMEM, "xrtBOAlloc: " + std::to_string(size) + " bytes asked, " +
                                        std::to_string(dev->capacity - dev->used) + " of the device's " +
                                        std::to_string(dev->capacity) + " bytes of DDR free");
    }
    if (!host_only) dev->used += size;
    ++dev->live_buffers;
  }
  auto* bo = new Buffer;
  bo->dev = dev;
  bo->size = size;
  bo->flags = flags;
  bo->device_mem = AllocZeroed(size);
  const bool single = host_only || (flags & NSP_XRT_BO_FLAGS_P2P);
  if (single) bo->host_mem = bo->device_mem;
  else if (!(flags & NSP_XRT_BO_FLAGS_DEV_ONLY)) bo->host_mem = AllocZeroed(size);
  return bo;
}

xrtBufferHandle xrtBOSubAlloc(xrtBufferHandle parent, size_t size, size_t offset) {
  auto* p = static_cast<Buffer*>(parent);
  if (p == nullptr) return FailNull<void>(EINVAL, "xrtBOSubAlloc: null parent");
  if (CheckRange(p, size, offset, "xrtBOSubAlloc") != 0) return nullptr;
  auto* bo = new Buffer(*p);
  bo->size = size;
  bo->device_mem = p->device_mem + offset;
  bo->host_mem = p->host_mem == nullptr ? nullptr : p->host_mem + offset;
  bo->owner = false;
  std::lock_guard<std::mutex> lock(p->dev->mu);
  ++p->dev->live_buffers;
  return bo;
}

int xrtBOFree(xrtBufferHandle bhdl) {
  auto* bo = static_cast<Buffer*>(bhdl);
  if (bo == nullptr) return Fail(EINVAL, "xrtBOFree: null buffer");
  {
    std::lock_guard<std::mutex> lock(bo->dev->mu);
    if (bo->owner && !(bo->flags & NSP_XRT_BO_FLAGS_HOST_ONLY)) bo->dev->used -= bo->size;
    --bo->dev->live_buffers;
  }
  if (bo->owner) {
    if (bo->host_mem != bo->device_mem) std::free(bo->host_mem);
    std::free(bo->device_mem);
  }
  delete bo;
  return 0;
}

size_t xrtBOSize(xrtBufferHandle bhdl) { return bhdl == nullptr ? 0 : static_cast<Buffer*>(bhdl)->size; }

void* xrtBOMap(xrtBufferHandle bhdl) {
  auto* bo = static_cast<Buffer*>(bhdl);
  if (bo == nullptr) return FailNull<void>(EINVAL, "xrtBOMap: null buffer");
  if (bo->host_mem == nullptr) return FailNull<void>(EINVAL, "xrtBOMap: a device-only buffer has no host mapping");
  return bo->host_mem;
}

int xrtBOSync(xrtBufferHandle bhdl, int dir, size_t size, size_t offset) {
  auto* bo = static_cast<Buffer*>(bhdl);
  if (bo == nullptr) return Fail(EINVAL, "xrtBOSync: null buffer");
  if (dir != NSP_XRT_BO_SYNC_TO_DEVICE && dir != NSP_XRT_BO_SYNC_FROM_DEVICE) {
    return Fail(EINVAL, "xrtBOSync: unknown direction " + std::to_string(dir));
  }
  if (int err = CheckRange(bo, size, offset, "xrtBOSync")) return err;
  if (bo->host_mem == nullptr) return Fail(EINVAL, "xrtBOSync: a device-only buffer has no host side to sync");
  if (InjectedDmaFault(bo->dev)) return Fail(EIO, "xrtBOSync: injected DMA fault (NSP_XRT_MODEL_FAIL_DMA_AT)");
  if (bo->host_mem == bo->device_mem) return 0;  // P2P / host-only: one memory, nothing to move
  if (dir == NSP_XRT_BO_SYNC_TO_DEVICE) std::memcpy(bo->device_mem + offset, bo->host_mem + offset, size);
  else std::memcpy(bo->host_mem + offset, bo->device_mem + offset, size);
  return 0;
}

int xrtBOWrite(xrtBufferHandle bhdl, const void* src, size_t size, size_t seek) {
  auto* bo = static_cast<Buffer*>(bhdl);
  if (bo == nullptr || src == nullptr) return Fail(EINVAL, "xrtBOWrite: null argument");
  if (int err = CheckRange(bo, size, seek, "xrtBOWrite")) return err;
  if (bo->host_mem == nullptr) return Fail(EINVAL, "xrtBOWrite: a device-only buffer has no host side");
  if (InjectedDmaFault(bo->dev)) return Fail(EIO, "xrtBOWrite: injected DMA fault (NSP_XRT_MODEL_FAIL_DMA_AT)");
  std::memcpy(bo->host_mem + seek, src, size);
  return 0;
}

int xrtBORead(xrtBufferHandle bhdl, void* dst, size_t size, size_t skip) {
  auto* bo = static_cast<Buffer*>(bhdl);
  if (bo == nullptr || dst == nullptr) return Fail(EINVAL, "xrtBORead: null argument");
  if (int err = CheckRange(bo, size, skip, "xrtBORead")) return err;
  if (bo->host_mem == nullptr) return Fail(EINVAL, "xrtBORead: a device-only buffer has no host side");
  if (InjectedDmaFault(bo->dev)) return Fail(EIO, "xrtBORead: injected DMA fault (NSP_XRT_MODEL_FAIL_DMA_AT)");
  std::memcpy(dst, bo->host_mem + skip, size);
  return 0;
}

int nspXrtP2PRead(xrtBufferHandle bhdl, int fd, size_t size, size_t bo_offset, off_t file_offset) {
  return TransferFile(static_cast<Buffer*>(bhdl), fd, size, bo_offset, file_offset, true);
}

int nspXrtP2PWrite(xrtBufferHandle bhdl, int fd, size_t size, size_t bo_offset, off_t file_offset) {
  return TransferFile(static_cast<Buffer*>(bhdl), fd, size, bo_offset, file_offset, false);
}

// ---- Runs ----

xrtRunHandle xrtRunOpen(xrtKernelHandle khdl) {
  if (khdl == nullptr) return FailNull<void>(EINVAL, "xrtRunOpen: null kernel");
  auto* run = new Run;
  run->kernel = static_cast<Kernel*>(khdl);
  return run;
}

int xrtRunSetArg(xrtRunHandle rhdl, int index, ...) {
  auto* run = static_cast<Run*>(rhdl);
  if (run == nullptr) return Fail(EINVAL, "xrtRunSetArg: null run");
  if (run->state.load() == NSP_ERT_CMD_STATE_RUNNING) return Fail(EBUSY, "xrtRunSetArg: the run is in flight");
  if (index < 0 || index >= NSP_XRT_NUM_ARGS) {
    return Fail(EINVAL, "xrtRunSetArg: the kernel has no argument " + std::to_string(index));
  }
  va_list args;
  va_start(args, index);
  if (IsBufferArg(index)) {
    run->buffers[index] = static_cast<Buffer*>(va_arg(args, xrtBufferHandle));
  } else {
    const int value = va_arg(args, int);  // 32-bit scalars arrive promoted to int
    if (index == NSP_XRT_ARG_N) run->n = value;
    else if (index == NSP_XRT_ARG_TOPK_COUNT) run->topk_count = value;
    else if (index == NSP_XRT_ARG_INDEX_BASE) run->index_base = value;
    else run->flags = static_cast<uint32_t>(value);
  }
  va_end(args);
  return 0;
}

int xrtRunStart(xrtRunHandle rhdl) {
  auto* run = static_cast<Run*>(rhdl);
  if (run == nullptr) return Fail(EINVAL, "xrtRunStart: null run");
  if (run->state.load() == NSP_ERT_CMD_STATE_RUNNING) return Fail(EBUSY, "xrtRunStart: the run is still in flight");
  if (run->worker.joinable()) run->worker.join();
  if (int err = ValidateRun(*run)) return err;
  Device* dev = run->kernel->dev;
  const int64_t number = ++dev->runs;
  run->error.clear();
  run->state.store(NSP_ERT_CMD_STATE_RUNNING);
  run->worker = std::thread(ExecuteRun, run, dev->fail_run_at > 0 && number == dev->fail_run_at, number);
  return 0;
}

int xrtRunWait(xrtRunHandle rhdl) {
  auto* run = static_cast<Run*>(rhdl);
  if (run == nullptr) {
    Fail(EINVAL, "xrtRunWait: null run");
    return NSP_ERT_CMD_STATE_ABORT;
  }
  if (run->worker.joinable()) run->worker.join();
  const int state = run->state.load();
  if (state == NSP_ERT_CMD_STATE_ERROR) Fail(EIO, run->error);
  return state;
}

int xrtRunState(xrtRunHandle rhdl) {
  return rhdl == nullptr ? NSP_ERT_CMD_STATE_ABORT : static_cast<Run*>(rhdl)->state.load();
}

int xrtRunClose(xrtRunHandle rhdl) {
  auto* run = static_cast<Run*>(rhdl);
  if (run == nullptr) return Fail(EINVAL, "xrtRunClose: null run");
  if (run->worker.joinable()) run->worker.join();
  delete run;
  return 0;
}

// ---- Errors ----

// The message the model recorded on this thread for `error` when it is the last error here, else strerror's text.
int xrtErrorGetString(xrtDeviceHandle, xrtErrorCode error, char* out, size_t len, size_t* out_len) {
  const std::string text = (static_cast<int>(error) == g_last_code && !g_last_message.empty())
                               ? g_last_message
                               : std::string(std::strerror(static_cast<int>(error)));
  if (out_len != nullptr) *out_len = text.size() + 1;
  if (out != nullptr && len > 0) {
    const size_t n = text.size() < len - 1 ? text.size() : len - 1;
    std::memcpy(out, text.data(), n);
    out[n] = '\0';
  }
  return 0;
}

}  // extern "C"
