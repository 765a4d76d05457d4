// The Python extension module nsp._nsp_ffi: hands the XLA FFI handlers to JAX as capsules and exposes the
// kernel's thread pool and the roofline loop used by the benchmarks.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <type_traits>

#include "thread_pool.h"
#include "update_kernel.h"
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(NspFusedUpdateDense);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NspFusedUpdateSparse);

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

using F32Array = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

}  // namespace

NB_MODULE(_nsp_ffi, m) {
  m.doc() = "nsp C++ kernels (XLA FFI handlers for the CPU platform).";
  m.def("registrations", []() {
    nb::dict targets;
    targets["nsp_fused_update_dense"] = EncapsulateFfiHandler(NspFusedUpdateDense);
    targets["nsp_fused_update_sparse"] = EncapsulateFfiHandler(NspFusedUpdateSparse);
    return targets;
  });
  m.def("kernel_isa", &nsp::KernelIsa, "Instruction set the update kernels use on this CPU.");
  m.def("get_num_threads", &nsp::GetNumThreads, "Threads the update kernels use.");
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 1) throw nb::value_error("the number of threads must be >= 1");
        nsp::SetNumThreads(n);
      },
      nb::arg("n"), "Sets the threads the update kernels use.");
  m.def(
      "stream_roofline",
      [](F32Array p, F32Array g, F32Array m, F32Array v) {
        const size_t n = p.shape(0);
        if (g.shape(0) != n || m.shape(0) != n || v.shape(0) != n) {
          throw nb::value_error("stream_roofline: all arrays must have the same length");
        }
        nb::gil_scoped_release release;
        nsp::StreamRoofline(p.data(), g.data(), m.data(), v.data(), static_cast<int64_t>(n));
      },
      nb::arg("p"), nb::arg("g"), nb::arg("m"), nb::arg("v"),
      "Streams p, g, m, v in and p, m, v out (28 B/param) with trivial arithmetic: the memory roofline.");
}
