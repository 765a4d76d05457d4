"""The xrt backend (libnsp_backend_xrt.so): a SmartSSD per shard through XRT's C API, run here against the software
model of XRT (ffi/backends/xrt/xrt_model.cc, built into a temporary directory with the system C++ compiler and given to
the backend with its library= option). Its results are the memory tier's for every kind, its pages move through
P2P buffers, each way it can be unavailable says why, and each injected fault fails one update cleanly."""

from __future__ import annotations

import numpy as np
import pytest
from backend_cases import (KINDS, PAGE, ROOT, assert_close, assert_runs_match, memory_store, model_sources,
                           open_device, params, run, states)
from backend_cases import compile_shared as _compile_shared

import nsp.storage as storage


def compile_shared(sources, out, *extra):
    return _compile_shared(sources, out, *extra, what="the XRT model")


@pytest.fixture(scope="module")
def xrt(tmp_path_factory):
    """The XRT model library, and an xclbin for it (the model programs any readable file)."""
    where = tmp_path_factory.mktemp("xrt_model")
    lib = compile_shared(model_sources("xrt_model"), where / "libxrt_model.so")
    xclbin = where / "nsp_updater.xclbin"
    xclbin.write_bytes(b"model xclbin")
    return {"library": str(lib), "xclbin": str(xclbin)}


@pytest.fixture(autouse=True)
def no_model_faults(monkeypatch):
    for name in ("NSP_XRT_MODEL_FAIL_RUN_AT", "NSP_XRT_MODEL_FAIL_DMA_AT", "NSP_XRT_MODEL_DDR_BYTES",
                 "NSP_XRT_LIBRARY"):
        monkeypatch.delenv(name, raising=False)


def on_xrt(path, options, **kw):
    return open_device(path, "xrt", options, **kw)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_xrt_matches_memory(tmp_path, xrt, kind):
    spec, how = KINDS[kind]
    with memory_store(2) as mem, on_xrt(tmp_path / "x", xrt) as dev:
        assert dev.backend == "xrt"
        assert_runs_match(mem, dev, spec, how)
        stats = dev.shard_stats()[0]["backend"]
        for name, want in states(mem, spec).items():
            assert_close(states(dev, spec)[name], want, name)
        # Every update read its pages P2P into the FPGA's buffers and ran the kernel there, page by page.
        pages = -(-dev.layout.shard_size // (PAGE // 4))
        assert stats["kernel_runs"] == 3 * pages and stats["failed_runs"] == 0 and stats["p2p_read_call"] == 1
        assert stats["p2p_page_reads"] == 3 * pages * sum(spec.states_used())
        assert dev.verify()["problems"] == []


def test_a_reopened_store_runs_on_xrt_again_and_the_library_can_come_from_the_environment(tmp_path, xrt,
                                                                                         monkeypatch):
    spec = storage.OptimizerSpec("adam")
    mem = memory_store(2)
    with on_xrt(tmp_path / "x", xrt) as dev:
        want, got = run(mem, spec, "dense", steps=2), run(dev, spec, "dense", steps=2)
        monkeypatch.setenv("NSP_XRT_LIBRARY", xrt["library"])
        with storage.open(tmp_path / "y", tier="csd", backend="xrt", backend_options={"xclbin": xrt["xclbin"]},
                          num_shards=2, page_bytes=PAGE) as env_dev:
            got_env = run(env_dev, spec, "dense", steps=2)
        for w, g, e in zip(want, got, got_env):
            assert_close(g, w)
            np.testing.assert_array_equal(e, g)
        version = dev.version
    with storage.open(tmp_path / "x", backend_options=xrt) as dev:
        assert (dev.backend, dev.version) == ("xrt", version) and dev.verify()["problems"] == []
        assert_close(run(dev, spec, "dense", steps=1, first=3)[0], run(mem, spec, "dense", steps=1, first=3)[0])
    mem.close()


def test_without_the_p2p_call_pages_are_read_into_the_buffers_mapping(tmp_path, xrt):
    """Real XRT has no nspXrtP2PRead: the device then preads each page file into the P2P buffer's mapping (the P2P
    transfer on a SmartSSD). The model built with that call hidden stands for it."""
    script = tmp_path / "hide_p2p.map"
    script.write_text("{ local: nspXrtP2PRead; nspXrtP2PWrite; };\n")
    lib = compile_shared([ROOT / "ffi/backends/xrt/xrt_model.cc", ROOT / "ffi/backends/hls/nsp_updater_hls.cc",
                          ROOT / "ffi/backends/hls/nsp_updater_host.cc"], tmp_path / "libxrt_plain.so",
                         f"-Wl,--version-script={script}")
    spec, how = KINDS["adamw_bf16"]
    with memory_store(2) as mem, \
            on_xrt(tmp_path / "x", {**xrt, "library": str(lib)}) as dev:
        assert_runs_match(mem, dev, spec, how)
        stats = dev.shard_stats()[0]["backend"]
    assert stats["p2p_read_call"] == 0 and stats["p2p_page_reads"] == 0
    assert stats["host_page_reads"] >= 3 * 2 * 3 and stats["kernel_runs"] == 3 * 2


def test_each_way_xrt_is_unavailable_says_why(tmp_path, xrt):
    def refused(options, why, name="x"):
        # Devices open when the store's state is first made (or when a store with state reopens).
        with on_xrt(tmp_path / name, options, num_shards=1) as store, pytest.raises(
                storage.StoreError, match=rf"^backend xrt not available: .*xrt device 0 \(.*\): {why}"):
            store.initialize(params(), storage.OptimizerSpec("adam"))

    refused({"xclbin": xrt["xclbin"]}, r"cannot load the XRT library 'libxrt_coreutil\.so\.2' .*: .*libxrt_coreutil",
            "default")
    refused({**xrt, "library": str(tmp_path / "nowhere" / "libxrt.so")},
            rf"cannot load the XRT library '{tmp_path}/nowhere/libxrt.so' .*: .*No such file", "missing")
    # A library that is not XRT's: the first call it lacks is named.
    partial = tmp_path / "partial.cc"
    partial.write_text('extern "C" void* xrtDeviceOpen(unsigned) { return nullptr; }\n')
    lib = compile_shared([partial], tmp_path / "libpartial.so")
    refused({**xrt, "library": str(lib)}, rf"the XRT library '{lib}' lacks the symbol xrtDeviceClose", "symbol")
    refused({"library": xrt["library"]}, r"option xclbin=<path> is required", "xclbin")
    refused({**xrt, "xclbin": str(tmp_path / "none.xclbin")}, r"loading the xclbin .* failed: .*cannot read", "bad")


@pytest.mark.parametrize("variable, at, what", [
    ("NSP_XRT_MODEL_FAIL_RUN_AT", 2, r"the update kernel on page \d+ failed: the run ended in state 5: "
                                     r"xrt model: injected kernel fault in run 2"),
    ("NSP_XRT_MODEL_FAIL_DMA_AT", 1, r"reading page \d+ of state '(param|mu|nu)' in slot 0 failed: the P2P read of "
                                     r"\S+ failed: xrt model: nspXrtP2PRead: injected DMA fault"),
    # 3 pages: 9 P2P reads and, per page, the gradient's and coefficients' write and sync and the params' read back.
    # The last five are the last computed page's (every read came before it): 23, its coefficients; 24, its params.
    ("NSP_XRT_MODEL_FAIL_DMA_AT", 24, r"the update kernel on page \d+ failed: xrtBORead failed: "
                                      r"xrt model: xrtBORead: injected DMA fault"),
    ("NSP_XRT_MODEL_FAIL_DMA_AT", 23, r"the update kernel on page \d+ failed: the coefficients: xrtBOSync to the "
                                      r"device failed: xrt model: xrtBOSync: injected DMA fault"),
])
def test_an_injected_fault_fails_one_update_cleanly(tmp_path, xrt, monkeypatch, variable, at, what):
    spec = storage.OptimizerSpec("adam")
    with on_xrt(tmp_path / "x", xrt, num_shards=1) as dev:
        dev.initialize(params(), spec)
        committed = dev.read()
    monkeypatch.setenv(variable, str(at))  # read when the device opens: counted from this reopen
    with on_xrt(tmp_path / "x", xrt, num_shards=1) as dev, \
            memory_store(1) as mem:
        mem.initialize(params(), spec)
        with pytest.raises(storage.StoreError, match=rf"version 0 is intact: .*xrt device 0 \({tmp_path}/x/shards/"
                           rf"00000\): {what}"):
            run(dev, spec, "dense", steps=1)
        assert dev.version == 0 and dev.held_versions() == [0]
        np.testing.assert_array_equal(dev.read(), committed)
        assert dev.verify()["problems"] == []
        assert_runs_match(mem, dev, spec, "dense", steps=2)
