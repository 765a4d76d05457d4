// The registry of engines reachable from XLA FFI calls by handle (engine_registry.h).
#include "engine/engine_registry.h"

#include <mutex>
#include <unordered_map>
#include <utility>

namespace nsp {
namespace {

std::mutex g_mu;
int64_t g_next = 1;

// Leaked on purpose: XLA may still run a call during static destruction at exit.
std::unordered_map<int64_t, std::shared_ptr<ShardEngine>>& Engines() {
  static auto* engines = new std::unordered_map<int64_t, std::shared_ptr<ShardEngine>>();
  return *engines;
}

}  // namespace

int64_t RegisterEngine(std::shared_ptr<ShardEngine> engine) {
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t handle = g_next++;
  Engines()[handle] = std::move(engine);
  return handle;
}

std::shared_ptr<ShardEngine> UnregisterEngine(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Engines().find(handle);
  if (it == Engines().end()) return nullptr;
  std::shared_ptr<ShardEngine> engine = std::move(it->second);
  Engines().erase(it);
  return engine;
}

std::shared_ptr<ShardEngine> FindEngine(int64_t handle, std::string* why) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Engines().find(handle);
  if (it != Engines().end()) return it->second;
  *why = handle > 0 && handle < g_next
             ? "store engine " + std::to_string(handle) + " was closed (store.close(), or the store was dropped); "
               "open the store again and build a new step"
             : "no store engine has handle " + std::to_string(handle);
  return nullptr;
}

}  // namespace nsp
