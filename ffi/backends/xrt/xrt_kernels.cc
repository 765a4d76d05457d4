// The XRT plugin's kernel runs (xrt_device.h): the updater kernel nsp_update_page on the card, through the XRT
// run API, one run at a time. The state's arguments are the engine's P2P buffers in place (or staged copies of host
// memory); the gradient, Top-K indices and coefficients go in through normal buffers (written, synced to the
// device), the outputs that were staged come back the same way once the run completes.
#include <algorithm>
#include <cerrno>
#include <string>
#include <utility>

#include "backends/hls/nsp_updater_hls.h"
#include "backends/xrt/xrt_device.h"

namespace nsp::xrt {
namespace {

// A normal BO of at least `bytes` for kernel argument `arg`, grown (freed and allocated again) when too small.
std::string StagingBo(nsp_backend_device* d, int arg, size_t bytes, xrtBufferHandle* out) {
  Bo& b = d->staging[arg];
  if (b.handle == nullptr || b.bytes < bytes) {
    if (b.handle != nullptr) d->api.xrtBOFree(b.handle);
    b = Bo{};
    const size_t want = std::max<size_t>(bytes, 4096);
    b.handle = d->api.xrtBOAlloc(d->dev, want, NSP_XRT_BO_FLAGS_NONE, 0);
    if (b.handle == nullptr) {
      const int code = errno;
      return "allocating a " + std::to_string(want) + "-byte buffer failed: " + d->XrtError(code);
    }
    b.bytes = want;
  }
  *out = b.handle;
  return {};
}

// Host memory -> a normal BO -> the device's DDR.
std::string CopyIn(nsp_backend_device* d, int arg, const void* src, size_t bytes, xrtBufferHandle* out) {
  if (std::string e = StagingBo(d, arg, bytes, out); !e.empty()) return e;
  if (bytes == 0) return {};
  if (int rc = d->api.xrtBOWrite(*out, src, bytes, 0)) return "xrtBOWrite failed: " + d->XrtError(rc);
  if (int rc = d->api.xrtBOSync(*out, NSP_XRT_BO_SYNC_TO_DEVICE, bytes, 0)) {
    return "xrtBOSync to the device failed: " + d->XrtError(rc);
  }
  d->bytes_to_device.fetch_add(static_cast<int64_t>(bytes));
  return {};
}

const char* const kArgNames[] = {"p_in", "m_in", "v_in", "p_out", "m_out", "v_out", "p_bf16_out",
                                 "grad_f32", "grad_bf16", "topk_idx", "coeffs"};

// Binds one state argument: the P2P buffer the pointer is, or a staged copy of host memory (inputs copied in,
// outputs copied back after the run; an output that is its input shares the input's BO).
std::string BindState(nsp_backend_device* d, int arg, const float* ptr, bool is_output, const float* in_ptr,
                      xrtBufferHandle in_bo, int64_t n, PendingRun* job, xrtBufferHandle* bound) {
  const size_t bytes = static_cast<size_t>(n) * 4;
  if (ptr == nullptr) {
    *bound = d->dummy.handle;
    return {};
  }
  if (xrtBufferHandle bo = BufferAt(d, ptr, bytes)) {
    *bound = bo;
    return {};
  }
  if (is_output && ptr == in_ptr) {
    *bound = in_bo;
  } else if (is_output) {
    if (std::string e = StagingBo(d, arg, bytes, bound); !e.empty()) return e;
  } else {
    return CopyIn(d, arg, ptr, bytes, bound);
  }
  job->copies.push_back({*bound, const_cast<float*>(ptr), bytes});
  return {};
}

int32_t GradFormat(const nsp_page_grad& g) {
  const bool bf16 = g.grad_type == NSP_GRAD_BF16;
  if (g.dense != nullptr) return bf16 ? NSP_HLS_GRAD_BF16 : NSP_HLS_GRAD_F32;
  return bf16 ? NSP_HLS_TOPK_BF16 : NSP_HLS_TOPK_F32;
}

// Stages everything a run reads, binds every argument and starts it. Returns "" or why not.
std::string StartRun(nsp_backend_device* d, const nsp_hyper_params& hp, const nsp_state_span& s,
                     const nsp_page_grad& g, PendingRun* job) {
  const int64_t n = s.size;
  if (n < 1 || n > d->page_elems) return "a span of " + std::to_string(n) + " elements is not a page";
  const int32_t fmt = GradFormat(g);
  const uint32_t flags = nsp_hls_flags(hp.kind, fmt, hp.lazy, hp.nesterov, hp.momentum, s.param_bf16_out != nullptr);
  float coeffs[NSP_HLS_NUM_COEFFS];
  if (const char* e = nsp_hls_make_coeffs(hp.kind, hp.lr, hp.step, hp.b1, hp.b2, hp.eps, hp.weight_decay, hp.momentum,
                                          coeffs)) {
    return e;
  }
  const bool um = nsp_hls_uses_m(flags), uv = nsp_hls_uses_v(flags);
  if ((um && (s.mu_in == nullptr || s.mu_out == nullptr)) || (uv && (s.nu_in == nullptr || s.nu_out == nullptr))) {
    return "the optimizer keeps a moment the span does not hold";
  }
  xrtBufferHandle bo[NSP_XRT_NUM_ARGS] = {};
  for (int a = 0; a <= NSP_XRT_ARG_COEFFS; ++a) bo[a] = d->dummy.handle;
  const float* ins[3] = {s.param_in, um ? s.mu_in : nullptr, uv ? s.nu_in : nullptr};
  const float* outs[3] = {s.param_out, um ? s.mu_out : nullptr, uv ? s.nu_out : nullptr};
  for (int k = 0; k < 3; ++k) {
    if (std::string e = BindState(d, NSP_XRT_ARG_P_IN + k, ins[k], false, nullptr, nullptr, n, job, &bo[k]);
        !e.empty()) {
      return std::string(kArgNames[k]) + ": " + e;
    }
  }
  for (int k = 0; k < 3; ++k) {
    const int arg = NSP_XRT_ARG_P_OUT + k;
    if (std::string e = BindState(d, arg, outs[k], true, ins[k], bo[k], n, job, &bo[arg]); !e.empty()) {
      return std::string(kArgNames[arg]) + ": " + e;
    }
  }
  int64_t count = 0;
  const size_t gsize = g.grad_type == NSP_GRAD_BF16 ? 2 : 4;
  const int garg = g.grad_type == NSP_GRAD_BF16 ? NSP_XRT_ARG_GRAD_BF16 : NSP_XRT_ARG_GRAD_F32;
  if (g.dense != nullptr) {
    if (std::string e = CopyIn(d, garg, g.dense, gsize * static_cast<size_t>(n), &bo[garg]); !e.empty()) {
      return "the gradient: " + e;
    }
  } else {
    count = g.count;
    if (nsp_hls_check_topk(g.indices, count, n, g.index_base) >= 0) {
      return "its Top-K indices are unsorted or outside the page";
    }
    if (count > 0) {
      if (std::string e = CopyIn(d, garg, g.values, gsize * static_cast<size_t>(count), &bo[garg]); !e.empty()) {
        return "the Top-K values: " + e;
      }
      if (std::string e = CopyIn(d, NSP_XRT_ARG_TOPK_IDX, g.indices, 4 * static_cast<size_t>(count),
                                 &bo[NSP_XRT_ARG_TOPK_IDX]);
          !e.empty()) {
        return "the Top-K indices: " + e;
      }
    }
  }
  if (std::string e = CopyIn(d, NSP_XRT_ARG_COEFFS, coeffs, sizeof coeffs, &bo[NSP_XRT_ARG_COEFFS]); !e.empty()) {
    return "the coefficients: " + e;
  }
  if (s.param_bf16_out != nullptr) {
    const size_t bytes = 2 * static_cast<size_t>(n);
    if (std::string e = StagingBo(d, NSP_XRT_ARG_P_BF16_OUT, bytes, &bo[NSP_XRT_ARG_P_BF16_OUT]); !e.empty()) {
      return "the bf16 params: " + e;
    }
    job->copies.push_back({bo[NSP_XRT_ARG_P_BF16_OUT], s.param_bf16_out, bytes});
  }
  for (int a = 0; a <= NSP_XRT_ARG_COEFFS; ++a) {
    if (int rc = d->api.xrtRunSetArg(d->run, a, bo[a])) return "xrtRunSetArg failed: " + d->XrtError(rc);
  }
  const int32_t scalars[] = {static_cast<int32_t>(n), static_cast<int32_t>(count),
                             static_cast<int32_t>(g.dense != nullptr ? 0 : g.index_base), static_cast<int32_t>(flags)};
  for (int k = 0; k < 4; ++k) {
    if (int rc = d->api.xrtRunSetArg(d->run, NSP_XRT_ARG_N + k, scalars[k])) {
      return "xrtRunSetArg failed: " + d->XrtError(rc);
    }
  }
  job->n = n;
  job->p_out = s.param_out;
  job->param_copy_out = s.param_copy_out;
  if (int rc = d->api.xrtRunStart(d->run)) return "xrtRunStart failed: " + d->XrtError(rc);
  d->runs.fetch_add(1);
  return {};
}

std::string KernelMessage(const nsp_backend_device* d, int64_t page, const std::string& why) {
  return d->Name() + ": the update kernel on page " + std::to_string(page) + " failed: " + why;
}

}  // namespace

std::string FinishRun(nsp_backend_device* d) {
  PendingRun& job = d->pending;
  d->have_pending = false;
  std::string e;
  const int state = d->api.xrtRunWait(d->run);
  if (state != NSP_ERT_CMD_STATE_COMPLETED) {
    const int code = errno;
    e = "the run ended in state " + std::to_string(state) + ": " + d->XrtError(code);
  }
  for (size_t i = 0; e.empty() && i < job.copies.size(); ++i) {
    const auto& c = job.copies[i];
    if (int rc = d->api.xrtBOSync(c.bo, NSP_XRT_BO_SYNC_FROM_DEVICE, c.bytes, 0)) {
      e = "xrtBOSync from the device failed: " + d->XrtError(rc);
    } else if (int rc2 = d->api.xrtBORead(c.bo, c.dst, c.bytes, 0)) {
      e = "xrtBORead failed: " + d->XrtError(rc2);
    } else {
      d->bytes_from_device.fetch_add(static_cast<int64_t>(c.bytes));
    }
  }
  // The params the host asked for: out of the params' P2P buffer (or the staged copy just read back).
  if (e.empty() && job.param_copy_out != nullptr) {
    const size_t bytes = static_cast<size_t>(job.n) * 4;
    if (xrtBufferHandle bo = BufferAt(d, job.p_out, bytes)) {
      if (int rc = d->api.xrtBORead(bo, job.param_copy_out, bytes, 0)) e = "xrtBORead failed: " + d->XrtError(rc);
      else d->bytes_from_device.fetch_add(static_cast<int64_t>(bytes));
    } else {
      std::memcpy(job.param_copy_out, job.p_out, bytes);
    }
  }
  if (!e.empty()) {
    d->failed_runs.fetch_add(1);
    e = KernelMessage(d, job.page, e);
  }
  d->done[job.ticket] = e;
  return e;
}

int ComputeLaunch(nsp_backend_device* d, const nsp_hyper_params* hp, const nsp_state_span* span,
                  const nsp_page_grad* grad, const nsp_page_info* info, uint64_t* ticket, char* err, size_t err_len) {
  if (nsp::plugin::CheckLaunch(*d, hp, span, grad, ticket, err, err_len) != 0) return 1;
  std::lock_guard<std::mutex> lock(d->run_mu);
  if (d->have_pending) FinishRun(d);  // one run handle: the last run completes first (its result is kept)
  PendingRun job;
  job.ticket = d->next_ticket++;
  job.page = nsp::plugin::PageOf(info);
  *ticket = job.ticket;
  if (std::string e = StartRun(d, *hp, *span, *grad, &job); !e.empty()) {
    d->failed_runs.fetch_add(1);
    d->done[job.ticket] = KernelMessage(d, job.page, e);
    return 0;  // reported by compute_wait, as a kernel's failure
  }
  d->pending = std::move(job);
  d->have_pending = true;
  return 0;
}

int ComputeWait(nsp_backend_device* d, uint64_t ticket, char* err, size_t err_len) {
  std::lock_guard<std::mutex> lock(d->run_mu);
  if (d->have_pending && d->pending.ticket == ticket) FinishRun(d);
  return nsp::plugin::TakeResult(*d, &d->done, ticket, err, err_len);
}

}  // namespace nsp::xrt
