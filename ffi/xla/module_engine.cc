// The module's ShardEngine class: one shard's engine over its backend, its versioned steps, whole-state and page
// transfers, checks and statistics. Every versioned step (step, step_if_finite, skip) goes through the engine's one
// door, ShardEngine::RunStep, as the XLA FFI handlers' steps do (store_update_ffi.cc): the checks of the version and
// of the gradient's finiteness are the engine's, written once.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/engine_registry.h"
#include "engine/store_engine.h"
#include "kernels/hyper_params.h"
#include "kernels/update_kernel.h"
#include "xla/module_common.h"

namespace nsp::module {
namespace {

void CheckSlotState(const char* what, int slot, int state) {
  if (std::string e = CheckSlotAndState(what, slot, state); !e.empty()) throw nb::value_error(e.c_str());
}

// Whole pages of one state from `first_page` (the last one short at the shard's end), read into `out` or written
// from `in`, without the GIL.
void ReadPages(EngineRef& ref, int slot, int state, int64_t first_page, F32Array out) {
  ShardEngine& e = ref.get();
  CheckWithoutGil([&] { return e.ReadPages(slot, state, first_page, out.data(), static_cast<int64_t>(out.shape(0))); });
}

void WritePages(EngineRef& ref, int slot, int state, int64_t first_page, F32In in) {
  ShardEngine& e = ref.get();
  CheckWithoutGil([&] { return e.WritePages(slot, state, first_page, in.data(), static_cast<int64_t>(in.shape(0))); });
}

// The engine's figures as Python dicts, one key per field.
#define NSP_TRAFFIC_FIELDS(X)                                                                                   \
  X(shared_in_bytes) X(shared_out_bytes) X(internal_read_bytes) X(internal_write_bytes) X(pages_read)          \
  X(pages_written) X(pages_read_direct) X(updates) X(update_ns) X(sync_ns) X(commit_ns) X(skipped) X(wait_ns) \
  X(params_adopted)
#define NSP_PROGRESS_FIELDS(X) X(pages_done) X(pages_total) X(elapsed_ns) X(running) X(updates_begun)
#define NSP_DICT_FIELD(field) d[#field] = from.field;

nb::dict TrafficDict(const TrafficStats& from) {
  nb::dict d;
  NSP_TRAFFIC_FIELDS(NSP_DICT_FIELD)
  return d;
}

nb::dict ProgressDict(const UpdateProgress& from) {
  nb::dict d;
  NSP_PROGRESS_FIELDS(NSP_DICT_FIELD)
  return d;
}

// read_state / write_state: a whole state, moved by `pages` (ReadPages, WritePages) from page 0, the array (named
// `name` in the error) as long as the shard.
template <typename Array>
auto WholeState(const char* name, void (*pages)(EngineRef&, int, int, int64_t, Array)) {
  return [name, pages](EngineRef& ref, int slot, int state, Array a) {
    CheckLength(name, a, ref.get().size());
    pages(ref, slot, state, 0, a);
  };
}

// The hyperparameters of one engine update: lr and step, and the rest from one Python dict with
// hyper_params.h's keys (nsp.spec.hyper_attrs builds it), decoded and validated once. A
// missing, unknown or wrong-typed key raises ValueError naming the key and `op`.
UpdateHyperParams HyperParamsFromDict(const char* op, const nb::dict& hyper, float lr, int64_t step) {
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
  UpdateHyperParams hp;
  hp.lr = lr;
  hp.step = step;
  if (std::string err = nsp::hyper::DecodeHyperParams(read, hp); !err.empty()) fail(err);
  return hp;
}

// Builds one update from Python arguments: a dense gradient (fp32, or bf16 as uint16) or compressed
// (indices, values), and where the new params go.
ShardUpdate MakeUpdate(const ShardEngine& e, const UpdateHyperParams& hp,
                            const std::optional<F32In>& grad, const std::optional<U16In>& grad_bf16,
                            const std::optional<I32In>& indices, const std::optional<F32In>& values,
                            const std::optional<U16In>& values_bf16, std::optional<F32Array>& params_out,
                            std::optional<U16Array>& params_bf16_out) {
  ShardUpdate u;
  u.hp = hp;
  const int64_t n = e.size();
  if (grad) {
    CheckLength("grad", *grad, n);
    u.grad = grad->data();
  } else if (grad_bf16) {
    CheckLength("grad", *grad_bf16, n);
    u.grad = grad_bf16->data();
    u.grad_type = GradType::kBF16;
  } else if (indices && (values || values_bf16)) {
    u.indices = indices->data();
    u.count = static_cast<int64_t>(indices->shape(0));
    if (values) {
      CheckLength("values", *values, u.count);
      u.values = values->data();
    } else {
      CheckLength("values", *values_bf16, u.count);
      u.values = values_bf16->data();
      u.grad_type = GradType::kBF16;
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
// hyper, the gradient and the outputs (MakeUpdate), then `finite` (True: the caller found the gradient finite,
// False: not finite, None: the engine is to check it) and `staleness`. `run(engine, update, check, staleness,
// &skipped, leading...)` runs it without the GIL and returns "" or an error; `op` names the method in
// hyperparameter errors. The method returns whether the step was skipped for a gradient that was not finite.
template <typename... Leading, typename Run>
auto UpdateMethod(const char* op, Run run) {
  return [op, run](EngineRef& ref, Leading... leading, float lr, int64_t step, const nb::dict& hyper,
                   std::optional<F32In> grad, std::optional<U16In> grad_bf16, std::optional<I32In> indices,
                   std::optional<F32In> values, std::optional<U16In> values_bf16,
                   std::optional<F32Array> params_out, std::optional<U16Array> params_bf16_out,
                   std::optional<bool> finite, int staleness) {
    ShardEngine& e = ref.get();
    ShardUpdate u = MakeUpdate(e, HyperParamsFromDict(op, hyper, lr, step), grad, grad_bf16, indices, values,
                               values_bf16, params_out, params_bf16_out);
    const GradCheck check = !finite ? GradCheck::kCheck : *finite ? GradCheck::kFinite : GradCheck::kNotFinite;
    bool skipped = false;
    CheckWithoutGil([&] { return run(e, u, check, staleness, &skipped, leading...); });
    return skipped;
  };
}

// Defines an UpdateMethod on the ShardEngine class: the names of its leading arguments, then those every update
// method takes (the gradient, the outputs, `finite` with its default, and `staleness`, optional, by keyword).
template <typename Method, typename... LeadingNames>
void DefUpdateMethod(nb::class_<EngineRef>& cls, const char* name, Method method, std::optional<bool> finite,
                     const char* doc, LeadingNames... leading) {
  cls.def(name, method, leading..., nb::arg("lr"), nb::arg("step"), nb::arg("hyper"),
          nb::arg("grad").none() = nb::none(), nb::arg("grad_bf16").none() = nb::none(),
          nb::arg("indices").none() = nb::none(), nb::arg("values").none() = nb::none(),
          nb::arg("values_bf16").none() = nb::none(), nb::arg("params_out").none() = nb::none(),
          nb::arg("params_bf16_out").none() = nb::none(), nb::arg("finite").none() = finite,
          nb::arg("staleness") = 0, doc);
}

// A versioned step through the engine's one door.
std::string RunStep(ShardEngine& e, ShardUpdate& u, GradCheck check, int staleness, bool* skipped, int64_t version) {
  StepOutcome outcome;
  std::string err = e.RunStep(u, {version, check, staleness}, &outcome);
  *skipped = outcome.skipped;
  return err;
}

// One update between two slots, outside the versioned steps: the benchmarks' diagnostics.
std::string RunUpdate(ShardEngine& e, ShardUpdate& u, GradCheck check, int staleness, bool*, int src, int dst) {
  if (check != GradCheck::kFinite || staleness != 0) return "ShardEngine.update: finite and staleness are a step's";
  u.src_slot = src;
  u.dst_slot = dst;
  return e.Update(u);
}

}  // namespace

void DefineShardEngine(nb::module_& m) {
  nb::class_<EngineRef> engine(m, "ShardEngine");
  engine
      .def("__init__",
           [](EngineRef* self, const std::string& backend, const std::string& root, int64_t size, int64_t page_elems,
              int pages_in_flight, std::array<bool, kNumStates> used, bool checksum, bool in_place,
              const std::string& backend_options, int64_t shard, int64_t num_shards, int slots) {
             BackendSpec b{backend, in_place, {root, shard, num_shards, size, page_elems,
                                               std::vector<bool>(used.begin(), used.end()), checksum, pages_in_flight,
                                               backend_options}, slots};
             new (self) EngineRef{MakeEngine(b)};
           },
           nb::arg("backend"), nb::arg("root"), nb::arg("size"), nb::arg("page_elems"), nb::arg("pages_in_flight"),
           nb::arg("states_used"), nb::arg("checksum"), nb::arg("in_place") = false, nb::arg("backend_options") = "",
           nb::arg("shard") = 0, nb::arg("num_shards") = 1, nb::arg("slots") = 2,
           "An engine for one shard over `backend`: 'memory' and 'file' are built in; any other name is a backend "
           "library (libnsp_backend_<name>.so, looked for in NSP_BACKEND_PATH, then nsp/backends/), opened for "
           "shard `shard` of `num_shards` with `backend_options` (\"key=value;...\"). RuntimeError "
           "\"backend <name> not available: <why>\" when it cannot be had.")
      .def("sync",
           [](EngineRef& ref, int slot) {
             ShardEngine& e = ref.get();
             CheckWithoutGil([&] { return e.Sync(slot); });
           })
      .def("read_state", WholeState("out", &ReadPages))
      .def("read_pages", &ReadPages,
           "Reads whole pages of a state from `first_page` into `out` (its length: whole pages, or to the end).")
      .def("write_state", WholeState("in", &WritePages))
      .def("write_pages", &WritePages,
           "Writes whole pages of a state starting at `first_page` (initialisation a page at a time).")
      .def("stats", [](EngineRef& ref) { return TrafficDict(ref.get().stats()); })
      .def("progress", [](EngineRef& ref) { return ProgressDict(ref.get().Progress()); },
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
             ShardEngine& e = ref.get();
             CheckWithoutGil([&] { return e.Wait(); });
           },
           "Waits for a background (staleness 1) step; raises its error.")
      .def(
          "skip",
          [](EngineRef& ref, int64_t version, std::optional<F32Array> params_out) {
            ShardEngine& e = ref.get();
            ShardUpdate u;
            if (params_out) {
              CheckLength("params_out", *params_out, e.size());
              u.params_out = params_out->data();
            }
            StepOutcome outcome;
            CheckWithoutGil([&] { return e.RunStep(u, {version, GradCheck::kNotFinite, 0}, &outcome); });
          },
          nb::arg("version"), nb::arg("params_out").none() = nb::none(),
          "Skips a step (non-finite gradient): the store stays at `version`; its params go to params_out.")
      .def_prop_ro("pending", [](EngineRef& ref) { return ref.get().pending(); })
      .def(
          "verify",
          [](EngineRef& ref, int slot, int state) {
            ShardEngine& e = ref.get();
            nb::gil_scoped_release release;
            return e.Verify(slot, state);
          },
          nb::arg("slot"), nb::arg("state"), "Reads every page, checking checksums; returns the problems found.")
      .def_prop_ro("version", [](EngineRef& ref) { return ref.get().version(); })
      .def("set_one_slot", [](EngineRef& ref, int group, int64_t window_pages) {
             ref.get().SetOneSlot(group, window_pages);
           },
           nb::arg("group"), nb::arg("window_pages"),
           "Every step of this one-slot shard goes through its redo journal, `window_pages` pages switched in at a "
           "time; `group`: the store's shards this process steps together. After set_manifest.")
      .def("recover",
           [](EngineRef& ref) {
             ShardEngine& e = ref.get();
             CheckWithoutGil([&] { return e.Recover(); });
             return e.version();
           },
           "Finishes a one-slot update a kill interrupted, from the shard's redo journal; returns the committed "
           "version.")
      .def("journal_state",
           [](EngineRef& ref) {
             ShardEngine& e = ref.get();
             int64_t version = -1, records = 0;
             CheckWithoutGil([&] { return e.JournalState(&version, &records); });
             return nb::make_tuple(version, records);
           },
           "The one-slot shard's redo journal: (the version its update starts from, or -1 for none; the windows "
           "it recorded).")
      .def("drop_journal",
           [](EngineRef& ref) {
             ShardEngine& e = ref.get();
             CheckWithoutGil([&] { return e.DropJournal(); });
           },
           "Removes the shard's redo journal, which recorded no window: its update is not taken.")
      .def_prop_ro("needs_recovery", [](EngineRef& ref) { return ref.get().needs_recovery(); })
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
            ShardEngine& e = ref.get();
            CheckWithoutGil([&] { return e.Commit(version); });
          },
          nb::arg("version"))
      .def("register", [](EngineRef& ref) { return RegisterEngine(ref.engine_or_throw()); },
           "Makes the engine reachable from XLA FFI calls (the registry holds a reference); returns its handle.")
      .def(
          "release",
          [](EngineRef& ref) {
            std::shared_ptr<ShardEngine> last = std::move(ref.engine);
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
  DefUpdateMethod(engine, "update", UpdateMethod<int, int>("ShardEngine.update", RunUpdate), true,
                  "One update from `src_slot` into `dst_slot`, not committed (the benchmarks' diagnostics drive the "
                  "engine so).",
                  nb::arg("src_slot"), nb::arg("dst_slot"));
  DefUpdateMethod(engine, "step", UpdateMethod<int64_t>("ShardEngine.step", RunStep), true,
                  "Reads `version`, writes, syncs and commits version + 1 (a replay of the one before is allowed).\n"
                  "`hyper`: the hyperparameters other than lr and step, one dict (nsp.primitives.hyper_attrs).\n"
                  "`finite`: True, the caller found the gradient finite; False, it is not: the step is skipped (the "
                  "store stays at `version`, the outputs get its params); None, the engine checks it (as "
                  "step_if_finite). `staleness` 1: the step finishes in the background (the outputs get the "
                  "previous step's params). Returns True when the step was skipped. The XLA handlers' steps go "
                  "through the same engine call, with the same checks.",
                  nb::arg("version"));
  DefUpdateMethod(engine, "step_if_finite", UpdateMethod<int64_t>("ShardEngine.step_if_finite", RunStep),
                  std::nullopt,
                  "step with finite=None: the engine checks the gradient for NaN/Inf, inside the update's own pass "
                  "when it steps from the committed `version` with a dense gradient on an engine whose "
                  "checks_finite_in_pass is True (else in one pass before). Returns True when it was not finite: "
                  "the step is skipped, the outputs hold the committed params, nothing is committed, and (after an "
                  "in-pass check) the version before the committed one is gone (its slot was partly overwritten).",
                  nb::arg("version"));
}

}  // namespace nsp::module
