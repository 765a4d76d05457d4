#include "engine_registry.h"

#include <mutex>
#include <unordered_map>

namespace nsp {
namespace {

std::mutex g_mu;
int64_t g_next = 1;

std::unordered_map<int64_t, ShardEngine*>& Engines() {
  static auto* engines = new std::unordered_map<int64_t, ShardEngine*>();
  return *engines;
}

}  // namespace

int64_t RegisterEngine(ShardEngine* engine) {
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t handle = g_next++;
  Engines()[handle] = engine;
  return handle;
}

void UnregisterEngine(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  Engines().erase(handle);
}

ShardEngine* FindEngine(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Engines().find(handle);
  return it == Engines().end() ? nullptr : it->second;
}

}  // namespace nsp
