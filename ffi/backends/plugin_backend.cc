// Loading backends from shared objects (plugin_backend.h): the search, the checks of what was loaded, and the
// nsp::Backend that forwards every call to the library's function table.
#include "backends/plugin_backend.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "backends/abi_structs.h"

namespace nsp {

namespace {

// A caller-given error buffer for one ABI call: starts empty, so a device that fails without a message is told
// apart from one that wrote one.
struct ErrorBuffer {
  char text[2048] = {0};
  static constexpr size_t size = sizeof(text);
  const char* get() const { return text; }
};

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

bool IsFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string BaseName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The paths to try for `file`, in search order, each with whether it may be that backend's library. A direct path
// in NSP_BACKEND_PATH counts only for the backend whose file name it has (it stands for that backend's library,
// wherever it was built); another is listed as passed over.
std::vector<std::pair<std::string, bool>> Candidates(const std::string& file, const PluginSearch& search) {
  std::vector<std::pair<std::string, bool>> out;
  size_t begin = 0;
  const std::string& env = search.env_path;
  while (begin <= env.size() && !env.empty()) {
    const size_t end = std::min(env.find(':', begin), env.size());
    const std::string entry = env.substr(begin, end - begin);
    begin = end + 1;
    if (entry.empty()) continue;
    if (EndsWith(entry, ".so") || IsFile(entry)) {
      out.emplace_back(entry, BaseName(entry) == file);
    } else {
      out.emplace_back(entry + "/" + file, true);
    }
  }
  if (!search.package_dir.empty()) out.emplace_back(search.package_dir + "/" + file, true);
  return out;
}

std::string Join(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : ", ") + p;
  return out;
}

// The table's required functions, by name: a library that leaves one out cannot serve a store.
std::string MissingFunction(const nsp_backend_v1& t) {
  const std::pair<const char*, const void*> required[] = {
      {"open", reinterpret_cast<const void*>(t.open)},
      {"close", reinterpret_cast<const void*>(t.close)},
      {"page_buffer_bytes", reinterpret_cast<const void*>(t.page_buffer_bytes)},
      {"alloc_buffer", reinterpret_cast<const void*>(t.alloc_buffer)},
      {"free_buffer", reinterpret_cast<const void*>(t.free_buffer)},
      {"read_page", reinterpret_cast<const void*>(t.read_page)},
      {"write_page", reinterpret_cast<const void*>(t.write_page)},
      {"sync", reinterpret_cast<const void*>(t.sync)},
      {"compute_launch", reinterpret_cast<const void*>(t.compute_launch)},
      {"compute_wait", reinterpret_cast<const void*>(t.compute_wait)},
      {"page_checksums_get", reinterpret_cast<const void*>(t.page_checksums_get)},
      {"page_checksums_set", reinterpret_cast<const void*>(t.page_checksums_set)},
      {"io_counts", reinterpret_cast<const void*>(t.io_counts)},
      {"stats", reinterpret_cast<const void*>(t.stats)},
  };
  for (const auto& [name, fn] : required) {
    if (fn == nullptr) return name;
  }
  return {};
}

// Loads the library at `path` and checks its table; returns "" or why it cannot serve (without the prefix).
std::string LoadFrom(const std::string& path, LoadedPlugin* out) {
  // RTLD_LOCAL: the library's symbols stay its own (a vendor library may carry names nsp's module also has).
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    return "cannot load " + path + ": " + (why ? why : "unknown loader error");
  }
  auto entry = reinterpret_cast<nsp_backend_entry_v1_fn>(::dlsym(handle, NSP_BACKEND_ENTRY_SYMBOL));
  if (entry == nullptr) {
    return path + " exports no " + NSP_BACKEND_ENTRY_SYMBOL + " (it is not an nsp backend, or one built for "
           "another backend ABI version; this nsp implements version " + std::to_string(NSP_BACKEND_ABI_VERSION) +
           ")";
  }
  const nsp_backend_v1* table = entry(NSP_BACKEND_ABI_VERSION);
  if (table == nullptr) {
    return path + " refused backend ABI version " + std::to_string(NSP_BACKEND_ABI_VERSION) +
           " (its entry returned no function table)";
  }
  if (table->abi_version != NSP_BACKEND_ABI_VERSION) {
    return path + " implements backend ABI version " + std::to_string(table->abi_version) +
           "; this nsp implements version " + std::to_string(NSP_BACKEND_ABI_VERSION);
  }
  if (table->struct_size < sizeof(nsp_backend_v1)) {
    return path + "'s function table is " + std::to_string(table->struct_size) + " bytes; version " +
           std::to_string(NSP_BACKEND_ABI_VERSION) + "'s is " + std::to_string(sizeof(nsp_backend_v1)) +
           " (the library was built against another nsp_backend_abi.h)";
  }
  if (std::string missing = MissingFunction(*table); !missing.empty()) {
    return path + "'s function table has no " + missing + " function";
  }
  // Never unloaded (see LoadedPlugin): the handle is deliberately kept open.
  out->path = path;
  out->table = table;
  return {};
}

}  // namespace

PluginSearch PluginSearch::FromEnv(std::string package_dir) {
  const char* env = std::getenv("NSP_BACKEND_PATH");
  return {env ? env : "", std::move(package_dir)};
}

std::string PluginFileName(const std::string& name) { return "libnsp_backend_" + name + ".so"; }

std::string LoadPlugin(const std::string& name, const PluginSearch& search, LoadedPlugin* out) {
  const std::string prefix = "backend " + name + " not available: ";
  if (!ValidName(name)) {
    return prefix + "a backend name is 1 to 64 letters, digits, '_' or '-' (it names the library file)";
  }
  const std::string file = PluginFileName(name);
  std::vector<std::string> looked;
  for (const auto& [path, usable] : Candidates(file, search)) {
    if (!usable) {
      looked.push_back(path + " (a library of another name)");
      continue;
    }
    if (!IsFile(path)) {
      looked.push_back(path);
      continue;
    }
    out->name = name;
    if (std::string err = LoadFrom(path, out); !err.empty()) return prefix + err;
    return {};
  }
  return prefix + "no " + file + " found; looked at " + (looked.empty() ? "nothing" : Join(looked)) +
         " (set NSP_BACKEND_PATH to the directory that holds it, or to the library itself)";
}

// ---- the adapter ---------------------------------------------------------------------------------------------

std::unique_ptr<PluginBackend> PluginBackend::Open(const LoadedPlugin& plugin, const PluginConfig& config,
                                                   std::string* error) {
  nsp_backend_config c{};
  c.struct_size = sizeof c;
  c.shard_dir = config.shard_dir.c_str();
  c.shard_index = config.shard_index;
  c.num_devices = config.num_devices;
  c.size = config.size;
  c.page_elems = config.page_elems;
  for (int s = 0; s < NSP_BACKEND_NUM_STATES; ++s) {
    c.states_used[s] = s < static_cast<int>(config.states_used.size()) && config.states_used[s] ? 1 : 0;
  }
  c.checksum = config.checksum ? 1 : 0;
  c.pages_in_flight = config.pages_in_flight;
  c.options = config.options.c_str();
  ErrorBuffer err;
  nsp_backend_device* device = nullptr;
  if (plugin.table->open(&c, &device, err.text, err.size) != 0 || device == nullptr) {
    *error = "backend " + plugin.name + " not available: opening the device for shard " +
             std::to_string(config.shard_index) + " (" + config.shard_dir + ") failed: " +
             (err.text[0] ? err.get() : "the device gave no reason") + " [" + plugin.path + "]";
    return nullptr;
  }
  const int64_t pages = (config.size + config.page_elems - 1) / config.page_elems;
  return std::unique_ptr<PluginBackend>(new PluginBackend(plugin, device, pages));
}

PluginBackend::PluginBackend(LoadedPlugin plugin, nsp_backend_device* device, int64_t num_pages)
    : plugin_(std::move(plugin)), device_(device), num_pages_(num_pages) {}

PluginBackend::~PluginBackend() { plugin_.table->close(device_); }

std::string PluginBackend::Message(const char* what, const char* err) {
  return err[0] ? std::string(err) : std::string(what) + " failed without a message";
}

size_t PluginBackend::PageBufferBytes(int64_t page_elems) const {
  return std::max(plugin_.table->page_buffer_bytes(device_, page_elems), static_cast<size_t>(page_elems) * 4);
}

void* PluginBackend::AllocPageBuffer(size_t bytes) {
  ErrorBuffer err;
  void* p = plugin_.table->alloc_buffer(device_, bytes, err.text, err.size);
  if (p == nullptr) {
    throw std::runtime_error("backend " + plugin_.name + " cannot allocate a page buffer of " +
                             std::to_string(bytes) + " bytes: " + Message("alloc_buffer", err.text));
  }
  return p;
}

void PluginBackend::FreePageBuffer(void* buffer, size_t bytes) { plugin_.table->free_buffer(device_, buffer, bytes); }

int64_t PluginBackend::PageIn(const void* buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buffer_page_.find(buffer);
  return it == buffer_page_.end() ? -1 : it->second;
}

std::string PluginBackend::ReadPage(int slot, int state, int64_t page, float* dst, int64_t n, bool scratch) {
  if (scratch) {
    std::lock_guard<std::mutex> lock(mu_);
    buffer_page_[dst] = page;
  }
  ErrorBuffer err;
  if (plugin_.table->read_page(device_, slot, state, page, dst, n, scratch ? 1 : 0, err.text, err.size) != 0) {
    return Message("read_page", err.text);
  }
  return {};
}

std::string PluginBackend::TakeKernelError(const void* param_buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = kernel_errors_.find(param_buffer);
  if (it == kernel_errors_.end()) return {};
  std::string err = std::move(it->second);
  kernel_errors_.erase(it);
  return err;
}

std::string PluginBackend::WritePage(int slot, int state, int64_t page, float* src, int64_t n, bool scratch) {
  if (state == kParamState) {
    if (std::string err = TakeKernelError(src); !err.empty()) return err;
  }
  ErrorBuffer err;
  if (plugin_.table->write_page(device_, slot, state, page, src, n, scratch ? 1 : 0, err.text, err.size) != 0) {
    return Message("write_page", err.text);
  }
  return {};
}

std::string PluginBackend::Sync(int slot) {
  {
    // A failed kernel whose page was never written (the update stopped on another error first) still fails
    // whatever tries to make the slot durable.
    std::lock_guard<std::mutex> lock(mu_);
    if (!kernel_errors_.empty()) {
      std::string err = std::move(kernel_errors_.begin()->second);
      kernel_errors_.clear();
      return err;
    }
  }
  ErrorBuffer err;
  if (plugin_.table->sync(device_, slot, err.text, err.size) != 0) return Message("sync", err.text);
  return {};
}

std::vector<uint32_t> PluginBackend::PageChecksums(int slot, int state) const {
  std::vector<uint32_t> crcs(static_cast<size_t>(num_pages_));
  ErrorBuffer err;
  // Not all known (or an error): the manifest then records none for this slot and state, as for the memory tier.
  if (plugin_.table->page_checksums_get(device_, slot, state, crcs.data(), num_pages_, err.text, err.size) != 1) {
    return {};
  }
  return crcs;
}

std::string PluginBackend::SetPageChecksums(int slot, int state, const std::vector<uint32_t>& crcs) {
  ErrorBuffer err;
  if (plugin_.table->page_checksums_set(device_, slot, state, crcs.data(), static_cast<int64_t>(crcs.size()),
                                        err.text, err.size) != 0) {
    return Message("page_checksums_set", err.text);
  }
  return {};
}

IoCounts PluginBackend::Io() const {
  nsp_io_counts c{};
  c.struct_size = sizeof c;
  plugin_.table->io_counts(device_, &c);
  return {c.read_bytes, c.write_bytes, c.pages_read, c.pages_written, c.pages_read_direct};
}

void PluginBackend::StreamStarted() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    kernel_errors_.clear();
  }
  if (plugin_.table->update_begin != nullptr) plugin_.table->update_begin(device_);
}

void PluginBackend::StreamFinished(bool ok) {
  if (plugin_.table->update_end != nullptr) plugin_.table->update_end(device_, ok ? 1 : 0);
}

std::string PluginBackend::Stats(std::vector<std::pair<std::string, double>>* out) const {
  std::vector<nsp_backend_stat> stats(64);
  for (int attempt = 0; attempt < 2; ++attempt) {
    ErrorBuffer err;
    const int64_t count = plugin_.table->stats(device_, stats.data(), static_cast<int64_t>(stats.size()), err.text,
                                               err.size);
    if (count < 0) return Message("stats", err.text);
    if (count > static_cast<int64_t>(stats.size())) {  // more than there was room for: once more with room
      stats.resize(static_cast<size_t>(count));
      continue;
    }
    out->clear();
    for (int64_t i = 0; i < count; ++i) {
      const nsp_backend_stat& s = stats[static_cast<size_t>(i)];
      out->emplace_back(std::string(s.name, strnlen(s.name, sizeof s.name)), s.value);
    }
    return {};
  }
  return "backend " + plugin_.name + "'s stats grew while they were read";
}

bool PluginBackend::ComputeIfFinite(const UpdateHyperParams& hp, const StateSpan& span, const void* grad,
                                    GradType type) {
  if (!AllFinite(grad, type, span.size)) return false;
  PageGrad g;
  g.type = type;
  g.dense = grad;
  Compute(hp, span, g);
  return true;
}

void PluginBackend::Compute(const UpdateHyperParams& hp, const StateSpan& span, const PageGrad& grad) {
  const nsp_hyper_params h = abi::ToAbi(hp);
  const nsp_state_span s = abi::ToAbi(span);
  const nsp_page_grad g = abi::ToAbi(grad);
  nsp_page_info info{};
  info.struct_size = sizeof info;
  // The page's buffers were filled by its reads (the params buffer, or, for a step from the caller's params,
  // the moments').
  info.page = PageIn(span.param_out);
  if (info.page < 0 && span.mu_out != nullptr) info.page = PageIn(span.mu_out);
  if (info.page < 0 && span.nu_out != nullptr) info.page = PageIn(span.nu_out);
  if (host_traffic_) {
    int64_t in = 0, out = 0;
    host_traffic_(&in, &out);
    // Counters below what was seen were reset in between: all they hold is this page's.
    info.host_in_bytes = in >= host_in_seen_ ? in - host_in_seen_ : in;
    info.host_out_bytes = out >= host_out_seen_ ? out - host_out_seen_ : out;
    host_in_seen_ = in;
    host_out_seen_ = out;
  }
  ErrorBuffer err;
  uint64_t ticket = 0;
  // The engine computes one page at a time and needs its outputs before it moves on: launch, then wait at once.
  int rc = plugin_.table->compute_launch(device_, &h, &s, &g, &info, &ticket, err.text, err.size);
  if (rc == 0) rc = plugin_.table->compute_wait(device_, ticket, err.text, err.size);
  if (rc != 0) {
    std::lock_guard<std::mutex> lock(mu_);
    kernel_errors_[span.param_out] = Message("the update kernel", err.text);
  }
}

}  // namespace nsp
