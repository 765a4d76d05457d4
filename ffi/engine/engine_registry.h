// Engines reachable from XLA FFI calls by handle. A compiled step names its store's engines with integer
// handles (attributes); Python registers an engine when it opens a store and unregisters it on close.
//
// Handles are never reused, and the registry owns a reference to each engine: a call takes its own reference
// while it runs (FindEngine), so unregistering (closing a store) never frees an engine under a running step, and
// a step compiled for a closed store finds nothing instead of another store's engine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/store_engine.h"

namespace nsp {

int64_t RegisterEngine(std::shared_ptr<ShardEngine> engine);
// Returns the registry's reference (null if the handle was not registered), so that the caller chooses where
// the engine's destructor runs when it was the last one.
std::shared_ptr<ShardEngine> UnregisterEngine(int64_t handle);
// The engine, or null with `why` saying whether the handle was closed or never existed.
std::shared_ptr<ShardEngine> FindEngine(int64_t handle, std::string* why);

}  // namespace nsp
