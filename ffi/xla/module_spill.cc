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
      [](const std::string& dir, int read_ahead, int write_behind, int64_t image_limit, const std::string& io) {
        if (image_limit < 0) throw std::runtime_error("image_limit must be >= 0");
        SpillOptions options{read_ahead, write_behind, static_cast<size_t>(image_limit), IoMode::kAuto};
        if (io == "direct") {
          options.io = IoMode::kDirect;
        } else if (io == "buffered") {
          options.io = IoMode::kBuffered;
        } else if (io != "auto") {
          throw std::runtime_error("io must be auto, direct or buffered, got " + io);
        }
        auto [area, err] = SpillArea::Open(dir, options);
        if (!area) throw std::runtime_error(err);
        return Areas().Register(std::move(area));
      },
      nb::arg("dir"), nb::arg("read_ahead"), nb::arg("write_behind"), nb::arg("image_limit"),
      nb::arg("io"),
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
        d["disk_bytes_written"] = s.disk_bytes_written;
        d["disk_bytes_read"] = s.disk_bytes_read;
        d["read_ahead"] = s.read_ahead;
        d["loads_from_memory"] = s.loads_from_memory;
        d["save_waits"] = s.save_waits;
        d["direct_io"] = s.direct_io;
        return d;
      },
      nb::arg("area"), "Counters of a spill area (spill_area.h's SpillStats).");
}

}  // namespace nsp::spill
