// The Python extension module nsp._nsp_ffi: hands the XLA FFI handlers to JAX as capsules, and exposes the
// kernels' thread pool and instruction set, the engine CPUs, the abort guard, CRC-32C, the finiteness check and the
// roofline loop used by the benchmarks. Its backends (finding a plugin) are module_backends.cc's; its ShardEngine
// class, the store's shard engines, is module_engine.cc's.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "xla/ffi/api/api.h"

#include "engine/engine_registry.h"
#include "kernels/update_kernel.h"
#include "util/abort_guard.h"
#include "util/crc32c.h"
#include "util/engine_cpus.h"
#include "util/thread_pool.h"
#include "xla/cuda/cuda_api.h"
#include "xla/cuda/cuda_stage.h"
#include "xla/module_common.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(NspFusedUpdateDense);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspFusedUpdateSparse);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdateDense);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdateSparse);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdatePieces);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspStoreUpdateStaged);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspGradientStage);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspGradientStageLoad);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspParamsHash);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspNextParamsUpdate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspNextParamsUpdateFlat);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspTopkSelect);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspTopkFeedback);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspSpillSave);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspSpillLoad);

namespace nsp::spill {
void Bind(nanobind::module_& m);  // module_spill.cc
}  // namespace nsp::spill

namespace {

namespace nb = nanobind;
using nsp::module::Check;
using nsp::module::F32Array;
using nsp::module::F32In;

using Handler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

// A handler as the capsule jax.ffi.register_ffi_target takes.
nb::capsule Capsule(Handler* handler) { return nb::capsule(reinterpret_cast<void*>(handler)); }

// Handlers by target name, as capsules.
nb::dict Capsules(std::initializer_list<std::pair<const char*, Handler*>> targets) {
  nb::dict out;
  for (const auto& [name, handler] : targets) out[name] = Capsule(handler);
  return out;
}

// The store update's targets: each with its CPU handler (store_update_ffi.cc) and the CUDA handlers that stage its
// buffers through host memory (cuda_stage.cc), on a CUDA stream and on a platform without one.
struct StoreTarget {
  const char* name;
  Handler* cpu;
  Handler* cuda;
  Handler* cuda_host;
};
constexpr StoreTarget kStoreTargets[] = {
    {"nsp_store_update_dense", NspStoreUpdateDense, NspStoreUpdateDenseCuda, NspStoreUpdateDenseCudaHost},
    {"nsp_store_update_sparse", NspStoreUpdateSparse, NspStoreUpdateSparseCuda, NspStoreUpdateSparseCudaHost},
    {"nsp_store_update_pieces", NspStoreUpdatePieces, NspStoreUpdatePiecesCuda, NspStoreUpdatePiecesCudaHost},
};

}  // namespace

NB_MODULE(_nsp_ffi, m) {
  m.doc() = "nsp C++ kernels (XLA FFI handlers for the CPU platform).";
  nsp::spill::Bind(m);
  m.def("registrations", []() {
    nb::dict targets = Capsules({{"nsp_fused_update_dense", NspFusedUpdateDense},
                                 {"nsp_fused_update_sparse", NspFusedUpdateSparse},
                                 {"nsp_params_hash", NspParamsHash},
                                 {"nsp_next_params_update", NspNextParamsUpdate},
                                 {"nsp_next_params_update_flat", NspNextParamsUpdateFlat},
                                 {"nsp_topk_select", NspTopkSelect},
                                 {"nsp_topk_feedback", NspTopkFeedback},
                                 {"nsp_spill_save", NspSpillSave},
                                 {"nsp_spill_load", NspSpillLoad},
                                 {"nsp_store_update_staged", NspStoreUpdateStaged},
                                 {"nsp_gradient_stage", NspGradientStage},
                                 {"nsp_gradient_stage_load", NspGradientStageLoad}});
    for (const StoreTarget& t : kStoreTargets) targets[t.name] = Capsule(t.cpu);
    return targets;
  });
  m.def("cuda_registrations", []() {
    // The store update's targets for CUDA devices ("device"), and the same handlers for a platform without a
    // stream ("host": the CPU, through the software model of the CUDA entry points).
    nb::dict device, host, both;
    for (const StoreTarget& t : kStoreTargets) {
      device[t.name] = Capsule(t.cuda);
      host[t.name] = Capsule(t.cuda_host);
    }
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
      "install_abort_guard",
      [](const std::string& host, int port, int probe_ms, const std::string& message, int exit_code) {
        Check(nsp::InstallAbortGuard(host, port, probe_ms, message, exit_code));
      },
      nb::arg("host"), nb::arg("port"), nb::arg("probe_ms"), nb::arg("message"), nb::arg("exit_code"),
      "On SIGABRT, when the coordination service at host:port (a numeric address) no longer accepts a "
      "connection within probe_ms, writes `message` to stderr and exits with `exit_code`; any other abort "
      "proceeds as before.");
  m.def("remove_abort_guard", &nsp::RemoveAbortGuard, "The default SIGABRT action again.");
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
  nsp::module::DefineBackendFunctions(m);
  nsp::module::DefineShardEngine(m);

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
      "kernel_time",
      []() {
        const nsp::KernelClock clock = nsp::KernelTime();
        return nb::make_tuple(clock.calls, static_cast<double>(clock.nanoseconds) * 1e-9);
      },
      "(calls, seconds): the update kernels' calls and the wall time spent inside them since the process started.");
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
