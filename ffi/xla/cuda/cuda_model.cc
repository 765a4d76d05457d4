// A software model of the CUDA runtime entry points the store update's CUDA handler uses (ffi/xla/cuda/cuda_api.h), for
// testing that handler on a machine without a GPU. "Device" memory is host memory; each stream is a thread that
// runs its copies and event records in order; pinned buffers are ordinary aligned allocations the model keeps a
// list of, and every async copy must have its host side inside one of them (as a real asynchronous copy needs
// pinned memory). Knobs, through the environment or the control functions below:
//   NSP_CUDA_MODEL_DELAY_US   each copy takes this long on its stream (the link is slow; copies overlap the host)
//   NSP_CUDA_MODEL_FAIL_COPY  the copy with this number (1-based, counted over the process) fails when queued
// Built with the system compiler by the tests (as the XRT and AXDIMM models are); never linked into nsp.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "util/model_common.h"

namespace {

constexpr int kSuccess = 0;
constexpr int kInvalidValue = 1;
constexpr int kNotReady = 600;
constexpr int kInjected = 999;  // cudaErrorUnknown

class StreamThread {
 public:
  StreamThread() : worker_([this] { Run(); }) {}
  ~StreamThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  void Push(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_all();
  }
  // Tasks queued and not yet finished.
  int64_t Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(tasks_.size()) + (busy_ ? 1 : 0);
  }
  void Drain() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [this] { return tasks_.empty() && !busy_; });
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
      lock.unlock();
      task();
      lock.lock();
      busy_ = false;
      if (tasks_.empty()) idle_cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread worker_;
};

struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = true;
};

struct Model {
  std::mutex mu;
  std::map<void*, StreamThread*> streams;  // nullptr: the default stream
  std::map<char*, size_t> pinned;          // start -> bytes
  int64_t delay_us = nsp_model::EnvInt("NSP_CUDA_MODEL_DELAY_US", 0);
  int64_t fail_copy = nsp_model::EnvInt("NSP_CUDA_MODEL_FAIL_COPY", 0);
  // Counters: copies queued, bytes each way, pinned allocations and frees, synchronisations.
  int64_t copies = 0, bytes_h2d = 0, bytes_d2h = 0, host_allocs = 0, host_frees = 0, syncs = 0, unpinned = 0;

  StreamThread* Stream(void* s) {
    std::lock_guard<std::mutex> lock(mu);
    StreamThread*& t = streams[s];
    if (t == nullptr) t = new StreamThread();  // lives as long as the process
    return t;
  }
  bool Pinned(const void* p, size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    const char* c = static_cast<const char*>(p);
    auto it = pinned.upper_bound(const_cast<char*>(c));
    if (it == pinned.begin()) return false;
    --it;
    return c >= it->first && c + n <= it->first + it->second;
  }
};

Model& M() {
  static Model* m = new Model();
  return *m;
}

thread_local std::string last_error_text;

}  // namespace

extern "C" {

int cudaMemcpyAsync(void* dst, const void* src, size_t bytes, int kind, void* stream) {
  Model& m = M();
  const void* host = kind == 1 ? src : kind == 2 ? dst : nullptr;
  if (host == nullptr) return kInvalidValue;  // the handler only ever copies host<->device
  if (!m.Pinned(host, bytes)) {
    std::lock_guard<std::mutex> lock(m.mu);
    m.unpinned++;
    return kInvalidValue;
  }
  int64_t number, delay;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    number = ++m.copies;
    delay = m.delay_us;
    if (m.fail_copy > 0 && number == m.fail_copy) {
      m.fail_copy = 0;
      return kInjected;
    }
    (kind == 1 ? m.bytes_h2d : m.bytes_d2h) += static_cast<int64_t>(bytes);
  }
  m.Stream(stream)->Push([dst, src, bytes, delay] {
    if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
    std::memcpy(dst, src, bytes);
  });
  return kSuccess;
}

int cudaStreamSynchronize(void* stream) {
  Model& m = M();
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.syncs++;
  }
  m.Stream(stream)->Drain();
  return kSuccess;
}

int cudaHostAlloc(void** ptr, size_t bytes, unsigned /*flags*/) {
  if (ptr == nullptr || bytes == 0) return kInvalidValue;
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) return 2;  // cudaErrorMemoryAllocation
  Model& m = M();
  std::lock_guard<std::mutex> lock(m.mu);
  m.pinned[static_cast<char*>(p)] = bytes;
  m.host_allocs++;
  *ptr = p;
  return kSuccess;
}

int cudaFreeHost(void* ptr) {
  Model& m = M();
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.pinned.erase(static_cast<char*>(ptr)) == 0) return kInvalidValue;
  m.host_frees++;
  std::free(ptr);
  return kSuccess;
}

int cudaEventCreateWithFlags(void** event, unsigned /*flags*/) {
  *event = new EventState();
  return kSuccess;
}

int cudaEventRecord(void* event, void* stream) {
  auto* e = static_cast<EventState*>(event);
  {
    std::lock_guard<std::mutex> lock(e->mu);
    e->done = false;
  }
  M().Stream(stream)->Push([e] {
    std::lock_guard<std::mutex> lock(e->mu);
    e->done = true;
    e->cv.notify_all();
  });
  return kSuccess;
}

int cudaEventQuery(void* event) {
  auto* e = static_cast<EventState*>(event);
  std::lock_guard<std::mutex> lock(e->mu);
  return e->done ? kSuccess : kNotReady;
}

int cudaEventSynchronize(void* event) {
  auto* e = static_cast<EventState*>(event);
  std::unique_lock<std::mutex> lock(e->mu);
  e->cv.wait(lock, [e] { return e->done; });
  return kSuccess;
}

int cudaEventDestroy(void* event) {
  delete static_cast<EventState*>(event);
  return kSuccess;
}

const char* cudaGetErrorString(int error) {
  switch (error) {
    case kSuccess: return "no error";
    case kInvalidValue: return "invalid argument";
    case kNotReady: return "device not ready";
    case kInjected: return "unknown error (a copy failed on demand in the CUDA model)";
    default: last_error_text = "CUDA model error " + std::to_string(error); return last_error_text.c_str();
  }
}

// Control and counters, for tests.
void nspCudaModelFailCopy(int64_t number) {
  std::lock_guard<std::mutex> lock(M().mu);
  M().fail_copy = number;
}

void nspCudaModelSetDelayUs(int64_t us) {
  std::lock_guard<std::mutex> lock(M().mu);
  M().delay_us = us;
}

// Copies and event records queued on any stream and not yet run.
int64_t nspCudaModelPending() {
  Model& m = M();
  std::lock_guard<std::mutex> lock(m.mu);
  int64_t pending = 0;
  for (auto& [stream, thread] : m.streams) pending += thread->Pending();
  return pending;
}

// copies, bytes host-to-device, bytes device-to-host, pinned allocations, pinned frees, stream synchronisations,
// copies refused because their host side was not pinned.
void nspCudaModelStats(int64_t* out) {
  Model& m = M();
  std::lock_guard<std::mutex> lock(m.mu);
  const int64_t values[] = {m.copies, m.bytes_h2d, m.bytes_d2h, m.host_allocs, m.host_frees, m.syncs, m.unpinned};
  std::memcpy(out, values, sizeof(values));
}

}  // extern "C"
