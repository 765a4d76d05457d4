// What the nanobind module's files share (module.cc, module_backends.cc, module_engine.cc): the array types of
// their arguments, raising an engine's error as a Python exception, the Python object of a shard engine, and the
// functions each file adds to the module.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "backends/plugin_backend.h"
#include "engine/store_engine.h"

namespace nsp::module {

namespace nb = nanobind;

using F32Array = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U16Array = nb::ndarray<uint16_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
// Read-only inputs (numpy views of jax arrays are read-only).
using F32In = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U16In = nb::ndarray<const uint16_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I32In = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

inline void Check(const std::string& err) {
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
  std::shared_ptr<ShardEngine> engine;
  const std::shared_ptr<ShardEngine>& engine_or_throw() const {
    if (!engine) throw std::runtime_error("this shard engine was released: its store is closed");
    return engine;
  }
  ShardEngine& get() const { return *engine_or_throw(); }
};

// What a shard engine's backend is made for: the backend by name, and its shard and the store around it (as a
// plugin is told them; the built-in backends read what they need from the same).
struct BackendSpec {
  std::string name;  // "memory", "file", or a plugin's name
  bool in_place = false;
  PluginConfig shard;
  int slots = 2;  // 1: the file tier's one-slot store (redo journal), 2: two version slots
};

// module_backends.cc: the engine of one shard over its backend (built in, or a plugin loaded by name); raises
// when it cannot be had.
std::shared_ptr<ShardEngine> MakeEngine(const BackendSpec& b);
// module_backends.cc: find_backend, backend_dir.
void DefineBackendFunctions(nb::module_& m);
// module_engine.cc: the ShardEngine class.
void DefineShardEngine(nb::module_& m);

}  // namespace nsp::module
