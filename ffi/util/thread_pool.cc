// The kernels' persistent thread pool (thread_pool.h).
#include "util/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "util/engine_cpus.h"

namespace nsp {
namespace {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads) : num_threads_(std::max(1, num_threads)) {
    for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int num_threads() const { return num_threads_; }

  void Run(int num_tasks, const std::function<void(int)>& task) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || num_threads_ == 1 || num_tasks == 1) {
      for (int i = 0; i < num_tasks; ++i) task(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = &task;
      num_tasks_ = num_tasks;
      next_.store(0);
      pending_ = num_tasks;
      ++generation_;
    }
    wake_.notify_all();
    Drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    task_ = nullptr;
  }

 private:
  // Takes tasks until none are left; returns how many this thread ran.
  void Drain() {
    int ran = 0;
    for (int i = next_.fetch_add(1); i < num_tasks_; i = next_.fetch_add(1)) {
      (*task_)(i);
      ++ran;
    }
    if (ran > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      pending_ -= ran;
      if (pending_ == 0) done_.notify_all();
    }
  }

  void WorkerLoop() {
    PinToEngineCpus();  // NSP_ENGINE_CPUS: the kernels' workers stay on the CPUs reserved for the update
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || (generation_ != seen && task_ != nullptr); });
        if (stop_) return;
        seen = generation_;
      }
      Drain();
    }
  }

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the caller whose tasks the pool is running
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* task_ = nullptr;
  int num_tasks_ = 0;
  std::atomic<int> next_{0};
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

int DefaultThreads() {
  if (const char* env = std::getenv("NSP_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n >= 1) return n;
  }
  if (!EngineCpus().empty()) return static_cast<int>(EngineCpus().size());  // one thread per reserved CPU
  return std::max(1u, std::thread::hardware_concurrency());
}

std::mutex g_pool_mu;

// The process-wide pool. Leaked on purpose: joining workers during static destruction at exit is fragile.
// Callers hold a shared_ptr while they run, so SetNumThreads can swap the pool under them safely.
std::shared_ptr<ThreadPool>& PoolSlot() {
  static auto* slot = new std::shared_ptr<ThreadPool>();
  return *slot;
}

std::shared_ptr<ThreadPool> Pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  std::shared_ptr<ThreadPool>& slot = PoolSlot();
  if (!slot) {
    static bool atfork_registered = false;
    if (!atfork_registered) {
      // A forked child has none of the parent's workers: drop the pool without running its destructor
      // (which would join threads that do not exist there) and start a fresh one on first use.
      pthread_atfork(nullptr, nullptr, [] { new std::shared_ptr<ThreadPool>(std::move(PoolSlot())); });
      atfork_registered = true;
    }
    slot = std::make_shared<ThreadPool>(DefaultThreads());
  }
  return slot;
}

}  // namespace

int GetNumThreads() { return Pool()->num_threads(); }

void SetNumThreads(int n) {
  Pool();  // make sure the fork handler is registered
  std::shared_ptr<ThreadPool> old;
  {
    std::lock_guard<std::mutex> lock(g_pool_mu);
    old = std::move(PoolSlot());
    PoolSlot() = std::make_shared<ThreadPool>(std::max(1, n));
  }
  // `old` is destroyed (its workers joined) by whoever releases it last: here, or a caller still running in it.
}

namespace {
thread_local bool t_serial = false;
}  // namespace

SerialScope::SerialScope(bool enable) : previous_(t_serial) { t_serial = t_serial || enable; }
SerialScope::~SerialScope() { t_serial = previous_; }

void ParallelFor(int num_tasks, const std::function<void(int)>& task) {
  if (num_tasks <= 0) return;
  if (t_serial) {
    for (int i = 0; i < num_tasks; ++i) task(i);
    return;
  }
  Pool()->Run(num_tasks, task);
}

}  // namespace nsp
