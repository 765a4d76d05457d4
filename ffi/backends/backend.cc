// What every backend shares: the state names, host-memory page buffers and the host CPU update a backend runs
// unless it has its own.
#include "backends/backend.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

namespace nsp {

namespace {

constexpr size_t kSmallPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;

size_t RoundUp(size_t bytes, size_t unit) { return (bytes + unit - 1) / unit * unit; }

}  // namespace

// A buffer of a huge page or more starts on a huge-page boundary and its whole huge pages are marked
// MADV_HUGEPAGE, so that its memory is physically contiguous 2 MiB at a time, for two reasons:
//   - a direct read or write of a 4 MiB page from such a buffer reaches the device as one or two requests. From
//     scattered 4 KiB pages it is cut into several (the device takes a bounded number of memory segments per
//     request): on a virtual disk measured here that was 3x the requests and 1.8x the time per update;
//   - the update kernel streams it with 512 times fewer TLB misses, and the CPU's prefetchers, which stop at
//     every 4 KiB page boundary, run on: over 64M params on 4 KiB pages the kernel ran at 0.90-0.91x its speed
//     on huge pages here (3 runs each). The memory tier's state lives in these buffers for that reason.
// Where the kernel has transparent huge pages off, the advice does nothing and plain pages serve. The tail past
// the last whole huge page (a page file's checksum block) stays in small pages, so a buffer holds no more memory
// than its size rounded up to 4 KiB.
void* AllocHostBuffer(size_t bytes) {
  if (bytes < kHugePage) {
    void* p = nullptr;
    if (::posix_memalign(&p, kSmallPage, bytes) != 0) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    return p;
  }
  const size_t len = RoundUp(bytes, kSmallPage);
  // Map a huge page more than needed, keep the aligned `len` bytes inside and give back the rest.
  void* raw = ::mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  char* base = static_cast<char*>(raw);
  char* aligned = base + (RoundUp(reinterpret_cast<uintptr_t>(base), kHugePage) - reinterpret_cast<uintptr_t>(base));
  if (aligned > base) ::munmap(base, static_cast<size_t>(aligned - base));
  char* const end = base + len + kHugePage;
  if (end > aligned + len) ::munmap(aligned + len, static_cast<size_t>(end - (aligned + len)));
  ::madvise(aligned, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // advice: ignoring a refusal is safe
  std::memset(aligned, 0, bytes);  // fault the memory in now, not during the first update
  return aligned;
}

void FreeHostBuffer(void* buffer, size_t bytes) {
  if (buffer == nullptr) return;
  if (bytes < kHugePage) {
    std::free(buffer);
  } else {
    ::munmap(buffer, RoundUp(bytes, kSmallPage));
  }
}

void* Backend::AllocPageBuffer(size_t bytes) { return AllocHostBuffer(bytes); }

void Backend::FreePageBuffer(void* buffer, size_t bytes) { FreeHostBuffer(buffer, bytes); }

const char* StateName(int state) {
  static const char* const kNames[kNumStates] = {"param", "mu", "nu"};
  return state >= 0 && state < kNumStates ? kNames[state] : "?";
}

std::string CheckSlotAndState(const char* what, int slot, int state) {
  if (slot >= 0 && slot <= 1 && state >= 0 && state < kNumStates) return {};
  return std::string(what) + ": slot must be 0 or 1 and state 0 (param), 1 (mu) or 2 (nu), got slot " +
         std::to_string(slot) + ", state " + std::to_string(state);
}

void Backend::Compute(const UpdateHyperParams& hp, const StateSpan& span, const PageGrad& grad) {
  if (grad.dense != nullptr) {
    UpdateDense(hp, span, grad.dense, grad.type);
  } else {
    UpdateSparse(hp, span, grad.indices, grad.values, grad.type, grad.count, grad.index_base);
  }
}

bool Backend::ComputeIfFinite(const UpdateHyperParams& hp, const StateSpan& span, const void* grad, GradType type) {
  return UpdateDenseIfFinite(hp, span, grad, type);
}

}  // namespace nsp
