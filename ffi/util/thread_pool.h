// A small persistent thread pool for the update kernels. The calling thread always takes part, so a pool of
// N threads starts N-1 workers. Concurrent callers never wait for each other: if the pool is busy (e.g. several
// XLA devices call the kernel at once under shard_map), the later caller runs its tasks on its own thread.
#pragma once

#include <functional>

namespace nsp {

// Number of threads the kernels use (NSP_NUM_THREADS, else one per CPU of NSP_ENGINE_CPUS, else the hardware
// concurrency).
int GetNumThreads();
// Resizes the pool; n >= 1.
void SetNumThreads(int n);
// Runs task(i) for every i in [0, num_tasks) and returns when all are done.
void ParallelFor(int num_tasks, const std::function<void(int)>& task);

// While one is alive, ParallelFor called on its thread runs the tasks right there, one after another: for work
// in the background that must not take the pool's cores from the foreground.
class SerialScope {
 public:
  explicit SerialScope(bool enable = true);
  ~SerialScope();
  SerialScope(const SerialScope&) = delete;
  SerialScope& operator=(const SerialScope&) = delete;

 private:
  bool previous_;
};

}  // namespace nsp
