"""The xrt backend (libnsp_backend_xrt.so): a SmartSSD per shard through XRT's C API, run here against the software
model of XRT (ffi/models/xrt_model.cc, built into a temporary directory with the system C++ compiler and given to
the backend with its library= option). Its results are the memory tier's for every kind, its pages move through
P2P buffers, each way it can be unavailable says why, and each injected fault fails one update cleanly."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import nsp.storage as storage
from nsp.primitives import kernel_isa

ROOT = Path(__file__).resolve().parent.parent
PAGE = 16 * 1024
KINDS = {
    "adam": (storage.OptimizerSpec("adam"), "dense"),
    "adamw": (storage.OptimizerSpec("adamw", b1=0.8, weight_decay=0.1), "dense"),
    "sgd_momentum": (storage.OptimizerSpec("sgd", momentum=0.9, nesterov=True), "dense"),
    "adagrad": (storage.OptimizerSpec("adagrad", initial_nu=0.1), "dense"),
    "adam_topk": (storage.OptimizerSpec("adam"), "topk"),
    "adamw_bf16": (storage.OptimizerSpec("adamw", weight_decay=0.1), "bf16"),
    "adam_lazy_topk": (storage.OptimizerSpec("adam", lazy=True), "topk"),
}


def compile_shared(sources: list[Path], out: Path, *extra: str) -> Path:
    cxx = next((shutil.which(c) for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c)),
               None)
    if cxx is None:
        pytest.skip("no C++ compiler: the XRT model is built from source")
    cmd = [cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-Wno-unknown-pragmas", "-shared", "-fPIC",
           *map(str, sources), *extra, "-o", str(out), "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr}"
    return out


@pytest.fixture(scope="module")
def xrt(tmp_path_factory):
    """The XRT model library, and an xclbin for it (the model programs any readable file)."""
    where = tmp_path_factory.mktemp("xrt_model")
    lib = compile_shared([ROOT / "ffi/models/xrt_model.cc", ROOT / "ffi/hls/nsp_updater_hls.cc",
                          ROOT / "ffi/hls/nsp_updater_host.cc"], where / "libxrt_model.so")
    xclbin = where / "nsp_updater.xclbin"
    xclbin.write_bytes(b"model xclbin")
    return {"library": str(lib), "xclbin": str(xclbin)}


@pytest.fixture(autouse=True)
def no_model_faults(monkeypatch):
    for name in ("NSP_XRT_MODEL_FAIL_RUN_AT", "NSP_XRT_MODEL_FAIL_DMA_AT", "NSP_XRT_MODEL_DDR_BYTES",
                 "NSP_XRT_LIBRARY"):
        monkeypatch.delenv(name, raising=False)


def params(elements: int = 9000):
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal(elements - 100).astype(np.float32),
            "b": rng.standard_normal(100).astype(np.float32)}


def gradient(step: int, layout, how: str) -> dict:
    rng = np.random.default_rng(100 + step)
    if how == "topk":
        real = [min(layout.shard_size, max(0, layout.total - i * layout.shard_size)) for i in range(layout.num_shards)]
        idx = [np.sort(rng.choice(r, max(1, r // 50), replace=False)).astype(np.int32) for r in real]
        return {"indices": idx, "values": [rng.standard_normal(len(i)).astype(np.float32) for i in idx]}
    g = rng.standard_normal(layout.padded_total).astype(np.float32)
    g[layout.total:] = 0
    return {"grad": g.astype(ml_dtypes.bfloat16) if how == "bf16" else g}


def run(store, spec, how: str, steps: int = 3, first: int = 1) -> list[np.ndarray]:
    if not store.initialized:
        store.initialize(params(), spec)
    outs = []
    for step in range(first, first + steps):
        out = store.update(**gradient(step, store.layout, how), version=store.version, lr=0.01 / step, step=step,
                           bf16_out=how == "bf16")
        outs.append(out["params"].copy())
        if how == "bf16":
            outs.append(out["params_bf16"].view(np.uint16).astype(np.float32))
    return outs


def assert_close(got, want, what: str = "") -> None:
    """Within 1e-6 of the array's scale (the kernels' contract: the HLS updater is the portable kernel, operation
    for operation, while the memory tier may run AVX2/AVX-512 with FMA), and bit for bit on the portable ISA."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want))), 1e-30)
    assert float(np.max(np.abs(got - want))) / scale <= 1e-6, what
    if kernel_isa() == "portable":
        np.testing.assert_array_equal(got, want, err_msg=what)


def states(store, spec) -> dict[str, np.ndarray]:
    return {s: store.read(s) for s, used in zip(("param", "mu", "nu"), spec.states_used()) if used}


def on_xrt(path, options, **kw):
    kw.setdefault("num_shards", 2)
    return storage.open(path, tier="csd", backend="xrt", backend_options=options, page_bytes=PAGE, **kw)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_xrt_matches_memory(tmp_path, xrt, kind):
    spec, how = KINDS[kind]
    with storage.open(None, tier="memory", num_shards=2, page_bytes=PAGE) as mem, on_xrt(tmp_path / "x", xrt) as dev:
        assert dev.backend == "xrt"
        for want, got in zip(run(mem, spec, how), run(dev, spec, how)):
            assert_close(got, want)
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
    mem = storage.open(None, tier="memory", num_shards=2, page_bytes=PAGE)
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
    lib = compile_shared([ROOT / "ffi/models/xrt_model.cc", ROOT / "ffi/hls/nsp_updater_hls.cc",
                          ROOT / "ffi/hls/nsp_updater_host.cc"], tmp_path / "libxrt_plain.so",
                         f"-Wl,--version-script={script}")
    spec, how = KINDS["adamw_bf16"]
    with storage.open(None, tier="memory", num_shards=2, page_bytes=PAGE) as mem, \
            on_xrt(tmp_path / "x", {**xrt, "library": str(lib)}) as dev:
        for want, got in zip(run(mem, spec, how), run(dev, spec, how)):
            assert_close(got, want)
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
            storage.open(None, tier="memory", num_shards=1, page_bytes=PAGE) as mem:
        mem.initialize(params(), spec)
        with pytest.raises(storage.StoreError, match=rf"version 0 is intact: .*xrt device 0 \({tmp_path}/x/shards/"
                           rf"00000\): {what}"):
            run(dev, spec, "dense", steps=1)
        assert dev.version == 0 and dev.held_versions() == [0]
        np.testing.assert_array_equal(dev.read(), committed)
        assert dev.verify()["problems"] == []
        for want, got in zip(run(mem, spec, "dense", steps=2), run(dev, spec, "dense", steps=2)):
            assert_close(got, want)
