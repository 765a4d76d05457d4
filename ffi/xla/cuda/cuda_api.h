// The few CUDA runtime entry points the CUDA side of the store update needs (ffi/xla/cuda/cuda_stage.cc), declared here
// and resolved at run time with dlopen/dlsym: building nsp never needs a CUDA toolkit. The library is the CUDA
// runtime (libcudart, usually already in the process through JAX's CUDA plugin), or, for tests on a CPU, the
// software model of these entry points (ffi/xla/cuda/cuda_model.cc), which keeps their signatures and semantics:
// an in-order stream, pinned host buffers, events.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace nsp::cuda {

// cudaError_t values the code looks at (the rest are reported through GetErrorString).
constexpr int kSuccess = 0;
constexpr int kErrorNotReady = 600;
// cudaMemcpyKind
constexpr int kHostToDevice = 1;
constexpr int kDeviceToHost = 2;
// cudaHostAllocPortable: pinned for every device's context, not only the current one.
constexpr unsigned kHostAllocPortable = 1;
// cudaEventDisableTiming
constexpr unsigned kEventDisableTiming = 2;

// cudaStream_t and cudaEvent_t are opaque pointers: void* is ABI-compatible with both.
using Stream = void*;
using Event = void*;

struct Api {
  int (*MemcpyAsync)(void* dst, const void* src, size_t bytes, int kind, Stream stream);
  int (*StreamSynchronize)(Stream stream);
  int (*HostAlloc)(void** ptr, size_t bytes, unsigned flags);
  int (*FreeHost)(void* ptr);
  int (*EventCreateWithFlags)(Event* event, unsigned flags);
  int (*EventRecord)(Event event, Stream stream);
  int (*EventQuery)(Event event);
  int (*EventSynchronize)(Event event);
  int (*EventDestroy)(Event event);
  const char* (*GetErrorString)(int error);
  std::string library;  // the file the entry points came from

  std::string Error(int code) const {
    const char* text = GetErrorString != nullptr ? GetErrorString(code) : nullptr;
    return std::string(text != nullptr ? text : "unknown CUDA error") + " (CUDA error " + std::to_string(code) + ")";
  }
};

// Loads `path` now (an error names it and what is missing) and makes it the library every later call uses.
std::string UseLibrary(const std::string& path);
// Directories to look for libcudart.so.12 in when the plain soname does not load (the CUDA runtime that ships
// with JAX's CUDA wheels), tried after NSP_CUDA_RUNTIME and the soname.
void SetSearchDirs(const std::string& dirs);  // ':'-separated
// The entry points: loaded on first use (NSP_CUDA_RUNTIME, else libcudart.so.12 as already loaded or found by
// the loader, else in the search directories); null with `why` set when none loads.
const Api* GetApi(std::string* why);

}  // namespace nsp::cuda
