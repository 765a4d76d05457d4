// Engines reachable from XLA FFI calls by handle. A compiled step names its store's engines with integer
// handles (attributes); Python registers an engine when it opens a store and unregisters it on close.
#pragma once

#include <cstdint>

#include "store_engine.h"

namespace nsp {

int64_t RegisterEngine(ShardEngine* engine);
void UnregisterEngine(int64_t handle);
// Null when the handle is unknown (the store was closed).
ShardEngine* FindEngine(int64_t handle);

}  // namespace nsp
