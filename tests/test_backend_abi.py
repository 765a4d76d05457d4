"""Backend libraries: a plugin written in C against ffi/nsp_backend_abi.h alone runs a store, and every way a backend
can be unavailable (no library, not loadable, no entry symbol, another ABI version, its device refusing to open, a
name with no library) is said when the store opens, in one message form."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import nsp.storage as storage
from nsp import _nsp_ffi

ABI_DIR = Path(__file__).resolve().parents[1] / "ffi"
PAGE = 16 * 1024

# A device in host RAM that runs plain SGD: everything a backend must provide, in C, from the header alone.
# Options: refuse=1 makes its open fail (as a device that is not there).
RAMDEV = r"""
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "nsp_backend_abi.h"

struct nsp_backend_device {
  int64_t page_elems, pages;
  float* slots[2];
  int64_t reads, writes, launches;
};

static int fail(char* err, size_t len, const char* msg) { snprintf(err, len, "%s", msg); return 1; }

static int dev_open(const nsp_backend_config* c, nsp_backend_device** out, char* err, size_t len) {
  if (c->struct_size < sizeof(nsp_backend_config)) return fail(err, len, "config from another ABI");
  if (strstr(c->options, "refuse=1") != NULL) return fail(err, len, "ramdev: no device attached");
  if (c->states_used[1] || c->states_used[2]) return fail(err, len, "ramdev keeps params only (plain SGD)");
  nsp_backend_device* d = calloc(1, sizeof *d);
  d->page_elems = c->page_elems;
  d->pages = (c->size + c->page_elems - 1) / c->page_elems;
  for (int s = 0; s < 2; ++s) d->slots[s] = calloc((size_t)(d->pages * d->page_elems), sizeof(float));
  *out = d;
  return 0;
}
static void dev_close(nsp_backend_device* d) { free(d->slots[0]); free(d->slots[1]); free(d); }
static size_t buffer_bytes(nsp_backend_device* d, int64_t n) { (void)d; return (size_t)n * 4; }
static void* alloc_buffer(nsp_backend_device* d, size_t bytes, char* err, size_t len) {
  void* p = NULL;
  (void)d;
  if (posix_memalign(&p, 4096, bytes) != 0) { fail(err, len, "out of memory"); return NULL; }
  memset(p, 0, bytes);
  return p;
}
static void free_buffer(nsp_backend_device* d, void* p, size_t bytes) { (void)d; (void)bytes; free(p); }
static float* at(nsp_backend_device* d, int32_t slot, int64_t page) { return d->slots[slot] + page * d->page_elems; }
static int read_page(nsp_backend_device* d, int32_t slot, int32_t state, int64_t page, float* dst, int64_t n,
                     int32_t scratch, char* err, size_t len) {
  (void)scratch;
  if (state != 0) return fail(err, len, "ramdev: no such state");
  memcpy(dst, at(d, slot, page), (size_t)n * 4);
  d->reads++;
  return 0;
}
static int write_page(nsp_backend_device* d, int32_t slot, int32_t state, int64_t page, float* src, int64_t n,
                      int32_t scratch, char* err, size_t len) {
  (void)scratch;
  if (state != 0) return fail(err, len, "ramdev: no such state");
  memcpy(at(d, slot, page), src, (size_t)n * 4);
  d->writes++;
  return 0;
}
static int sync_slot(nsp_backend_device* d, int32_t slot, char* err, size_t len) {
  (void)d; (void)slot; (void)err; (void)len;
  return 0;
}
static int launch(nsp_backend_device* d, const nsp_hyper_params* hp, const nsp_state_span* s,
                  const nsp_page_grad* g, const nsp_page_info* info, uint64_t* ticket, char* err, size_t len) {
  (void)info;
  if (hp->kind != NSP_KIND_SGD || hp->momentum != 0 || hp->weight_decay != 0 || g->grad_type != NSP_GRAD_F32) {
    return fail(err, len, "ramdev runs plain SGD on fp32 gradients only");
  }
  for (int64_t i = 0; i < s->size; ++i) s->param_out[i] = s->param_in[i];
  for (int64_t i = 0; i < s->size; ++i) {
    const float grad = g->dense != NULL ? ((const float*)g->dense)[i] : 0.0f;
    s->param_out[i] = s->param_in[i] - hp->lr * grad;
  }
  for (int64_t k = 0; g->dense == NULL && k < g->count; ++k) {
    const int64_t i = g->indices[k] - g->index_base;
    s->param_out[i] -= hp->lr * ((const float*)g->values)[k];
  }
  if (s->param_copy_out != NULL) memcpy(s->param_copy_out, s->param_out, (size_t)s->size * 4);
  *ticket = (uint64_t)++d->launches;
  return 0;
}
static int wait_kernel(nsp_backend_device* d, uint64_t ticket, char* err, size_t len) {
  (void)d; (void)ticket; (void)err; (void)len;
  return 0;
}
static int crcs_get(nsp_backend_device* d, int32_t slot, int32_t state, uint32_t* out, int64_t pages, char* err,
                    size_t len) {
  (void)d; (void)slot; (void)state; (void)out; (void)pages; (void)err; (void)len;
  return 0;
}
static int crcs_set(nsp_backend_device* d, int32_t slot, int32_t state, const uint32_t* crcs, int64_t pages,
                    char* err, size_t len) {
  (void)d; (void)slot; (void)state; (void)crcs; (void)pages; (void)err; (void)len;
  return 0;
}
static void io_counts(nsp_backend_device* d, nsp_io_counts* out) {
  out->struct_size = sizeof *out;
  out->read_bytes = d->reads * d->page_elems * 4;
  out->write_bytes = d->writes * d->page_elems * 4;
  out->pages_read = d->reads;
  out->pages_written = d->writes;
  out->pages_read_direct = 0;
}
static int64_t stats(nsp_backend_device* d, nsp_backend_stat* out, int64_t capacity, char* err, size_t len) {
  (void)err; (void)len;
  if (capacity >= 1) { snprintf(out[0].name, sizeof out[0].name, "launches"); out[0].value = (double)d->launches; }
  return 1;
}

static const nsp_backend_v1 table = {
    NSP_BACKEND_ABI_VERSION, sizeof(nsp_backend_v1), "ramdev", dev_open, dev_close, buffer_bytes, alloc_buffer,
    free_buffer, read_page, write_page, sync_slot, launch, wait_kernel, crcs_get, crcs_set, io_counts, stats,
    NULL, NULL};

NSP_BACKEND_EXPORT const nsp_backend_v1* nsp_backend_entry_v1(uint32_t host_abi_version) {
  return host_abi_version == NSP_BACKEND_ABI_VERSION ? &table : NULL;
}
"""

# A library built for a later ABI version: its table says so.
LATER_ABI = r"""
#include "nsp_backend_abi.h"
static const nsp_backend_v1 table = {
    .abi_version = NSP_BACKEND_ABI_VERSION + 1, .struct_size = sizeof(nsp_backend_v1), .name = "later"};
NSP_BACKEND_EXPORT const nsp_backend_v1* nsp_backend_entry_v1(uint32_t v) { (void)v; return &table; }
"""

NO_ENTRY = "int nsp_backend_something_else(void) { return 1; }\n"


def build(tmp_path: Path, name: str, source: str) -> Path:
    """Compiles `source` into tmp_path/plugins/libnsp_backend_<name>.so with the system C compiler, warnings as
    errors (so the header is checked as plain C too)."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler (cc) to build test plugins with")
    out_dir = tmp_path / "plugins"
    out_dir.mkdir(exist_ok=True)
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    lib = out_dir / f"libnsp_backend_{name}.so"
    done = subprocess.run([cc, "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-I",
                           str(ABI_DIR), str(src), "-o", str(lib)], capture_output=True, text=True)
    assert done.returncode == 0, f"{name}.c does not build:\n{done.stderr}"
    return lib


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """The test plugins, built once per test, on NSP_BACKEND_PATH."""
    build(tmp_path, "ramdev", RAMDEV)
    build(tmp_path, "later", LATER_ABI)
    build(tmp_path, "noentry", NO_ENTRY)
    (tmp_path / "plugins" / "libnsp_backend_garbage.so").write_bytes(b"not an ELF file at all")
    monkeypatch.setenv("NSP_BACKEND_PATH", str(tmp_path / "plugins"))
    return tmp_path / "plugins"


def params():
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((70, 130)).astype(np.float32), "b": rng.standard_normal(50).astype(np.float32)}


def test_the_header_alone_builds_as_c_and_cxx(tmp_path):
    """A vendor compiles against nsp_backend_abi.h alone, from C or C++."""
    for compiler, flags in (("cc", ["-std=c99", "-x", "c"]), ("c++", ["-std=c++11", "-x", "c++"])):
        path = shutil.which(compiler)
        if path is None:
            pytest.skip(f"no {compiler}")
        subprocess.run([path, *flags, "-Wall", "-Wextra", "-Werror", "-pedantic", "-fsyntax-only", "-I",
                        str(ABI_DIR), "-"], input='#include "nsp_backend_abi.h"\nint main(void) { return 0; }\n',
                       check=True, text=True, capture_output=True)


def test_a_c_plugin_runs_a_store_and_is_recorded(tmp_path, plugins):
    spec = storage.OptimizerSpec("sgd")
    rng = np.random.default_rng(1)
    with storage.open(None, tier="memory", num_shards=2, page_bytes=PAGE) as ref, \
            storage.open(tmp_path / "dev", backend="ramdev", num_shards=2, page_bytes=PAGE, checksum=False) as dev:
        assert dev.tier == "file" and dev.backend == "ramdev"
        for store in (ref, dev):
            store.initialize(params(), spec)
        for step in range(1, 4):
            g = rng.standard_normal(ref.layout.padded_total).astype(np.float32)
            want = ref.update(g, version=step - 1, lr=0.1, step=step)["params"]
            got = dev.update(g, version=step - 1, lr=0.1, step=step)["params"]
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(dev.read("param"), ref.read("param"), rtol=1e-6, atol=1e-7)
        stats = dev.shard_stats()
        # Each shard's device ran one kernel per page per update (the page buffers were its own).
        assert [s["backend"] for s in stats] == [{"launches": 3.0 * dev.layout.pages_per_shard}] * 2
        assert dev.stats()["updates"] == 3 and isinstance(dev.stats()["shared_in_bytes"], int)
        assert all(s["pages_read"] == 3 * dev.layout.pages_per_shard for s in stats)
    meta = json.loads((tmp_path / "dev" / "nsp_store.json").read_text())
    assert (meta["tier"], meta["backend"]) == ("file", "ramdev")


def test_any_backend_library_by_name_is_recorded_and_reopened(tmp_path, plugins):
    """The generic way in: a library under a vendor's name (here nsp's csd device, copied), its options given as
    they are, the store recording the name and reopening on it."""
    shutil.copy(Path(_nsp_ffi.backend_dir()) / "libnsp_backend_csd.so", plugins / "libnsp_backend_vendorx.so")
    figures = {"device_link_gbps": 4, "p2p_read_gbps": 2, "p2p_write_gbps": 1, "updater_gbps": 7,
               "shared_gbps": 6, "ssd_overlap": 0}
    spec = storage.OptimizerSpec("adam")
    rng = np.random.default_rng(2)
    with storage.open(tmp_path / "s", tier="csd", backend="vendorx", backend_options=figures, num_shards=2,
                      page_bytes=PAGE) as s, storage.open(None, num_shards=2, page_bytes=PAGE) as ref:
        for store in (s, ref):
            store.initialize(params(), spec)
        g = rng.standard_normal(ref.layout.padded_total).astype(np.float32)
        np.testing.assert_array_equal(s.update(g, version=0, lr=0.01, step=1)["params"],
                                      ref.update(g, version=0, lr=0.01, step=1)["params"])
        assert s.shard_stats()[1]["backend"]["shared_gbps"] == 6.0
    meta = json.loads((tmp_path / "s" / "nsp_store.json").read_text())
    assert (meta["tier"], meta["backend"]) == ("csd", "vendorx")
    with storage.open(tmp_path / "s", backend_options=figures) as again:
        assert again.backend == "vendorx" and again.version == 1 and again.verify()["problems"] == []
    # Options are not recorded: the device wants its figures at every open.
    with pytest.raises(storage.StoreError, match=not_available("vendorx") + ".*figure 'device_link_gbps' is "
                       "missing"):
        storage.open(tmp_path / "s")
    with pytest.raises(storage.StoreError, match="runs on backend 'vendorx', opened with backend='ramdev'"):
        storage.open(tmp_path / "s", backend="ramdev")


def not_available(name: str) -> str:
    return f"^backend {name} not available: "


def test_each_unavailable_backend_says_why_at_open(tmp_path, plugins, monkeypatch):
    cases = {
        "nosuch": rf"no libnsp_backend_nosuch\.so found; looked at {plugins}/libnsp_backend_nosuch\.so, "
                  rf"{Path(_nsp_ffi.backend_dir())}/libnsp_backend_nosuch\.so",
        "garbage": rf"cannot load {plugins}/libnsp_backend_garbage\.so: ",
        "noentry": rf"{plugins}/libnsp_backend_noentry\.so exports no nsp_backend_entry_v1 ",
        "later": rf"{plugins}/libnsp_backend_later\.so implements backend ABI version 2; this nsp implements "
                 r"version 1$",
    }
    for i, (name, why) in enumerate(cases.items()):
        with pytest.raises(storage.StoreError, match=not_available(name) + why):
            storage.open(tmp_path / f"s{i}", backend=name)
        assert not (tmp_path / f"s{i}" / "nsp_store.json").exists()
    # A direct path to a library stands for the backend of its file name; one that is not there is said.
    missing = tmp_path / "elsewhere" / "libnsp_backend_direct.so"
    monkeypatch.setenv("NSP_BACKEND_PATH", f"{missing}:{plugins}/libnsp_backend_ramdev.so")
    with pytest.raises(storage.StoreError, match=not_available("direct") + rf"no libnsp_backend_direct\.so found; "
                       rf"looked at {missing}, {plugins}/libnsp_backend_ramdev\.so \(a library of another name\)"):
        storage.open(tmp_path / "direct", backend="direct")
    assert storage.open(tmp_path / "direct_ok", backend="ramdev").backend == "ramdev"


def test_a_name_with_no_library_anywhere(tmp_path, monkeypatch):
    monkeypatch.delenv("NSP_BACKEND_PATH", raising=False)
    with pytest.raises(storage.StoreError, match=not_available("xrt_missing") + r"no libnsp_backend_xrt_missing\.so "
                       rf"found; looked at {Path(_nsp_ffi.backend_dir())}/libnsp_backend_xrt_missing\.so"):
        storage.open(tmp_path / "s", backend="xrt_missing")
    with pytest.raises(storage.StoreError, match=not_available("a/b") + "a backend name is"):
        storage.open(tmp_path / "t", backend="a/b")


def test_a_device_that_refuses_to_open(tmp_path, plugins):
    store = storage.open(tmp_path / "s", backend="ramdev", backend_options={"refuse": 1}, num_shards=2,
                         page_bytes=PAGE, checksum=False)
    with store, pytest.raises(storage.StoreError, match=not_available("ramdev") + r"opening the device for shard 0 "
                              rf"\({tmp_path}/s/shards/00000\) failed: ramdev: no device attached"):
        store.initialize(params(), storage.OptimizerSpec("sgd"))
    assert not store.initialized
    # What the device cannot run is its own message too.
    with storage.open(tmp_path / "adam", backend="ramdev", checksum=False, page_bytes=PAGE) as store, \
            pytest.raises(storage.StoreError, match="ramdev keeps params only"):
        store.initialize(params(), storage.OptimizerSpec("adam"))


def test_backend_arguments_are_checked(tmp_path, plugins):
    with pytest.raises(ValueError, match="open the store with a path"):
        storage.open(None, tier="memory", backend="ramdev")
    with pytest.raises(ValueError, match="backend 'file' is the file tier's own"):
        storage.open(tmp_path / "s", tier="csd", backend="file")
    with pytest.raises(ValueError, match="takes no backend_options"):
        storage.open(tmp_path / "s", tier="file", backend_options={"a": 1})
    with pytest.raises(ValueError, match="must not hold ';'"):
        storage.open(tmp_path / "s", backend="ramdev", backend_options={"a": "1;b=2"})
