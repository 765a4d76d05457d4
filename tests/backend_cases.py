"""What the backend plugins' tests (test_csd_device.py, test_xrt_backend.py, test_axdimm_backend.py) share: the
optimizer kinds each backend is run with, the params and gradients it is fed, a few steps of updates, the stores it
is compared against, and building a vendor model library from source. Every backend must give the memory tier's
results on the same inputs, so the inputs are made in one place."""

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
PAGE_ELEMS = PAGE // 4
# Per kind: the spec, and how its gradients travel.
KINDS = {
    "adam": (storage.OptimizerSpec("adam"), "dense"),
    "adamw": (storage.OptimizerSpec("adamw", b1=0.8, weight_decay=0.1), "dense"),
    "sgd_momentum": (storage.OptimizerSpec("sgd", momentum=0.9, nesterov=True), "dense"),
    "adagrad": (storage.OptimizerSpec("adagrad", initial_nu=0.1), "dense"),
    "adam_topk": (storage.OptimizerSpec("adam"), "topk"),
    "adamw_bf16": (storage.OptimizerSpec("adamw", weight_decay=0.1), "bf16"),
    "adam_lazy_topk": (storage.OptimizerSpec("adam", lazy=True), "topk"),
}


def params(elements: int = 9000):
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal(elements - 100).astype(np.float32),
            "b": rng.standard_normal(100).astype(np.float32)}


def gradient(step: int, layout, how: str) -> dict:
    """update() arguments for one step's gradient: dense fp32 or bf16, or 2% Top-K pairs per shard."""
    rng = np.random.default_rng(100 + step)
    if how == "topk":
        real = [min(layout.shard_size, max(0, layout.total - i * layout.shard_size)) for i in range(layout.num_shards)]
        idx = [np.sort(rng.choice(r, max(1, r // 50), replace=False)).astype(np.int32) for r in real]
        return {"indices": idx, "values": [rng.standard_normal(len(i)).astype(np.float32) for i in idx]}
    g = rng.standard_normal(layout.padded_total).astype(np.float32)
    g[layout.total:] = 0
    return {"grad": g.astype(ml_dtypes.bfloat16) if how == "bf16" else g}


def run(store, spec, how: str, steps: int = 3, first: int = 1) -> list[np.ndarray]:
    """The params each step hands out (and their bf16 copy's bits, for a bf16 kind), initializing first if needed."""
    if not store.initialized:
        store.initialize(params(), spec)
    outs = []
    for step in range(first, first + steps):
        out = store.update(**gradient(step, store.layout, how), version=store.version, lr=0.01 / step, step=step,
                           bf16_out=how == "bf16")
        outs.append(out["params"].copy())
        if how == "bf16":
            outs.append(out["params_bf16"].view(np.uint16).copy())
    return outs


def states(store, spec) -> dict[str, np.ndarray]:
    return {s: store.read(s) for s, used in zip(("param", "mu", "nu"), spec.states_used()) if used}


def memory_store(num_shards: int = 2):
    """The memory tier, the reference every backend's results are held to."""
    return storage.open(None, tier="memory", num_shards=num_shards, page_bytes=PAGE)


def open_device(path, backend: str | None = None, options=None, **kw):
    """A store on the csd tier with `backend` (the tier's default, csd, when None), two shards and PAGE-sized pages
    unless `kw` says otherwise."""
    kw.setdefault("num_shards", 2)
    kw.setdefault("page_bytes", PAGE)
    if backend is not None:
        kw.update(backend=backend, backend_options=options)
    return storage.open(path, tier="csd", **kw)


def assert_close(got, want, what: str = "") -> None:
    """Within 1e-6 of the array's scale (the kernels' contract: the HLS updater is the portable kernel, operation
    for operation, while the memory tier may run AVX2/AVX-512 with FMA), and bit for bit on the portable ISA."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want))), 1e-30)
    assert float(np.max(np.abs(got - want))) / scale <= 1e-6, what
    if kernel_isa() == "portable":
        np.testing.assert_array_equal(got, want, err_msg=what)


def assert_runs_match(mem, dev, spec, how: str, compare=assert_close, **run_kw) -> None:
    """The same steps on the memory tier and on the device hand out the same params."""
    for want, got in zip(run(mem, spec, how, **run_kw), run(dev, spec, how, **run_kw)):
        compare(got, want)


def compile_shared(sources: list[Path], out: Path, *extra: str, what: str = "the model") -> Path:
    """Builds a shared library from `sources` with the system C++ compiler (skips the test where there is none)."""
    cxx = next((shutil.which(c) for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c)),
               None)
    if cxx is None:
        pytest.skip(f"no C++ compiler: {what} is built from source")
    cmd = [cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-Wno-unknown-pragmas", "-shared", "-fPIC",
           f"-I{ROOT / 'ffi'}", *map(str, sources), *extra, "-o", str(out), "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr}"
    return out


def model_sources(model: str) -> list[Path]:
    """A vendor model's sources: the model beside its backend (ffi/backends/<vendor>/<vendor>_model.cc, `model` being
    xrt_model or axdimm_model) and the HLS updater it runs (ffi/backends/hls)."""
    vendor = model.removesuffix("_model")
    return [ROOT / f"ffi/backends/{vendor}/{model}.cc", ROOT / "ffi/backends/hls/nsp_updater_hls.cc",
            ROOT / "ffi/backends/hls/nsp_updater_host.cc"]
