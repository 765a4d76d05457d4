// The nanobind module's spill areas (nsp.offload.SpillArea): open, close, reset and stats.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "offload/spill_area.h"

namespace nb = nanobind;

namespace nsp::spill {

void Bind(nb::module_& m) {
  m.def(
      "spill_open",
      [](const std::string& dir, int read_ahead) {
        auto [area, err] = SpillArea::Open(dir, read_ahead);
        if (!area) throw std::runtime_error(err);
        return Areas().Register(std::move(area));
      },
      nb::arg("dir"), nb::arg("read_ahead"),
      "Opens a spill area over an existing, writable directory; returns its id (the handlers' `area`).");
  m.def(
      "spill_close",
      [](int64_t id) {
        if (auto area = Areas().Unregister(id)) area->RemoveFiles();
      },
      nb::arg("area"), "Closes a spill area and removes the files it wrote.");
  m.def(
      "spill_reset",
      [](int64_t id) {
        if (auto area = Areas().Find(id)) area->Reset();
      },
      nb::arg("area"), "Forgets a spill area's entries (after a step that failed between its pushes and pops).");
  m.def(
      "spill_stats",
      [](int64_t id) {
        auto area = Areas().Find(id);
        if (!area) throw std::runtime_error("spill area " + std::to_string(id) + " is closed");
        SpillStats s = area->Stats();
        nb::dict d;
        d["saves"] = s.saves;
        d["loads"] = s.loads;
        d["bytes_written"] = s.bytes_written;
        d["bytes_read"] = s.bytes_read;
        d["array_bytes"] = s.array_bytes;
        d["arrays_sparse"] = s.arrays_sparse;
        d["read_ahead_hints"] = s.read_ahead_hints;
        return d;
      },
      nb::arg("area"), "Counters of a spill area: saves, loads, bytes_written, bytes_read, array_bytes, arrays_sparse, read_ahead_hints.");
}

}  // namespace nsp::spill
