// Objects reachable from XLA FFI calls by an integer handle (an attribute of the compiled call): store engines,
// spill areas. Handles are never reused, and the registry owns a reference to each object: a call takes its own
// while it runs (Find), so unregistering never frees an object under a running call, and a step compiled for a
// closed one finds nothing instead of another's object. The map is leaked on purpose: XLA may still run a call
// during static destruction at exit.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace nsp {

template <typename T>
class HandleRegistry {
 public:
  // The process's registry of T (leaked on purpose: see above).
  static HandleRegistry& Global() {
    static auto* registry = new HandleRegistry();
    return *registry;
  }

  int64_t Register(std::shared_ptr<T> object) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t handle = next_++;
    objects_[handle] = std::move(object);
    return handle;
  }
  // The registry's reference, or null: the caller chooses where the object's destructor runs.
  std::shared_ptr<T> Unregister(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(handle);
    if (it == objects_.end()) return nullptr;
    std::shared_ptr<T> object = std::move(it->second);
    objects_.erase(it);
    return object;
  }
  std::shared_ptr<T> Find(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(handle);
    return it == objects_.end() ? nullptr : it->second;
  }
  // Whether `handle` was given out (and so, when Find finds nothing, closed rather than never valid).
  bool Issued(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    return handle > 0 && handle < next_;
  }

 private:
  std::mutex mu_;
  int64_t next_ = 1;
  std::unordered_map<int64_t, std::shared_ptr<T>> objects_;
};

}  // namespace nsp
