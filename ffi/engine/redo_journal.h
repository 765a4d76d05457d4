// The redo journal of a one-slot shard (ShardEngine::SetOneSlot): what lets a store that keeps one copy of its
// state on disk still leave version t or t+1 whole after a kill at any point of an update.
//
// Before any page of the shard changes, the step's gradient (dense, or the compressed pairs as given) and its
// hyperparameters are written to SHARD/redo.journal (to a temporary file, fsynced, renamed, the directory
// fsynced: the journal exists whole or not at all). The update then goes a window of pages at a time: each
// page's new p, m and v are written beside the old ones (page files "<page>.next"), made durable, and only then
// recorded in the journal (a record per window, with the new pages' checksums, appended and fsynced) and renamed
// over the old files. Recovery (ShardEngine::Recover) renames in every recorded page still beside its old one,
// and recomputes every page no record names from its old state, which is still on disk, with the journal's
// gradient: the update's kernel, the same inputs, the same bits. A kill before the journal exists leaves version
// t untouched; after it, recovery finishes version t+1.
//
// A gradient staged on the shard's disk (gradient_stage.h) is not copied into the journal: the stage file is made
// durable and the journal holds each page's checksum of it instead, so that a one-slot store's staged step costs
// no more disk than the stage file already takes. The new params the update writes over that file are held back
// until their window is recorded: a page's gradient stays in the stage file until its new state is in place.
//
// The format (native byte order; the shard is read back on the machine that wrote it):
//   header (JournalHeader), payload (dense: size gradient elements; compressed: count int32 indices, then count
//   values; staged: a CRC-32C of each page's staged gradient bytes), CRC-32C of header and payload; then records,
//   each {kRecordMagic, first, end, the new checksum of each page of [first, end) for each used state in state
//   order, CRC-32C of the record}. A torn last record (a kill while it was appended) fails its CRC and is
//   ignored: its pages were not renamed in yet.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/update_kernel.h"

namespace nsp {

constexpr const char* kJournalFile = "redo.journal";

// What a journal's payload holds (JournalHeader::compressed).
enum class JournalPayload : int32_t { kDense = 0, kCompressed = 1, kStaged = 2 };

// Why the header holds the hyperparameters' raw bytes: they are the kernel's input, and redo must hand the kernel
// exactly what the interrupted update had.
struct JournalHeader {
  char magic[8];
  int64_t version;  // the version the update read (it writes version + 1)
  int64_t size;
  int64_t page_elems;
  int32_t compressed;  // JournalPayload: dense gradient, sorted indices and their values, or staged
  int32_t grad_type;   // GradType
  int64_t count;       // compressed pairs; staged: the elements the stage file holds (the rest are padding)
  float stage_scale;   // staged: the factor the gradient is multiplied by as it is read (ShardPieces::scale)
  int32_t reserved;
  int64_t hp_bytes;    // sizeof(UpdateHyperParams), so another build's journal is refused, not misread
  UpdateHyperParams hp;
};

// One window's record: pages [first, end) are durable beside their old files with these checksums
// (crcs[state_index * (end - first) + page - first], used states only).
struct JournalRecord {
  int64_t first = 0;
  int64_t end = 0;
  std::vector<uint32_t> crcs;
};

// A journal read back (Read): its header, the gradient it holds (pointers into the mapped file), and the complete
// records. The mapping lives as long as this object.
class RedoJournal {
 public:
  ~RedoJournal();
  RedoJournal(const RedoJournal&) = delete;
  RedoJournal& operator=(const RedoJournal&) = delete;

  // The gradient of one page, written into `out` (page_elems elements of the gradient's type, the last page
  // short): `fill(page, out)` returns "" or an error. Write calls it for every page of a dense gradient.
  using PageFill = std::function<std::string(int64_t page, char* out)>;
  // Writes the journal of the update of `version` in `dir` (dense: `fill` per page; compressed: `indices` and
  // `values` of `count` pairs), durable before it returns. Returns "" or an error (then no journal exists).
  static std::string Write(const std::string& dir, int64_t version, int64_t size, int64_t page_elems,
                           const UpdateHyperParams& hp, GradType type, const PageFill& fill,
                           const int32_t* indices, const void* values, int64_t count);
  // Writes the journal of an update whose gradient is staged (`staged` elements in the shard's stage file, read
  // times `scale`): `page_crcs` holds each page's CRC-32C of its staged bytes. The stage file must already be
  // durable. Durable before it returns; "" or an error (then no journal exists).
  static std::string WriteStaged(const std::string& dir, int64_t version, int64_t size, int64_t page_elems,
                                 const UpdateHyperParams& hp, GradType type, int64_t staged, float scale,
                                 const std::vector<uint32_t>& page_crcs);
  // Appends `record` to the journal in `dir` and makes it durable. `states`: used states. Returns "" or an error.
  static std::string Append(const std::string& dir, const JournalRecord& record, int states);
  // Reads the journal in `dir`: *out null when there is none (a temporary left by a kill while it was written is
  // removed); "" or an error naming what is wrong with it. `check_gradient` false leaves the gradient's checksum
  // unchecked (its whole size read): for a look at the header and records only, not for a redo.
  static std::string Read(const std::string& dir, int states, std::unique_ptr<RedoJournal>* out,
                          bool check_gradient = true);
  // Removes the journal in `dir` (after the commit of the version it produced); "" or an error.
  static std::string Remove(const std::string& dir);

  const JournalHeader& header() const { return *header_; }
  GradType grad_type() const { return static_cast<GradType>(header_->grad_type); }
  JournalPayload payload() const { return static_cast<JournalPayload>(header_->compressed); }
  const void* dense() const { return payload() == JournalPayload::kDense ? payload_ : nullptr; }
  const int32_t* indices() const {
    return payload() == JournalPayload::kCompressed ? reinterpret_cast<const int32_t*>(payload_) : nullptr;
  }
  const void* values() const {
    return payload() == JournalPayload::kCompressed
               ? payload_ + header_->count * static_cast<int64_t>(sizeof(int32_t)) : nullptr;
  }
  // Staged: each page's CRC-32C of its staged gradient bytes (header().count elements in all).
  const uint32_t* staged_page_crcs() const {
    return payload() == JournalPayload::kStaged ? reinterpret_cast<const uint32_t*>(payload_) : nullptr;
  }
  const std::vector<JournalRecord>& records() const { return records_; }

 private:
  RedoJournal() = default;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const JournalHeader* header_ = nullptr;
  const char* payload_ = nullptr;
  std::vector<JournalRecord> records_;
};

// The shards of one store that a process steps together: none of them renames in a page of version t+1 before
// every one has made its journal durable, so that after a kill each shard either already holds t+1 or can redo
// it (a shard that committed t+1 cannot go back to t: it keeps one copy). Each step of the group arrives once,
// saying whether its journal is durable; Wait returns true once all have, false when one could not (nothing was
// changed: each drops its journal) or `timeout_s` passes (steps of the group that did not run side by side).
class JournalBarrier {
 public:
  // The barrier of store `store_id`'s `count` shards in this process (made on first use, shared by its engines).
  static std::shared_ptr<JournalBarrier> For(const std::string& store_id, int count);
  void Arrive(int64_t version, bool ok);
  bool Wait(int64_t version, double timeout_s);

 private:
  explicit JournalBarrier(int count) : count_(count) {}
  struct Round;
  std::shared_ptr<Round> RoundOf(int64_t version);
  int count_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<int64_t, std::shared_ptr<Round>>> rounds_;
};

// Faults for the fault campaign inside the journal's own writes, read from the environment once per process:
// NSP_DEBUG_KILL_IN_JOURNAL=N kills the process halfway through writing its Nth journal (counted over the
// process, from 1), before it is durable or renamed into place.
void MaybeKillInJournal();

}  // namespace nsp
