// libaxdimm_model.so: a software model of the AXDIMM runtime API of ffi/backends/axdimm/vendor/axdimm_api.h, standing
// in for the module where there is none. A model, not the hardware: module memory is host memory behind opaque
// addresses, the arbiters are flags, and the Adam kernel is the HLS updater's C++ source (ffi/backends/hls) run by host
// threads.
//
//   - capacity: NSP_AXDIMM_MODEL_BYTES (default 32 GiB, the paper's module), split evenly between the two channels;
//     allocations past a channel's free bytes fail with NSP_AXDIMM_ENOMEM (accounting only: memory is allocated per
//     allocation, so a large module costs nothing until used).
//   - arbiters: a channel in acceleration mode refuses host copies (NSP_AXDIMM_EACCES); a launch needs acceleration
//     mode (NSP_AXDIMM_EMODE); a channel with a running kernel refuses mode switches, frees and launches
//     (NSP_AXDIMM_EBUSY).
//   - the kernel: a launch returns at once; a channel thread splits the parameters over NSP_AXDIMM_MODEL_RANKS
//     (default 4) rank threads -- the module's ranks work side by side -- each running nsp_update_page on its slice
//     (with its share of the Top-K pairs); nspAxdimmWait joins it.
//   - fault injection, read at open: NSP_AXDIMM_MODEL_FAIL_KERNEL_AT=k makes the k-th launch end in
//     NSP_AXDIMM_EKERNEL (reported by nspAxdimmWait) without touching memory; NSP_AXDIMM_MODEL_FAIL_COPY_AT=k makes
//     the k-th copy fail with NSP_AXDIMM_EIO, moving nothing. Each fails once; the next call succeeds.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/axdimm/vendor/axdimm_api.h"
#include "backends/hls/nsp_updater_hls.h"
#include "util/model_common.h"

namespace {

thread_local std::string g_last_error;

int Fail(int code, const std::string& message) {
  g_last_error = "axdimm model: " + message;
  return code;
}

using nsp_model::EnvInt;

// Addresses: channel + 1 in the top byte, then a byte offset in the channel's address space. Offsets are handed out
// upwards and never reused, so a stale address after FreeX is recognised as unknown instead of aliasing new data.
constexpr int kChannelShift = 56;
constexpr uint64_t kOffsetMask = (uint64_t{1} << kChannelShift) - 1;
constexpr uint64_t kAlignment = 64;  // a DDR4 burst; the kernel reads 512-bit words

int ChannelOf(nspAxdimmAddr addr) { return static_cast<int>(addr >> kChannelShift) - 1; }

struct Allocation {
  size_t size = 0;
  std::unique_ptr<char[]> mem;
};

// One launch's outcome, owned jointly by the kernel thread and the channel until nspAxdimmWait takes it.
struct KernelResult {
  std::atomic<bool> done{false};
  int status = NSP_AXDIMM_OK;  // written by the kernel thread before `done`
  std::string error;
};

struct Channel {
  size_t capacity = 0, used = 0;
  uint64_t next_offset = kAlignment;  // offset 0 stays unused so that no address is 0
  std::map<uint64_t, Allocation> allocations;  // by base offset
  int mode = NSP_AXDIMM_MODE_NORMAL;
  // The last launch, until nspAxdimmWait collects it: every launch is waited for, so no kernel error goes unseen.
  std::thread kernel;
  std::shared_ptr<KernelResult> result;
};

// A module, with its knobs read from the environment when it opens: its DRAM split between the channels.
struct Module {
  Module() {
    const int64_t bytes = EnvInt("NSP_AXDIMM_MODEL_BYTES", int64_t{32} << 30);
    for (Channel& c : channels) c.capacity = static_cast<size_t>(std::max<int64_t>(0, bytes)) / 2;
  }
  std::mutex mu;  // guards every channel's allocations, modes and kernel handles
  Channel channels[NSP_AXDIMM_NUM_CHANNELS];
  int ranks = static_cast<int>(std::max<int64_t>(1, EnvInt("NSP_AXDIMM_MODEL_RANKS", 4)));
  int64_t fail_kernel_at = EnvInt("NSP_AXDIMM_MODEL_FAIL_KERNEL_AT", 0);
  int64_t fail_copy_at = EnvInt("NSP_AXDIMM_MODEL_FAIL_COPY_AT", 0);
  int64_t launches = 0, copies = 0;  // guarded by mu
};

int CheckChannel(int channel) {
  if (channel < 0 || channel >= NSP_AXDIMM_NUM_CHANNELS) {
    return Fail(NSP_AXDIMM_EINVAL, "channel " + std::to_string(channel) + " does not exist (the module has 0 and 1)");
  }
  return NSP_AXDIMM_OK;
}

// The checks a per-channel call starts with: the handle (and, for a call that fills or reads one, its pointer
// argument `arg`) and the channel. NSP_AXDIMM_OK, or the error (recorded).
int CheckChannelCall(const Module* mod, int channel, const char* call) {
  if (mod == nullptr) return Fail(NSP_AXDIMM_EINVAL, std::string(call) + ": null handle");
  return CheckChannel(channel);
}
int CheckChannelCall(const Module* mod, const void* arg, int channel, const char* call) {
  if (mod == nullptr || arg == nullptr) return Fail(NSP_AXDIMM_EINVAL, std::string(call) + ": null argument");
  return CheckChannel(channel);
}

// The host pointer behind [addr, addr + nbytes), or null with the error recorded when no allocation holds it all.
char* Resolve(Module* mod, nspAxdimmAddr addr, size_t nbytes, const char* what) {
  const int ch = ChannelOf(addr);
  if (ch < 0 || ch >= NSP_AXDIMM_NUM_CHANNELS) {
    Fail(NSP_AXDIMM_EINVAL, std::string(what) + ": address " + std::to_string(addr) + " is not a module address");
    return nullptr;
  }
  const uint64_t off = addr & kOffsetMask;
  auto& allocs = mod->channels[ch].allocations;
  auto it = allocs.upper_bound(off);
  if (it == allocs.begin()) {
    Fail(NSP_AXDIMM_EINVAL, std::string(what) + ": address " + std::to_string(addr) + " is not allocated");
    return nullptr;
  }
  --it;
  const uint64_t inside = off - it->first;
  if (inside > it->second.size || nbytes > it->second.size - inside) {
    Fail(NSP_AXDIMM_EINVAL, std::string(what) + ": " + std::to_string(nbytes) + " bytes at address " +
                                std::to_string(addr) + " run past its allocation of " +
                                std::to_string(it->second.size) + " bytes");
    return nullptr;
  }
  return it->second.mem.get() + inside;
}

// Whether the channel's kernel is still computing. Caller holds mod->mu.
bool Running(const Channel& c) { return c.kernel.joinable() && !c.result->done.load(); }

// Host access to a channel goes through its arbiter. Caller holds mod->mu.
int CheckHostAccess(Module* mod, nspAxdimmAddr addr, const char* what) {
  const int ch = ChannelOf(addr);
  if (ch >= 0 && ch < NSP_AXDIMM_NUM_CHANNELS && mod->channels[ch].mode == NSP_AXDIMM_MODE_ACCELERATION) {
    return Fail(NSP_AXDIMM_EACCES, std::string(what) + ": channel " + std::to_string(ch) +
                                       " is in acceleration mode, whose arbiter blocks host access "
                                       "(nspAxdimmSetArbiterNormal first)");
  }
  return NSP_AXDIMM_OK;
}

int Copy(Module* mod, char* dst, nspAxdimmAddr module_addr, const void* src, size_t nbytes, bool to_module) {
  const char* what = to_module ? "nspAxdimmMemcpyH2X" : "nspAxdimmMemcpyX2H";
  std::lock_guard<std::mutex> lock(mod->mu);
  if (int err = CheckHostAccess(mod, module_addr, what)) return err;
  char* mem = Resolve(mod, module_addr, nbytes, what);
  if (mem == nullptr) return NSP_AXDIMM_EINVAL;
  if (++mod->copies == mod->fail_copy_at) {
    return Fail(NSP_AXDIMM_EIO, std::string(what) + ": injected copy fault (NSP_AXDIMM_MODEL_FAIL_COPY_AT)");
  }
  if (to_module) std::memcpy(mem, src, nbytes);
  else std::memcpy(dst, mem, nbytes);
  return NSP_AXDIMM_OK;
}

// ---- The kernel ----

// Everything one rank needs: host pointers already resolved, coefficients derived, the rank's element range.
struct Launch {
  float* p = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  uint16_t* p16 = nullptr;
  const void* grad = nullptr;
  const int32_t* idx = nullptr;
  int64_t n = 0, count = 0, index_base = 0;
  int32_t format = 0;
  uint32_t flags = 0;
  float coeffs[NSP_HLS_NUM_COEFFS] = {};
};

void RunRank(const Launch& l, int64_t begin, int64_t end) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  const bool bf16 = l.format == NSP_HLS_GRAD_BF16 || l.format == NSP_HLS_TOPK_BF16;
  const float* gf = static_cast<const float*>(l.grad);
  const uint16_t* gh = static_cast<const uint16_t*>(l.grad);
  int64_t lo = 0, count = 0;
  if (l.format >= NSP_HLS_TOPK_F32) {  // the rank's share of the sorted pairs
    lo = std::lower_bound(l.idx, l.idx + l.count, l.index_base + begin) - l.idx;
    count = (std::lower_bound(l.idx, l.idx + l.count, l.index_base + end) - l.idx) - lo;
  } else {
    lo = begin;
  }
  float* m = l.m ? l.m + begin : nullptr;
  float* v = l.v ? l.v + begin : nullptr;
  nsp_update_page(l.p + begin, m, v, l.p + begin, m, v, l.p16 ? l.p16 + begin : nullptr, bf16 ? nullptr : gf + lo,
                  bf16 ? gh + lo : nullptr, l.idx ? l.idx + lo : nullptr, l.coeffs, static_cast<int32_t>(n),
                  static_cast<int32_t>(count), static_cast<int32_t>(l.index_base + begin), l.flags);
}

// The channel's kernel: ranks side by side, slices aligned to 16 elements (one 512-bit word of fp32).
void RunKernel(std::shared_ptr<KernelResult> result, Launch l, int ranks, bool inject_fault, int64_t number) {
  if (inject_fault) {
    result->error = "injected kernel fault in launch " + std::to_string(number) + " (NSP_AXDIMM_MODEL_FAIL_KERNEL_AT)";
    result->status = NSP_AXDIMM_EKERNEL;
    result->done.store(true);
    return;
  }
  const int64_t per_rank = ((l.n + ranks - 1) / ranks + 15) / 16 * 16;
  std::vector<std::thread> workers;
  for (int r = 0; r < ranks; ++r) {
    const int64_t begin = std::min(l.n, r * per_rank), end = std::min(l.n, begin + per_rank);
    workers.emplace_back(RunRank, std::cref(l), begin, end);
  }
  for (auto& w : workers) w.join();
  result->done.store(true);
}

// Resolves and checks a launch's arguments. Caller holds mod->mu.
int PrepareLaunch(Module* mod, const nspAxdimmAdamArgs& a, int channel, Launch& l) {
  if (a.kind != NSP_HLS_ADAM && a.kind != NSP_HLS_ADAMW) {
    return Fail(NSP_AXDIMM_EINVAL, "the module's kernel runs Adam or AdamW, got kind " + std::to_string(a.kind));
  }
  if (a.grad_format < NSP_HLS_GRAD_F32 || a.grad_format > NSP_HLS_TOPK_BF16) {
    return Fail(NSP_AXDIMM_EINVAL, "unknown gradient format " + std::to_string(a.grad_format));
  }
  if (a.nparams < 0 || a.nparams > INT32_MAX || a.topk_count < 0 || a.topk_count > INT32_MAX ||
      a.index_base < 0 || a.index_base + a.nparams > int64_t{INT32_MAX} + 1) {
    return Fail(NSP_AXDIMM_EINVAL, "nparams, topk_count and index_base must fit the kernel's 32-bit counters");
  }
  if (const char* err = nsp_hls_make_coeffs(a.kind, a.lr, a.step, a.b1, a.b2, a.eps, a.weight_decay, 0.0,
                                            l.coeffs)) {
    return Fail(NSP_AXDIMM_EINVAL, err);
  }
  const bool topk = a.grad_format >= NSP_HLS_TOPK_F32;
  const size_t gbytes = (a.grad_format == NSP_HLS_GRAD_BF16 || a.grad_format == NSP_HLS_TOPK_BF16) ? 2 : 4;
  const size_t n = static_cast<size_t>(a.nparams), pairs = static_cast<size_t>(a.topk_count);
  struct Need {
    const char* name;
    nspAxdimmAddr addr;
    size_t bytes;
    bool required;
  };
  const Need needs[] = {{"p", a.p, 4 * n, true},
                        {"m", a.m, 4 * n, true},
                        {"v", a.v, 4 * n, true},
                        {"grad", a.grad, gbytes * (topk ? pairs : n), !topk || pairs > 0},
                        {"indices", a.indices, 4 * pairs, topk && pairs > 0},
                        {"p_bf16", a.p_bf16, 2 * n, false}};
  char* ptrs[6] = {};
  for (int i = 0; i < 6; ++i) {
    if (needs[i].addr == 0) {
      if (needs[i].required) return Fail(NSP_AXDIMM_EINVAL, std::string(needs[i].name) + " has no address");
      continue;
    }
    if (ChannelOf(needs[i].addr) != channel) {
      return Fail(NSP_AXDIMM_EINVAL, std::string(needs[i].name) + " lies on channel " +
                                         std::to_string(ChannelOf(needs[i].addr)) + ", the launch is on channel " +
                                         std::to_string(channel) + ": a channel's kernel sees only its own DRAM");
    }
    ptrs[i] = Resolve(mod, needs[i].addr, needs[i].bytes, needs[i].name);
    if (ptrs[i] == nullptr) return NSP_AXDIMM_EINVAL;
  }
  l.p = reinterpret_cast<float*>(ptrs[0]);
  l.m = reinterpret_cast<float*>(ptrs[1]);
  l.v = reinterpret_cast<float*>(ptrs[2]);
  l.grad = ptrs[3];
  l.idx = reinterpret_cast<const int32_t*>(ptrs[4]);
  l.p16 = reinterpret_cast<uint16_t*>(ptrs[5]);
  l.n = a.nparams;
  l.count = topk ? a.topk_count : 0;
  l.index_base = a.index_base;
  l.format = a.grad_format;
  l.flags = nsp_hls_flags(a.kind, a.grad_format, a.lazy, 0, 0.0, l.p16 != nullptr);
  if (topk && l.count > 0) {
    const int64_t bad = nsp_hls_check_topk(l.idx, l.count, l.n, l.index_base);
    if (bad >= 0) {
      return Fail(NSP_AXDIMM_EINVAL, "Top-K index " + std::to_string(l.idx[bad]) + " at position " +
                                         std::to_string(bad) + " is unsorted or outside [" +
                                         std::to_string(l.index_base) + ", " + std::to_string(l.index_base + l.n) +
                                         ")");
    }
  }
  return NSP_AXDIMM_OK;
}

// A call that reads one value of a channel, under the module's lock, into *out.
template <typename Read>
int QueryChannel(nspAxdimmHandle h, int channel, int* out, const char* call, Read read) {
  auto* mod = static_cast<Module*>(h);
  if (int err = CheckChannelCall(mod, out, channel, call)) return err;
  std::lock_guard<std::mutex> lock(mod->mu);
  *out = read(mod->channels[channel]);
  return NSP_AXDIMM_OK;
}

}  // namespace

extern "C" {

int nspAxdimmOpen(const char* device, nspAxdimmHandle* out) {
  if (device == nullptr || *device == '\0' || out == nullptr) {
    return Fail(NSP_AXDIMM_EINVAL, "nspAxdimmOpen: a device path (e.g. /dev/axdimm0) and an output are needed");
  }
  *out = new Module;
  return NSP_AXDIMM_OK;
}

int nspAxdimmClose(nspAxdimmHandle h) {
  auto* mod = static_cast<Module*>(h);
  if (mod == nullptr) return Fail(NSP_AXDIMM_EINVAL, "nspAxdimmClose: null handle");
  for (Channel& c : mod->channels) {
    if (c.kernel.joinable()) c.kernel.join();
  }
  delete mod;
  return NSP_AXDIMM_OK;
}

int nspAxdimmMallocX(nspAxdimmHandle h, size_t nbytes, int channel, nspAxdimmAddr* out) {
  auto* mod = static_cast<Module*>(h);
  if (int err = CheckChannelCall(mod, out, channel, "nspAxdimmMallocX")) return err;
  std::lock_guard<std::mutex> lock(mod->mu);
  Channel& c = mod->channels[channel];
  if (nbytes > c.capacity - c.used) {
    return Fail(NSP_AXDIMM_ENOMEM, "nspAxdimmMallocX: " + std::to_string(nbytes) + " bytes asked on channel " +
                                       std::to_string(channel) + ", which has " + std::to_string(c.capacity - c.used) +
                                       " of " + std::to_string(c.capacity) + " bytes free");
  }
  Allocation a;
  a.size = nbytes;
  a.mem.reset(new (std::nothrow) char[nbytes == 0 ? 1 : nbytes]());
  if (a.mem == nullptr) return Fail(NSP_AXDIMM_ENOMEM, "nspAxdimmMallocX: the host cannot back the allocation");
  const uint64_t base = c.next_offset;
  c.next_offset += (nbytes + kAlignment - 1) / kAlignment * kAlignment + kAlignment;  // a gap: no adjacent aliasing
  c.used += nbytes;
  c.allocations.emplace(base, std::move(a));
  *out = (static_cast<uint64_t>(channel + 1) << kChannelShift) | base;
  return NSP_AXDIMM_OK;
}

int nspAxdimmFreeX(nspAxdimmHandle h, nspAxdimmAddr addr) {
  auto* mod = static_cast<Module*>(h);
  if (mod == nullptr) return Fail(NSP_AXDIMM_EINVAL, "nspAxdimmFreeX: null handle");
  const int ch = ChannelOf(addr);
  if (CheckChannel(ch) != NSP_AXDIMM_OK) return Fail(NSP_AXDIMM_EINVAL, "nspAxdimmFreeX: not a module address");
  std::lock_guard<std::mutex> lock(mod->mu);
  Channel& c = mod->channels[ch];
  if (Running(c)) return Fail(NSP_AXDIMM_EBUSY, "nspAxdimmFreeX: channel " + std::to_string(ch) +
                                                             "'s kernel is running (nspAxdimmWait first)");
  auto it = c.allocations.find(addr & kOffsetMask);
  if (it == c.allocations.end()) {
    return Fail(NSP_AXDIMM_EINVAL, "nspAxdimmFreeX: address " + std::to_string(addr) + " is not an allocation's base");
  }
  c.used -= it->second.size;
  c.allocations.erase(it);
  return NSP_AXDIMM_OK;
}

int nspAxdimmMemInfo(nspAxdimmHandle h, int channel, size_t* capacity, size_t* free_bytes) {
  auto* mod = static_cast<Module*>(h);
  if (int err = CheckChannelCall(mod, channel, "nspAxdimmMemInfo")) return err;
  std::lock_guard<std::mutex> lock(mod->mu);
  const Channel& c = mod->channels[channel];
  if (capacity != nullptr) *capacity = c.capacity;
  if (free_bytes != nullptr) *free_bytes = c.capacity - c.used;
  return NSP_AXDIMM_OK;
}

int nspAxdimmMemcpyH2X(nspAxdimmHandle h, nspAxdimmAddr dst, const void* src, size_t nbytes) {
  if (h == nullptr || src == nullptr) return Fail(NSP_AXDIMM_EINVAL, "nspAxdimmMemcpyH2X: null argument");
  return Copy(static_cast<Module*>(h), nullptr, dst, src, nbytes, true);
}

int nspAxdimmMemcpyX2H(nspAxdimmHandle h, void* dst, nspAxdimmAddr src, size_t nbytes) {
  if (h == nullptr || dst == nullptr) return Fail(NSP_AXDIMM_EINVAL, "nspAxdimmMemcpyX2H: null argument");
  return Copy(static_cast<Module*>(h), static_cast<char*>(dst), src, nullptr, nbytes, false);
}

int nspAxdimmSetArbiterAcc(nspAxdimmHandle h, int channel) {
  auto* mod = static_cast<Module*>(h);
  if (int err = CheckChannelCall(mod, channel, "nspAxdimmSetArbiterAcc")) return err;
  std::lock_guard<std::mutex> lock(mod->mu);
  mod->channels[channel].mode = NSP_AXDIMM_MODE_ACCELERATION;
  return NSP_AXDIMM_OK;
}

int nspAxdimmSetArbiterNormal(nspAxdimmHandle h, int channel) {
  auto* mod = static_cast<Module*>(h);
  if (int err = CheckChannelCall(mod, channel, "nspAxdimmSetArbiterNormal")) return err;
  std::lock_guard<std::mutex> lock(mod->mu);
  Channel& c = mod->channels[channel];
  if (Running(c)) {
    return Fail(NSP_AXDIMM_EBUSY, "nspAxdimmSetArbiterNormal: channel " + std::to_string(channel) +
                                      "'s kernel is running (nspAxdimmWait first)");
  }
  c.mode = NSP_AXDIMM_MODE_NORMAL;
  return NSP_AXDIMM_OK;
}

int nspAxdimmGetArbiterMode(nspAxdimmHandle h, int channel, int* mode) {
  return QueryChannel(h, channel, mode, "nspAxdimmGetArbiterMode", [](const Channel& c) { return c.mode; });
}

int nspAxdimmRunAdamAsync(nspAxdimmHandle h, const nspAxdimmAdamArgs* args, int channel) {
  auto* mod = static_cast<Module*>(h);
  if (mod == nullptr || args == nullptr) return Fail(NSP_AXDIMM_EINVAL, "nspAxdimmRunAdamAsync: null argument");
  if (args->struct_size < sizeof(nspAxdimmAdamArgs)) {
    return Fail(NSP_AXDIMM_EINVAL, "nspAxdimmRunAdamAsync: struct_size " + std::to_string(args->struct_size) +
                                       " is smaller than this runtime's " + std::to_string(sizeof(nspAxdimmAdamArgs)));
  }
  if (int err = CheckChannel(channel)) return err;
  std::lock_guard<std::mutex> lock(mod->mu);
  Channel& c = mod->channels[channel];
  if (c.mode != NSP_AXDIMM_MODE_ACCELERATION) {
    return Fail(NSP_AXDIMM_EMODE, "nspAxdimmRunAdamAsync: channel " + std::to_string(channel) +
                                      " is in normal mode; its kernel cannot reach DRAM "
                                      "(nspAxdimmSetArbiterAcc first)");
  }
  if (c.kernel.joinable()) {
    return Fail(NSP_AXDIMM_EBUSY, "nspAxdimmRunAdamAsync: channel " + std::to_string(channel) +
                                      "'s last kernel has not been waited for (nspAxdimmWait first)");
  }
  Launch launch;
  if (int err = PrepareLaunch(mod, *args, channel, launch)) return err;
  const int64_t number = ++mod->launches;
  c.result = std::make_shared<KernelResult>();
  c.kernel = std::thread(RunKernel, c.result, launch, mod->ranks, number == mod->fail_kernel_at, number);
  return NSP_AXDIMM_OK;
}

int nspAxdimmWait(nspAxdimmHandle h, int channel) {
  auto* mod = static_cast<Module*>(h);
  if (int err = CheckChannelCall(mod, channel, "nspAxdimmWait")) return err;
  Channel& c = mod->channels[channel];
  std::thread finished;
  std::shared_ptr<KernelResult> result;
  {
    std::lock_guard<std::mutex> lock(mod->mu);
    finished = std::move(c.kernel);  // joined outside the lock: the other channel stays usable meanwhile
    result = std::move(c.result);
  }
  if (!finished.joinable()) return NSP_AXDIMM_OK;  // nothing was launched since the last wait
  finished.join();
  if (result->status != NSP_AXDIMM_OK) return Fail(result->status, "nspAxdimmWait: " + result->error);
  return NSP_AXDIMM_OK;
}

int nspAxdimmPoll(nspAxdimmHandle h, int channel, int* done) {
  return QueryChannel(h, channel, done, "nspAxdimmPoll", [](const Channel& c) { return Running(c) ? 0 : 1; });
}

const char* nspAxdimmLastError(void) { return g_last_error.c_str(); }

}  // extern "C"
