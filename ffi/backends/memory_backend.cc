// The host-memory backend: both version slots of every state in RAM, or one slot updated in place.
#include <cstring>
#include <memory>
#include <vector>

#include "backends/backend.h"

namespace nsp {

namespace {

// Gives a state's buffer back to AllocHostBuffer's allocator.
struct Free {
  size_t bytes = 0;
  void operator()(float* p) const { FreeHostBuffer(p, bytes); }
};

class MemoryBackend final : public Backend {
 public:
  MemoryBackend(int64_t size, int64_t page_elems, std::vector<bool> states_used, bool in_place)
      : page_elems_(page_elems), in_place_(in_place) {
    const size_t bytes = sizeof(float) * static_cast<size_t>(size);
    for (int slot = 0; slot < (in_place ? 1 : 2); ++slot) {
      for (int s = 0; s < kNumStates; ++s) {
        if (!states_used[s]) continue;
        // On huge pages where the kernel grants them (the update streams it: AllocHostBuffer says why), and
        // 64-byte aligned, so the kernel may stream its out-of-place writes into the other slot.
        data_[slot][s] = std::unique_ptr<float, Free>(static_cast<float*>(AllocHostBuffer(bytes)), Free{bytes});
      }
    }
  }
  std::string name() const override { return "memory"; }
  bool KeepsPrevious() const override { return !in_place_; }
  float* PageAddress(int slot, int state, int64_t page) override {
    float* base = data_[in_place_ ? 0 : slot][state].get();
    return base == nullptr ? nullptr : base + page * page_elems_;
  }
  std::string ReadPage(int slot, int state, int64_t page, float* dst, int64_t n, bool) override {
    std::memcpy(dst, PageAddress(slot, state, page), sizeof(float) * n);
    return {};
  }
  std::string WritePage(int slot, int state, int64_t page, float* src, int64_t n, bool) override {
    float* dst = PageAddress(slot, state, page);
    if (dst != src) std::memcpy(dst, src, sizeof(float) * n);
    return {};
  }
  std::string Sync(int) override { return {}; }

 private:
  int64_t page_elems_;
  bool in_place_;
  std::unique_ptr<float, Free> data_[2][kNumStates];  // [slot][state]; slot 1 unused in place
};

}  // namespace

std::unique_ptr<Backend> MakeMemoryBackend(int64_t size, int64_t page_elems, std::vector<bool> states_used,
                                           bool in_place) {
  return std::make_unique<MemoryBackend>(size, page_elems, std::move(states_used), in_place);
}

}  // namespace nsp
