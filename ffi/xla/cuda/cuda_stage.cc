// The store update on a CUDA device: the same targets as ffi/xla/store_update_ffi.cc, for the CUDA platform.
//
// The engine runs on the host, so each call moves only what the update needs across the link, on the stream
// XLA hands the handler: the six scalars and the (compressed) gradient shard go down into pinned host buffers,
// the handler synchronises once, runs the CPU handler of the same target on those host buffers (one code path
// for the engine call, its checks and its errors), and queues the results' copies up (the new params in the
// step's dtype: 2 bytes a parameter when the params are bf16) without waiting for them: XLA orders the results'
// readers after them on the stream. The params the step may adopt go down only when the adopt flag is set
// (after the one synchronisation that brought the flag; a second one, then).
//
// Buffers: each call takes a set of pinned buffers from a pool keyed by the call's operand sizes; sets come in
// pairs, so a call finds one whose copies up have finished (an event marks their end) while the other's may
// still be in flight: nothing is written while a copy still reads it, and nothing is allocated per step (the
// adopted params get their own buffer in the set the first time a step adopts). With staleness 1 the CPU
// handler returns once the gradient is copied and the previous step's params are handed back; the step runs
// on the host while JAX dispatches the next forward/backward.
//
// A copy that fails is reported with the shard and the copy it was. A failure going down leaves the store as it
// was (the step never ran); one going up comes after the step ran and committed: at staleness 0 the next call
// with the same version replays it.
#include "xla/cuda/cuda_stage.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/cuda/cuda_api.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdateDense);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdateSparse);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdatePieces);

namespace nsp::cuda {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// The library
// ---------------------------------------------------------------------------------------------------------------

std::mutex g_api_mu;
std::unique_ptr<Api> g_api;  // loaded once, never unloaded
std::string g_search_dirs;

template <typename Fn>
void Resolve(void* lib, const char* name, Fn*& fn, std::string* missing) {
  fn = reinterpret_cast<Fn*>(::dlsym(lib, name));
  if (fn == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
}

std::string Load(const std::string& path, std::unique_ptr<Api>* out) {
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);  // JAX's CUDA plugin loaded it already
  if (lib == nullptr) lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = ::dlerror();
    return err != nullptr ? err : path + ": cannot be loaded";
  }
  auto api = std::make_unique<Api>();
  std::string missing;
  Resolve(lib, "cudaMemcpyAsync", api->MemcpyAsync, &missing);
  Resolve(lib, "cudaStreamSynchronize", api->StreamSynchronize, &missing);
  Resolve(lib, "cudaHostAlloc", api->HostAlloc, &missing);
  Resolve(lib, "cudaFreeHost", api->FreeHost, &missing);
  Resolve(lib, "cudaEventCreateWithFlags", api->EventCreateWithFlags, &missing);
  Resolve(lib, "cudaEventRecord", api->EventRecord, &missing);
  Resolve(lib, "cudaEventQuery", api->EventQuery, &missing);
  Resolve(lib, "cudaEventSynchronize", api->EventSynchronize, &missing);
  Resolve(lib, "cudaEventDestroy", api->EventDestroy, &missing);
  Resolve(lib, "cudaGetErrorString", api->GetErrorString, &missing);
  if (!missing.empty()) return path + " lacks " + missing;
  api->library = path;
  *out = std::move(api);
  return "";
}

// ---------------------------------------------------------------------------------------------------------------
// Counters
// ---------------------------------------------------------------------------------------------------------------

struct Counters {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> pinned_allocs{0};   // cudaHostAlloc calls (buffer sets and adopted-params buffers)
  std::atomic<int64_t> pinned_bytes{0};    // what they hold
  std::atomic<int64_t> copies_down{0};
  std::atomic<int64_t> bytes_down{0};
  std::atomic<int64_t> copies_up{0};
  std::atomic<int64_t> bytes_up{0};
  std::atomic<int64_t> params_bytes_up{0};  // of bytes_up: the new params alone (not the version scalar)
  std::atomic<int64_t> syncs{0};            // stream synchronisations
  std::atomic<int64_t> buffer_waits{0};     // calls that waited for a set's copies up to finish
  std::atomic<int64_t> failed_copies{0};
};
Counters g_counters;

// ---------------------------------------------------------------------------------------------------------------
// Pinned buffer sets
// ---------------------------------------------------------------------------------------------------------------

enum class Target { kDense, kSparse, kPieces };

constexpr size_t kAlign = 64;
size_t Aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// What one call's operands look like: the pool's key.
struct Shape {
  Target target;
  std::vector<size_t> arg_bytes;  // every operand
  std::vector<size_t> ret_bytes;  // every result
  std::vector<int> ret_alias;     // per result: the operand it aliases (XLA gave both one buffer), or -1
  size_t first_params;            // operands from here on are the params leaves (read only when adopting)
  std::string Key() const {
    std::string k = std::to_string(static_cast<int>(target)) + "|" + std::to_string(first_params) + "|";
    for (size_t b : arg_bytes) k += std::to_string(b) + ",";
    k += "|";
    for (size_t i = 0; i < ret_bytes.size(); ++i) k += std::to_string(ret_bytes[i]) + ":" + std::to_string(ret_alias[i]) + ",";
    return k;
  }
};

struct Set {
  void* block = nullptr;         // pinned: the staged operands (scalars, gradient) and the results
  void* params_block = nullptr;  // pinned: the params leaves, allocated the first time a step adopts
  std::vector<char*> arg_host;   // per operand (null for params leaves until params_block exists)
  std::vector<char*> ret_host;   // per result
  Event up_done = nullptr;       // recorded after the results' copies up
  bool recorded = false;
  bool in_use = false;
};

class Pool {
 public:
  // A free set for `shape` whose copies up have finished if there is one, else a free one (the caller waits for
  // its event), else a new pair.
  Set* Acquire(const Api& api, const Shape& shape, std::string* err) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& sets = sets_[shape.Key()];
    Set* busy = nullptr;
    for (auto& s : sets) {
      if (s->in_use) continue;
      if (!s->recorded || api.EventQuery(s->up_done) == kSuccess) {
        s->in_use = true;
        return s.get();
      }
      if (busy == nullptr) busy = s.get();
    }
    if (busy != nullptr) {
      busy->in_use = true;
      return busy;
    }
    for (int i = 0; i < 2; ++i) {
      auto s = std::make_unique<Set>();
      if (*err = Make(api, shape, s.get()); !err->empty()) return nullptr;
      sets.push_back(std::move(s));
    }
    sets[sets.size() - 2]->in_use = true;
    return sets[sets.size() - 2].get();
  }

  void Release(Set* s) {
    std::lock_guard<std::mutex> lock(mu_);
    s->in_use = false;
  }

 private:
  static std::string Make(const Api& api, const Shape& shape, Set* s) {
    size_t bytes = 0;
    for (size_t i = 0; i < shape.first_params; ++i) bytes += Aligned(shape.arg_bytes[i]);
    for (size_t j = 0; j < shape.ret_bytes.size(); ++j) {
      if (shape.ret_alias[j] < 0) bytes += Aligned(shape.ret_bytes[j]);
    }
    if (int e = api.HostAlloc(&s->block, bytes == 0 ? kAlign : bytes, kHostAllocPortable); e != kSuccess) {
      return "allocating " + std::to_string(bytes) + " bytes of pinned host memory failed: " + api.Error(e);
    }
    g_counters.pinned_allocs++;
    g_counters.pinned_bytes += static_cast<int64_t>(bytes);
    char* at = static_cast<char*>(s->block);
    s->arg_host.assign(shape.arg_bytes.size(), nullptr);
    for (size_t i = 0; i < shape.first_params; ++i) {
      s->arg_host[i] = at;
      at += Aligned(shape.arg_bytes[i]);
    }
    s->ret_host.assign(shape.ret_bytes.size(), nullptr);
    for (size_t j = 0; j < shape.ret_bytes.size(); ++j) {
      if (shape.ret_alias[j] >= 0) {
        s->ret_host[j] = s->arg_host[static_cast<size_t>(shape.ret_alias[j])];
      } else {
        s->ret_host[j] = at;
        at += Aligned(shape.ret_bytes[j]);
      }
    }
    if (int e = api.EventCreateWithFlags(&s->up_done, kEventDisableTiming); e != kSuccess) {
      return "creating a CUDA event failed: " + api.Error(e);
    }
    return "";
  }

  std::mutex mu_;
  std::map<std::string, std::vector<std::unique_ptr<Set>>> sets_;  // kept for the process's life
};

Pool& ThePool() {
  static Pool* pool = new Pool();  // never destroyed: in-flight copies may outlive static destruction
  return *pool;
}

// The params leaves' buffer of `s`, made the first time a step adopts.
std::string EnsureParams(const Api& api, const Shape& shape, Set* s) {
  if (s->params_block != nullptr || shape.first_params >= shape.arg_bytes.size()) return "";
  size_t bytes = 0;
  for (size_t i = shape.first_params; i < shape.arg_bytes.size(); ++i) bytes += Aligned(shape.arg_bytes[i]);
  if (int e = api.HostAlloc(&s->params_block, bytes, kHostAllocPortable); e != kSuccess) {
    s->params_block = nullptr;
    return "allocating " + std::to_string(bytes) + " bytes of pinned host memory for the adopted params failed: " +
           api.Error(e);
  }
  g_counters.pinned_allocs++;
  g_counters.pinned_bytes += static_cast<int64_t>(bytes);
  char* at = static_cast<char*>(s->params_block);
  for (size_t i = shape.first_params; i < shape.arg_bytes.size(); ++i) {
    s->arg_host[i] = at;
    at += Aligned(shape.arg_bytes[i]);
  }
  return "";
}

// ---------------------------------------------------------------------------------------------------------------
// The handler
// ---------------------------------------------------------------------------------------------------------------

constexpr const char* kScalarNames[] = {"lr", "step", "version", "shard", "apply flag", "adopt flag"};
constexpr size_t kScalars = 6;

std::string ArgName(Target target, size_t i, size_t first_params) {
  if (i < kScalars) return std::string("scalar ") + kScalarNames[i];
  if (i >= first_params) return "params leaf " + std::to_string(i - first_params);
  switch (target) {
    case Target::kDense: return "gradient";
    case Target::kSparse: return i == kScalars ? "Top-K values" : "Top-K indices";
    case Target::kPieces: return "gradient leaf " + std::to_string(i - kScalars);
  }
  return "operand " + std::to_string(i);
}

std::string RetName(Target target, size_t j) {
  if (target == Target::kPieces) return j == 0 ? "version" : "new params leaf " + std::to_string(j - 1);
  return j == 0 ? "new params" : j == 1 ? "version" : "new bf16 params";
}

XLA_FFI_Error* MakeError(const XLA_FFI_Api* api, XLA_FFI_Error_Code code, const std::string& message) {
  XLA_FFI_Error_Create_Args args;
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.extension_start = nullptr;
  args.message = message.c_str();
  args.errc = code;
  return api->XLA_FFI_Error_Create(&args);
}

constexpr char kOp[] = "nsp.store_update (CUDA)";

class SetLease {
 public:
  explicit SetLease(Set* s) : s_(s) {}
  ~SetLease() { ThePool().Release(s_); }
  SetLease(const SetLease&) = delete;
  SetLease& operator=(const SetLease&) = delete;

 private:
  Set* s_;
};

XLA_FFI_Error* Staged(XLA_FFI_CallFrame* frame, XLA_FFI_Error* (*inner)(XLA_FFI_CallFrame*), Target target,
                      bool device_stream) {
  // Metadata queries and stages other than execution: the CPU handler answers them (same binding, same traits).
  if ((frame->extension_start != nullptr && frame->extension_start->type == XLA_FFI_Extension_Metadata) ||
      frame->stage != XLA_FFI_ExecutionStage_EXECUTE) {
    return inner(frame);
  }
  const XLA_FFI_Api* xla = frame->api;
  auto fail = [xla](const std::string& m) { return MakeError(xla, XLA_FFI_Error_Code_INTERNAL, std::string(kOp) + ": " + m); };
  auto invalid = [xla](const std::string& m) {
    return MakeError(xla, XLA_FFI_Error_Code_INVALID_ARGUMENT, std::string(kOp) + ": " + m);
  };
  std::string why;
  const Api* cu = GetApi(&why);
  if (cu == nullptr) return fail("no CUDA runtime: " + why);
  g_counters.calls++;

  Stream stream = nullptr;
  if (device_stream) {
    XLA_FFI_Stream_Get_Args get;
    get.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
    get.extension_start = nullptr;
    get.ctx = frame->ctx;
    get.stream = nullptr;
    if (XLA_FFI_Error* e = xla->XLA_FFI_Stream_Get(&get); e != nullptr) return e;
    stream = get.stream;
  }

  // The operands and results, all buffers.
  const size_t n_args = static_cast<size_t>(frame->args.size);
  const size_t n_rets = static_cast<size_t>(frame->rets.size);
  std::vector<XLA_FFI_Buffer*> in(n_args), out(n_rets);
  Shape shape;
  shape.target = target;
  for (size_t i = 0; i < n_args; ++i) {
    if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER) return invalid("operand " + std::to_string(i) + " is not a buffer");
    in[i] = static_cast<XLA_FFI_Buffer*>(frame->args.args[i]);
    shape.arg_bytes.push_back(xla::ffi::AnyBuffer(in[i]).size_bytes());
  }
  for (size_t j = 0; j < n_rets; ++j) {
    if (frame->rets.types[j] != XLA_FFI_RetType_BUFFER) return invalid("result " + std::to_string(j) + " is not a buffer");
    out[j] = static_cast<XLA_FFI_Buffer*>(frame->rets.rets[j]);
    shape.ret_bytes.push_back(xla::ffi::AnyBuffer(out[j]).size_bytes());
    int alias = -1;
    for (size_t i = kScalars; i < n_args && alias < 0; ++i) {
      if (in[i]->data == out[j]->data && shape.arg_bytes[i] == shape.ret_bytes[j]) alias = static_cast<int>(i);
    }
    shape.ret_alias.push_back(alias);
  }
  if (n_args < kScalars + 1 || n_rets < 1) return invalid("too few operands or results");
  size_t first = target == Target::kDense ? kScalars + 1 : target == Target::kSparse ? kScalars + 2 : kScalars + n_rets - 1;
  shape.first_params = first < n_args ? first : n_args;
  for (size_t i = 0; i < kScalars; ++i) {
    if (shape.arg_bytes[i] != 4) return invalid("the scalar " + std::string(kScalarNames[i]) + " must be 4 bytes");
  }
  for (size_t j = 0; j < n_rets; ++j) {  // a result aliasing an operand other than a staged one: stage it apart
    if (shape.ret_alias[j] >= static_cast<int>(shape.first_params)) shape.ret_alias[j] = -1;
  }

  Set* set = ThePool().Acquire(*cu, shape, &why);
  if (set == nullptr) return fail(why);
  SetLease lease(set);
  if (set->recorded && cu->EventQuery(set->up_done) != kSuccess) {
    g_counters.buffer_waits++;
    if (int e = cu->EventSynchronize(set->up_done); e != kSuccess) {
      return fail("waiting for an earlier step's copies up failed: " + cu->Error(e));
    }
  }

  // Down: the scalars and the gradient, then one synchronisation.
  auto copy_down = [&](size_t from, size_t to, std::string* failed) {
    for (size_t i = from; i < to; ++i) {
      if (int e = cu->MemcpyAsync(set->arg_host[i], in[i]->data, shape.arg_bytes[i], kDeviceToHost, stream); e != kSuccess) {
        g_counters.failed_copies++;
        *failed = "copying the " + ArgName(target, i, shape.first_params) + " down (" + std::to_string(shape.arg_bytes[i]) +
                  " bytes) failed: " + cu->Error(e);
        return i;
      }
      g_counters.copies_down++;
      g_counters.bytes_down += static_cast<int64_t>(shape.arg_bytes[i]);
    }
    return to;
  };
  auto synchronise = [&](const std::string& what, std::string* failed) {
    g_counters.syncs++;
    const int e = cu->StreamSynchronize(stream);
    if (e != kSuccess && failed->empty()) *failed = "waiting for the copies down (" + what + ") failed: " + cu->Error(e);
    return e == kSuccess;
  };
  std::string failed;
  const size_t copied = copy_down(0, shape.first_params, &failed);
  const bool synced = synchronise("scalars and gradient", &failed);
  const bool shard_known = copied > 3 && synced;  // the shard scalar landed
  const std::string shard =
      shard_known ? "shard " + std::to_string(*reinterpret_cast<const int32_t*>(set->arg_host[3])) : "shard (unknown)";
  const std::string unchanged = "; the step did not run: the store is unchanged";
  if (!failed.empty()) return fail(shard + ": " + failed + unchanged);

  const bool adopt = *reinterpret_cast<const int32_t*>(set->arg_host[5]) != 0;
  if (adopt && shape.first_params < n_args) {
    if (std::string e = EnsureParams(*cu, shape, set); !e.empty()) return fail(shard + ": " + e + unchanged);
    copy_down(shape.first_params, n_args, &failed);
    synchronise("params", &failed);
    if (!failed.empty()) return fail(shard + ": " + failed + unchanged);
  }

  // The CPU handler on the staged buffers: a call frame like XLA's, over host memory.
  std::vector<XLA_FFI_Buffer> args(n_args), rets(n_rets);
  std::vector<void*> arg_ptrs(n_args), ret_ptrs(n_rets);
  for (size_t i = 0; i < n_args; ++i) {
    args[i] = *in[i];
    args[i].struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    args[i].extension_start = nullptr;
    args[i].data = (i < shape.first_params || adopt) ? set->arg_host[i] : nullptr;  // unread unless adopting
    arg_ptrs[i] = &args[i];
  }
  for (size_t j = 0; j < n_rets; ++j) {
    rets[j] = *out[j];
    rets[j].struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    rets[j].extension_start = nullptr;
    rets[j].data = set->ret_host[j];
    ret_ptrs[j] = &rets[j];
  }
  XLA_FFI_CallFrame host{};
  host.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  host.extension_start = nullptr;
  host.api = xla;
  host.ctx = frame->ctx;
  host.stage = frame->stage;
  host.args = {XLA_FFI_Args_STRUCT_SIZE, nullptr, static_cast<int64_t>(n_args), frame->args.types, arg_ptrs.data()};
  host.rets = {XLA_FFI_Rets_STRUCT_SIZE, nullptr, static_cast<int64_t>(n_rets), frame->rets.types, ret_ptrs.data()};
  host.attrs = frame->attrs;
  host.future = nullptr;
  if (XLA_FFI_Error* e = inner(&host); e != nullptr) return e;

  // Up: every result, then an event that says when its buffers are free again.
  const size_t params_ret = target == Target::kPieces ? 1 : 0;  // results from here on are params (bar the version)
  for (size_t j = 0; j < n_rets && failed.empty(); ++j) {
    if (int e = cu->MemcpyAsync(out[j]->data, set->ret_host[j], shape.ret_bytes[j], kHostToDevice, stream); e != kSuccess) {
      g_counters.failed_copies++;
      failed = "copying the " + RetName(target, j) + " up (" + std::to_string(shape.ret_bytes[j]) + " bytes) failed: " +
               cu->Error(e);
      break;
    }
    g_counters.copies_up++;
    g_counters.bytes_up += static_cast<int64_t>(shape.ret_bytes[j]);
    const bool is_version = target == Target::kPieces ? j == 0 : j == 1;
    if (j >= params_ret && !is_version) g_counters.params_bytes_up += static_cast<int64_t>(shape.ret_bytes[j]);
  }
  const int recorded = cu->EventRecord(set->up_done, stream);
  set->recorded = recorded == kSuccess;
  if (failed.empty() && recorded != kSuccess) failed = "recording the copies' event failed: " + cu->Error(recorded);
  if (failed.empty() && !device_stream) {
    // No stream orders the results' readers after the copies: they must have landed before the call returns.
    g_counters.syncs++;
    if (int e = cu->EventSynchronize(set->up_done); e != kSuccess) failed = "waiting for the copies up failed: " + cu->Error(e);
  }
  if (!failed.empty()) {
    // The copies queued before the failure still write into the results: they must land before the call
    // returns, since a failed call's results may be freed (on the host path, at once) and a late write into
    // freed memory corrupts the heap.
    g_counters.syncs++;
    if (int e = cu->StreamSynchronize(stream); e != kSuccess) {
      failed += "; then waiting for the earlier copies up failed: " + cu->Error(e);
    }
    return fail(shard + ": " + failed +
                "; the step ran on the host and its version is the store's (at staleness 0 a call with the same "
                "version replays it)");
  }
  return nullptr;
}

}  // namespace

std::string UseLibrary(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_api_mu);
  std::unique_ptr<Api> api;
  if (std::string e = Load(path, &api); !e.empty()) return "the CUDA runtime library " + e;
  if (g_api != nullptr && g_api->library != path) return "the CUDA entry points already come from " + g_api->library;
  if (g_api == nullptr) g_api = std::move(api);
  return "";
}

void SetSearchDirs(const std::string& dirs) {
  std::lock_guard<std::mutex> lock(g_api_mu);
  g_search_dirs = dirs;
}

const Api* GetApi(std::string* why) {
  std::lock_guard<std::mutex> lock(g_api_mu);
  if (g_api != nullptr) return g_api.get();
  std::vector<std::string> candidates;
  const char* env = std::getenv("NSP_CUDA_RUNTIME");
  if (env != nullptr && *env != '\0') {
    candidates.push_back(env);  // named: only it
  } else {
    candidates.push_back("libcudart.so.12");
    size_t at = 0;
    while (at <= g_search_dirs.size()) {
      size_t end = g_search_dirs.find(':', at);
      if (end == std::string::npos) end = g_search_dirs.size();
      if (end > at) candidates.push_back(g_search_dirs.substr(at, end - at) + "/libcudart.so.12");
      at = end + 1;
    }
    candidates.push_back("libcudart.so");
  }
  std::string tried;
  for (const std::string& c : candidates) {
    std::unique_ptr<Api> api;
    std::string e = Load(c, &api);
    if (e.empty()) {
      g_api = std::move(api);
      return g_api.get();
    }
    tried += (tried.empty() ? "" : "; ") + e;
  }
  *why = "none of the CUDA runtime libraries loads (" + tried +
         "); set NSP_CUDA_RUNTIME to the path of libcudart.so.12";
  return nullptr;
}

std::vector<std::pair<std::string, int64_t>> Stats() {
  const Counters& c = g_counters;
  return {{"calls", c.calls},           {"pinned_allocs", c.pinned_allocs}, {"pinned_bytes", c.pinned_bytes},
          {"copies_down", c.copies_down}, {"bytes_down", c.bytes_down},     {"copies_up", c.copies_up},
          {"bytes_up", c.bytes_up},     {"params_bytes_up", c.params_bytes_up}, {"syncs", c.syncs},
          {"buffer_waits", c.buffer_waits}, {"failed_copies", c.failed_copies}};
}

}  // namespace nsp::cuda

using nsp::cuda::Target;

// Each CPU target's two staged handlers: <target>Cuda on a CUDA stream, <target>CudaHost without one.
#define NSP_STAGED_TARGET(target, kind)                                                            \
  extern "C" XLA_FFI_Error* target##Cuda(XLA_FFI_CallFrame* f) {                                   \
    return nsp::cuda::Staged(f, target, Target::kind, true);                                       \
  }                                                                                                \
  extern "C" XLA_FFI_Error* target##CudaHost(XLA_FFI_CallFrame* f) {                               \
    return nsp::cuda::Staged(f, target, Target::kind, false);                                      \
  }

NSP_STAGED_TARGET(NspStoreUpdateDense, kDense)
NSP_STAGED_TARGET(NspStoreUpdateSparse, kSparse)
NSP_STAGED_TARGET(NspStoreUpdatePieces, kPieces)

#undef NSP_STAGED_TARGET
