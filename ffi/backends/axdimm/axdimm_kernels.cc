// The AXDIMM plugin's kernels (axdimm_device.h): Adam and AdamW on the module (the page's state staged into its
// resident allocation unless the module already holds it, the gradient into a staging allocation, the channel in
// acceleration mode), the other kinds on the host with nsp's CPU kernel, and the wait that brings a kernel's
// outputs back to the engine's buffers.
#include <cstring>
#include <exception>
#include <string>

#include "backends/axdimm/axdimm_device.h"
#include "backends/hls/nsp_updater_hls.h"
#include "kernels/update_kernel.h"

namespace nsp::axdimm {
namespace {

// ---- Kernels ----

// A kind the module's kernel does not run: nsp's CPU kernel on the engine's buffers.
std::string HostKernel(nsp_backend_device* d, const nsp_hyper_params& h, const nsp_state_span& s,
                       const nsp_page_grad& g, int64_t page) {
  const nsp::StateSpan span = nsp::abi::FromAbi(s);
  const nsp::UpdateHyperParams hp = nsp::abi::FromAbi(h);
  const nsp::GradType type = g.grad_type == NSP_GRAD_BF16 ? nsp::GradType::kBF16 : nsp::GradType::kF32;
  try {
    if (g.dense != nullptr) nsp::UpdateDense(hp, span, g.dense, type);
    else nsp::UpdateSparse(hp, span, g.indices, g.values, type, g.count, g.index_base);
  } catch (const std::exception& e) {
    return e.what();
  }
  d->host_kernels.fetch_add(1);
  Invalidate(d, page);
  return {};
}

// Brings the page's state into its resident allocation unless the module already holds what the span's inputs
// hold (the buffer a read filled from, or into, the module). Holder of the channel.
std::string StageState(nsp_backend_device* d, const nsp_state_span& s, int64_t page, nspAxdimmAddr base) {
  const float* ins[3] = {s.param_in, s.mu_in, s.nu_in};
  for (int state = 0; state < 3; ++state) {
    bool held = false;
    {
      std::lock_guard<std::mutex> lock(d->mu);
      auto src = d->sources.find(ins[state]);
      const Resident& r = d->resident[page];
      held = src != d->sources.end() && src->second.page == page && src->second.state == state &&
             r.valid_slot[state] == src->second.slot && r.valid_slot[state] >= 0;
    }
    if (held) continue;
    if (std::string e = CopyToModule(d, base + d->StateOffset(state), ins[state], static_cast<size_t>(s.size) * 4);
        !e.empty()) {
      return "state '" + std::string(nsp::StateName(state)) + "': " + e;
    }
  }
  return {};
}

size_t Align64(size_t bytes) { return (bytes + 63) / 64 * 64; }

// Copies the gradient (and indices) into a staging allocation on the channel and fills the launch's arguments.
std::string StageGradient(nsp_backend_device* d, const nsp_page_grad& g, const nsp_state_span& s, int c,
                          int64_t page, Launch* l, nspAxdimmAdamArgs* a) {
  const size_t gsize = g.grad_type == NSP_GRAD_BF16 ? 2 : 4;
  const bool topk = g.dense == nullptr;
  const size_t n = static_cast<size_t>(s.size), count = topk ? static_cast<size_t>(g.count) : 0;
  const size_t grad_bytes = Align64(gsize * (topk ? count : n)), idx_bytes = Align64(4 * count);
  const size_t p16_bytes = s.param_bf16_out ? Align64(2 * n) : 0;
  const size_t total = std::max<size_t>(64, grad_bytes + idx_bytes + p16_bytes);
  bool fits = true;
  if (std::string e = Allocate(d, c, total, page, false, &l->staging, &fits); !e.empty()) return "the gradient: " + e;
  a->grad_format = topk ? (gsize == 2 ? NSP_HLS_TOPK_BF16 : NSP_HLS_TOPK_F32)
                        : (gsize == 2 ? NSP_HLS_GRAD_BF16 : NSP_HLS_GRAD_F32);
  if (!topk || count > 0) {
    a->grad = l->staging;
    if (std::string e = CopyToModule(d, a->grad, topk ? g.values : g.dense, gsize * (topk ? count : n)); !e.empty()) {
      return "the gradient: " + e;
    }
  }
  if (count > 0) {
    a->indices = l->staging + grad_bytes;
    if (std::string e = CopyToModule(d, a->indices, g.indices, 4 * count); !e.empty()) return "the indices: " + e;
  }
  if (p16_bytes > 0) l->p16 = a->p_bf16 = l->staging + grad_bytes + idx_bytes;
  a->topk_count = static_cast<int64_t>(count);
  a->index_base = topk ? g.index_base : 0;
  return {};
}

// Everything up to the kernel's start on channel c (which the caller holds). Returns "" or why not.
std::string StartKernel(nsp_backend_device* d, const nsp_hyper_params& h, const nsp_state_span& s,
                        const nsp_page_grad& g, int c, Launch* l) {
  const int64_t page = l->page;
  if (h.kind != NSP_KIND_ADAM && h.kind != NSP_KIND_ADAMW) return "the module's kernel runs Adam or AdamW only";
  if (s.size < 1 || s.size > d->page_elems) return "a span of " + std::to_string(s.size) + " elements is not a page";
  bool present = true;
  if (std::string e = EnsureResident(d, page, false, &present); !e.empty()) return "the page's state: " + e;
  nspAxdimmAddr base;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    base = d->resident[page].base;
  }
  if (std::string e = StageState(d, s, page, base); !e.empty()) return e;
  nspAxdimmAdamArgs a{};
  a.struct_size = sizeof a;
  a.kind = h.kind == NSP_KIND_ADAM ? NSP_HLS_ADAM : NSP_HLS_ADAMW;
  a.lazy = h.lazy;
  a.p = base + d->StateOffset(0);
  a.m = base + d->StateOffset(1);
  a.v = base + d->StateOffset(2);
  a.nparams = s.size;
  a.step = h.step;
  a.lr = h.lr;
  a.b1 = h.b1;
  a.b2 = h.b2;
  a.eps = h.eps;
  a.weight_decay = h.weight_decay;
  if (std::string e = StageGradient(d, g, s, c, page, l, &a); !e.empty()) return e;
  {
    // From here the module's copy is the new version (or, if the kernel fails, nothing anyone may read).
    std::lock_guard<std::mutex> lock(d->mu);
    Resident& r = d->resident[page];
    for (int state = 0; state < 3; ++state) {
      r.valid_slot[state] = -1;
      r.fresh[state] = true;
    }
    r.updated = true;
    for (const void* out : {static_cast<const void*>(s.param_out), static_cast<const void*>(s.mu_out),
                            static_cast<const void*>(s.nu_out)}) {
      d->sources.erase(out);
    }
  }
  if (d->api.nspAxdimmSetArbiterAcc(d->module, c) != NSP_AXDIMM_OK) {
    return "switching channel " + std::to_string(c) + " to acceleration mode failed: " + d->LastError();
  }
  if (int rc = d->api.nspAxdimmRunAdamAsync(d->module, &a, c)) {
    const std::string e = d->LastError();
    d->api.nspAxdimmSetArbiterNormal(d->module, c);
    return "the launch failed (" + std::to_string(rc) + "): " + e;
  }
  d->channel_launches[c].fetch_add(1);
  return {};
}

std::string KernelMessage(const nsp_backend_device* d, int64_t page, int c, const std::string& why) {
  const std::string where = c < 0 ? " (on the host)" : " (channel " + std::to_string(c) + ")";
  return d->Name() + ": the update kernel on page " + std::to_string(page) + where + " failed: " + why;
}

// Frees a launch's staging and gives its channel back.
void EndLaunch(nsp_backend_device* d, const Launch& l) {
  if (l.staging != 0) d->api.nspAxdimmFreeX(d->module, l.staging);
  ReleaseChannel(d, l.channel);
}

std::string FinishKernel(nsp_backend_device* d, const Launch& l);

// Completes a launch: its outputs back, its channel given back; "" or the message naming device, page and cause.
std::string Complete(nsp_backend_device* d, const Launch& l) {
  std::string e = FinishKernel(d, l);
  if (!e.empty()) {
    Invalidate(d, l.page);
    d->failed_kernels.fetch_add(1);
    e = KernelMessage(d, l.page, l.channel, e);
  }
  EndLaunch(d, l);
  return e;
}

// One kernel per channel: a launch on a channel whose last kernel nobody has waited for yet completes that one
// first (its result is kept for its compute_wait). The engine waits for every page at once, so this is rare.
void CompletePendingOn(nsp_backend_device* d, int c) {
  uint64_t ticket = 0;
  Launch l;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    for (auto it = d->launches.begin(); it != d->launches.end(); ++it) {
      if (it->second.channel != c) continue;
      ticket = it->first;
      l = it->second;
      d->launches.erase(it);
      break;
    }
  }
  if (ticket == 0) return;
  std::string e = Complete(d, l);
  std::lock_guard<std::mutex> lock(d->mu);
  d->done[ticket] = std::move(e);
}

}  // namespace

int ComputeLaunch(nsp_backend_device* d, const nsp_hyper_params* hp, const nsp_state_span* span,
                  const nsp_page_grad* grad, const nsp_page_info* info, uint64_t* ticket, char* err, size_t err_len) {
  if (nsp::plugin::CheckLaunch(*d, hp, span, grad, ticket, err, err_len) != 0) return 1;
  Launch l;
  l.page = nsp::plugin::PageOf(info);
  l.channel = ChannelOf(l.page);
  l.n = span->size;
  l.span = *span;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    *ticket = d->next_ticket++;
  }
  // A kind the module cannot run, or a page the host cannot name (the cache is by page): on the host.
  if (!d->module_kernel || (hp->kind != NSP_KIND_ADAM && hp->kind != NSP_KIND_ADAMW) || l.page < 0) {
    std::string e = HostKernel(d, *hp, *span, *grad, l.page);
    if (!e.empty()) e = KernelMessage(d, l.page, -1, e);
    std::lock_guard<std::mutex> lock(d->mu);
    d->done[*ticket] = e;
    return 0;
  }
  CompletePendingOn(d, l.channel);
  AcquireChannel(d, l.channel);  // held until compute_wait: the kernel owns the channel meanwhile
  if (std::string e = StartKernel(d, *hp, *span, *grad, l.channel, &l); !e.empty()) {
    Invalidate(d, l.page);
    d->failed_kernels.fetch_add(1);
    EndLaunch(d, l);
    std::lock_guard<std::mutex> lock(d->mu);
    d->done[*ticket] = KernelMessage(d, l.page, l.channel, e);
    return 0;
  }
  std::lock_guard<std::mutex> lock(d->mu);
  d->launches[*ticket] = l;
  return 0;
}

namespace {

// The kernel's end, then its outputs back into the engine's buffers (which the engine writes through to NVMe).
std::string FinishKernel(nsp_backend_device* d, const Launch& l) {
  const int c = l.channel;
  const int rc = d->api.nspAxdimmWait(d->module, c);
  std::string e = rc == NSP_AXDIMM_OK ? "" : d->LastError();
  if (d->api.nspAxdimmSetArbiterNormal(d->module, c) != 0 && e.empty()) {
    e = "switching channel " + std::to_string(c) + " back to normal mode failed: " + d->LastError();
  }
  if (!e.empty()) return e;
  nspAxdimmAddr base;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    base = d->resident[l.page].base;
  }
  const size_t bytes = static_cast<size_t>(l.n) * 4;
  float* outs[3] = {l.span.param_out, l.span.mu_out, l.span.nu_out};
  for (int state = 0; state < 3; ++state) {
    if (std::string e2 = CopyFromModule(d, outs[state], base + d->StateOffset(state), bytes); !e2.empty()) {
      return "state '" + std::string(nsp::StateName(state)) + "': " + e2;
    }
  }
  if (l.p16 != 0) {
    if (std::string e2 = CopyFromModule(d, l.span.param_bf16_out, l.p16, static_cast<size_t>(l.n) * 2); !e2.empty()) {
      return "the bf16 params: " + e2;
    }
  }
  if (l.span.param_copy_out != nullptr) std::memcpy(l.span.param_copy_out, l.span.param_out, bytes);
  return {};
}

}  // namespace

int ComputeWait(nsp_backend_device* d, uint64_t ticket, char* err, size_t err_len) {
  Launch l;
  bool running = false;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    auto it = d->launches.find(ticket);
    if (it != d->launches.end()) {
      l = it->second;
      d->launches.erase(it);
      running = true;
    }
  }
  if (running) {
    const std::string e = Complete(d, l);
    return e.empty() ? 0 : Fail(err, err_len, e);
  }
  std::lock_guard<std::mutex> lock(d->mu);
  return nsp::plugin::TakeResult(*d, &d->done, ticket, err, err_len);
}

}  // namespace nsp::axdimm
