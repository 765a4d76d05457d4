// The engine's one-slot steps (ShardEngine::SetOneSlot): a shard that keeps one copy of its state, whose every
// update goes through the redo journal (redo_journal.h), and the recovery that finishes an update a kill
// interrupted. What a step promises is the two-slot store's: a kill at any point leaves version t or t+1 whole.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "engine/store_engine.h"
#include "util/crc32c.h"
#include "util/elapsed.h"

namespace nsp {
namespace {

// How long a shard's step waits for the other shards of its store to make their journals durable: the steps of
// one store's shards run side by side (one thread per device in a jitted step, the store's pool eagerly), so this
// is only reached when one of them never comes (then nothing has changed, and the step fails saying so).
constexpr double kBarrierTimeoutS = 900.0;

}  // namespace

void ShardEngine::SetOneSlot(int group, int64_t window_pages) {
  one_slot_ = true;
  window_pages_ = std::max<int64_t>(1, window_pages);
  barrier_ = group > 1 ? JournalBarrier::For(store_id_, group) : nullptr;
}

std::string ShardEngine::WriteJournal(const ShardUpdate& u, int64_t version) {
  if (manifest_.empty()) return "a one-slot store needs its shards on disk (the file tier)";
  if (u.params_in != nullptr) {
    return "a one-slot store steps from its own params: a step that adopts the caller's params needs a two-slot "
           "store (its journal would have to hold the params too)";
  }
  if (u.pieces != nullptr && u.pieces->stage != nullptr) return WriteStagedJournal(u, version);
  const bool dense = u.grad != nullptr || u.pieces != nullptr;
  RedoJournal::PageFill fill;
  if (dense) {
    const int64_t gbytes = GradBytes(u.grad_type);
    fill = [this, &u, gbytes](int64_t page, char* out) -> std::string {  // gbytes by value: it ends with this block
      PageGrad g;
      if (std::string e = GradForPage(u, page, &g); !e.empty()) return e;
      const int64_t n = std::min(page_elems_, size_ - page * page_elems_);
      std::memcpy(out, g.dense, static_cast<size_t>(n * gbytes));
      return {};
    };
  } else if (std::string err = ValidateSparseIndices(u.indices, u.count, size_); !err.empty()) {
    return err;
  }
  return RedoJournal::Write(ShardDir(), version, size_, page_elems_, u.hp, u.grad_type, fill, u.indices, u.values,
                            u.count);
}

std::string ShardEngine::StagedPageCrc(const ShardPieces& pieces, int64_t page, uint32_t* crc) {
  const int64_t begin = page * page_elems_;
  const int64_t covered = ShardPieces::Covered(&pieces, begin, std::min(page_elems_, size_ - begin));
  *crc = 0;
  if (covered <= 0) return {};
  char* buf = GradStage();
  if (std::string e = pieces.stage->Read(begin, buf, covered, GradBytes(pieces.type)); !e.empty()) return e;
  *crc = Crc32c(buf, static_cast<size_t>(covered * GradBytes(pieces.type)));
  return {};
}

std::string ShardEngine::WriteStagedJournal(const ShardUpdate& u, int64_t version) {
  // The stage file already holds the gradient: made durable, it is the journal's gradient, named by a checksum
  // of each page (read back once, mostly from the page cache) instead of copied.
  const ShardPieces& pieces = *u.pieces;
  if (std::string e = pieces.stage->Sync(); !e.empty()) return e;
  std::vector<uint32_t> crcs(static_cast<size_t>(num_pages_));
  for (int64_t page = 0; page < num_pages_; ++page) {
    if (page == num_pages_ / 2) MaybeKillInJournal();  // a kill halfway through the journal (the fault campaign)
    if (std::string e = StagedPageCrc(pieces, page, &crcs[static_cast<size_t>(page)]); !e.empty()) return e;
  }
  return RedoJournal::WriteStaged(ShardDir(), version, size_, page_elems_, u.hp, u.grad_type,
                                  ShardPieces::Covered(&pieces, 0, size_), pieces.scale, crcs);
}

std::string ShardEngine::StepOneSlot(ShardUpdate u, int64_t version) {
  std::string err;
  if (needs_recovery_) {
    err = "a one-slot update of shard " + ShardDir() + " failed part way: its redo journal holds it; reopen the store "
          "to finish it (nsp.storage.open recovers it) before stepping again";
  } else if (version != version_) {
    err = "the store no longer holds version " + std::to_string(version) + " (committed: " +
          std::to_string(version_) + "; a one-slot store keeps no version before it)";
  } else {
    err = backend_->DiscardScratch();  // what an earlier failed write left beside the pages
    if (err.empty()) err = WriteJournal(u, version);
  }
  // Every shard of the store arrives, with its journal durable or not: none switches a page in before all are.
  if (barrier_) barrier_->Arrive(version, err.empty());
  if (!err.empty()) return err;
  if (barrier_ && !barrier_->Wait(version, kBarrierTimeoutS)) {
    RedoJournal::Remove(ShardDir());  // no page changed anywhere: version t stays whole
    return "another shard of the store could not make its redo journal durable (or its step never came): the "
           "step is not taken; version " + std::to_string(version) + " is intact";
  }
  return ApplyWindows(u, version, 0);
}

std::string ShardEngine::ApplyWindows(ShardUpdate u, int64_t version, int64_t start) {
  needs_recovery_ = true;  // from here until the commit, only the journal can finish this update
  u.src_slot = 0;
  u.dst_slot = 1;
  // A staged gradient is the journal's: each window's new params wait in memory until the window is recorded,
  // and only then go over its gradient in the stage file (redo_journal.h).
  ShardPieces window_pieces;
  const bool staged = u.pieces != nullptr && u.pieces->stage != nullptr;
  if (staged) {
    window_pieces = *u.pieces;
    u.pieces = &window_pieces;
    const size_t bytes = static_cast<size_t>(window_pages_ * page_elems_ * GradBytes(window_pieces.type));
    if (window_params_.bytes < bytes) window_params_ = AlignedBuffer(bytes);
    window_pieces.sink = reinterpret_cast<char*>(window_params_.data);
  }
  for (int64_t first = start; first < num_pages_; first += window_pages_) {
    JournalRecord record;
    record.first = first;
    record.end = std::min(num_pages_, first + window_pages_);
    u.first_page = first;
    u.end_page = record.end;
    window_pieces.sink_begin = first * page_elems_;
    if (std::string e = Update(u); !e.empty()) return e;
    {
      const AddElapsedNs sync_timer(&stats_.sync_ns);
      if (std::string e = Sync(1); !e.empty()) return e;  // the window's new pages are durable beside the old
    }
    if (std::string e = backend_->ScratchChecksums(first, record.end, used_.data(), &record.crcs); !e.empty()) {
      return e;
    }
    if (std::string e = RedoJournal::Append(ShardDir(), record, CountStates(used_)); !e.empty()) return e;
    if (std::string e = backend_->SwitchPages(first, record.end, used_.data(), record.crcs.data(), false);
        !e.empty()) {
      return e;
    }
    if (staged) {
      const int64_t begin = first * page_elems_;
      const int64_t end = std::min(size_, record.end * page_elems_);
      const int64_t covered = ShardPieces::Covered(&window_pieces, begin, end - begin);
      if (covered > 0) {
        if (std::string e = window_pieces.stage->Write(begin, window_pieces.sink, covered,
                                                       GradBytes(window_pieces.type));
            !e.empty()) {
          return e;
        }
      }
    }
  }
  {
    const AddElapsedNs sync_timer(&stats_.sync_ns);
    if (std::string e = Sync(0); !e.empty()) return e;  // the renames are durable before the commit names them
  }
  {
    const AddElapsedNs commit_timer(&stats_.commit_ns);
    if (std::string e = Commit(version + 1); !e.empty()) return e;
  }
  needs_recovery_ = false;
  previous_valid_ = false;
  // A journal left behind (a kill now) names the version before the committed one: recovery drops it.
  return RedoJournal::Remove(ShardDir());
}

std::string ShardEngine::Recover() {
  std::lock_guard<std::mutex> lock(step_mu_);
  if (!one_slot_) return "internal error: recovery of a two-slot shard";
  std::unique_ptr<RedoJournal> journal;
  if (std::string e = RedoJournal::Read(ShardDir(), CountStates(used_), &journal); !e.empty()) return e;
  if (journal == nullptr || journal->header().version == version_ - 1) {
    // No update was under way, or it was committed before its journal was removed.
    needs_recovery_ = false;
    if (journal != nullptr) {
      if (std::string e = RedoJournal::Remove(ShardDir()); !e.empty()) return e;
    }
    return backend_->DiscardScratch();
  }
  const JournalHeader& h = journal->header();
  if (h.version != version_) {
    return "the redo journal of shard " + ShardDir() + " is of the update of version " + std::to_string(h.version) +
           ", but the shard's manifest names version " + std::to_string(version_) + ": the shard is damaged";
  }
  if (h.size != size_ || h.page_elems != page_elems_) {
    return "the redo journal of shard " + ShardDir() + " is of a shard of " + std::to_string(h.size) +
           " elements in pages of " + std::to_string(h.page_elems) + ", not this one's " + std::to_string(size_) +
           " in pages of " + std::to_string(page_elems_) + ": the shard is damaged";
  }
  // The recorded windows first: their pages are durable beside the old ones, or already renamed in.
  int64_t done = 0;
  for (const JournalRecord& r : journal->records()) {
    if (r.first != done || r.end > num_pages_) {
      return "the redo journal of shard " + ShardDir() + " records pages " + std::to_string(r.first) + "-" +
             std::to_string(r.end) + " out of order: the shard is damaged";
    }
    if (std::string e = backend_->SwitchPages(r.first, r.end, used_.data(), r.crcs.data(), true); !e.empty()) {
      return e;
    }
    done = r.end;
  }
  // Whatever else lies beside the pages was never recorded: the pages from `done` on still hold version t.
  if (std::string e = backend_->DiscardScratch(); !e.empty()) return e;
  ShardUpdate u;
  u.hp = h.hp;
  u.grad_type = journal->grad_type();
  u.grad = journal->dense();
  u.indices = journal->indices();
  u.values = journal->values();
  u.count = journal->payload() == JournalPayload::kCompressed ? h.count : 0;
  ShardPieces staged;  // a staged gradient: the stage file, as the interrupted update read it
  if (journal->payload() == JournalPayload::kStaged) {
    if (std::string e = StagedForRecovery(*journal, done, &staged); !e.empty()) return e;
    u.pieces = &staged;
  }
  // With every window recorded, only the renames' sync and the commit remain: ApplyWindows does just those.
  return ApplyWindows(u, version_, done);
}

std::string ShardEngine::JournalState(int64_t* version, int64_t* records) {
  std::lock_guard<std::mutex> lock(step_mu_);
  *version = -1;
  *records = 0;
  if (!one_slot_) return {};
  std::unique_ptr<RedoJournal> journal;
  if (std::string e = RedoJournal::Read(ShardDir(), CountStates(used_), &journal, false); !e.empty()) return e;
  if (journal != nullptr) {
    *version = journal->header().version;
    *records = static_cast<int64_t>(journal->records().size());
  }
  return {};
}

std::string ShardEngine::DropJournal() {
  std::lock_guard<std::mutex> lock(step_mu_);
  std::unique_ptr<RedoJournal> journal;
  if (std::string e = RedoJournal::Read(ShardDir(), CountStates(used_), &journal, false); !e.empty()) return e;
  if (journal != nullptr && !journal->records().empty()) {
    return "internal error: the redo journal of shard " + ShardDir() + " recorded windows of its update (pages of "
           "version " + std::to_string(journal->header().version + 1) + " are in): it cannot be dropped";
  }
  if (std::string e = RedoJournal::Remove(ShardDir()); !e.empty()) return e;
  needs_recovery_ = false;
  return backend_->DiscardScratch();
}

std::string ShardEngine::StagedForRecovery(const RedoJournal& journal, int64_t from_page, ShardPieces* out) {
  const JournalHeader& h = journal.header();
  ShardPieces& pieces = *out;
  pieces.type = journal.grad_type();
  pieces.scale = h.stage_scale;
  if (h.count > 0) pieces.sizes.push_back(h.count);
  const std::string path = ShardDir() + "/" + kStageFile;
  GradientStage* stage = nullptr;
  if (std::string e = Stage(&stage); !e.empty()) return e;
  const int64_t need = h.count * GradBytes(pieces.type);
  if (stage->Bytes() < need) {
    return "the redo journal of shard " + ShardDir() + " redoes its update from the staged gradient " + path +
           ", which holds " + std::to_string(std::max<int64_t>(0, stage->Bytes())) + " bytes, not " +
           std::to_string(need) + ": the shard is damaged (it was removed or cut short)";
  }
  pieces.stage = stage;
  if (std::string e = pieces.Finalize(size_); !e.empty()) return e;
  // Every page still to redo must hold the gradient the journal recorded, or the redo would be silently wrong.
  for (int64_t page = from_page; page < num_pages_; ++page) {
    uint32_t crc = 0;
    if (std::string e = StagedPageCrc(pieces, page, &crc); !e.empty()) return e;
    if (crc != journal.staged_page_crcs()[page]) {
      return "the staged gradient " + path + " does not match the redo journal of shard " + ShardDir() +
             " at page " + std::to_string(page) + ": the shard is damaged (the update of version " +
             std::to_string(h.version) + " cannot be redone)";
    }
  }
  return {};
}

}  // namespace nsp
