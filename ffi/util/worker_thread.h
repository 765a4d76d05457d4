// WorkerThread: a thread with a small stack, for the store engine's page pipeline.
//
// std::thread takes the process's default stack (8 MiB of address space each, RLIMIT_STACK): an update's
// feeder, 6 readers and up to 8 writers reserved 120 MiB, which under an address-space cap (RLIMIT_AS) was what a
// model near the cap ran out of. These threads move pages and checksum them; 1 MiB is far more than they use.
// A thread that cannot be created is reported (Start returns false), not thrown: the pipeline then runs with the
// threads it got, or stops with an error.
#pragma once

#include <pthread.h>

#include <cstddef>
#include <functional>
#include <string>

namespace nsp {

class WorkerThread {
 public:
  static constexpr size_t kStackBytes = size_t{1} << 20;

  WorkerThread() = default;
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;
  WorkerThread(WorkerThread&& other) noexcept;
  WorkerThread& operator=(WorkerThread&& other) = delete;
  ~WorkerThread() { Join(); }

  // Runs `fn` on a new thread; false, and why in *why, when the thread cannot be created.
  bool Start(std::function<void()> fn, std::string* why);
  // Waits for the thread, if one was started and not yet joined.
  void Join();

 private:
  static void* Run(void* self);
  std::function<void()> fn_;
  pthread_t thread_{};
  bool running_ = false;
};

}  // namespace nsp
