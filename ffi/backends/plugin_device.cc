// What every backend plugin does the same way (plugin_device.h): errors, options, loading its vendor library, the
// open-time checks, the shard's page files as its storage, and the ABI table's entries that only go through them.
#include "backends/plugin_device.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

namespace nsp::plugin {

void SetError(char* err, size_t err_len, const std::string& msg) {
  if (err == nullptr || err_len == 0) return;
  const size_t n = std::min(msg.size(), err_len - 1);
  std::memcpy(err, msg.data(), n);
  err[n] = '\0';
}

int Fail(char* err, size_t err_len, const std::string& msg) {
  SetError(err, err_len, msg);
  return 1;
}

std::string PageName(int32_t slot, int32_t state, int64_t page) {
  return "page " + std::to_string(page) + " of state '" + nsp::StateName(state) + "' in slot " + std::to_string(slot);
}

// ---- Options ----

std::string ParseOptions(const std::string& text, OptionMap* out) {
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t end = std::min(text.find(';', pos), text.size());
    const std::string item = text.substr(pos, end - pos);
    pos = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) return "option '" + item + "' is not key=value";
    (*out)[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return {};
}

std::string CheckOptionKeys(const OptionMap& opts, std::initializer_list<const char*> known) {
  for (const auto& kv : opts) {
    bool found = false;
    for (const char* k : known) found = found || kv.first == k;
    if (found) continue;
    std::string list;
    for (const char* k : known) list += std::string(list.empty() ? "" : ", ") + k;
    return "unknown option '" + kv.first + "' (it takes " + list + ")";
  }
  return {};
}

std::string LibraryPath(const OptionMap& opts, const char* env, const char* fallback) {
  if (auto it = opts.find("library"); it != opts.end()) return it->second;
  const char* value = std::getenv(env);
  return value && *value ? value : fallback;
}

std::string LoadLibrary(const std::string& library, const std::string& what, const char* env, const char* fallback,
                        void** handle) {
  *handle = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (*handle != nullptr) return {};
  const char* why = ::dlerror();
  return "cannot load " + what + " '" + library + "' (option library=, env " + env + ", default " + fallback +
         "): " + (why ? why : "unknown error");
}

void* Symbols::Find(const char* name) const { return ::dlsym(handle_, name); }

std::string LoadVendorLibrary(const std::string& library, const std::string& what, const char* env,
                              const char* fallback, const std::string& hint,
                              const std::function<void(Symbols&)>& resolve) {
  void* handle = nullptr;
  if (std::string e = LoadLibrary(library, what, env, fallback, &handle); !e.empty()) return e;
  Symbols symbols(handle);
  resolve(symbols);
  if (symbols.missing().empty()) return {};
  return what + " '" + library + "' lacks the symbol " + symbols.missing() + hint;
}

// ---- Opening ----

namespace {

bool IsDir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

int CheckConfig(const nsp_backend_config* c, const char* kind, const char* missing_dir, PluginDevice* d, char* err,
                size_t err_len) {
  if (c == nullptr || c->struct_size < sizeof(nsp_backend_config)) {
    return plugin::Fail(err, err_len,
                        std::string(kind) + ": the config struct is from another ABI version (too small)");
  }
  d->kind = kind;
  d->dir = c->shard_dir ? c->shard_dir : "";
  d->shard = c->shard_index;
  if (c->size < 1 || c->page_elems < 1) return d->Fail(err, err_len, "size and page_elems must be >= 1");
  if (!IsDir(d->dir)) {
    return d->Fail(err, err_len, std::string("the shard directory does not exist") + (*missing_dir ? " " : "") +
                                     missing_dir);
  }
  return 0;
}

std::string OpenPages(const nsp_backend_config* c, PluginDevice* d) {
  nsp::FileIoSettings io;
  if (std::string e = nsp::FileIoSettingsFromEnv(&io); !e.empty()) return e;
  d->size = c->size;
  d->page_elems = c->page_elems;
  for (int s = 0; s < NSP_BACKEND_NUM_STATES; ++s) d->used[s] = c->states_used[s] != 0;
  d->checksum = c->checksum != 0;
  d->pages = nsp::MakeFileBackend(d->dir, d->size, d->page_elems, d->checksum, io);
  return {};
}

// ---- Kernel arguments ----

int64_t PageOf(const nsp_page_info* info) {
  return info != nullptr && info->struct_size >= offsetof(nsp_page_info, page) + sizeof(int64_t) ? info->page : -1;
}

int CheckLaunch(const PluginDevice& d, const void* hp, const void* span, const void* grad, const void* ticket,
                char* err, size_t err_len) {
  if (hp != nullptr && span != nullptr && grad != nullptr && ticket != nullptr) return 0;
  return d.Fail(err, err_len, "compute_launch needs hyperparameters, a span, a gradient and a ticket");
}

int TakeResult(const PluginDevice& d, std::map<uint64_t, std::string>* done, uint64_t ticket, char* err,
               size_t err_len) {
  auto it = done->find(ticket);
  if (it == done->end()) return Fail(err, err_len, d.Name() + ": no kernel launch " + std::to_string(ticket));
  const std::string e = std::move(it->second);
  done->erase(it);
  return e.empty() ? 0 : Fail(err, err_len, e);
}

// ---- Counters ----

void WriteIoCounts(const nsp::IoCounts& c, nsp_io_counts* out) {
  const uint32_t room = out->struct_size;
  nsp_io_counts full{sizeof(nsp_io_counts), c.read_bytes, c.write_bytes, c.pages_read, c.pages_written,
                     c.pages_read_direct};
  std::memcpy(out, &full, std::min<size_t>(room, sizeof full));
  out->struct_size = static_cast<uint32_t>(std::min<size_t>(room, sizeof full));
}

int64_t WriteStats(const std::vector<std::pair<std::string, double>>& stats, nsp_backend_stat* out,
                   int64_t capacity) {
  const int64_t count = static_cast<int64_t>(stats.size());
  for (int64_t i = 0; i < capacity && i < count; ++i) {
    std::snprintf(out[i].name, sizeof out[i].name, "%s", stats[static_cast<size_t>(i)].first.c_str());
    out[i].value = stats[static_cast<size_t>(i)].second;
  }
  return count;
}

// ---- Table entries ----

size_t PageBufferBytes(PluginDevice* d, int64_t page_elems) { return d->pages->PageBufferBytes(page_elems); }

void* AllocHostBuffer(PluginDevice* d, size_t bytes, char* err, size_t err_len) {
  try {
    return d->pages->AllocPageBuffer(bytes);
  } catch (const std::exception& e) {
    SetError(err, err_len, d->Name() + ": cannot allocate a buffer of " + std::to_string(bytes) + " bytes: " +
                               e.what());
    return nullptr;
  }
}

void FreeHostBuffer(PluginDevice* d, void* buffer, size_t bytes) { d->pages->FreePageBuffer(buffer, bytes); }

int Sync(PluginDevice* d, int32_t slot, char* err, size_t err_len) {
  if (std::string e = d->pages->Sync(slot); !e.empty()) return d->Fail(err, err_len, e);
  return 0;
}

// 1 with the table, 0 when the file tier has none (nothing written yet), -1 on error.
int ChecksumsGet(PluginDevice* d, int32_t slot, int32_t state, uint32_t* out, int64_t pages, char* err,
                 size_t err_len) {
  if (!d->GoodSlotState(slot, state)) {
    SetError(err, err_len, d->Name() + ": no such slot or state");
    return -1;
  }
  const std::vector<uint32_t> crcs = d->pages->PageChecksums(slot, state);
  if (crcs.empty()) return 0;
  if (static_cast<int64_t>(crcs.size()) != pages) {
    SetError(err, err_len, d->Name() + ": the shard has " + std::to_string(crcs.size()) + " pages, not " +
                               std::to_string(pages));
    return -1;
  }
  std::memcpy(out, crcs.data(), crcs.size() * sizeof(uint32_t));
  return 1;
}

int ChecksumsSet(PluginDevice* d, int32_t slot, int32_t state, const uint32_t* crcs, int64_t pages, char* err,
                 size_t err_len) {
  if (!d->GoodSlotState(slot, state)) return d->Fail(err, err_len, "no such slot or state");
  if (std::string e = d->pages->SetPageChecksums(slot, state, std::vector<uint32_t>(crcs, crcs + pages));
      !e.empty()) {
    return d->Fail(err, err_len, e);
  }
  return 0;
}

}  // namespace nsp::plugin
