// The registry of engines reachable from XLA FFI calls by handle (engine_registry.h).
#include "engine/engine_registry.h"

#include <utility>

#include "util/handle_registry.h"

namespace nsp {

int64_t RegisterEngine(std::shared_ptr<ShardEngine> engine) {
  return HandleRegistry<ShardEngine>::Global().Register(std::move(engine));
}

std::shared_ptr<ShardEngine> UnregisterEngine(int64_t handle) {
  return HandleRegistry<ShardEngine>::Global().Unregister(handle);
}

std::shared_ptr<ShardEngine> FindEngine(int64_t handle, std::string* why) {
  auto& engines = HandleRegistry<ShardEngine>::Global();
  if (auto engine = engines.Find(handle)) return engine;
  *why = engines.Issued(handle)
             ? "store engine " + std::to_string(handle) + " was closed (store.close(), or the store was dropped); "
               "open the store again and build a new step"
             : "no store engine has handle " + std::to_string(handle);
  return nullptr;
}

}  // namespace nsp
