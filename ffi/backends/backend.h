// The backend interface: everything the storage engine knows about where a shard's state lives and where its
// update runs. A backend owns the buffers near the state, moves pages between storage and those buffers, and
// runs the update kernel. `cpu` backends (memory, file) are real; FPGA (XRT) and AXDIMM backends plug in here.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/read_mode.h"
#include "kernels/update_kernel.h"

namespace nsp {

// The optimizer states of one shard, in a fixed order.
enum StateId : int { kParamState = 0, kMuState = 1, kNuState = 2, kNumStates = 3 };
const char* StateName(int state);
// "" when `slot` names one of the two version slots and `state` one of p, m, v; else "<what>: slot must be ...".
std::string CheckSlotAndState(const char* what, int slot, int state);

// Host memory of `bytes`, zero-filled (so faulted in now, not during an update) and 4 KiB aligned; from a huge
// page up, on transparent huge pages where the kernel grants them (see backend.cc). Throws std::bad_alloc.
// Freed with FreeHostBuffer and the same `bytes`.
void* AllocHostBuffer(size_t bytes);
void FreeHostBuffer(void* buffer, size_t bytes);

// A shard's gradient for one page: dense (n elements of `type`) or a run of sorted compressed pairs whose
// indices are shard positions (the page starts at `index_base`).
struct PageGrad {
  const void* dense = nullptr;
  GradType type = GradType::kF32;
  const int32_t* indices = nullptr;
  const void* values = nullptr;
  int64_t count = 0;
  int64_t index_base = 0;
};

// Bytes and pages a backend's storage I/O moved, summed from each call's return value.
struct IoCounts {
  int64_t read_bytes = 0;
  int64_t write_bytes = 0;
  int64_t pages_read = 0;
  int64_t pages_written = 0;
  int64_t pages_read_direct = 0;  // of pages_read, those read with direct I/O (the rest went through the cache)
};

struct AtomicIoCounts {
  std::atomic<int64_t> read_bytes{0}, write_bytes{0}, pages_read{0}, pages_written{0}, pages_read_direct{0};
  IoCounts Get() const {
    return {read_bytes.load(), write_bytes.load(), pages_read.load(), pages_written.load(), pages_read_direct.load()};
  }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // Address of a page when the state is directly addressable (host memory): the engine then updates it with
  // no copies. Null when pages must be read into and written from buffers.
  virtual float* PageAddress(int /*slot*/, int /*state*/, int64_t /*page*/) { return nullptr; }

  // Bytes a page buffer the engine hands to ReadPage/WritePage with `scratch` set holds: room for the page plus
  // whatever the backend adds on the way (a checksum trailer, alignment padding).
  virtual size_t PageBufferBytes(int64_t page_elems) const { return static_cast<size_t>(page_elems) * 4; }

  // Reads `n` elements of page `page` of `state` in version slot `slot` into `dst`. Returns "" or an error.
  // `scratch`: dst is an engine page buffer (PageBufferBytes, 4 KiB aligned) the backend may fill beyond n
  // (direct I/O); otherwise exactly n elements are written to dst.
  virtual std::string ReadPage(int slot, int state, int64_t page, float* dst, int64_t n, bool scratch) = 0;
  // Writes page `page` of the uncommitted slot `slot`. A page another link shares (a snapshot's) is replaced,
  // never overwritten in place. Returns "" or an error.
  // `scratch`: src is an engine page buffer whose tail beyond n the backend may overwrite.
  virtual std::string WritePage(int slot, int state, int64_t page, float* src, int64_t n, bool scratch) = 0;
  // Makes everything written to `slot` durable. Returns "" or an error.
  virtual std::string Sync(int slot) = 0;
  // The checksum each page of `state` in `slot` holds, as written there or as set below; empty unless every
  // page's is known (the memory tier keeps none). The engine records them in the shard's manifest at commit.
  virtual std::vector<uint32_t> PageChecksums(int /*slot*/, int /*state*/) const { return {}; }
  // Sets them from a committed manifest: from then on a read checks that each page holds what was written for
  // its place, so a valid page of another slot, page, shard or store is reported as damage. Returns "" or an
  // error (wrong count).
  virtual std::string SetPageChecksums(int /*slot*/, int /*state*/, const std::vector<uint32_t>& /*crcs*/) {
    return {};
  }
  // What the backend's storage I/O has moved so far (null counts for page-addressable state, which the
  // engine counts as the kernel passes over it).
  virtual IoCounts Io() const { return {}; }
  // Called around each streamed update (ReadPage/WritePage page by page), from the updating thread: a backend
  // may tune its I/O by what it measures in between (`ok` false: the update failed, not a fair measurement).
  virtual void StreamStarted() {}
  virtual void StreamFinished(bool /*ok*/) {}
  // Called right before the engine writes pages [first, end) of the states `used` marks in `slot` (an update's
  // destination slot, or a slot being initialised), all of which it then writes whole: a backend may lay out their
  // storage the way updates read it. Returns "" or an error naming the problem.
  virtual std::string PrepareSlot(int /*slot*/, const bool* /*used*/, int64_t /*first*/, int64_t /*end*/) {
    return {};
  }
  // Whether writing one slot leaves the other's version whole (false when both slots are one memory: an
  // in-place store, which cannot replay a step).
  virtual bool KeepsPrevious() const { return true; }
  // One-slot stores (the file tier's with slots=1; ffi/engine/redo_journal.h): slot 1 is not a second copy of the
  // state but scratch beside slot 0's pages (a page file "<page>.next" beside "<page>"), written by an update a
  // window of pages at a time. The checksums of the scratch pages [first, end) of the states `used` marks, state
  // by state (as a journal record holds them); "" or an error.
  virtual std::string ScratchChecksums(int64_t /*first*/, int64_t /*end*/, const bool* /*used*/,
                                       std::vector<uint32_t>* /*out*/) {
    return "this backend keeps no one-slot store";
  }
  // Switches the scratch pages [first, end) in over slot 0's, each by an atomic rename (a snapshot's hard link to
  // an old page keeps the old bytes), and records their checksums as slot 0's (`crcs`, as ScratchChecksums gives
  // them). `recovering`: a scratch page that is absent was switched in before a kill (not an error). The renames
  // are durable after the next Sync(0).
  virtual std::string SwitchPages(int64_t /*first*/, int64_t /*end*/, const bool* /*used*/, const uint32_t* /*crcs*/,
                                  bool /*recovering*/) {
    return "this backend keeps no one-slot store";
  }
  // Removes every scratch page (what a failed or killed update left that no journal record names).
  virtual std::string DiscardScratch() { return {}; }
  // Called by the engine as it commits `version`, before it writes anything of the shard's manifest (only for a
  // shard that has one): the last moment the version before is still the committed one. Real backends have
  // nothing to do here; the fault-injecting one may kill the process, as a crash at that moment would.
  virtual void BeforeCommit(int64_t /*version*/) {}

  // A page buffer of `bytes` (PageBufferBytes), zero-filled and 4 KiB aligned (direct I/O), allocated near the
  // state: the engine's streamed pages live in these. The default is host memory. Throws std::bad_alloc (or a
  // std::runtime_error naming the problem) when it cannot.
  virtual void* AllocPageBuffer(size_t bytes);
  virtual void FreePageBuffer(void* buffer, size_t bytes);
  // Named figures the backend reports about itself (a plugin's stats: the csd device's model clock); none for
  // the built-in backends. Returns "" or an error.
  virtual std::string Stats(std::vector<std::pair<std::string, double>>* /*out*/) const { return {}; }

  // Runs the update kernel on one page, near the state. The default runs the host CPU kernel.
  virtual void Compute(const UpdateHyperParams& hp, const StateSpan& span, const PageGrad& grad);
  // Compute for a dense gradient that stops, returning false, at the first NaN/Inf it meets (the span's
  // outputs are then partly written). The default runs the host CPU kernel with its in-pass check.
  virtual bool ComputeIfFinite(const UpdateHyperParams& hp, const StateSpan& span, const void* grad, GradType type);
};

// Host-memory tier: two version slots of every state in RAM; with `in_place`, one memory that both slots
// name, so an update runs in place (half the RAM, no read-for-ownership of a second copy, no replay).
std::unique_ptr<Backend> MakeMemoryBackend(int64_t size, int64_t page_elems, std::vector<bool> states_used,
                                           bool in_place);

// How the file tier moves its pages, as the environment asks (read where a backend is made, never in an update).
struct FileIoSettings {
  bool direct_io = true;                 // NSP_NO_DIRECT_IO unset: direct I/O where the file system takes it
  ReadMode read_mode = ReadMode::kAuto;  // NSP_READ_MODE (read_mode.h)
  bool direct_writes = true;             // NSP_BUFFERED_WRITES unset: page writes from engine buffers go direct
  bool rewrite_in_place = true;          // NSP_REPLACE_PAGES unset: a page nothing else shares is rewritten in place
  bool lay_out_slots = true;             // NSP_NO_SLOT_LAYOUT unset: a slot's page files are made in read order
  bool one_slot = false;                 // the store keeps one slot (set by the store, not the environment)
};
// Returns "" or an error naming a variable whose value is not one it takes.
std::string FileIoSettingsFromEnv(FileIoSettings* settings);

// File tier: each page is a zarr v3 chunk file <root>/slot<k>/<state>/c/<page> (raw little-endian fp32, plus a
// CRC-32C trailer when `checksum`), exactly as tensorstore reads and writes it. A missing page is an error.
std::unique_ptr<Backend> MakeFileBackend(std::string root, int64_t size, int64_t page_elems, bool checksum,
                                         const FileIoSettings& io);

// Faults for tests and the fault campaign (bench/fault_campaign.py) to put a store through; -1 is off.
struct FaultPlan {
  int64_t fail_writes_after = -1;  // page writes after the first N fail with ENOSPC, as on a full disk
  int64_t kill_after_writes = -1;  // SIGKILL at the page write after the first N: a crash mid-update
  // SIGKILL just before the Nth commit of the process (counted over every backend that has this set), and
  // before each later one: a crash between a version's last page write and its manifest.
  int64_t kill_at_commit = -1;
  // SIGKILL just before the Nth page switch of the process (a one-slot window whose journal record is durable,
  // none of its pages renamed in yet), and before each later one.
  int64_t kill_at_switch = -1;
  bool any() const {
    return fail_writes_after >= 0 || kill_after_writes >= 0 || kill_at_commit >= 0 || kill_at_switch >= 0;
  }
};

// The plan the environment asks for, read where a backend is made (never in an update): NSP_DEBUG_FAIL_WRITES_AFTER,
// NSP_DEBUG_KILL_AFTER_WRITES and NSP_DEBUG_KILL_AT_COMMIT, each N as above. Tests and the campaign run real
// processes, so variables are how they reach an engine; nothing is injected when none is set.
FaultPlan FaultPlanFromEnv();

// `inner` with `plan`'s faults injected: every call goes to `inner`, the plan's page writes fail or kill the
// process instead, and the plan's commit kills it. Counts are the wrapper's own (page writes) or the process's
// (commits), as a crash at "the Nth page write of a shard" or "the Nth commit" would be.
std::unique_ptr<Backend> MakeFaultInjectingBackend(std::unique_ptr<Backend> inner, FaultPlan plan);

}  // namespace nsp
