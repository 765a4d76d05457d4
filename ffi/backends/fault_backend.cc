// Fault injection as a backend around a real one: the faults the tests and the fault campaign need (a full disk,
// a crash mid-update, a crash at a commit) live here, so the real backends and the engine carry no debug code.
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"

namespace nsp {

namespace {

int64_t EnvCount(const char* name) {
  const char* env = std::getenv(name);
  return env ? std::atoll(env) : int64_t{-1};
}

class FaultInjectingBackend final : public Backend {
 public:
  FaultInjectingBackend(std::unique_ptr<Backend> inner, FaultPlan plan) : inner_(std::move(inner)), plan_(plan) {}

  std::string name() const override { return inner_->name(); }
  float* PageAddress(int slot, int state, int64_t page) override { return inner_->PageAddress(slot, state, page); }
  size_t PageBufferBytes(int64_t page_elems) const override { return inner_->PageBufferBytes(page_elems); }

  std::string ReadPage(int slot, int state, int64_t page, float* dst, int64_t n, bool scratch) override {
    return inner_->ReadPage(slot, state, page, dst, n, scratch);
  }

  // Both faults strike before the write reaches the inner backend: a full disk refuses the page, and a crash
  // lands between two page writes of the uncommitted slot. The error reads as the real one does (ENOSPC's text).
  std::string WritePage(int slot, int state, int64_t page, float* src, int64_t n, bool scratch) override {
    if (plan_.fail_writes_after >= 0 && writes_.fetch_add(1) >= plan_.fail_writes_after) {
      errno = ENOSPC;
      return "cannot write page " + std::to_string(page) + " of state '" + StateName(state) + "' in slot " +
             std::to_string(slot) + " (" + inner_->name() + " tier): " + std::strerror(ENOSPC) +
             " (an injected fault: page writes after the first " + std::to_string(plan_.fail_writes_after) +
             " fail)";
    }
    if (plan_.kill_after_writes >= 0 && kill_writes_.fetch_add(1) >= plan_.kill_after_writes) ::raise(SIGKILL);
    return inner_->WritePage(slot, state, page, src, n, scratch);
  }

  std::string Sync(int slot) override { return inner_->Sync(slot); }
  std::vector<uint32_t> PageChecksums(int slot, int state) const override {
    return inner_->PageChecksums(slot, state);
  }
  std::string SetPageChecksums(int slot, int state, const std::vector<uint32_t>& crcs) override {
    return inner_->SetPageChecksums(slot, state, crcs);
  }
  IoCounts Io() const override { return inner_->Io(); }
  void StreamStarted() override { inner_->StreamStarted(); }
  std::string PrepareSlot(int slot, const bool* used, int64_t first, int64_t end) override {
    return inner_->PrepareSlot(slot, used, first, end);
  }
  void StreamFinished(bool ok) override { inner_->StreamFinished(ok); }
  bool KeepsPrevious() const override { return inner_->KeepsPrevious(); }

  std::string ScratchChecksums(int64_t first, int64_t end, const bool* used, std::vector<uint32_t>* out) override {
    return inner_->ScratchChecksums(first, end, used, out);
  }
  std::string SwitchPages(int64_t first, int64_t end, const bool* used, const uint32_t* crcs,
                          bool recovering) override {
    static std::atomic<int64_t> switches{0};  // the process's, as commits are
    if (plan_.kill_at_switch >= 0 && ++switches >= plan_.kill_at_switch) ::raise(SIGKILL);
    return inner_->SwitchPages(first, end, used, crcs, recovering);
  }
  std::string DiscardScratch() override { return inner_->DiscardScratch(); }
  // The commit count is the process's: the campaign aims at "the Nth commit" of a run whose shards commit in
  // turn, not at one shard's.
  void BeforeCommit(int64_t version) override {
    static std::atomic<int64_t> commits{0};
    if (plan_.kill_at_commit >= 0 && ++commits >= plan_.kill_at_commit) ::raise(SIGKILL);
    inner_->BeforeCommit(version);
  }

  void Compute(const UpdateHyperParams& hp, const StateSpan& span, const PageGrad& grad) override {
    inner_->Compute(hp, span, grad);
  }
  bool ComputeIfFinite(const UpdateHyperParams& hp, const StateSpan& span, const void* grad, GradType type) override {
    return inner_->ComputeIfFinite(hp, span, grad, type);
  }

 private:
  std::unique_ptr<Backend> inner_;
  const FaultPlan plan_;
  std::atomic<int64_t> writes_{0};       // page writes tried, for fail_writes_after
  std::atomic<int64_t> kill_writes_{0};  // page writes that did not fail, for kill_after_writes
};

}  // namespace

FaultPlan FaultPlanFromEnv() {
  FaultPlan plan;
  plan.fail_writes_after = EnvCount("NSP_DEBUG_FAIL_WRITES_AFTER");
  plan.kill_after_writes = EnvCount("NSP_DEBUG_KILL_AFTER_WRITES");
  plan.kill_at_commit = EnvCount("NSP_DEBUG_KILL_AT_COMMIT");
  plan.kill_at_switch = EnvCount("NSP_DEBUG_KILL_AT_SWITCH");
  return plan;
}

std::unique_ptr<Backend> MakeFaultInjectingBackend(std::unique_ptr<Backend> inner, FaultPlan plan) {
  return std::make_unique<FaultInjectingBackend>(std::move(inner), plan);
}

}  // namespace nsp
