// WorkerThread (worker_thread.h): pthreads with a 1 MiB stack.
#include "util/worker_thread.h"

#include <cstring>
#include <utility>

namespace nsp {

WorkerThread::WorkerThread(WorkerThread&& other) noexcept
    : fn_(std::move(other.fn_)), thread_(other.thread_), running_(other.running_) {
  other.running_ = false;
}

void* WorkerThread::Run(void* self) {
  static_cast<WorkerThread*>(self)->fn_();
  return nullptr;
}

bool WorkerThread::Start(std::function<void()> fn, std::string* why) {
  fn_ = std::move(fn);
  pthread_attr_t attr;
  int rc = pthread_attr_init(&attr);
  if (rc == 0) rc = pthread_attr_setstacksize(&attr, kStackBytes);
  if (rc == 0) rc = pthread_create(&thread_, &attr, &WorkerThread::Run, this);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    *why = std::string("cannot start a thread: ") + std::strerror(rc);
    return false;
  }
  running_ = true;
  return true;
}

void WorkerThread::Join() {
  if (running_) {
    pthread_join(thread_, nullptr);
    running_ = false;
  }
}

}  // namespace nsp
