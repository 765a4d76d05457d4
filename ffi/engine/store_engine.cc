// The engine's shard across versions: construction; versioned steps, with RunStep, the one door every caller's step
// comes in by (its finiteness check, then a skip, a step or a background step; replays included); their commits
// (the shard's manifest); and whole-state transfers outside any update. One update's work is store_engine_update.cc's
// and store_engine_stream.cc's; the background step is store_engine_async.cc's.
#include "engine/store_engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "kernels/kernel_block.h"
#include "util/elapsed.h"
#include "util/engine_cpus.h"

namespace nsp {

ShardEngine::ShardEngine(std::unique_ptr<Backend> backend, int64_t size, int64_t page_elems, int pages_in_flight,
                         std::array<bool, kNumStates> states_used)
    : backend_(std::move(backend)),
      size_(size),
      page_elems_(page_elems),
      num_pages_((size + page_elems - 1) / page_elems),
      pages_in_flight_(std::max(2, pages_in_flight)),
      used_(states_used) {}

ShardEngine::~ShardEngine() { Wait(); }

ShardEngine::AlignedBuffer::AlignedBuffer(size_t n) : bytes(n) {
  void* p = nullptr;
  if (::posix_memalign(&p, 4096, n) != 0) throw std::bad_alloc();
  std::memset(p, 0, n);
  data = static_cast<float*>(p);
}

ShardEngine::AlignedBuffer::AlignedBuffer(Backend* backend, size_t n) : bytes(n), owner(backend) {
  data = static_cast<float*>(backend->AllocPageBuffer(n));
}

ShardEngine::AlignedBuffer::~AlignedBuffer() {
  if (data == nullptr) return;
  if (owner != nullptr) {
    owner->FreePageBuffer(data, bytes);
  } else {
    std::free(data);
  }
}

int64_t ShardEngine::buffer_bytes() const {
  int64_t total = 0;
  for (const auto& set : buffers_) {
    for (const auto& b : set) total += static_cast<int64_t>(b.bytes);
  }
  return total + static_cast<int64_t>(grad_stage_.bytes + params_stage_.bytes + window_params_.bytes);
}

// {"store": ID, "shard": I, "version": V, "checksums": {"SLOT": {"version": W, "STATE": [crc, ...]}}}: the slots
// whose every page's checksum is known (the committed one always: its pages were all written or loaded).
std::string ShardEngine::ManifestText(int64_t version) const {
  std::string text = "{\"store\": \"" + store_id_ + "\", \"shard\": " + std::to_string(shard_index_) +
                     ", \"version\": " + std::to_string(version) + ", \"checksums\": {";
  bool first_slot = true;
  for (int slot = 0; slot < (one_slot_ ? 1 : 2); ++slot) {  // a one-slot shard's slot 1 is scratch
    std::string states;
    for (int s = 0; s < kNumStates; ++s) {
      if (!used_[s]) continue;
      const std::vector<uint32_t> crcs = backend_->PageChecksums(slot, s);
      if (crcs.empty()) continue;
      states += std::string(states.empty() ? "" : ", ") + "\"" + StateName(s) + "\": [";
      for (size_t i = 0; i < crcs.size(); ++i) states += (i ? "," : "") + std::to_string(crcs[i]);
      states += "]";
    }
    if (states.empty()) continue;
    // The committed version's slot, and the slot beside it, which holds the version before (a replay reads it).
    const int64_t held = one_slot_ || slot == version % 2 ? version : version - 1;
    text += std::string(first_slot ? "" : ", ") + "\"" + std::to_string(slot) + "\": {\"version\": " +
            std::to_string(held) + ", " + states + "}";
    first_slot = false;
  }
  return text + "}}";
}

std::string ShardEngine::Commit(int64_t version) {
  if (!manifest_.empty()) {
    backend_->BeforeCommit(version);
    // Write-to-temp, fsync, rename, fsync the directory: the old or the new manifest, never a mix.
    const std::string tmp = manifest_ + ".tmp";
    const std::string text = ManifestText(version);
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return "cannot create " + tmp + ": " + std::strerror(errno);
    const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
    const int err = errno;
    ::close(fd);
    if (!ok) {
      ::unlink(tmp.c_str());
      return "cannot write " + tmp + ": " + std::strerror(err);
    }
    if (::rename(tmp.c_str(), manifest_.c_str()) != 0) {
      return "cannot commit " + manifest_ + ": " + std::strerror(errno);
    }
    const std::string dir = manifest_.substr(0, manifest_.find_last_of('/'));
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }
  version_ = version;
  return {};
}

namespace {
int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

// Marks an update as running for Progress() from its start to its end, however it returns.
class ShardEngine::ProgressScope {
 public:
  explicit ProgressScope(ShardEngine* e) : e_(e) {
    e_->progress_done_.store(0, std::memory_order_relaxed);
    e_->progress_total_.store(e_->num_pages_, std::memory_order_relaxed);
    e_->progress_start_ns_.store(SteadyNowNs(), std::memory_order_relaxed);
    e_->progress_begun_.fetch_add(1, std::memory_order_relaxed);
    e_->progress_running_.store(true, std::memory_order_release);
  }
  ~ProgressScope() {
    e_->progress_end_ns_.store(SteadyNowNs(), std::memory_order_relaxed);
    e_->progress_running_.store(false, std::memory_order_release);
  }
  ProgressScope(const ProgressScope&) = delete;
  ProgressScope& operator=(const ProgressScope&) = delete;

 private:
  ShardEngine* e_;
};

UpdateProgress ShardEngine::Progress() const {
  UpdateProgress p;
  p.running = progress_running_.load(std::memory_order_acquire);
  p.pages_done = progress_done_.load(std::memory_order_relaxed);
  p.pages_total = progress_total_.load(std::memory_order_relaxed);
  p.updates_begun = progress_begun_.load(std::memory_order_relaxed);
  const int64_t start = progress_start_ns_.load(std::memory_order_relaxed);
  if (p.updates_begun > 0) {
    p.elapsed_ns = (p.running ? SteadyNowNs() : progress_end_ns_.load(std::memory_order_relaxed)) - start;
  }
  return p;
}

namespace {

// Whether the update's gradient (dense, pieces, or compressed values) holds no NaN or Inf: one multithreaded pass.
bool GradientFinite(const ShardUpdate& u, int64_t size) {
  if (u.pieces != nullptr) {
    for (size_t i = 0; i < u.pieces->sizes.size(); ++i) {
      if (!AllFinite(u.pieces->grad[i], u.pieces->type, u.pieces->sizes[i])) return false;
    }
    return true;
  }
  if (u.grad != nullptr) return AllFinite(u.grad, u.grad_type, size);
  return AllFinite(u.values, u.grad_type, u.count);
}

}  // namespace

std::string ShardEngine::Stage(GradientStage** out) {
  std::lock_guard<std::mutex> lock(stage_mu_);
  if (stage_ == nullptr) {
    if (manifest_.empty()) {
      return "staging the gradient needs a store on disk (the file tier): this shard has no directory";
    }
    const std::string dir = manifest_.substr(0, manifest_.find_last_of('/'));
    if (std::string e = GradientStage::Open(dir + "/" + kStageFile, &stage_); !e.empty()) return e;
  }
  *out = stage_.get();
  return {};
}

std::string ShardEngine::RunStep(ShardUpdate u, const StepCall& call, StepOutcome* outcome) {
  if (u.pieces != nullptr && u.pieces->stage != nullptr) {
    // A staged gradient is read a page at a time by the streamed pipeline alone, and its stage calls already
    // told whether it is finite.
    if (Addressable()) return "a staged gradient needs a store whose pages live in files (the file tier)";
    if (call.staleness > 0) return "a staged gradient needs staleness 0";
    if (call.grad_check == GradCheck::kCheck) return "internal error: a staged gradient's finiteness must be given";
  }
  u.check_finite = false;
  bool skipped_in_pass = false;
  bool finite = call.grad_check != GradCheck::kNotFinite;
  if (call.grad_check == GradCheck::kCheck) {
    // Inside the update's own pass (no pass over the gradient of its own, with the disk idle) where a half-done
    // update leaves the committed version whole: a synchronous step from it and from the store's own params, a
    // dense gradient (or pieces), a store that keeps two slots. Otherwise one pass first.
    const bool dense = u.grad != nullptr || u.pieces != nullptr;
    if (call.staleness == 0 && dense && ChecksFiniteInPass() && call.version == version_ && u.params_in == nullptr) {
      u.check_finite = true;
      u.skipped = &skipped_in_pass;
    } else {
      finite = GradientFinite(u, size_);
    }
  }
  std::string err = !finite              ? Skip(u, call.version)
                    : call.staleness > 0 ? StepAsync(u, call.version)
                                         : Step(u, call.version);
  if (!err.empty()) return err;
  outcome->skipped = !finite || skipped_in_pass;
  outcome->version = outcome->skipped ? call.version : call.version + 1;
  return {};
}

std::string ShardEngine::Step(ShardUpdate u, int64_t version) {
  const EngineCpuScope cpus;  // NSP_ENGINE_CPUS; the page readers and writers started below inherit it
  std::lock_guard<std::mutex> lock(step_mu_);
  const AddElapsedNs timer(&stats_.update_ns);  // the step's wall time, however it returns
  const ProgressScope progress(this);
  if (one_slot_) return StepOneSlot(std::move(u), version);
  if (version == version_ - 1 && version >= 0 && previous_valid_) {
    // A replay overwrites the slot of the committed version: step the commit back first, so a crash during
    // the replay still leaves a whole committed version.
    if (std::string e = Commit(version); !e.empty()) return e;
  } else if (version != version_) {
    return "the store no longer holds version " + std::to_string(version) + " (committed: " +
           std::to_string(version_) + (previous_valid_ ? ", and the one before it" : "") + ")";
  }
  previous_valid_ = false;  // the other slot is about to be overwritten
  u.src_slot = static_cast<int>(version % 2);
  u.dst_slot = 1 - u.src_slot;
  if (u.check_finite) *u.skipped = false;
  if (std::string e = Update(u); !e.empty()) return e;
  if (u.check_finite && *u.skipped) {  // a NaN/Inf met in the pass: version stays committed, as Skip leaves it
    if (version != version_) return "internal error: an in-pass check ran on a replay";
    stats_.skipped += 1;
    return CommittedParamsOut(u, version);
  }
  {
    const AddElapsedNs sync_timer(&stats_.sync_ns);
    if (std::string e = Sync(u.dst_slot); !e.empty()) return e;
  }
  {
    const AddElapsedNs commit_timer(&stats_.commit_ns);
    if (std::string e = Commit(version + 1); !e.empty()) return e;
  }
  previous_valid_ = backend_->KeepsPrevious();
  if (u.params_in != nullptr) stats_.params_adopted += 1;
  return {};
}

std::string ShardEngine::Skip(const ShardUpdate& u, int64_t version) {
  const EngineCpuScope cpus;
  if (std::string e = Wait(); !e.empty()) return "the previous (background) step failed: " + e;
  std::lock_guard<std::mutex> lock(step_mu_);
  if (version != version_) {
    return "the store no longer holds version " + std::to_string(version) + " (committed: " +
           std::to_string(version_) + ")";
  }
  stats_.skipped += 1;
  return CommittedParamsOut(u, version);
}

std::string ShardEngine::CommittedParamsOut(const ShardUpdate& u, int64_t version) {
  if (u.params_in != nullptr) {  // the step was to start from the caller's params: those are what it keeps
    for (int64_t begin = 0; begin < size_; begin += page_elems_) {
      const int64_t n = std::min(page_elems_, size_ - begin);
      const float* page = CallerParams(u, begin, n);
      if (u.pieces != nullptr) {
        if (std::string e = u.pieces->ScatterParams(begin, n, page); !e.empty()) return e;
      }
      if (u.params_out != nullptr) std::memcpy(u.params_out + begin, page, sizeof(float) * static_cast<size_t>(n));
      if (u.params_bf16_out != nullptr) internal::RoundToBf16(page, u.params_bf16_out + begin, n);
    }
    return {};
  }
  if (u.pieces != nullptr) {  // the committed params into the pieces, a page at a time
    const int slot = static_cast<int>(version % 2);
    AlignedBuffer page_buffer = PageBuffer(backend_->PageBufferBytes(page_elems_));
    for (int64_t page = 0; page < num_pages_; ++page) {
      const int64_t begin = page * page_elems_;
      const int64_t n = std::min(page_elems_, size_ - begin);
      if (std::string e = backend_->ReadPage(slot, kParamState, page, page_buffer.data, n, true); !e.empty()) return e;
      if (std::string e = u.pieces->ScatterParams(begin, n, page_buffer.data); !e.empty()) return e;
    }
    return {};
  }
  if (u.params_out == nullptr && u.params_bf16_out == nullptr) return {};
  std::vector<float> scratch;
  float* params = u.params_out;
  if (params == nullptr) {
    scratch.resize(static_cast<size_t>(size_));
    params = scratch.data();
  }
  if (std::string e = ReadState(static_cast<int>(version % 2), kParamState, params); !e.empty()) return e;
  if (u.params_bf16_out != nullptr) internal::RoundToBf16(params, u.params_bf16_out, size_);
  return {};
}

std::vector<std::string> ShardEngine::Verify(int slot, int state) {
  std::vector<std::string> problems;
  AlignedBuffer buffer = PageBuffer(backend_->PageBufferBytes(page_elems_));
  for (int64_t page = 0; page < num_pages_; ++page) {
    const int64_t n = std::min(page_elems_, size_ - page * page_elems_);
    if (std::string e = backend_->ReadPage(slot, state, page, buffer.data, n, true); !e.empty()) {
      problems.push_back(std::move(e));
    }
  }
  return problems;
}

std::string ShardEngine::ReadState(int slot, int state, float* out) { return ReadPages(slot, state, 0, out, size_); }

std::string ShardEngine::ReadPages(int slot, int state, int64_t first_page, float* out, int64_t n) {
  if (std::string e = CheckSlotAndState("read_pages", slot, state); !e.empty()) return e;
  const int64_t begin = first_page * page_elems_;
  if (first_page < 0 || n < 0 || begin + n > size_ || (n % page_elems_ != 0 && begin + n != size_)) {
    return "read_pages: " + std::to_string(n) + " elements from page " + std::to_string(first_page) +
           " are not whole pages of the shard";
  }
  // Pages that are not addressable go through one aligned page buffer, so the backend can read them its
  // fastest way (direct I/O), then into `out` (a memcpy costs a fraction of the read).
  AlignedBuffer bounce;
  if (backend_->PageAddress(slot, state, 0) == nullptr) bounce = PageBuffer(backend_->PageBufferBytes(page_elems_));
  for (int64_t done = 0; done < n; done += page_elems_) {
    const int64_t page = first_page + done / page_elems_;
    const int64_t len = std::min(page_elems_, n - done);
    float* dst = out + done;
    if (bounce.data == nullptr) {
      if (std::string e = backend_->ReadPage(slot, state, page, dst, len, false); !e.empty()) return e;
      continue;
    }
    if (std::string e = backend_->ReadPage(slot, state, page, bounce.data, len, true); !e.empty()) return e;
    std::memcpy(dst, bounce.data, sizeof(float) * static_cast<size_t>(len));
  }
  return {};
}

std::string ShardEngine::WritePages(int slot, int state, int64_t first_page, const float* in, int64_t n) {
  if (std::string e = CheckSlotAndState("write_pages", slot, state); !e.empty()) return e;
  const int64_t begin = first_page * page_elems_;
  if (first_page < 0 || begin + n > size_ || n < 0 || (n % page_elems_ != 0 && begin + n != size_)) {
    return "write_pages: " + std::to_string(n) + " elements from page " + std::to_string(first_page) +
           " are not whole pages of the shard";
  }
  std::array<bool, kNumStates> only{};  // the one state this call writes
  only[static_cast<size_t>(state)] = true;
  const int64_t end_page = first_page + (n + page_elems_ - 1) / page_elems_;
  if (std::string e = backend_->PrepareSlot(slot, only.data(), first_page, end_page); !e.empty()) return e;
  for (int64_t done = 0; done < n; done += page_elems_) {
    const int64_t len = std::min(page_elems_, n - done);
    if (std::string e = backend_->WritePage(slot, state, first_page + done / page_elems_, const_cast<float*>(in) + done,
                                            len, false);
        !e.empty()) {
      return e;
    }
  }
  return {};
}

std::string ShardEngine::WriteState(int slot, int state, const float* in) {
  return WritePages(slot, state, 0, in, size_);
}

}  // namespace nsp
