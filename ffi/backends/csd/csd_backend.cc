// csd: an emulated computational-storage device, one per store shard, behind the backend ABI (nsp_backend_abi.h).
//
// The data path is real. Each device keeps its pages in its shard's directory exactly as the file tier does (zarr
// page files with CRC-32C trailers, read and written by the file tier's own code), so snapshots, checkpoints,
// tensorstore reads and manifests work unchanged; and it runs the real update kernel on a worker thread of its
// own, so its results are the file tier's, bit for bit. Only time is modelled: every operation is charged as it
// happens to the device's model clock (csd_clock.h), whose figures come in through the options string
// (csd_options.h). Faults can be injected by options too, for tests: the k-th page read, page write or kernel of
// a device fails once.
//
// Built as libnsp_backend_csd.so, which exports nothing but nsp_backend_entry_v1: the nsp code it links (kernel,
// file tier) is hidden inside it.
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/backend.h"
#include "backends/csd/csd_clock.h"
#include "backends/csd/csd_options.h"
#include "backends/plugin_device.h"
#include "kernels/update_kernel.h"
#include "nsp_backend_abi.h"

namespace {

using nsp::csd::ModelClock;
using nsp::csd::Options;
using nsp::plugin::Fail;

const char* Ordinal(int64_t k) {
  const int64_t tens = k % 100;
  if (tens >= 11 && tens <= 13) return "th";
  switch (k % 10) {
    case 1:
      return "st";
    case 2:
      return "nd";
    case 3:
      return "rd";
    default:
      return "th";
  }
}

// One kernel launch, as the worker runs it: copies of what the launch was given (the memory they point to stays
// valid until compute_wait, by the ABI's contract).
struct KernelJob {
  uint64_t ticket = 0;
  nsp::UpdateHyperParams hp;
  nsp::StateSpan span;
  nsp_page_grad grad{};
  nsp_page_info info{};
  bool inject_fault = false;
  int64_t ordinal = 0;  // this kernel's number on the device, from open
};

}  // namespace

// The shard, its page files and the checksums they carry are PluginDevice's; the rest is the model's.
struct nsp_backend_device : nsp::plugin::PluginDevice {
  int states = 0;
  Options options;
  std::unique_ptr<ModelClock> clock;

  // Operations so far, for the faults (each counts every attempt, from open).
  std::atomic<int64_t> reads{0}, writes{0}, kernels{0};
  // Page writes go one at a time: each write's bytes are then exactly what the file tier's counters moved
  // during it (a new page file written directly moves whole blocks, more than its length).
  std::mutex write_mu;

  // The worker that runs kernels, and the results of finished launches (ticket -> error, "" = ok).
  std::thread worker;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<KernelJob> queue;
  std::map<uint64_t, std::string> done;
  uint64_t next_ticket = 1;
  bool stop = false;

  int64_t FileBytes() const { return page_elems * 4 + (checksum ? 4 : 0); }
  // "<device>: reading page 3 of state 'mu' in slot 1 failed: injected fault (fail_read_at=2: ...)".
  std::string Injected(const char* what, int32_t slot, int64_t page, int32_t state, int64_t ordinal,
                       const char* option) const {
    return Name() + ": " + what + " " + nsp::plugin::PageName(slot, state, page) + " failed: injected fault (" +
           option + "=" + std::to_string(ordinal) + ": the device's " + std::to_string(ordinal) + Ordinal(ordinal) +
           " such operation)";
  }
  void RunWorker();
  std::string RunKernel(const KernelJob& job);
};

namespace {

std::string StatesOf(const nsp_backend_device& d) {
  std::string out;
  for (int s = 0; s < NSP_BACKEND_NUM_STATES; ++s) {
    if (d.used[s]) out += std::string(out.empty() ? "" : ", ") + nsp::StateName(s);
  }
  return out;
}

}  // namespace

std::string nsp_backend_device::RunKernel(const KernelJob& job) {
  const int64_t page = job.info.page;
  if (job.inject_fault) {
    return Name() + ": the update kernel on page " + std::to_string(page) + " (states " + StatesOf(*this) +
           ") failed: injected fault (fail_kernel_at=" + std::to_string(job.ordinal) + ": the device's " +
           std::to_string(job.ordinal) + Ordinal(job.ordinal) + " kernel)";
  }
  const nsp::GradType type = job.grad.grad_type == NSP_GRAD_BF16 ? nsp::GradType::kBF16 : nsp::GradType::kF32;
  const int64_t n = job.span.size;
  if (job.grad.dense != nullptr) {
    nsp::UpdateDense(job.hp, job.span, job.grad.dense, type);
  } else {
    nsp::UpdateSparse(job.hp, job.span, job.grad.indices, job.grad.values, type, job.grad.count,
                      job.grad.index_base);
  }
  // The updater takes in the page's state and a dense gradient's worth (a compressed one is decompressed to fp32
  // inside the pass): Table I's state + gradient bytes.
  const int64_t grad_bytes = job.grad.dense != nullptr ? n * nsp::GradBytes(type) : n * 4;
  int64_t host_in = job.info.host_in_bytes, host_out = job.info.host_out_bytes;
  if (job.info.struct_size < sizeof(nsp_page_info)) {  // the host counted nothing: what the span shows
    host_in = job.grad.dense != nullptr ? grad_bytes : job.grad.count * (nsp::GradBytes(type) + 4);
    host_out = (job.span.param_copy_out ? n * 4 : 0) + (job.span.param_bf16_out ? n * 2 : 0);
  }
  clock->ChargeKernel(page, host_in, n * 4 * states + grad_bytes, host_out);
  return {};
}

void nsp_backend_device::RunWorker() {
  for (;;) {
    KernelJob job;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;
      job = queue.front();
      queue.pop_front();
    }
    std::string err;
    try {
      err = RunKernel(job);
    } catch (const std::exception& e) {
      err = Name() + ": the update kernel on page " + std::to_string(job.info.page) + " failed: " + e.what();
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      done[job.ticket] = std::move(err);
    }
    cv.notify_all();
  }
}

namespace {

int Open(const nsp_backend_config* c, nsp_backend_device** out, char* err, size_t err_len) {
  auto d = std::make_unique<nsp_backend_device>();
  if (nsp::plugin::CheckConfig(c, "csd", "(the store creates its arrays there before it opens the device)", d.get(),
                               err, err_len) != 0) {
    return 1;
  }
  if (std::string e = nsp::csd::ParseOptions(c->options ? c->options : "", &d->options); !e.empty()) {
    return d->Fail(err, err_len, e);
  }
  if (std::string e = nsp::plugin::OpenPages(c, d.get()); !e.empty()) return d->Fail(err, err_len, e);
  for (int s = 0; s < NSP_BACKEND_NUM_STATES; ++s) d->states += d->used[s] ? 1 : 0;
  d->clock = std::make_unique<ModelClock>(d->options.figures, c->num_devices, c->pages_in_flight);
  nsp_backend_device* raw = d.get();
  d->worker = std::thread([raw] { raw->RunWorker(); });
  *out = d.release();
  return 0;
}

void Close(nsp_backend_device* d) {
  {
    std::lock_guard<std::mutex> lock(d->mu);
    d->stop = true;
  }
  d->cv.notify_all();
  d->worker.join();  // runs what is queued first: nobody waits on a launch that never ends
  delete d;
}

int ReadPage(nsp_backend_device* d, int32_t slot, int32_t state, int64_t page, float* dst, int64_t n, int32_t scratch,
             char* err, size_t err_len) {
  const int64_t k = ++d->reads;
  if (k == d->options.faults.read_at) {
    return Fail(err, err_len, d->Injected("reading", slot, page, state, k, "fail_read_at"));
  }
  if (std::string e = d->pages->ReadPage(slot, state, page, dst, n, scratch != 0); !e.empty()) {
    return d->Fail(err, err_len, e);
  }
  // A read that succeeds moved exactly one page file: the file tier refuses a file of any other length.
  d->clock->ChargeRead(page, d->FileBytes());
  return 0;
}

int WritePage(nsp_backend_device* d, int32_t slot, int32_t state, int64_t page, float* src, int64_t n,
              int32_t scratch, char* err, size_t err_len) {
  const int64_t k = ++d->writes;
  if (k == d->options.faults.write_at) {
    return Fail(err, err_len, d->Injected("writing", slot, page, state, k, "fail_write_at"));
  }
  std::lock_guard<std::mutex> lock(d->write_mu);
  const int64_t before = d->pages->Io().write_bytes;
  std::string e = d->pages->WritePage(slot, state, page, src, n, scratch != 0);
  d->clock->ChargeWrite(page, d->pages->Io().write_bytes - before);  // what moved, failed or not
  if (!e.empty()) return d->Fail(err, err_len, e);
  return 0;
}

int ComputeLaunch(nsp_backend_device* d, const nsp_hyper_params* hp, const nsp_state_span* span,
                  const nsp_page_grad* grad, const nsp_page_info* info, uint64_t* ticket, char* err, size_t err_len) {
  if (nsp::plugin::CheckLaunch(*d, hp, span, grad, ticket, err, err_len) != 0) return 1;
  KernelJob job;
  job.hp = nsp::abi::FromAbi(*hp);
  job.span = nsp::abi::FromAbi(*span);
  std::memcpy(&job.grad, grad, std::min<size_t>(sizeof job.grad, grad->struct_size));
  job.info.page = -1;
  if (info != nullptr) std::memcpy(&job.info, info, std::min<size_t>(sizeof job.info, info->struct_size));
  job.ordinal = ++d->kernels;
  job.inject_fault = job.ordinal == d->options.faults.kernel_at;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    job.ticket = d->next_ticket++;
    *ticket = job.ticket;
    d->queue.push_back(job);
  }
  d->cv.notify_all();
  return 0;
}

int ComputeWait(nsp_backend_device* d, uint64_t ticket, char* err, size_t err_len) {
  std::unique_lock<std::mutex> lock(d->mu);
  if (ticket == 0 || ticket >= d->next_ticket) return Fail(err, err_len, d->Name() + ": no kernel launch " +
                                                                            std::to_string(ticket));
  d->cv.wait(lock, [&] { return d->done.count(ticket) > 0; });
  return nsp::plugin::TakeResult(*d, &d->done, ticket, err, err_len);
}

void IoCounts(nsp_backend_device* d, nsp_io_counts* out) { nsp::plugin::WriteIoCounts(d->pages->Io(), out); }

// The model clock's figures (csd_clock.h), and the operations counted so far (what the faults count).
int64_t Stats(nsp_backend_device* d, nsp_backend_stat* out, int64_t capacity, char*, size_t) {
  std::vector<std::pair<std::string, double>> stats = d->clock->Stats();
  stats.emplace_back("page_reads", nsp::plugin::Stat(d->reads));
  stats.emplace_back("page_writes", nsp::plugin::Stat(d->writes));
  stats.emplace_back("kernels", nsp::plugin::Stat(d->kernels));
  return nsp::plugin::WriteStats(stats, out, capacity);
}

void UpdateBegin(nsp_backend_device* d) {
  d->pages->StreamStarted();
  d->clock->BeginUpdate();
}

void UpdateEnd(nsp_backend_device* d, int32_t ok) {
  d->clock->EndUpdate(ok != 0);
  d->pages->StreamFinished(ok != 0);
}

// Buffers, sync and checksums are the page files' (the buffers 4 KiB aligned: where the file tier's direct I/O goes).
constexpr nsp_backend_v1 kTable = nsp::plugin::MakeTable<nsp_backend_device>(
    {"csd", Open, Close, ReadPage, WritePage, ComputeLaunch, ComputeWait, IoCounts, Stats, UpdateBegin, UpdateEnd});

}  // namespace

NSP_PLUGIN_ENTRY(kTable)
