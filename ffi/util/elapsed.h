// Wall time as the engine and the file tier measure it: nanoseconds of the steady clock.
#pragma once

#include <chrono>
#include <cstdint>

namespace nsp {

inline int64_t NsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

// Adds the wall time from its construction to its destruction to *total (a call's time, however it returns).
class AddElapsedNs {
 public:
  explicit AddElapsedNs(int64_t* total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~AddElapsedNs() { *total_ += NsSince(start_); }
  AddElapsedNs(const AddElapsedNs&) = delete;
  AddElapsedNs& operator=(const AddElapsedNs&) = delete;

 private:
  int64_t* total_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace nsp
