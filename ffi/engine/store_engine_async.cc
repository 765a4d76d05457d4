// The engine's staleness-1 step (ShardEngine::StepAsync): the step finishes on a background thread while the
// caller's next forward/backward runs on params one step old; Wait joins it and hands back its error.
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "engine/store_engine.h"
#include "kernels/kernel_block.h"
#include "util/elapsed.h"
#include "util/engine_cpus.h"
#include "util/thread_pool.h"

namespace nsp {
namespace {

// A staleness-1 step in the background yields the CPU to the foreground (see StepAsync), unless
// NSP_BACKGROUND_PRIORITY=normal, or NSP_ENGINE_CPUS gave the update CPUs of its own (nothing there to yield to).
bool YieldToForeground() {
  static const bool yield = [] {
    const char* env = std::getenv("NSP_BACKGROUND_PRIORITY");
    return (env == nullptr || std::string(env) != "normal") && EngineCpus().empty();
  }();
  return yield;
}

}  // namespace

std::string ShardEngine::Wait() {
  if (pending_.joinable()) pending_.join();
  return std::exchange(pending_error_, std::string());
}

std::string ShardEngine::StepAsync(const ShardUpdate& update, int64_t version) {
  const AddElapsedNs timer(&stats_.wait_ns);  // the time this call holds the caller, however it returns
  if (update.params_in != nullptr) {
    return "the params passed to the update are not the ones the previous update led to; with staleness 1 the "
           "store cannot start a step from them (it hands back params one step old by design): change params "
           "only through the update, or use staleness 0";
  }
  if (std::string e = Wait(); !e.empty()) {
    async_params_valid_ = false;
    return "the previous (background) step failed: " + e;
  }
  if (!async_params_valid_ || version != version_) {
    // First step, or the caller moved on without us: start from the committed params.
    if (version != version_) {
      return "the store no longer holds version " + std::to_string(version) + " (committed: " +
             std::to_string(version_) + ")";
    }
    async_params_.resize(static_cast<size_t>(size_));
    if (std::string e = ReadState(static_cast<int>(version % 2), kParamState, async_params_.data()); !e.empty()) {
      return e;
    }
    async_params_valid_ = true;
  }
  // The caller's buffers live only for this call: copy what the background step reads (first: with pieces the
  // params below may land on the gradient's memory).
  ShardUpdate u = update;
  const size_t gbytes = static_cast<size_t>(GradBytes(update.grad_type));
  if (update.pieces != nullptr) {
    async_grad_.resize(gbytes * static_cast<size_t>(size_));
    if (std::string e = update.pieces->GatherGrad(0, size_, async_grad_.data()); !e.empty()) return e;
    u.grad = async_grad_.data();
    u.pieces = nullptr;
    // params one step old for the caller
    if (std::string e = update.pieces->ScatterParams(0, size_, async_params_.data()); !e.empty()) return e;
  } else if (update.grad != nullptr) {
    async_grad_.resize(gbytes * static_cast<size_t>(size_));
    std::memcpy(async_grad_.data(), update.grad, async_grad_.size());
    u.grad = async_grad_.data();
  } else {
    if (std::string e = ValidateSparseIndices(update.indices, update.count, size_); !e.empty()) return e;
    async_grad_.resize(gbytes * static_cast<size_t>(update.count));
    std::memcpy(async_grad_.data(), update.values, async_grad_.size());
    async_indices_.assign(update.indices, update.indices + update.count);
    u.values = async_grad_.data();
    u.indices = async_indices_.data();
  }
  // Params one step old for the caller (bf16 copy too, rounded as the kernel rounds).
  if (update.params_out != nullptr) std::memcpy(update.params_out, async_params_.data(), sizeof(float) * size_);
  if (update.params_bf16_out != nullptr) internal::RoundToBf16(async_params_.data(), update.params_bf16_out, size_);
  u.params_out = async_params_.data();
  u.params_bf16_out = nullptr;
  pending_ = std::thread([this, u, version] {
    // The step runs beside the caller's next forward/backward, which keeps every core busy: computing on one
    // thread at the lowest priority (SCHED_IDLE: any runnable foreground thread preempts it at once; inherited
    // by the readers and writers it starts) lets it use the cores the foreground leaves idle instead of stalling
    // the foreground's parallel loops; its I/O (direct) needs little CPU.
    const bool yield = YieldToForeground();
    if (yield) {
      sched_param param{};
      if (::sched_setscheduler(0, SCHED_IDLE, &param) != 0) {  // where refused: the lowest nice level
        ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
      }
    }
    SerialScope serial(yield);
    pending_error_ = Step(u, version);
    if (!pending_error_.empty()) async_params_valid_ = false;
  });
  return {};
}

}  // namespace nsp
