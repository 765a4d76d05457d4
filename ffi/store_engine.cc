#include "store_engine.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <condition_variable>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <string>
#include <thread>

#include "engine_cpus.h"
#include "kernel_block.h"
#include "thread_pool.h"

namespace nsp {
namespace {

// Reader threads of a streamed update, each with one page file read in flight: the disk sees this many requests
// at once (a page's p, m and v files are read side by side, and the next pages' behind them), and while some
// threads check checksums (CPU) the others keep it busy.
constexpr int kReaders = 6;
constexpr int kWriters = 2;  // page writer threads: while one checksums a page (CPU), the other's write runs

// A staleness-1 step in the background yields the CPU to the foreground (see StepAsync), unless
// NSP_BACKGROUND_PRIORITY=normal, or NSP_ENGINE_CPUS gave the update CPUs of its own (nothing there to yield to).
bool YieldToForeground() {
  static const bool yield = [] {
    const char* env = std::getenv("NSP_BACKGROUND_PRIORITY");
    return (env == nullptr || std::string(env) != "normal") && EngineCpus().empty();
  }();
  return yield;
}


// Adds the wall time from its construction to its destruction to *total.
class AddElapsedNs {
 public:
  explicit AddElapsedNs(int64_t* total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~AddElapsedNs() {
    *total_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
  }
  AddElapsedNs(const AddElapsedNs&) = delete;
  AddElapsedNs& operator=(const AddElapsedNs&) = delete;

 private:
  int64_t* total_;
  std::chrono::steady_clock::time_point start_;
};

// A closable blocking queue of page numbers (buffer set and page travel together).
struct Work {
  int set;
  int64_t page;
  int state = -1;  // a read of one state's page file (the readers' queue); -1 elsewhere
};

class Queue {
 public:
  void Push(Work w) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      items_.push_back(w);
    }
    cv_.notify_one();
  }
  // Blocks until an item or Close(); returns false when closed and empty.
  bool Pop(Work* w) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return closed_ || !items_.empty(); });
    if (items_.empty()) return false;
    *w = items_.front();
    items_.pop_front();
    return true;
  }
  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> items_;
  bool closed_ = false;
};

// The writers' two queues: new-param pages first, deferred m/v pages only when no param page waits.
class WriteQueues {
 public:
  void PushParam(Work w) { Push(&params_, w); }
  void PushState(Work w) { Push(&states_, w); }
  // Returns false once closed and both queues are empty; *is_param tells which queue `w` came from.
  bool Pop(Work* w, bool* is_param) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return closed_ || !params_.empty() || !states_.empty(); });
    std::deque<Work>* q = !params_.empty() ? &params_ : (!states_.empty() ? &states_ : nullptr);
    if (q == nullptr) return false;
    *is_param = q == &params_;
    *w = q->front();
    q->pop_front();
    return true;
  }
  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }

 private:
  void Push(std::deque<Work>* q, Work w) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      q->push_back(w);
    }
    cv_.notify_one();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> params_, states_;
  bool closed_ = false;
};

// First error wins; every stage checks it to stop early.
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

std::string ShardPieces::Finalize(int64_t shard_size) {
  if (grad.size() != sizes.size() || out.size() != sizes.size()) return "pieces: gradients, outputs and sizes differ in count";
  starts.resize(sizes.size());
  int64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) return "pieces: negative size";
    starts[i] = total;
    total += sizes[i];
  }
  if (total > shard_size) {
    return "the pieces hold " + std::to_string(total) + " elements, more than the shard's " + std::to_string(shard_size);
  }
  return {};
}

namespace {

// Calls fn(i, lo, hi) for each piece i that overlaps elements [begin, end), with [lo, hi) the overlap (in the
// same positions as `starts`), in order.
template <typename Fn>
void ForEachOverlap(const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes, int64_t begin, int64_t end,
                    Fn fn) {
  // The first piece that ends after `begin`.
  size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin();
  i = i == 0 ? 0 : i - 1;
  for (; i < sizes.size() && starts[i] < end; ++i) {
    const int64_t lo = std::max(begin, starts[i]);
    const int64_t hi = std::min(end, starts[i] + sizes[i]);
    if (hi > lo) fn(i, lo, hi);
  }
}

}  // namespace

void ShardPieces::GatherGrad(int64_t begin, int64_t n, char* dst) const {
  const int64_t bytes = GradBytes(type);
  std::memset(dst, 0, static_cast<size_t>(n * bytes));  // padding past the last piece stays zero
  ForEachOverlap(starts, sizes, begin, begin + n, [&](size_t i, int64_t lo, int64_t hi) {
    std::memcpy(dst + (lo - begin) * bytes, static_cast<const char*>(grad[i]) + (lo - starts[i]) * bytes,
                static_cast<size_t>((hi - lo) * bytes));
  });
}

void ShardPieces::ScatterParams(int64_t begin, int64_t n, const float* src) const {
  ForEachOverlap(starts, sizes, begin, begin + n, [&](size_t i, int64_t lo, int64_t hi) {
    if (type == GradType::kF32) {
      std::memcpy(static_cast<float*>(out[i]) + (lo - starts[i]), src + (lo - begin),
                  sizeof(float) * static_cast<size_t>(hi - lo));
    } else {
      internal::RoundToBf16(src + (lo - begin), static_cast<uint16_t*>(out[i]) + (lo - starts[i]), hi - lo);
    }
  });
}

std::string ParamsIn::Finalize() {
  if (leaves.size() != sizes.size()) return "params: leaves and sizes differ in count";
  starts.resize(sizes.size());
  int64_t at = -offset;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) return "params: negative size";
    starts[i] = at;
    at += sizes[i];
  }
  return {};
}

void ParamsIn::Gather(int64_t begin, int64_t n, float* dst) const {
  std::fill(dst, dst + n, 0.0f);  // padding
  ForEachOverlap(starts, sizes, begin, begin + n, [&](size_t i, int64_t lo, int64_t hi) {
    if (type == GradType::kF32) {
      std::memcpy(dst + (lo - begin), static_cast<const float*>(leaves[i]) + (lo - starts[i]),
                  sizeof(float) * static_cast<size_t>(hi - lo));
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(leaves[i]) + (lo - starts[i]);
      for (int64_t k = 0; k < hi - lo; ++k) {
        const uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
        std::memcpy(dst + (lo - begin) + k, &bits, sizeof(bits));
      }
    }
  });
}

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

ShardEngine::AlignedBuffer::~AlignedBuffer() { std::free(data); }

bool ShardEngine::Addressable() const {
  for (int s = 0; s < kNumStates; ++s) {
    if (used_[s] && (backend_->PageAddress(0, s, 0) == nullptr || backend_->PageAddress(1, s, 0) == nullptr)) {
      return false;
    }
  }
  return true;
}

int64_t ShardEngine::buffer_bytes() const {
  int64_t total = 0;
  for (const auto& set : buffers_) {
    for (const auto& b : set) total += static_cast<int64_t>(b.bytes);
  }
  return total + static_cast<int64_t>(grad_stage_.bytes);
}

// The shared link's bytes, counted where the engine consumes a gradient span (dense elements, or compressed
// pairs) and hands out its params (fp32, bf16, or into the gradient's pieces).
// The caller's params, when the step starts from them, count as coming down the link too.
void ShardEngine::CountShared(const ShardUpdate& u, const PageGrad& g, int64_t elems, const StateSpan& span) {
  const int64_t gbytes = GradBytes(g.type);
  stats_.shared_in_bytes += g.dense != nullptr ? elems * gbytes : g.count * (gbytes + 4);
  if (u.params_in != nullptr) stats_.shared_in_bytes += elems * GradBytes(u.params_in->type);
  if (u.pieces != nullptr) stats_.shared_out_bytes += elems * gbytes;
  if (span.param_copy_out != nullptr) stats_.shared_out_bytes += span.size * 4;
  if (span.param_bf16_out != nullptr) stats_.shared_out_bytes += span.size * 2;
}

// The internal link's bytes when the state is addressable: what the kernel pass read and wrote in place.
void ShardEngine::CountInPlace(int64_t elems, bool param_read) {
  int states = 0;
  for (int s = 0; s < kNumStates; ++s) states += used_[s] ? 1 : 0;
  stats_.internal_read_bytes += (states - (param_read ? 0 : 1)) * elems * 4;
  stats_.internal_write_bytes += states * elems * 4;
}

char* ShardEngine::GradStage() {
  if (grad_stage_.data == nullptr) grad_stage_ = AlignedBuffer(sizeof(float) * static_cast<size_t>(page_elems_));
  return reinterpret_cast<char*>(grad_stage_.data);
}

const float* ShardEngine::CallerParams(const ShardUpdate& u, int64_t begin, int64_t n) {
  if (params_stage_.data == nullptr) params_stage_ = AlignedBuffer(sizeof(float) * static_cast<size_t>(page_elems_));
  u.params_in->Gather(begin, n, params_stage_.data);
  return params_stage_.data;
}

PageGrad ShardEngine::GradForPage(const ShardUpdate& u, int64_t page) {
  PageGrad g;
  g.type = u.grad_type;
  const int64_t begin = page * page_elems_;
  if (u.pieces != nullptr) {  // gather this page's gradient from the leaves it spans
    char* stage = GradStage();
    u.pieces->GatherGrad(begin, std::min(page_elems_, size_ - begin), stage);
    g.dense = stage;
    return g;
  }
  if (u.grad != nullptr) {
    g.dense = static_cast<const char*>(u.grad) + begin * GradBytes(u.grad_type);
    return g;
  }
  // Pages may arrive in any order: find this page's run of the sorted indices.
  const int64_t end = std::min(begin + page_elems_, size_);
  const int64_t lo = std::lower_bound(u.indices, u.indices + u.count, begin) - u.indices;
  const int64_t hi = std::lower_bound(u.indices + lo, u.indices + u.count, end) - u.indices;
  g.indices = u.indices + lo;
  g.values = static_cast<const char*>(u.values) + lo * GradBytes(u.grad_type);
  g.count = hi - lo;
  g.index_base = begin;
  return g;
}

std::string ShardEngine::Update(const ShardUpdate& u) {
  if (u.src_slot == u.dst_slot || u.src_slot < 0 || u.src_slot > 1 || u.dst_slot < 0 || u.dst_slot > 1) {
    return "an update must read one version slot and write the other";
  }
  if (u.pieces != nullptr && u.pieces->type != u.grad_type) return "internal error: pieces and gradient types differ";
  if (u.grad == nullptr && u.pieces == nullptr) {
    if (std::string err = ValidateSparseIndices(u.indices, u.count, size_); !err.empty()) return err;
  }
  if (u.check_finite && (u.pieces == nullptr || u.skipped == nullptr || !ChecksFiniteInPass() || u.params_in)) {
    return "internal error: an in-pass finiteness check needs pieces, a skipped flag and a two-slot addressable store";
  }
  const IoCounts before = backend_->Io();
  std::string err = !Addressable()            ? UpdateStreamed(u)
                    : u.params_in != nullptr ? UpdateAddressableFromCaller(u)
                                             : UpdateAddressable(u);
  // What the backend's I/O moved during the update (each call's return value), failed or not.
  const IoCounts after = backend_->Io();
  stats_.internal_read_bytes += after.read_bytes - before.read_bytes;
  stats_.internal_write_bytes += after.write_bytes - before.write_bytes;
  stats_.pages_read += after.pages_read - before.pages_read;
  stats_.pages_written += after.pages_written - before.pages_written;
  stats_.pages_read_direct += after.pages_read_direct - before.pages_read_direct;
  if (Addressable() && err.empty()) {  // every page of every state was passed over in place
    int states = 0;
    for (int s = 0; s < kNumStates; ++s) states += used_[s] ? 1 : 0;
    stats_.pages_read += states * num_pages_;
    stats_.pages_written += states * num_pages_;
  }
  if (err.empty() && !(u.check_finite && *u.skipped)) stats_.updates += 1;
  return err;
}

StateSpan ShardEngine::SlotSpan(const ShardUpdate& u, int64_t begin, int64_t n) const {
  StateSpan span;
  span.size = n;
  span.param_in = backend_->PageAddress(u.src_slot, kParamState, 0) + begin;
  span.param_out = backend_->PageAddress(u.dst_slot, kParamState, 0) + begin;
  if (used_[kMuState]) {
    span.mu_in = backend_->PageAddress(u.src_slot, kMuState, 0) + begin;
    span.mu_out = backend_->PageAddress(u.dst_slot, kMuState, 0) + begin;
  }
  if (used_[kNuState]) {
    span.nu_in = backend_->PageAddress(u.src_slot, kNuState, 0) + begin;
    span.nu_out = backend_->PageAddress(u.dst_slot, kNuState, 0) + begin;
  }
  return span;
}

std::string ShardEngine::UpdateAddressable(const ShardUpdate& u) {
  if (u.pieces != nullptr) {
    // Piece by piece, with no copies: the kernel reads each piece's gradient where it lies and writes the new
    // params over it (element by element, each read before its write), while updating the slots.
    const ShardPieces& pieces = *u.pieces;
    int64_t end = 0;
    for (size_t i = 0; i < pieces.sizes.size(); ++i) {
      StateSpan span = SlotSpan(u, pieces.starts[i], pieces.sizes[i]);
      if (pieces.type == GradType::kF32) {
        span.param_copy_out = static_cast<float*>(pieces.out[i]);
      } else {
        span.param_bf16_out = static_cast<uint16_t*>(pieces.out[i]);
      }
      PageGrad g;
      g.type = pieces.type;
      g.dense = pieces.grad[i];
      CountShared(u, g, pieces.sizes[i], StateSpan{});
      CountInPlace(pieces.sizes[i], true);
      if (u.check_finite) {
        if (!backend_->ComputeIfFinite(u.hp, span, pieces.grad[i], pieces.type)) {
          *u.skipped = true;  // slot dst is half written and stays uncommitted: Step skips the step
          return {};
        }
      } else {
        backend_->Compute(u.hp, span, g);
      }
      end = pieces.starts[i] + pieces.sizes[i];
    }
    // The shard's padding past the last piece: a zero gradient (it keeps its zeros), a page at a time.
    for (int64_t begin = end; begin < size_; begin += page_elems_) {
      const int64_t n = std::min(page_elems_, size_ - begin);
      PageGrad g;
      g.type = pieces.type;
      char* stage = GradStage();
      std::memset(stage, 0, static_cast<size_t>(n * GradBytes(pieces.type)));
      g.dense = stage;
      CountInPlace(n, true);
      backend_->Compute(u.hp, SlotSpan(u, begin, n), g);
    }
    return {};
  }
  StateSpan span = SlotSpan(u, 0, size_);
  span.param_copy_out = u.params_out;
  span.param_bf16_out = u.params_bf16_out;
  PageGrad g;
  g.type = u.grad_type;
  g.dense = u.grad;
  g.indices = u.indices;
  g.values = u.values;
  g.count = u.count;
  CountShared(u, g, size_, span);
  CountInPlace(size_, true);
  backend_->Compute(u.hp, span, g);
  return {};
}

std::string ShardEngine::UpdateAddressableFromCaller(const ShardUpdate& u) {
  const int64_t pieces_end =
      u.pieces == nullptr || u.pieces->sizes.empty() ? size_ : u.pieces->starts.back() + u.pieces->sizes.back();
  for (int64_t begin = 0; begin < size_; begin += page_elems_) {
    const int64_t n = std::min(page_elems_, size_ - begin);
    StateSpan span = SlotSpan(u, begin, n);
    span.param_in = CallerParams(u, begin, n);
    if (u.params_out != nullptr) span.param_copy_out = u.params_out + begin;
    if (u.params_bf16_out != nullptr) span.param_bf16_out = u.params_bf16_out + begin;
    const PageGrad g = GradForPage(u, begin / page_elems_);
    CountShared(u, g, std::max<int64_t>(0, std::min(n, pieces_end - begin)), span);
    CountInPlace(n, false);
    backend_->Compute(u.hp, span, g);
    if (u.pieces != nullptr) u.pieces->ScatterParams(begin, n, span.param_out);
  }
  return {};
}

std::string ShardEngine::UpdateStreamed(const ShardUpdate& u) {
  if (buffers_.empty()) {  // allocated once, reused by every later update
    const size_t bytes = backend_->PageBufferBytes(page_elems_);
    buffers_.resize(static_cast<size_t>(pages_in_flight_));
    for (auto& set : buffers_) {
      for (int s = 0; s < kNumStates; ++s) {
        if (used_[s]) set[s] = AlignedBuffer(bytes);
      }
    }
  }
  auto page_len = [&](int64_t page) { return std::min(page_elems_, size_ - page * page_elems_); };
  backend_->StreamStarted();
  Queue free_sets, ready;
  WriteQueues writes;
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
  int states_read = 0;
  for (int s = 0; s < kNumStates; ++s) states_read += to_read[s] ? 1 : 0;
  std::thread feeder([&] {
    Work w;
    for (int64_t page = 0; page < num_pages_ && !error.failed() && free_sets.Pop(&w); ++page) {
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
  });
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
  std::vector<std::thread> readers;
  for (int r = 0; r < kReaders; ++r) readers.emplace_back(read_pages);

  auto write_pages = [&] {
    Work w;
    bool is_param = false;
    while (writes.Pop(&w, &is_param)) {
      if (error.failed()) {  // keep draining so nobody blocks, but write nothing more
        free_sets.Push(w);
        continue;
      }
      const int64_t n = page_len(w.page);
      if (is_param) {
        float* src = buffers_[w.set][kParamState].data;
        if (std::string e = backend_->WritePage(u.dst_slot, kParamState, w.page, src, n, true); !e.empty()) {
          error.Set(e);
        }
        if (used_[kMuState] || used_[kNuState]) {
          writes.PushState(w);  // m/v can wait: the next forward pass needs only params
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
  std::vector<std::thread> writers;
  for (int r = 0; r < kWriters; ++r) writers.emplace_back(write_pages);

  // Compute on the calling thread (the kernel itself fans out over the thread pool).
  const int64_t pieces_end =
      u.pieces == nullptr || u.pieces->sizes.empty() ? 0 : u.pieces->starts.back() + u.pieces->sizes.back();
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
    const PageGrad g = GradForPage(u, w.page);
    // The gradient elements this page takes from the caller (a shard's padding past its pieces comes from none).
    const int64_t from_caller = u.pieces == nullptr ? span.size
                                                    : std::max<int64_t>(0, std::min(span.size, pieces_end - begin));
    CountShared(u, g, from_caller, span);
    backend_->Compute(u.hp, span, g);
    if (u.pieces != nullptr) u.pieces->ScatterParams(begin, span.size, pbuf);
    writes.PushParam(w);
    ++computed;
  }
  // Unblock the readers if we stopped early, then let the writers finish what they hold.
  if (error.failed()) {
    free_sets.Close();
    while (ready.Pop(&w)) {
    }
  }
  feeder.join();
  for (auto& r : readers) r.join();
  // The writers exit once every queued write has drained.
  writes.Close();
  for (auto& t : writers) t.join();
  backend_->StreamFinished(!error.failed());
  if (error.failed()) return error.Get();
  if (computed != num_pages_) return "internal error: not every page was updated";
  return {};
}

// {"store": ID, "shard": I, "version": V, "checksums": {"SLOT": {"version": W, "STATE": [crc, ...]}}}: the slots whose every
// page's checksum is known (the committed one always: its pages were all written or loaded).
std::string ShardEngine::ManifestText(int64_t version) const {
  std::string text = "{\"store\": \"" + store_id_ + "\", \"shard\": " + std::to_string(shard_index_) +
                     ", \"version\": " + std::to_string(version) + ", \"checksums\": {";
  bool first_slot = true;
  for (int slot = 0; slot < 2; ++slot) {
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
    const int64_t held = slot == version % 2 ? version : version - 1;
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
    if (::rename(tmp.c_str(), manifest_.c_str()) != 0) return "cannot commit " + manifest_ + ": " + std::strerror(errno);
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

std::string ShardEngine::Step(ShardUpdate u, int64_t version) {
  const EngineCpuScope cpus;  // NSP_ENGINE_CPUS; the page readers and writers started below inherit it
  std::lock_guard<std::mutex> lock(step_mu_);
  const AddElapsedNs timer(&stats_.update_ns);  // the step's wall time, however it returns
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
  if (std::string e = Sync(u.dst_slot); !e.empty()) return e;
  if (std::string e = Commit(version + 1); !e.empty()) return e;
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
      if (u.pieces != nullptr) u.pieces->ScatterParams(begin, n, page);
      if (u.params_out != nullptr) std::memcpy(u.params_out + begin, page, sizeof(float) * static_cast<size_t>(n));
      if (u.params_bf16_out != nullptr) internal::RoundToBf16(page, u.params_bf16_out + begin, n);
    }
    return {};
  }
  if (u.pieces != nullptr) {  // the committed params into the pieces, a page at a time
    const int slot = static_cast<int>(version % 2);
    AlignedBuffer page_buffer(backend_->PageBufferBytes(page_elems_));
    for (int64_t page = 0; page < num_pages_; ++page) {
      const int64_t begin = page * page_elems_;
      const int64_t n = std::min(page_elems_, size_ - begin);
      if (std::string e = backend_->ReadPage(slot, kParamState, page, page_buffer.data, n, true); !e.empty()) return e;
      u.pieces->ScatterParams(begin, n, page_buffer.data);
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

std::string ShardEngine::Wait() {
  if (pending_.joinable()) pending_.join();
  return std::exchange(pending_error_, std::string());
}

std::string ShardEngine::StepAsync(const ShardUpdate& update, int64_t version) {
  const AddElapsedNs timer(&stats_.wait_ns);  // the time this call holds the caller, however it returns
  if (update.params_in != nullptr) {
    return "the params passed to the update are not the ones the previous update led to; with staleness 1 the "
           "store cannot start a step from them (it hands back params one step old by design): change params "
           "only through the update, or use staleness 0";
  }
  if (std::string e = Wait(); !e.empty()) {
    async_params_valid_ = false;
    return "the previous (background) step failed: " + e;
  }
  if (!async_params_valid_ || version != version_) {
    // First step, or the caller moved on without us: start from the committed params.
    if (version != version_) {
      return "the store no longer holds version " + std::to_string(version) + " (committed: " +
             std::to_string(version_) + ")";
    }
    async_params_.resize(static_cast<size_t>(size_));
    if (std::string e = ReadState(static_cast<int>(version % 2), kParamState, async_params_.data()); !e.empty()) {
      return e;
    }
    async_params_valid_ = true;
  }
  // The caller's buffers live only for this call: copy what the background step reads (first: with pieces the
  // params below may land on the gradient's memory).
  ShardUpdate u = update;
  const size_t gbytes = static_cast<size_t>(GradBytes(update.grad_type));
  if (update.pieces != nullptr) {
    async_grad_.resize(gbytes * static_cast<size_t>(size_));
    update.pieces->GatherGrad(0, size_, async_grad_.data());
    u.grad = async_grad_.data();
    u.pieces = nullptr;
    update.pieces->ScatterParams(0, size_, async_params_.data());  // params one step old for the caller
  } else if (update.grad != nullptr) {
    async_grad_.resize(gbytes * static_cast<size_t>(size_));
    std::memcpy(async_grad_.data(), update.grad, async_grad_.size());
    u.grad = async_grad_.data();
  } else {
    if (std::string e = ValidateSparseIndices(update.indices, update.count, size_); !e.empty()) return e;
    async_grad_.resize(gbytes * static_cast<size_t>(update.count));
    std::memcpy(async_grad_.data(), update.values, async_grad_.size());
    async_indices_.assign(update.indices, update.indices + update.count);
    u.values = async_grad_.data();
    u.indices = async_indices_.data();
  }
  // Params one step old for the caller (bf16 copy too, rounded as the kernel rounds).
  if (update.params_out != nullptr) std::memcpy(update.params_out, async_params_.data(), sizeof(float) * size_);
  if (update.params_bf16_out != nullptr) internal::RoundToBf16(async_params_.data(), update.params_bf16_out, size_);
  u.params_out = async_params_.data();
  u.params_bf16_out = nullptr;
  pending_ = std::thread([this, u, version] {
    // The step runs beside the caller's next forward/backward, which keeps every core busy: computing on one
    // thread at the lowest priority (SCHED_IDLE: any runnable foreground thread preempts it at once; inherited
    // by the readers and writers it starts) lets it use the cores the foreground leaves idle instead of stalling
    // the foreground's parallel loops; its I/O (direct) needs little CPU.
    const bool yield = YieldToForeground();
    if (yield) {
      sched_param param{};
      if (::sched_setscheduler(0, SCHED_IDLE, &param) != 0) {  // where refused: the lowest nice level
        ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
      }
    }
    SerialScope serial(yield);
    pending_error_ = Step(u, version);
    if (!pending_error_.empty()) async_params_valid_ = false;
  });
  return {};
}

std::vector<std::string> ShardEngine::Verify(int slot, int state) {
  std::vector<std::string> problems;
  AlignedBuffer buffer(backend_->PageBufferBytes(page_elems_));
  for (int64_t page = 0; page < num_pages_; ++page) {
    const int64_t n = std::min(page_elems_, size_ - page * page_elems_);
    if (std::string e = backend_->ReadPage(slot, state, page, buffer.data, n, true); !e.empty()) {
      problems.push_back(std::move(e));
    }
  }
  return problems;
}

std::string ShardEngine::ReadState(int slot, int state, float* out) {
  // Pages that are not addressable go through one aligned page buffer, so the backend can read them its
  // fastest way (direct I/O), then into `out` (a memcpy costs a fraction of the read).
  AlignedBuffer bounce;
  if (backend_->PageAddress(slot, state, 0) == nullptr) bounce = AlignedBuffer(backend_->PageBufferBytes(page_elems_));
  for (int64_t page = 0; page < num_pages_; ++page) {
    const int64_t n = std::min(page_elems_, size_ - page * page_elems_);
    float* dst = out + page * page_elems_;
    if (bounce.data == nullptr) {
      if (std::string e = backend_->ReadPage(slot, state, page, dst, n, false); !e.empty()) return e;
      continue;
    }
    if (std::string e = backend_->ReadPage(slot, state, page, bounce.data, n, true); !e.empty()) return e;
    std::memcpy(dst, bounce.data, sizeof(float) * static_cast<size_t>(n));
  }
  return {};
}

std::string ShardEngine::WritePages(int slot, int state, int64_t first_page, const float* in, int64_t n) {
  const int64_t begin = first_page * page_elems_;
  if (first_page < 0 || begin + n > size_ || n < 0 || (n % page_elems_ != 0 && begin + n != size_)) {
    return "write_pages: " + std::to_string(n) + " elements from page " + std::to_string(first_page) +
           " are not whole pages of the shard";
  }
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
