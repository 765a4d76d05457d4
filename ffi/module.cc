// The Python extension module nsp._nsp_ffi: hands the XLA FFI handlers to JAX as capsules, makes the store's shard
// engines over their backends (built in, or loaded by name: plugin_backend.h), and exposes the kernel's thread
// pool and the roofline loop used by the benchmarks.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <dlfcn.h>

#include <array>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "abort_guard.h"
#include "backend.h"
#include "crc32c.h"
#include "cuda_api.h"
#include "cuda_stage.h"
#include "engine_cpus.h"
#include "engine_registry.h"
#include "hyper_params.h"
#include "plugin_backend.h"
#include "store_engine.h"
#include "thread_pool.h"
#include "update_kernel.h"
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(NspFusedUpdateDense);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspFusedUpdateSparse);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdateDense);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdateSparse);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdatePieces);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspParamsHash);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspNextParamsUpdate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspNextParamsUpdateFlat);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspSegmentHash);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspTopkSelect);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspTopkFeedback);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspSpillSave);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspSpillLoad);

namespace nb = nanobind;

namespace nsp::spill {
void Bind(nb::module_& m);  // spill_module.cc
}  // namespace nsp::spill

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

using F32Array = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U16Array = nb::ndarray<uint16_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I32Array = nb::ndarray<int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
// Read-only inputs (numpy views of jax arrays are read-only).
using F32In = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U16In = nb::ndarray<const uint16_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I32In = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void Check(const std::string& err) {
  if (!err.empty()) throw std::runtime_error(err);
}

// Runs `call` (returns "" or an error) without the GIL, for engine work that may wait on the disk or on a
// background step, then raises its error.
template <typename Call>
void CheckWithoutGil(Call&& call) {
  std::string err;
  {
    nb::gil_scoped_release release;
    err = call();
  }
  Check(err);
}

void CheckSlotState(const char* what, int slot, int state) {
  if (std::string e = nsp::CheckSlotAndState(what, slot, state); !e.empty()) throw nb::value_error(e.c_str());
}

template <typename A>
void CheckLength(const char* name, const A& a, int64_t n) {
  if (static_cast<int64_t>(a.shape(0)) != n) {
    throw nb::value_error((std::string(name) + " has " + std::to_string(a.shape(0)) + " elements, expected " +
                           std::to_string(n)).c_str());
  }
}

// The Python object of a ShardEngine holds one reference to it; the registry (reached by XLA FFI calls) holds
// another, and each running call one more. So an engine lives until the last of them is gone, in whatever order
// Python objects, the registry and in-flight steps let go of it: no call ever sees a freed engine.
struct EngineRef {
  std::shared_ptr<nsp::ShardEngine> engine;
  const std::shared_ptr<nsp::ShardEngine>& engine_or_throw() const {
    if (!engine) throw std::runtime_error("this shard engine was released: its store is closed");
    return engine;
  }
  nsp::ShardEngine& get() const { return *engine_or_throw(); }
};

// nsp's own backends/ directory, beside this module's file: where backends shipped with the package (csd) live.
// Found from the loaded module itself (its __file__ is set only after its initialisation).
const std::string& PackageBackendDir() {
  static const std::string dir = [] {
    Dl_info info;
    if (::dladdr(reinterpret_cast<void*>(&PackageBackendDir), &info) == 0 || info.dli_fname == nullptr) {
      return std::string();
    }
    const std::string file = info.dli_fname;
    const size_t slash = file.find_last_of('/');
    return (slash == std::string::npos ? std::string(".") : file.substr(0, slash)) + "/backends";
  }();
  return dir;
}

bool BuiltIn(const std::string& backend) { return backend == "memory" || backend == "file"; }

// What a shard engine's backend is made for: its shard, and the store around it.
struct BackendSpec {
  std::string name;     // "memory", "file", or a plugin's name
  std::string root;     // the shard's directory ("" for memory)
  int64_t size = 0, page_elems = 0;
  std::array<bool, nsp::kNumStates> used{};
  bool checksum = true;
  bool in_place = false;
  int64_t shard = 0, num_shards = 1;
  int pages_in_flight = 8;
  std::string options;  // a plugin's options string
};

std::unique_ptr<nsp::Backend> MakeBuiltInBackend(const BackendSpec& b) {
  if (b.name == "memory") {
    return nsp::MakeMemoryBackend(b.size, b.page_elems, std::vector<bool>(b.used.begin(), b.used.end()), b.in_place);
  }
  // The file tier's I/O settings and its fault injection (tests, bench/fault_campaign.py: it wraps the file
  // tier, whose page writes and commits are the ones a full disk or a crash interrupts) come from environment
  // variables, read here, once per engine: a value the tier does not take fails the store's opening.
  nsp::FileIoSettings io;
  if (std::string err = nsp::FileIoSettingsFromEnv(&io); !err.empty()) throw nb::value_error(err.c_str());
  std::unique_ptr<nsp::Backend> backend = nsp::MakeFileBackend(b.root, b.size, b.page_elems, b.checksum, io);
  const nsp::FaultPlan faults = nsp::FaultPlanFromEnv();
  return faults.any() ? nsp::MakeFaultInjectingBackend(std::move(backend), faults) : std::move(backend);
}

// A plugin's device for the shard. Every reason it cannot be had (not found, not loadable, another ABI, its open
// failing) raises RuntimeError("backend <name> not available: <why>"). Plugins inject their own faults (their
// options), not the environment's.
std::unique_ptr<nsp::PluginBackend> MakePluginBackend(const BackendSpec& b) {
  nsp::LoadedPlugin plugin;
  if (std::string err = nsp::LoadPlugin(b.name, nsp::PluginSearch::FromEnv(PackageBackendDir()), &plugin);
      !err.empty()) {
    throw std::runtime_error(err);
  }
  nsp::PluginConfig config;
  config.shard_dir = b.root;
  config.shard_index = b.shard;
  config.num_devices = b.num_shards;
  config.size = b.size;
  config.page_elems = b.page_elems;
  config.states_used.assign(b.used.begin(), b.used.end());
  config.checksum = b.checksum;
  config.pages_in_flight = b.pages_in_flight;
  config.options = b.options;
  std::string err;
  std::unique_ptr<nsp::PluginBackend> backend = nsp::PluginBackend::Open(plugin, config, &err);
  if (!backend) throw std::runtime_error(err);
  return backend;
}

// The engine of one shard over its backend.
std::shared_ptr<nsp::ShardEngine> MakeEngine(const BackendSpec& b) {
  if (b.size < 1 || b.page_elems < 1) throw nb::value_error("size and page_elems must be >= 1");
  if (b.in_place && b.name != "memory") throw nb::value_error("only the memory tier updates in place");
  if (b.shard < 0 || b.num_shards < 1 || b.shard >= b.num_shards) {
    throw nb::value_error(("shard " + std::to_string(b.shard) + " of " + std::to_string(b.num_shards) +
                           " shards does not exist").c_str());
  }
  if (BuiltIn(b.name)) {
    return std::make_shared<nsp::ShardEngine>(MakeBuiltInBackend(b), b.size, b.page_elems, b.pages_in_flight,
                                              b.used);
  }
  std::unique_ptr<nsp::PluginBackend> plugin = MakePluginBackend(b);
  nsp::PluginBackend* adapter = plugin.get();
  auto engine = std::make_shared<nsp::ShardEngine>(std::move(plugin), b.size, b.page_elems, b.pages_in_flight,
                                                   b.used);
  // The device is told each page's host-link bytes as the engine counts them (the engine owns the adapter, so it
  // outlives every call of this reader).
  nsp::ShardEngine* counted = engine.get();
  adapter->SetHostTraffic([counted](int64_t* in, int64_t* out) {
    *in = counted->stats().shared_in_bytes;
    *out = counted->stats().shared_out_bytes;
  });
  return engine;
}

// The hyperparameters of one engine update: lr and step, and the rest from one Python dict with
// hyper_params.h's keys (nsp.spec.hyper_attrs builds it), decoded and validated once. A
// missing, unknown or wrong-typed key raises ValueError naming the key and `op`.
nsp::UpdateHyperParams HyperParamsFromDict(const char* op, const nb::dict& hyper, float lr, int64_t step) {
  auto fail = [op](const std::string& err) { throw nb::value_error((std::string(op) + ": " + err).c_str()); };
  for (auto [key, value] : hyper) {
    if (!nb::isinstance<nb::str>(key)) fail(nsp::hyper::UnknownKey(nb::repr(key).c_str()));
    if (!nsp::hyper::IsKey(nb::cast<std::string>(key))) fail(nsp::hyper::UnknownKey(nb::cast<std::string>(key)));
  }
  auto read = [&hyper](const char* key, auto* out) -> std::string {
    using T = std::remove_pointer_t<decltype(out)>;
    if (!hyper.contains(key)) return nsp::hyper::MissingKey(key);
    nb::handle v = hyper[key];
    auto got = [v] { return std::string(nb::inst_name(v).c_str()); };
    if constexpr (std::is_same_v<T, bool>) {
      if (!nb::try_cast<bool>(v, *out)) return nsp::hyper::WrongType(key, "a bool", got());
    } else if constexpr (std::is_same_v<T, int32_t>) {
      int64_t i = 0;
      if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr()) || !nb::try_cast<int64_t>(v, i) || i != int32_t(i)) {
        return nsp::hyper::WrongType(key, "an int32", got());
      }
      *out = static_cast<int32_t>(i);
    } else {
      if (PyBool_Check(v.ptr()) || !nb::try_cast<double>(v, *out)) return nsp::hyper::WrongType(key, "a float", got());
    }
    return "";
  };
  nsp::UpdateHyperParams hp;
  hp.lr = lr;
  hp.step = step;
  if (std::string err = nsp::hyper::DecodeHyperParams(read, hp); !err.empty()) fail(err);
  return hp;
}

// Builds one update from Python arguments: a dense gradient (fp32, or bf16 as uint16) or compressed
// (indices, values), and where the new params go.
nsp::ShardUpdate MakeUpdate(const nsp::ShardEngine& e, const nsp::UpdateHyperParams& hp,
                            const std::optional<F32In>& grad, const std::optional<U16In>& grad_bf16,
                            const std::optional<I32In>& indices, const std::optional<F32In>& values,
                            const std::optional<U16In>& values_bf16, std::optional<F32Array>& params_out,
                            std::optional<U16Array>& params_bf16_out) {
  nsp::ShardUpdate u;
  u.hp = hp;
  const int64_t n = e.size();
  if (grad) {
    CheckLength("grad", *grad, n);
    u.grad = grad->data();
  } else if (grad_bf16) {
    CheckLength("grad", *grad_bf16, n);
    u.grad = grad_bf16->data();
    u.grad_type = nsp::GradType::kBF16;
  } else if (indices && (values || values_bf16)) {
    u.indices = indices->data();
    u.count = static_cast<int64_t>(indices->shape(0));
    if (values) {
      CheckLength("values", *values, u.count);
      u.values = values->data();
    } else {
      CheckLength("values", *values_bf16, u.count);
      u.values = values_bf16->data();
      u.grad_type = nsp::GradType::kBF16;
    }
  } else {
    throw nb::value_error("update needs a dense gradient or (indices, values)");
  }
  if (params_out) {
    CheckLength("params_out", *params_out, n);
    u.params_out = params_out->data();
  }
  if (params_bf16_out) {
    CheckLength("params_bf16_out", *params_bf16_out, n);
    u.params_bf16_out = params_bf16_out->data();
  }
  return u;
}

// An engine method that runs one update given as Python arguments: its own leading arguments, then lr, step,
// hyper, the gradient and the outputs (MakeUpdate). `run(engine, update, leading...)` runs it without the GIL
// and returns "" or an error; `op` names the method in hyperparameter errors. The method returns whether the
// update was skipped for a gradient its own pass found not finite (only ever with update.check_finite).
template <typename... Leading, typename Run>
auto UpdateMethod(const char* op, Run run) {
  return [op, run](EngineRef& ref, Leading... leading, float lr, int64_t step, const nb::dict& hyper,
                   std::optional<F32In> grad, std::optional<U16In> grad_bf16, std::optional<I32In> indices,
                   std::optional<F32In> values, std::optional<U16In> values_bf16,
                   std::optional<F32Array> params_out, std::optional<U16Array> params_bf16_out) {
    nsp::ShardEngine& e = ref.get();
    nsp::ShardUpdate u = MakeUpdate(e, HyperParamsFromDict(op, hyper, lr, step), grad, grad_bf16, indices, values,
                                    values_bf16, params_out, params_bf16_out);
    bool skipped = false;
    u.skipped = &skipped;
    CheckWithoutGil([&] { return run(e, u, leading...); });
    return skipped;
  };
}

// Defines an UpdateMethod on the ShardEngine class: the names of its leading arguments, then those every update
// method takes (the gradient and the outputs optional, by keyword).
template <typename Method, typename... LeadingNames>
void DefUpdateMethod(nb::class_<EngineRef>& cls, const char* name, Method method, const char* doc,
                     LeadingNames... leading) {
  cls.def(name, method, leading..., nb::arg("lr"), nb::arg("step"), nb::arg("hyper"),
          nb::arg("grad").none() = nb::none(), nb::arg("grad_bf16").none() = nb::none(),
          nb::arg("indices").none() = nb::none(), nb::arg("values").none() = nb::none(),
          nb::arg("values_bf16").none() = nb::none(), nb::arg("params_out").none() = nb::none(),
          nb::arg("params_bf16_out").none() = nb::none(), doc);
}

}  // namespace

NB_MODULE(_nsp_ffi, m) {
  m.doc() = "nsp C++ kernels (XLA FFI handlers for the CPU platform).";
  nsp::spill::Bind(m);
  m.def("registrations", []() {
    nb::dict targets;
    targets["nsp_fused_update_dense"] = EncapsulateFfiHandler(NspFusedUpdateDense);
    targets["nsp_fused_update_sparse"] = EncapsulateFfiHandler(NspFusedUpdateSparse);
    targets["nsp_store_update_dense"] = EncapsulateFfiHandler(NspStoreUpdateDense);
    targets["nsp_store_update_sparse"] = EncapsulateFfiHandler(NspStoreUpdateSparse);
    targets["nsp_store_update_pieces"] = EncapsulateFfiHandler(NspStoreUpdatePieces);
    targets["nsp_params_hash"] = EncapsulateFfiHandler(NspParamsHash);
    targets["nsp_next_params_update"] = EncapsulateFfiHandler(NspNextParamsUpdate);
    targets["nsp_next_params_update_flat"] = EncapsulateFfiHandler(NspNextParamsUpdateFlat);
    targets["nsp_segment_hash"] = EncapsulateFfiHandler(NspSegmentHash);
    targets["nsp_topk_select"] = EncapsulateFfiHandler(NspTopkSelect);
    targets["nsp_topk_feedback"] = EncapsulateFfiHandler(NspTopkFeedback);
    targets["nsp_spill_save"] = EncapsulateFfiHandler(NspSpillSave);
    targets["nsp_spill_load"] = EncapsulateFfiHandler(NspSpillLoad);
    return targets;
  });
  m.def("cuda_registrations", []() {
    // The store update's targets for CUDA devices ("device"), and the same handlers for a platform without a
    // stream ("host": the CPU, through the software model of the CUDA entry points).
    nb::dict device, host, both;
    device["nsp_store_update_dense"] = EncapsulateFfiHandler(NspStoreUpdateDenseCuda);
    device["nsp_store_update_sparse"] = EncapsulateFfiHandler(NspStoreUpdateSparseCuda);
    device["nsp_store_update_pieces"] = EncapsulateFfiHandler(NspStoreUpdatePiecesCuda);
    host["nsp_store_update_dense"] = EncapsulateFfiHandler(NspStoreUpdateDenseCudaHost);
    host["nsp_store_update_sparse"] = EncapsulateFfiHandler(NspStoreUpdateSparseCudaHost);
    host["nsp_store_update_pieces"] = EncapsulateFfiHandler(NspStoreUpdatePiecesCudaHost);
    both["device"] = device;
    both["host"] = host;
    return both;
  });
  m.def("cuda_use_library", [](const std::string& path) { Check(nsp::cuda::UseLibrary(path)); }, nb::arg("path"),
        "Loads the CUDA entry points from `path` now (the CUDA runtime, or its software model for tests).");
  m.def("cuda_search_dirs", [](const std::string& dirs) { nsp::cuda::SetSearchDirs(dirs); }, nb::arg("dirs"),
        "Directories (':'-separated) to look for libcudart.so.12 in when the loader does not find it.");
  m.def("cuda_stats", []() {
    nb::dict out;
    for (const auto& [name, value] : nsp::cuda::Stats()) out[name.c_str()] = value;
    return out;
  }, "Counters of the CUDA handlers: calls, pinned allocations and bytes, copies and bytes each way, syncs.");
  m.def(
      "unregister_engine",
      [](int64_t handle) {
        std::shared_ptr<nsp::ShardEngine> dropped = nsp::UnregisterEngine(handle);
        nb::gil_scoped_release release;
        dropped.reset();  // the last reference may wait for a background step: without the GIL
      },
      nb::arg("handle"),
      "Makes `handle` unknown to XLA FFI calls (a later call naming it fails: the store was closed). A call "
      "running now keeps the engine alive until it returns.");
  m.def(
      "kernel_isa",
      []() {
        for (const std::string* error : {&nsp::KernelIsaError(), &nsp::Crc32cIsaError()}) {
          if (!error->empty()) throw nb::value_error(error->c_str());
        }
        return nsp::KernelIsa();
      },
      "Instruction set the update kernels use on this CPU (a bad NSP_KERNEL_ISA or NSP_CRC32C_ISA raises).");
  m.def(
      "find_backend",
      [](const std::string& name) -> std::string {
        if (BuiltIn(name)) return "";
        nsp::LoadedPlugin plugin;
        if (std::string err = nsp::LoadPlugin(name, nsp::PluginSearch::FromEnv(PackageBackendDir()), &plugin);
            !err.empty()) {
          throw std::runtime_error(err);
        }
        return plugin.path;
      },
      nb::arg("name"),
      "Loads backend `name` (checking its library and ABI version, opening no device) and returns its library's "
      "path ('' for the built-in memory and file). RuntimeError \"backend <name> not available: <why>\" when it "
      "cannot be had.");
  m.def(
      "install_abort_guard",
      [](const std::string& host, int port, int probe_ms, const std::string& message, int exit_code) {
        Check(nsp::InstallAbortGuard(host, port, probe_ms, message, exit_code));
      },
      nb::arg("host"), nb::arg("port"), nb::arg("probe_ms"), nb::arg("message"), nb::arg("exit_code"),
      "On SIGABRT, when the coordination service at host:port (a numeric address) no longer accepts a "
      "connection within probe_ms, writes `message` to stderr and exits with `exit_code`; any other abort "
      "proceeds as before.");
  m.def("remove_abort_guard", &nsp::RemoveAbortGuard, "The default SIGABRT action again.");
  m.def("backend_dir", []() { return PackageBackendDir(); },
        "nsp's own directory of backend libraries, searched after NSP_BACKEND_PATH.");
  m.def("get_num_threads", &nsp::GetNumThreads, "Threads the update kernels use.");
  m.def(
      "engine_cpus",
      []() {
        if (!nsp::EngineCpusError().empty()) throw nb::value_error(nsp::EngineCpusError().c_str());
        return nsp::EngineCpus();
      },
      "CPUs NSP_ENGINE_CPUS reserves for the update work (empty: unset).");
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 1) throw nb::value_error("the number of threads must be >= 1");
        nsp::SetNumThreads(n);
      },
      nb::arg("n"), "Sets the threads the update kernels use.");
  nb::class_<EngineRef> engine(m, "ShardEngine");
  engine
      .def("__init__",
           [](EngineRef* self, const std::string& backend, const std::string& root, int64_t size, int64_t page_elems,
              int pages_in_flight, std::array<bool, nsp::kNumStates> used, bool checksum, bool in_place,
              const std::string& backend_options, int64_t shard, int64_t num_shards) {
             BackendSpec b{backend, root, size, page_elems, used, checksum, in_place, shard, num_shards,
                           pages_in_flight, backend_options};
             new (self) EngineRef{MakeEngine(b)};
           },
           nb::arg("backend"), nb::arg("root"), nb::arg("size"), nb::arg("page_elems"), nb::arg("pages_in_flight"),
           nb::arg("states_used"), nb::arg("checksum"), nb::arg("in_place") = false, nb::arg("backend_options") = "",
           nb::arg("shard") = 0, nb::arg("num_shards") = 1,
           "An engine for one shard over `backend`: 'memory' and 'file' are built in; any other name is a backend "
           "library (libnsp_backend_<name>.so, looked for in NSP_BACKEND_PATH, then nsp/backends/), opened for "
           "shard `shard` of `num_shards` with `backend_options` (\"key=value;...\"). RuntimeError "
           "\"backend <name> not available: <why>\" when it cannot be had.")
      .def("sync",
           [](EngineRef& ref, int slot) {
             nsp::ShardEngine& e = ref.get();
             CheckWithoutGil([&] { return e.Sync(slot); });
           })
      .def("read_state",
           [](EngineRef& ref, int slot, int state, F32Array out) {
             nsp::ShardEngine& e = ref.get();
             CheckLength("out", out, e.size());
             CheckWithoutGil([&] { return e.ReadState(slot, state, out.data()); });
           })
      .def("read_pages",
           [](EngineRef& ref, int slot, int state, int64_t first_page, F32Array out) {
             nsp::ShardEngine& e = ref.get();
             CheckWithoutGil([&] {
               return e.ReadPages(slot, state, first_page, out.data(), static_cast<int64_t>(out.shape(0)));
             });
           },
           "Reads whole pages of a state from `first_page` into `out` (its length: whole pages, or to the end).")
      .def("write_state",
           [](EngineRef& ref, int slot, int state, F32In in) {
             nsp::ShardEngine& e = ref.get();
             CheckLength("in", in, e.size());
             CheckWithoutGil([&] { return e.WriteState(slot, state, in.data()); });
           })
      .def("write_pages",
           [](EngineRef& ref, int slot, int state, int64_t first_page, F32In in) {
             nsp::ShardEngine& e = ref.get();
             CheckWithoutGil(
                 [&] { return e.WritePages(slot, state, first_page, in.data(), static_cast<int64_t>(in.shape(0))); });
           },
           "Writes whole pages of a state starting at `first_page` (initialisation a page at a time).")
      .def("stats",
           [](EngineRef& ref) {
             nsp::ShardEngine& e = ref.get();
             const nsp::TrafficStats& s = e.stats();
             nb::dict d;
             d["shared_in_bytes"] = s.shared_in_bytes;
             d["shared_out_bytes"] = s.shared_out_bytes;
             d["internal_read_bytes"] = s.internal_read_bytes;
             d["internal_write_bytes"] = s.internal_write_bytes;
             d["pages_read"] = s.pages_read;
             d["pages_written"] = s.pages_written;
             d["pages_read_direct"] = s.pages_read_direct;
             d["updates"] = s.updates;
             d["update_ns"] = s.update_ns;
             d["sync_ns"] = s.sync_ns;
             d["commit_ns"] = s.commit_ns;
             d["skipped"] = s.skipped;
             d["wait_ns"] = s.wait_ns;
             d["params_adopted"] = s.params_adopted;
             return d;
           })
      .def("progress",
           [](EngineRef& ref) {
             const nsp::UpdateProgress p = ref.get().Progress();
             nb::dict d;
             d["pages_done"] = p.pages_done;
             d["pages_total"] = p.pages_total;
             d["elapsed_ns"] = p.elapsed_ns;
             d["running"] = p.running;
             d["updates_begun"] = p.updates_begun;
             return d;
           },
           "The current (or last) update's progress: pages done of total, time since it began, whether it "
           "runs. Safe to call from another thread while an update runs.")
      .def("backend_stats",
           [](EngineRef& ref) {
             std::vector<std::pair<std::string, double>> stats;
             Check(ref.get().backend().Stats(&stats));
             nb::dict d;
             for (const auto& [name, value] : stats) d[nb::str(name.c_str())] = value;
             return d;
           },
           "The backend's own figures, name -> value (a plugin's stats call; empty for memory and file).")
      .def("wait",
           [](EngineRef& ref) {
             nsp::ShardEngine& e = ref.get();
             CheckWithoutGil([&] { return e.Wait(); });
           },
           "Waits for a background (staleness 1) step; raises its error.")
      .def(
          "skip",
          [](EngineRef& ref, int64_t version, std::optional<F32Array> params_out) {
            nsp::ShardEngine& e = ref.get();
            nsp::ShardUpdate u;
            if (params_out) {
              CheckLength("params_out", *params_out, e.size());
              u.params_out = params_out->data();
            }
            CheckWithoutGil([&] { return e.Skip(u, version); });
          },
          nb::arg("version"), nb::arg("params_out").none() = nb::none(),
          "Skips a step (non-finite gradient): the store stays at `version`; its params go to params_out.")
      .def_prop_ro("pending", [](EngineRef& ref) { return ref.get().pending(); })
      .def(
          "verify",
          [](EngineRef& ref, int slot, int state) {
            nsp::ShardEngine& e = ref.get();
            nb::gil_scoped_release release;
            return e.Verify(slot, state);
          },
          nb::arg("slot"), nb::arg("state"), "Reads every page, checking checksums; returns the problems found.")
      .def_prop_ro("version", [](EngineRef& ref) { return ref.get().version(); })
      .def_prop_ro("previous_valid", [](EngineRef& ref) { return ref.get().previous_valid(); })
      .def("forget_previous", [](EngineRef& ref) { ref.get().ForgetPrevious(); },
           "The version before the committed one may no longer be replayed.")
      .def("set_manifest",
           [](EngineRef& ref, std::string path, int64_t version, std::string store_id, int64_t shard) {
             ref.get().SetManifest(std::move(path), version, std::move(store_id), shard);
           },
           nb::arg("path"), nb::arg("version"), nb::arg("store_id") = "", nb::arg("shard") = 0)
      .def(
          "page_checksums",
          [](EngineRef& ref, int slot, int state) {
            CheckSlotState("page_checksums", slot, state);
            return ref.get().backend().PageChecksums(slot, state);
          },
          nb::arg("slot"), nb::arg("state"), "Each page's checksum in `slot` (empty: not all known).")
      .def(
          "set_page_checksums",
          [](EngineRef& ref, int slot, int state, std::vector<uint32_t> crcs) {
            CheckSlotState("set_page_checksums", slot, state);
            Check(ref.get().backend().SetPageChecksums(slot, state, crcs));
          },
          nb::arg("slot"), nb::arg("state"), nb::arg("crcs"),
          "Sets what each page of `slot` must hold (from a committed manifest); reads then check it.")
      .def(
          "commit",
          [](EngineRef& ref, int64_t version) {
            nsp::ShardEngine& e = ref.get();
            CheckWithoutGil([&] { return e.Commit(version); });
          },
          nb::arg("version"))
      .def("register", [](EngineRef& ref) { return nsp::RegisterEngine(ref.engine_or_throw()); },
           "Makes the engine reachable from XLA FFI calls (the registry holds a reference); returns its handle.")
      .def(
          "release",
          [](EngineRef& ref) {
            std::shared_ptr<nsp::ShardEngine> last = std::move(ref.engine);
            nb::gil_scoped_release release;
            last.reset();  // when it was the last reference, waits for a background step and frees the buffers
          },
          "Drops this object's reference to the engine; its methods fail from now on. The engine itself lives on "
          "while the registry or a running XLA call still holds it.")
      .def("reset_stats", [](EngineRef& ref) { ref.get().ResetStats(); })
      .def_prop_ro("buffer_bytes", [](EngineRef& ref) { return ref.get().buffer_bytes(); })
      .def_prop_ro("num_pages", [](EngineRef& ref) { return ref.get().num_pages(); })
      .def_prop_ro("checks_finite_in_pass", [](EngineRef& ref) { return ref.get().ChecksFiniteInPass(); })
      .def_prop_ro("pages_in_flight", [](EngineRef& ref) { return ref.get().pages_in_flight(); })
      .def_prop_ro("size", [](EngineRef& ref) { return ref.get().size(); })
      .def_prop_ro("backend", [](EngineRef& ref) { return ref.get().backend().name(); });
  DefUpdateMethod(engine, "update",
                  UpdateMethod<int, int>("ShardEngine.update",
                                         [](nsp::ShardEngine& e, nsp::ShardUpdate& u, int src_slot, int dst_slot) {
                                           u.src_slot = src_slot;
                                           u.dst_slot = dst_slot;
                                           return e.Update(u);
                                         }),
                  "One update from `src_slot` into `dst_slot`, not committed (the benchmarks' diagnostics drive the "
                  "engine so).",
                  nb::arg("src_slot"), nb::arg("dst_slot"));
  DefUpdateMethod(engine, "step",
                  UpdateMethod<int64_t>("ShardEngine.step",
                                        [](nsp::ShardEngine& e, nsp::ShardUpdate& u, int64_t version) {
                                          return e.Step(u, version);
                                        }),
                  "Reads `version`, writes, syncs and commits version + 1 (a replay of the one before is allowed).\n"
                  "`hyper`: the hyperparameters other than lr and step, one dict (nsp.primitives.hyper_attrs).",
                  nb::arg("version"));
  DefUpdateMethod(engine, "step_if_finite",
                  UpdateMethod<int64_t>("ShardEngine.step_if_finite",
                                        [](nsp::ShardEngine& e, nsp::ShardUpdate& u, int64_t version) {
                                          u.check_finite = true;
                                          return e.Step(u, version);
                                        }),
                  "step from the committed `version` with a dense gradient, checked for NaN/Inf inside the update's "
                  "own pass (engines whose checks_finite_in_pass is True). Returns True when it was not finite: "
                  "the step is skipped, the outputs hold the committed params, nothing is committed, and the "
                  "version before the committed one is gone (its slot was partly overwritten).",
                  nb::arg("version"));

  m.def(
      "stream_roofline",
      [](F32Array p, F32In g, F32Array m, F32Array v) {
        const size_t n = p.shape(0);
        if (g.shape(0) != n || m.shape(0) != n || v.shape(0) != n) {
          throw nb::value_error("stream_roofline: all arrays must have the same length");
        }
        nb::gil_scoped_release release;
        nsp::StreamRoofline(p.data(), g.data(), m.data(), v.data(), static_cast<int64_t>(n));
      },
      nb::arg("p"), nb::arg("g"), nb::arg("m"), nb::arg("v"),
      "Streams p, g, m, v in and p, m, v out (28 B/param) with trivial arithmetic: the memory roofline.");

  m.def(
      "all_finite",
      [](nb::ndarray<nb::ndim<1>, nb::c_contig, nb::device::cpu> data) {
        nsp::GradType type;
        if (data.dtype() == nb::dtype<float>()) {
          type = nsp::GradType::kF32;
        } else if (data.dtype() == nb::dtype<uint16_t>()) {
          type = nsp::GradType::kBF16;
        } else {
          throw nb::type_error("all_finite takes float32 values, or bfloat16 values as their uint16 bit patterns");
        }
        nb::gil_scoped_release release;
        return nsp::AllFinite(data.data(), type, static_cast<int64_t>(data.shape(0)));
      },
      nb::arg("data"),
      "Whether a float32 array (or bfloat16 values given as uint16 bit patterns) holds no NaN or Inf: one "
      "multithreaded pass, no temporaries.");
  m.def(
      "crc32c",
      [](nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> data, uint32_t crc) {
        nb::gil_scoped_release release;
        return nsp::Crc32cExtend(crc, data.data(), data.shape(0));
      },
      nb::arg("data"), nb::arg("crc") = 0,
      "CRC-32C of a uint8 array (continuing `crc`): the checksum the file tier stores with every page.");
}
