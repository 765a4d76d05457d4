// The engine's streamed update (ShardEngine::UpdateStreamed), for state that is not page-addressable: pages flow
// through the preallocated buffer sets in a pipeline of threads. A feeder hands each free set the next page and
// queues its reads; reader threads load the pages; the calling thread computes; writer threads store each page's
// new params first and its m/v after, when no param page waits. Everything here lives for one update.
#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "engine/store_engine.h"
#include "util/worker_thread.h"

namespace nsp {
namespace {

// Reader threads of a streamed update, each with one page file read in flight: the disk sees this many requests
// at once (a page's p, m and v files are read side by side, and the next pages' behind them), and while some
// threads check checksums (CPU) the others keep it busy.
constexpr int kReaders = 6;
// Writer threads, each with one page file write in flight: one per buffer set, up to this many. Writes need a
// queue as deep as the reads beside them: with 2 writers against 6 readers the disk served mostly reads, pages
// waiting to be written held their buffer sets, and the reads waited for free sets. Measured interleaved on one
// virtual disk, 8 sets, as the speed of a serial swap of the same state (its time / the update's): 21M params,
// 2 writers 0.99x, 4 writers 1.03x, 8 writers 1.05x; 48M params, 2 writers 0.98x, 8 writers 1.02x.
constexpr int kMaxWriters = 8;

// A unit of pipeline work: a buffer set and the page it holds travel together.
struct Work {
  int set;
  int64_t page;
  int state = -1;  // a read of one state's page file (the readers' queue); -1 elsewhere
};

// A closable blocking queue of Work in `Lanes` lanes: Pop takes from the first lane that holds an item.
template <int Lanes>
class WorkQueue {
 public:
  void Push(Work w, int lane = 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      items_[lane].push_back(w);
    }
    cv_.notify_one();
  }
  // Blocks until an item or Close(); returns false when closed and empty. `lane`, when given: w's lane.
  bool Pop(Work* w, int* lane = nullptr) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return closed_ || !Empty(); });
    for (int l = 0; l < Lanes; ++l) {
      if (items_[l].empty()) continue;
      *w = items_[l].front();
      items_[l].pop_front();
      if (lane != nullptr) *lane = l;
      return true;
    }
    return false;
  }
  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }

 private:
  bool Empty() const {
    for (const std::deque<Work>& lane : items_) {
      if (!lane.empty()) return false;
    }
    return true;
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> items_[Lanes];
  bool closed_ = false;
};

using Queue = WorkQueue<1>;
// The writers' queue: new-param pages first, deferred m/v pages only when no param page waits.
using WriteQueue = WorkQueue<2>;
constexpr int kParamLane = 0, kStateLane = 1;

// First error wins; every stage checks it to stop early. A gradient found not finite in the pass stops the
// stream the same way, with kNotFinite as its "error".
constexpr char kNotFinite[] = "the gradient is not finite";
class ErrorSlot {
 public:
  void Set(const std::string& e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.empty()) error_ = e;
    failed_ = true;
  }
  bool failed() const { return failed_; }
  std::string Get() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  std::mutex mu_;
  std::string error_;
  std::atomic<bool> failed_{false};
};

}  // namespace

std::string ShardEngine::UpdateStreamed(const ShardUpdate& u) {
  if (buffers_.empty()) {  // allocated once, reused by every later update
    const size_t bytes = backend_->PageBufferBytes(page_elems_);
    buffers_.resize(static_cast<size_t>(pages_in_flight_));
    for (auto& set : buffers_) {
      for (int s = 0; s < kNumStates; ++s) {
        if (used_[s]) set[s] = PageBuffer(bytes);
      }
    }
  }
  auto page_len = [&](int64_t page) { return std::min(page_elems_, size_ - page * page_elems_); };
  // The pages this update covers: the whole shard, or a one-slot step's window of it (ShardUpdate::first_page).
  const int64_t first_page = u.first_page, end_page = u.end_page < 0 ? num_pages_ : u.end_page;
  if (std::string e = backend_->PrepareSlot(u.dst_slot, used_.data(), first_page, end_page); !e.empty()) return e;
  backend_->StreamStarted();
  Queue free_sets, ready;
  WriteQueue writes;
  ErrorSlot error;
  for (int s = 0; s < pages_in_flight_; ++s) free_sets.Push({s, -1});

  // Reading: a feeder gives each free buffer set the next page and queues one read per used state; the readers
  // take those reads in order, several at once, and the last of a page's reads passes its set to the compute
  // loop. Pages therefore reach the compute loop in about, not exactly, their order.
  Queue reads;
  std::vector<std::atomic<int>> reads_left(static_cast<size_t>(pages_in_flight_));
  // A step from the caller's params reads no param pages (the compute loop gathers them from the caller).
  std::array<bool, kNumStates> to_read = used_;
  if (u.params_in != nullptr) to_read[kParamState] = false;
  const int states_read = CountStates(to_read);
  WorkerThread feeder;
  std::string why;
  const bool fed = feeder.Start([&] {
    Work w;
    for (int64_t page = first_page; page < end_page && !error.failed() && free_sets.Pop(&w); ++page) {
      if (states_read == 0) {  // nothing to read (SGD without momentum, from the caller's params)
        ready.Push({w.set, page});
        continue;
      }
      reads_left[static_cast<size_t>(w.set)].store(states_read);
      for (int s = 0; s < kNumStates; ++s) {
        if (to_read[s]) reads.Push({w.set, page, s});
      }
    }
    reads.Close();
  }, &why);
  if (!fed) {
    backend_->StreamFinished(false);
    return "the update's page feeder: " + why;
  }
  std::atomic<int> readers_left{kReaders};
  auto read_pages = [&] {
    Work r;
    while (reads.Pop(&r)) {
      if (!error.failed()) {
        if (std::string e = backend_->ReadPage(u.src_slot, r.state, r.page, buffers_[r.set][r.state].data,
                                               page_len(r.page), true);
            !e.empty()) {
          error.Set(e);
        }
      }
      if (reads_left[static_cast<size_t>(r.set)].fetch_sub(1) == 1) ready.Push({r.set, r.page});
    }
    if (readers_left.fetch_sub(1) == 1) ready.Close();
  };
  // Readers and writers that cannot start (an address-space or thread limit) leave the pipeline narrower; with
  // none of either the update stops with the reason.
  std::vector<WorkerThread> readers(kReaders);
  int readers_started = 0;
  for (auto& r : readers) {
    if (r.Start(read_pages, &why)) {
      ++readers_started;
    } else if (readers_left.fetch_sub(1) == 1) {
      ready.Close();
    }
  }
  if (readers_started == 0) error.Set("the update's page readers: " + why);

  auto write_pages = [&] {
    Work w;
    int lane = kParamLane;
    while (writes.Pop(&w, &lane)) {
      if (error.failed()) {  // keep draining so nobody blocks, but write nothing more
        free_sets.Push(w);
        continue;
      }
      const int64_t n = page_len(w.page);
      if (lane == kParamLane) {
        float* src = buffers_[w.set][kParamState].data;
        if (std::string e = backend_->WritePage(u.dst_slot, kParamState, w.page, src, n, true); !e.empty()) {
          error.Set(e);
        }
        if (used_[kMuState] || used_[kNuState]) {
          writes.Push(w, kStateLane);  // m/v can wait: the next forward pass needs only params
        } else {
          free_sets.Push(w);
        }
      } else {
        for (int s : {kMuState, kNuState}) {
          if (!used_[s] || error.failed()) continue;
          if (std::string e = backend_->WritePage(u.dst_slot, s, w.page, buffers_[w.set][s].data, n, true);
              !e.empty()) {
            error.Set(e);
          }
        }
        free_sets.Push(w);
      }
    }
  };
  std::vector<WorkerThread> writers(static_cast<size_t>(std::min(pages_in_flight_, kMaxWriters)));
  int writers_started = 0;
  for (auto& t : writers) writers_started += t.Start(write_pages, &why) ? 1 : 0;
  if (writers_started == 0) error.Set("the update's page writers: " + why);

  // Compute on the calling thread (the kernel itself fans out over the thread pool).
  int64_t computed = 0;
  Work w;
  while (ready.Pop(&w)) {
    if (error.failed()) break;
    const int64_t begin = w.page * page_elems_;
    StateSpan span;
    span.size = page_len(w.page);
    // The new params land in the page buffer (written to storage from there) and, in the same pass, in the
    // caller's output.
    float* pbuf = buffers_[w.set][kParamState].data;
    span.param_in = u.params_in != nullptr ? CallerParams(u, begin, span.size) : pbuf;
    span.param_out = pbuf;
    if (u.params_out != nullptr) span.param_copy_out = u.params_out + begin;
    if (used_[kMuState]) span.mu_in = span.mu_out = buffers_[w.set][kMuState].data;
    if (used_[kNuState]) span.nu_in = span.nu_out = buffers_[w.set][kNuState].data;
    if (u.params_bf16_out != nullptr) span.param_bf16_out = u.params_bf16_out + begin;
    PageGrad g;
    if (std::string e = GradForPage(u, w.page, &g); !e.empty()) {
      error.Set(e);
      break;
    }
    CountShared(u, g, ShardPieces::Covered(u.pieces, begin, span.size), span);
    if (!ComputeChecked(u, span, g)) {
      error.Set(kNotFinite);  // nothing more is written; the slot stays uncommitted
      break;
    }
    if (u.pieces != nullptr) {
      if (std::string e = u.pieces->ScatterParams(begin, span.size, pbuf); !e.empty()) {
        error.Set(e);
        break;
      }
    }
    writes.Push(w, kParamLane);
    ++computed;
    PageDone();
  }
  // Unblock the readers if we stopped early, then let the writers finish what they hold.
  if (error.failed()) {
    free_sets.Close();
    while (ready.Pop(&w)) {
    }
  }
  feeder.Join();
  for (auto& r : readers) r.Join();
  // The writers exit once every queued write has drained.
  writes.Close();
  for (auto& t : writers) t.Join();
  backend_->StreamFinished(!error.failed());
  if (error.failed()) {
    std::string e = error.Get();
    if (e != kNotFinite) return e;
    *u.skipped = true;  // Step hands back the committed params and commits nothing
    return {};
  }
  if (computed != end_page - first_page) return "internal error: not every page was updated";
  return {};
}

}  // namespace nsp
