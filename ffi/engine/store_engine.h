// The near-storage update engine for one shard of a state store.
//
// An update reads version slot `src`, runs the fused kernel page by page, and writes slot `dst` (the caller
// commits dst only after Sync). For page-addressable backends (host memory) the whole shard is one kernel pass
// with no copies. Otherwise pages stream through a fixed set of preallocated buffers: a reader thread loads
// page i+1 while the calling thread computes page i while a writer thread stores page i-1; each page's new
// params are written (and handed to the caller) before any m/v write-back, which the writer defers to when no
// param page is waiting (the Smart-Infinity transfer handler). Peak extra memory is
// pages_in_flight x states x page size, whatever the model size.
//
// Defined by concern: versions, commits and whole-state transfers in store_engine.cc; one update (checks, the
// in-place paths, traffic counts) in store_engine_update.cc; the streamed page pipeline in
// store_engine_stream.cc; the staleness-1 background step in store_engine_async.cc.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "engine/gradient_stage.h"
#include "engine/redo_journal.h"
#include "engine/shard_pieces.h"
#include "kernels/update_kernel.h"

namespace nsp {

// Bytes moved by updates, accumulated. "Shared" is the link between the host/accelerator and the store
// (gradients in, params out); "internal" is between the store's storage and its compute (pages).
struct TrafficStats {
  int64_t shared_in_bytes = 0;
  int64_t shared_out_bytes = 0;
  int64_t internal_read_bytes = 0;
  int64_t internal_write_bytes = 0;
  int64_t pages_read = 0;
  int64_t pages_written = 0;
  int64_t pages_read_direct = 0;  // of pages_read, those the backend read with direct I/O
  int64_t updates = 0;
  int64_t update_ns = 0;  // wall time inside Step (update + sync + commit)
  int64_t sync_ns = 0;    // of update_ns, making the new version's pages durable (the backend's Sync)
  int64_t commit_ns = 0;  // of update_ns, recording the new version (the manifest, written and synced)
  int64_t skipped = 0;    // steps skipped because the gradient was not finite
  int64_t wait_ns = 0;    // wall time a staleness-1 call held its caller (the part of the update not hidden)
  int64_t params_adopted = 0;  // steps that started from the caller's params instead of the committed ones
};

// Where the running update is, for a progress display polled from another thread while the update runs (an
// update of a big shard takes minutes). Plain values, read from the engine's atomics (ShardEngine::Progress).
struct UpdateProgress {
  int64_t pages_done = 0;   // pages updated (read, computed, handed to be written) in the current or last update
  int64_t pages_total = 0;  // pages of that update (the shard's page count)
  int64_t elapsed_ns = 0;   // since that update began (to its end, once it ended)
  bool running = false;     // an update is under way (Step, synchronous or in the background)
  int64_t updates_begun = 0;  // updates begun since the engine opened: tells one update's progress from the next
};

struct ShardUpdate {
  UpdateHyperParams hp;
  int src_slot = 0;
  int dst_slot = 1;
  // Dense gradient of `size` elements ...
  const void* grad = nullptr;
  GradType grad_type = GradType::kF32;
  // ... or compressed: sorted shard positions and their values (grad_type gives the value type).
  const int32_t* indices = nullptr;
  const void* values = nullptr;
  int64_t count = 0;
  // Where the new params go (either may be null).
  float* params_out = nullptr;
  uint16_t* params_bf16_out = nullptr;
  // Or, instead of `grad` and the outputs above: the gradient in, and the new params out, as pieces.
  const ShardPieces* pieces = nullptr;
  // The params to step from instead of the committed version's (null: the committed ones). The store's m and v
  // are kept; only the params are the caller's. Not with staleness 1.
  const ParamsIn* params_in = nullptr;
  // A dense gradient (or pieces) on a store that ChecksFiniteInPass(), stepping from its committed version and
  // its own params: check the gradient for NaN/Inf inside the update's own pass (no pass of its own before the
  // update, with the disk idle). When it is not finite, Step skips the step (the outputs get the committed
  // params back, nothing is committed) and sets *skipped.
  bool check_finite = false;
  bool* skipped = nullptr;
  // The pages the update covers: [first_page, end_page), end_page -1 for the shard's end. Only a one-slot step
  // (which goes a window at a time) sets them; only the streamed pipeline takes part of a shard.
  int64_t first_page = 0;
  int64_t end_page = -1;
};

// What the caller of a versioned step knows of its gradient's finiteness.
enum class GradCheck {
  kFinite,     // it is finite (or not to be checked): step
  kNotFinite,  // it holds NaN/Inf: skip the step
  kCheck,      // unknown: the engine checks it (inside the update's own pass where the store allows, else first)
};

// A versioned step as every caller hands it to the engine (ShardEngine::RunStep): the version it reads, what is
// known of its gradient, and its staleness (1: it finishes in the background).
struct StepCall {
  int64_t version = 0;
  GradCheck grad_check = GradCheck::kFinite;
  int staleness = 0;
};

// What a step left: the version the store holds after it (with staleness 1, the one its background step will
// commit: what the caller reads next), and whether it was skipped for a gradient that was not finite (the store
// then stays at the version read and the outputs hold that version's params).
struct StepOutcome {
  int64_t version = 0;
  bool skipped = false;
};

class ShardEngine {
 public:
  ShardEngine(std::unique_ptr<Backend> backend, int64_t size, int64_t page_elems, int pages_in_flight,
              std::array<bool, kNumStates> states_used);
  ~ShardEngine();
  ShardEngine(const ShardEngine&) = delete;
  ShardEngine& operator=(const ShardEngine&) = delete;

  // Runs one update; returns "" or an error (then slot dst is garbage and must not be committed).
  std::string Update(const ShardUpdate& update);

  // The one door of a versioned step, for the XLA FFI handlers and the module's eager methods alike: decides
  // between skip, step and background step from what `call` says of the gradient (with GradCheck::kCheck it checks
  // the gradient itself: inside the update's own pass when the step is synchronous, from the committed version,
  // from the store's own params, on a store that ChecksFiniteInPass(); otherwise in one multithreaded pass before
  // the update), then runs it (Skip, Step or StepAsync, which check the version). `update`'s slots, check_finite
  // and skipped are the engine's to set. Returns "" or an error; *outcome is set on success.
  std::string RunStep(ShardUpdate update, const StepCall& call, StepOutcome* outcome);

  // One versioned step: reads `version` (the committed one, or the one before it: a replay), writes
  // version + 1 into the other slot, syncs it, and commits it. The slots in `update` are ignored. Safe to call
  // from several threads (steps on one shard are serialised).
  std::string Step(ShardUpdate update, int64_t version);
  // The committed version of this shard; whether the slot beside it still holds the version before (a replay
  // of the last step needs it: true only after a step this engine completed, until the next one starts, so a
  // failed or killed update, or a reopen, never replays from a half-written slot); and committing (atomic
  // manifest rename when the shard has a manifest path; memory-only otherwise).
  int64_t version() const { return version_; }
  bool previous_valid() const { return previous_valid_; }
  // The version before the committed one may no longer be replayed (the store restarted from new params: a state
  // that still names the old version must fail, not overwrite the new one).
  void ForgetPrevious() { previous_valid_ = false; }
  std::string Commit(int64_t version);

  // A step whose gradient is not finite (NaN/Inf: an overflowed loss scale, a diverged batch) is skipped: the
  // store stays at `version`, untouched, and the caller gets that version's params back.
  std::string Skip(const ShardUpdate& update, int64_t version);
  // One slot (the file tier's, slots=1 stores): the shard keeps one copy of its state, and every step goes
  // through the redo journal (redo_journal.h): gradient and hyperparameters made durable first, then a window of
  // `window_pages` pages at a time written beside the old ones, recorded, and renamed in. `group`: the store's
  // shards this process steps together (JournalBarrier); call after SetManifest. No replay, no in-pass check.
  void SetOneSlot(int group, int64_t window_pages);
  bool one_slot() const { return one_slot_; }
  // Finishes, from the shard's redo journal, the update a kill (or a failed write) interrupted: renames in the
  // pages its records name, recomputes the others from the version the journal read, commits the next version
  // and removes the journal. Without a journal it only removes scratch files. Returns "" or an error; the
  // committed version is version() after it.
  std::string Recover();
  // The redo journal the shard holds, its header and records read back (not its gradient: Recover checks that):
  // *version the version its update started from (-1: none) and *records the windows it recorded (each was
  // switched in, or may have been). Opening a store asks every shard before any recovers: a journal without
  // records may have to be dropped (DropJournal) rather than redone, when another shard of the store holds none
  // (a kill came before every shard's journal was durable).
  std::string JournalState(int64_t* version, int64_t* records);
  // Removes the shard's redo journal and what lies beside its pages: its update is not taken, the shard stays at
  // its committed version. Only for a journal that recorded no window (nothing of it was switched in).
  std::string DropJournal();
  // Whether the shard holds a redo journal's unfinished update (a failed one-slot step in this process): every
  // step is refused until a reopen recovers it.
  bool needs_recovery() const { return needs_recovery_; }
  // Whether a step can check its gradient inside the update pass (ShardUpdate::check_finite): the update writes
  // the other slot (in RAM, or the other slot's page files), so a half-done update of a non-finite gradient
  // leaves the committed version whole and is simply not committed, as a failed update is. After such a skip
  // the version before the committed one is gone (its slot was partly overwritten), so it cannot be replayed.
  bool ChecksFiniteInPass() const { return backend_->KeepsPrevious(); }

  // Bounded staleness 1 (Angel-PTM's lock-free updating): finishes the step in the background and returns at
  // once. Waits for the previous background step, hands the caller that step's new params (so the caller's
  // next forward/backward runs on params one step old while this step streams), copies the gradient, and
  // starts Step(update, version) on a worker thread. An error of a background step is returned by the next
  // StepAsync or Wait. Costs one params copy and one gradient copy of this shard in host memory.
  std::string StepAsync(const ShardUpdate& update, int64_t version);
  // Waits for the background step, if any; returns its error.
  std::string Wait();
  bool pending() const { return pending_.joinable(); }

  // Where commits go (SHARD/MANIFEST.json; empty: memory only), the committed version, and the identity every
  // manifest names: the store's id and this shard's index. A manifest also records each page's checksum in
  // both slots (Backend::PageChecksums), so a read can tell a page written for its place from any other.
  void SetManifest(std::string path, int64_t version, std::string store_id, int64_t shard) {
    manifest_ = std::move(path);
    version_ = version;
    previous_valid_ = false;
    store_id_ = std::move(store_id);
    shard_index_ = shard;
  }
  // The shard's gradient stage (gradient_stage.h), the file STAGE_FILE beside its manifest, opened on first use;
  // "" or an error (a shard without a directory: the memory tier).
  static constexpr const char* kStageFile = "gradient.stage";
  std::string Stage(GradientStage** out);
  // Makes slot `slot` durable.
  std::string Sync(int slot) { return backend_->Sync(slot); }

  // Reads every page of `state` in `slot` (the backend checks each page's checksum) through one page buffer;
  // returns one message per unreadable or corrupt page (empty: all good).
  std::vector<std::string> Verify(int slot, int state);

  // Whole-state transfers (initialisation, export): `n` = size elements.
  std::string ReadState(int slot, int state, float* out);
  // Reads `n` elements of a state from the start of page `first_page` (whole pages, the shard's last one short).
  std::string ReadPages(int slot, int state, int64_t first_page, float* out, int64_t n);
  std::string WriteState(int slot, int state, const float* in);
  // Writes `n` elements of `state` starting at page `first_page` (whole pages, or through the shard's end), so
  // a state can be written a page at a time without a whole-shard array.
  std::string WritePages(int slot, int state, int64_t first_page, const float* in, int64_t n);

  int64_t size() const { return size_; }
  int64_t page_elems() const { return page_elems_; }
  int64_t num_pages() const { return num_pages_; }
  int pages_in_flight() const { return pages_in_flight_; }
  // Bytes of the preallocated pipeline buffers (0 for page-addressable backends, which need none).
  int64_t buffer_bytes() const;
  const TrafficStats& stats() const { return stats_; }
  void ResetStats() { stats_ = TrafficStats{}; }
  Backend& backend() { return *backend_; }
  // Safe to call from any thread at any time, also while an update runs.
  UpdateProgress Progress() const;

 private:
  bool Addressable() const;
  std::string UpdateAddressable(const ShardUpdate& u);
  // UpdateAddressable for a step from the caller's params: page by page, each page's params gathered first.
  std::string UpdateAddressableFromCaller(const ShardUpdate& u);
  // Elements [begin, begin + n) of every used state, read from slot src and written to slot dst, in place
  // (page-addressable backends).
  StateSpan SlotSpan(const ShardUpdate& u, int64_t begin, int64_t n) const;
  std::string UpdateStreamed(const ShardUpdate& u);
  // A one-slot step (SetOneSlot): the journal, the barrier, then ApplyWindows from page 0.
  std::string StepOneSlot(ShardUpdate u, int64_t version);
  // Writes the update's journal (its gradient as given, its hyperparameters) for `version`; "" or an error.
  std::string WriteJournal(const ShardUpdate& u, int64_t version);
  // WriteJournal for a gradient staged in the shard's stage file: the file made durable, each page's checksum.
  std::string WriteStagedJournal(const ShardUpdate& u, int64_t version);
  // The CRC-32C of page `page`'s staged gradient bytes (0 for a page of padding only); "" or an error.
  std::string StagedPageCrc(const ShardPieces& pieces, int64_t page, uint32_t* crc);
  // The pieces recovery redoes a staged update from: the stage file, checked against the journal's checksum of
  // every page from `from_page` on; "" or an error naming what is damaged.
  std::string StagedForRecovery(const RedoJournal& journal, int64_t from_page, ShardPieces* out);
  // The windows of a one-slot update from page `start` on (the ones before it are in place), then the commit of
  // version + 1 and the journal's removal. A failure leaves needs_recovery_ set.
  std::string ApplyWindows(ShardUpdate u, int64_t version, int64_t start);
  std::string ShardDir() const { return manifest_.substr(0, manifest_.find_last_of('/')); }
  // Writes the params of committed version `version` into the update's outputs (a skipped step's result).
  std::string CommittedParamsOut(const ShardUpdate& u, int64_t version);
  // This page's gradient into *g (from the caller's memory, the pieces, or their stage file); "" or an error.
  std::string GradForPage(const ShardUpdate& u, int64_t page, PageGrad* g);
  // Runs the kernel on `span`. With u.check_finite it checks the (dense) gradient in the same pass and returns
  // false at the first NaN/Inf, the span's outputs then partly written; true otherwise.
  bool ComputeChecked(const ShardUpdate& u, const StateSpan& span, const PageGrad& g);
  char* GradStage();
  // One page of the caller's params (ShardUpdate::params_in), elements [begin, begin + n), as fp32.
  const float* CallerParams(const ShardUpdate& u, int64_t begin, int64_t n);
  void CountShared(const ShardUpdate& u, const PageGrad& g, int64_t elems, const StateSpan& span);
  // `param_read`: false when the step took the params from the caller (only m and v were read in place).
  void CountInPlace(int64_t elems, bool param_read);
  // How many states `states` marks (those the kind keeps, or those an update reads).
  static int CountStates(const std::array<bool, kNumStates>& states);

  std::unique_ptr<Backend> backend_;
  std::mutex step_mu_;
  // Background step (StepAsync): its thread, its error, and the buffers it reads and fills.
  std::thread pending_;
  std::string pending_error_;
  std::vector<float> async_params_;  // params of the newest version (valid when async_params_valid_)
  bool async_params_valid_ = false;
  std::vector<char> async_grad_;     // the gradient (dense) or compressed values the background step reads
  std::vector<int32_t> async_indices_;
  std::string manifest_;  // SHARD/MANIFEST.json, or empty (memory tier)
  std::mutex stage_mu_;
  std::unique_ptr<GradientStage> stage_;  // opened by the first Stage()
  std::string store_id_;
  int64_t shard_index_ = 0;
  std::string ManifestText(int64_t version) const;
  int64_t version_ = 0;
  bool previous_valid_ = false;
  bool one_slot_ = false;
  bool needs_recovery_ = false;
  int64_t window_pages_ = 16;
  std::shared_ptr<JournalBarrier> barrier_;  // null: the shard steps alone
  int64_t size_, page_elems_, num_pages_;
  int pages_in_flight_;
  std::array<bool, kNumStates> used_;
  // A page buffer: 4 KiB aligned (direct I/O), sized by the backend (page + checksum + padding). Host memory, or,
  // when `owner` is set, the backend's own (Backend::AllocPageBuffer: near the state), given back to it.
  struct AlignedBuffer {
    float* data = nullptr;
    size_t bytes = 0;
    Backend* owner = nullptr;
    AlignedBuffer() = default;
    explicit AlignedBuffer(size_t n);
    AlignedBuffer(Backend* backend, size_t n);
    AlignedBuffer(AlignedBuffer&& o) noexcept : data(o.data), bytes(o.bytes), owner(o.owner) { o.data = nullptr; }
    AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
      std::swap(data, o.data);
      std::swap(bytes, o.bytes);
      std::swap(owner, o.owner);
      return *this;
    }
    ~AlignedBuffer();
  };
  // A page buffer the engine hands to the backend's page I/O and kernel: allocated by the backend (declared
  // after backend_, every such buffer is freed before the backend goes).
  AlignedBuffer PageBuffer(size_t bytes) { return AlignedBuffer(backend_.get(), bytes); }
  // buffers_[set][state]: page buffers, allocated once (lazily, on the first streamed update).
  std::vector<std::array<AlignedBuffer, kNumStates>> buffers_;
  // One page of gradient gathered from pieces (allocated on the first update given pieces).
  AlignedBuffer grad_stage_;
  // One page of the caller's params (allocated on the first update that starts from them).
  AlignedBuffer params_stage_;
  // A one-slot window's new params, held until the window is recorded (a staged gradient's update).
  AlignedBuffer window_params_;
  TrafficStats stats_;
  // The running update's progress (Progress()): written by the update's thread, read by anyone.
  class ProgressScope;
  void PageDone(int64_t pages = 1) { progress_done_.fetch_add(pages, std::memory_order_relaxed); }
  std::atomic<int64_t> progress_done_{0}, progress_total_{0}, progress_start_ns_{0}, progress_end_ns_{0};
  std::atomic<int64_t> progress_begun_{0};
  std::atomic<bool> progress_running_{false};
};

}  // namespace nsp
