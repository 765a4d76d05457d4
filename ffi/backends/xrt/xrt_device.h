// The XRT plugin's device (xrt_backend.cc says what the plugin does and how): the XRT calls, the card's buffers
// (the engine's page buffers as P2P buffer objects, the staging buffers of a run), the checksums the P2P reads
// check, the kernel run in flight; and what the plugin's files share: the kernel runs (xrt_kernels.cc) and the
// card's buffers (xrt_backend.cc).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backends/plugin_device.h"
#include "backends/xrt/vendor/xrt_c_api.h"
#include "kernels/update_kernel.h"
#include "nsp_backend_abi.h"

namespace nsp::xrt {

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

// The shard and its page files are PluginDevice's; the rest is the card's.
struct Device : nsp::plugin::PluginDevice {
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

}  // namespace nsp::xrt

// The ABI's device: the XRT device as it is.
struct nsp_backend_device : nsp::xrt::Device {};

namespace nsp::xrt {

// ---- Buffers (xrt_backend.cc) ----

// The P2P BO whose mapping starts at `p` and holds `bytes`, or null (host memory).
xrtBufferHandle BufferAt(nsp_backend_device* d, const void* p, size_t bytes);

// ---- Kernel runs (xrt_kernels.cc) ----

int ComputeLaunch(nsp_backend_device* d, const nsp_hyper_params* hp, const nsp_state_span* span,
                  const nsp_page_grad* grad, const nsp_page_info* info, uint64_t* ticket, char* err, size_t err_len);
int ComputeWait(nsp_backend_device* d, uint64_t ticket, char* err, size_t err_len);
// Waits for the pending run and brings its outputs back; returns "" or the run's error (kept by ticket too).
// Caller holds run_mu.
std::string FinishRun(nsp_backend_device* d);

}  // namespace nsp::xrt
