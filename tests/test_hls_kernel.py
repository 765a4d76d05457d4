"""The HLS-style updater kernel (ffi/backends/hls) in C simulation, and against nsp's own CPU kernel.

Two checks, both built here with the system C++ compiler (no Xilinx tools):
- the C simulation testbench (ffi/backends/hls/csim_main.cc), which holds every kind x gradient format x lazy against
  its own fp32 and double oracles and exits non-zero above 1e-6;
- the kernel compiled into a shared library and called through ctypes on numpy arrays, page by page with the
  Top-K run split per page (as a device backend would run it), against ``nsp.primitives.fused_update`` on the same
  inputs: within 1e-6 relative under whatever instruction set nsp's kernels use here (its AVX2/AVX-512 kernels
  fuse multiply-adds, so the last bit may differ), and bit for bit against its portable kernel, which runs the same
  fp32 operations in the same order (checked in a subprocess with ``NSP_KERNEL_ISA=portable``).

Run as a script (``python tests/test_hls_kernel.py LIB``) it prints the comparison as JSON: the subprocess check.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
FFI = ROOT / "ffi"  # the include root of the C++ sources
HLS = FFI / "backends" / "hls"
CXXFLAGS = ["-O2", "-std=c++17", "-Wno-unknown-pragmas", "-ffp-contract=off"]
KERNEL_SOURCES = [HLS / "nsp_updater_hls.cc", HLS / "nsp_updater_host.cc"]
TOLERANCE = 1e-6
PAGE = 3000  # elements per page: not a multiple of the kernel's 1024-element chunk, so pages end in a tail
SIZE = 2 * PAGE + 1234

KINDS = {"adam": 0, "adamw": 1, "sgd": 2, "adagrad": 3}
FORMATS = {"dense_f32": 0, "dense_bf16": 1, "topk_f32": 2, "topk_bf16": 3}
CONFIGS = {
    "adam": dict(kind="adam", b1=0.9, b2=0.999, eps=1e-8),
    "adam_l2": dict(kind="adam", b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01),
    "adamw_wd": dict(kind="adamw", b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.05),
    "sgd": dict(kind="sgd", eps=0.0),
    "sgd_momentum": dict(kind="sgd", eps=0.0, momentum=0.9),
    "sgd_nesterov_l2": dict(kind="sgd", eps=0.0, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adagrad": dict(kind="adagrad", eps=1e-7),
}


def find_cxx() -> str | None:
    """The system C++ compiler (``$CXX``, then c++, g++, clang++), or None."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_cxx(cxx: str, sources: list[Path], out: Path, *extra: str) -> Path:
    """Compiles ``sources`` into ``out``; fails the test with the compiler's message."""
    cmd = [cxx, *CXXFLAGS, *extra, f"-I{FFI}", *map(str, sources), "-o", str(out), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"compiling {out.name} failed:\n{' '.join(cmd)}\n{proc.stderr}"
    return out


def load_kernel(path: str | Path) -> ctypes.CDLL:
    """The kernel library with its C signatures declared."""
    lib = ctypes.CDLL(str(path))
    ptr = ctypes.c_void_p
    lib.nsp_update_page.restype = None
    lib.nsp_update_page.argtypes = [ptr] * 11 + [ctypes.c_int32] * 3 + [ctypes.c_uint32]
    lib.nsp_hls_make_coeffs.restype = ctypes.c_char_p
    lib.nsp_hls_make_coeffs.argtypes = [ctypes.c_int32, ctypes.c_float, ctypes.c_int64] + [ctypes.c_double] * 5 + [ptr]
    lib.nsp_hls_flags.restype = ctypes.c_uint32
    lib.nsp_hls_flags.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int, ctypes.c_int, ctypes.c_double,
                                  ctypes.c_int]
    lib.nsp_hls_check_topk.restype = ctypes.c_int64
    lib.nsp_hls_check_topk.argtypes = [ptr, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return lib


def _addr(a: np.ndarray | None):
    return None if a is None else a.ctypes.data


def uses_m(cfg: dict) -> bool:
    return cfg["kind"] in ("adam", "adamw") or (cfg["kind"] == "sgd" and cfg.get("momentum", 0.0) != 0.0)


def uses_v(cfg: dict) -> bool:
    return cfg["kind"] != "sgd"


def hls_update(lib, cfg: dict, state: dict, grad: np.ndarray, indices: np.ndarray | None, *, step: int, lr: float,
               lazy: bool, page: int = PAGE) -> dict:
    """One update with the HLS kernel, in place on copies of ``state``, one page at a time.

    Args:
      lib: the kernel library (``load_kernel``).
      cfg: fused_update keyword arguments (kind, b1, b2, eps, weight_decay, momentum, nesterov).
      state: ``p``, ``m``, ``v`` fp32 arrays (``m``/``v`` unused by some kinds).
      grad: the dense gradient, or the Top-K values; float32 or bfloat16 (raw bits as uint16 go to the kernel).
      indices: sorted int32 positions of the Top-K values, or None for a dense gradient.
      step: the 1-based step; lr: the learning rate.
      lazy: the lazy (sparse) update.
      page: elements per kernel run; each run gets the Top-K pairs that fall in its page, as a backend sends them.

    Returns:
      ``p``, ``m``, ``v`` and ``p16`` (the bf16 copy as uint16 bits) after the update.
    """
    coeffs = np.zeros(16, np.float32)
    err = lib.nsp_hls_make_coeffs(KINDS[cfg["kind"]], lr, step, cfg.get("b1", 0.9), cfg.get("b2", 0.999), cfg["eps"],
                                  cfg.get("weight_decay", 0.0), cfg.get("momentum", 0.0), _addr(coeffs))
    assert err is None, err.decode()
    bf16 = grad.dtype != np.float32
    raw = np.ascontiguousarray(grad).view(np.uint16) if bf16 else np.ascontiguousarray(grad, np.float32)
    fmt = (2 if indices is not None else 0) + (1 if bf16 else 0)
    flags = lib.nsp_hls_flags(KINDS[cfg["kind"]], fmt, int(lazy), int(cfg.get("nesterov", False)),
                              cfg.get("momentum", 0.0), 1)
    p, m, v = (np.array(state[k], np.float32) for k in ("p", "m", "v"))
    m, v = (m if uses_m(cfg) else None), (v if uses_v(cfg) else None)
    p16 = np.zeros(p.size, np.uint16)
    for base in range(0, p.size, page):
        n = min(page, p.size - base)
        at = lambda a: None if a is None else a[base:base + n]  # noqa: E731
        if indices is None:
            values, idx, count = at(raw), None, 0
        else:
            lo, hi = np.searchsorted(indices, [base, base + n])
            values, idx, count = raw[lo:hi], indices[lo:hi], int(hi - lo)
            assert lib.nsp_hls_check_topk(_addr(idx), count, n, base) == -1
        pv, mv, vv = at(p), at(m), at(v)
        lib.nsp_update_page(_addr(pv), _addr(mv), _addr(vv), _addr(pv), _addr(mv), _addr(vv), _addr(at(p16)),
                            None if bf16 else _addr(values), _addr(values) if bf16 else None, _addr(idx),
                            _addr(coeffs), n, count, base, flags)
    return {"p": p, "m": state["m"] if m is None else m, "v": state["v"] if v is None else v, "p16": p16}


def random_case(seed: int, cfg: dict, fmt: str, lazy: bool):
    """State and gradient for one comparison: Top-K runs at 1% with both ends of the array and a page boundary in."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    p = rng.standard_normal(SIZE).astype(np.float32)
    m = (0.1 * rng.standard_normal(SIZE)).astype(np.float32)
    r = rng.standard_normal(SIZE).astype(np.float32)
    v = (0.1 + r * r if cfg["kind"] == "adagrad" else 0.01 * r * r).astype(np.float32)
    dtype = ml_dtypes.bfloat16 if fmt.endswith("bf16") else np.float32
    if fmt.startswith("dense"):
        g = rng.standard_normal(SIZE).astype(np.float32)
        if lazy:
            g[rng.random(SIZE) < 1 / 3] = 0.0
        return {"p": p, "m": m, "v": v}, g.astype(dtype), None
    picks = rng.choice(SIZE, size=SIZE // 100, replace=False)
    idx = np.unique(np.concatenate([picks, [0, SIZE - 1, PAGE - 1, PAGE]])).astype(np.int32)
    values = rng.standard_normal(idx.size).astype(dtype)
    return {"p": p, "m": m, "v": v}, values, idx


def nsp_update(cfg: dict, state: dict, grad, indices, *, step: int, lr: float, lazy: bool) -> dict:
    """The same update with nsp's CPU kernel (``nsp.primitives.fused_update``)."""
    import jax.numpy as jnp

    from nsp.primitives import fused_update

    out = fused_update(jnp.asarray(state["p"]), jnp.asarray(grad),
                       jnp.asarray(state["m"]) if uses_m(cfg) else None,
                       jnp.asarray(state["v"]) if uses_v(cfg) else None,
                       step=step, lr=lr, lazy=lazy, bf16_out=True,
                       indices=None if indices is None else jnp.asarray(indices), **cfg)
    return {"p": np.asarray(out.param), "m": np.asarray(out.mu) if uses_m(cfg) else state["m"],
            "v": np.asarray(out.nu) if uses_v(cfg) else state["v"],
            "p16": np.asarray(out.param_bf16).view(np.uint16)}


def rel_error(actual: np.ndarray, expected: np.ndarray, before: np.ndarray) -> float:
    """max |actual - expected| relative to the larger of the array's scale before and after the update."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(np.max(np.abs(expected)), np.max(np.abs(before)), 1e-30)
    diff = np.abs(actual - expected)
    return float("inf") if np.isnan(diff).any() else float(np.max(diff) / scale)


def compare_with_nsp(lib_path: str) -> list[dict]:
    """Every config x gradient format x lazy: the HLS kernel against fused_update on the same inputs.

    Returns one record per case: ``case``, ``rel_error`` (largest over p, m, v), ``exact`` (p, m, v and the bf16
    copy equal bit for bit) and ``isa`` (the instruction set nsp's kernels ran).
    """
    from nsp.primitives import kernel_isa

    lib = load_kernel(lib_path)
    records = []
    for seed, (name, cfg) in enumerate(sorted(CONFIGS.items())):
        for fmt in FORMATS:
            for lazy in (False, True):
                state, grad, idx = random_case(seed * 16 + FORMATS[fmt] * 2 + lazy, cfg, fmt, lazy)
                step, lr = 3 + seed, 0.01 * 0.95 ** seed
                ours = hls_update(lib, cfg, state, grad, idx, step=step, lr=lr, lazy=lazy)
                ref = nsp_update(cfg, state, grad, idx, step=step, lr=lr, lazy=lazy)
                err = max(rel_error(ours[k], ref[k], state[k]) for k in ("p", "m", "v"))
                exact = all(np.array_equal(ours[k].view(np.uint32), ref[k].view(np.uint32)) for k in ("p", "m", "v"))
                exact = exact and np.array_equal(ours["p16"], ref["p16"])
                records.append({"case": f"{name}/{fmt}/lazy={lazy}", "rel_error": err, "exact": bool(exact),
                                "isa": kernel_isa()})
    return records


@pytest.fixture(scope="module")
def cxx() -> str:
    compiler = find_cxx()
    if compiler is None:
        pytest.skip("no C++ compiler found (tried $CXX, c++, g++, clang++): the HLS kernel's C simulation needs one")
    return compiler


@pytest.fixture(scope="module")
def kernel_lib(cxx, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hls") / "libnsp_updater_hls.so"
    return compile_cxx(cxx, KERNEL_SOURCES, out, "-shared", "-fPIC")


def test_csim_testbench_passes(cxx, tmp_path):
    exe = compile_cxx(cxx, [HLS / "csim_main.cc", *KERNEL_SOURCES], tmp_path / "csim")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    print(proc.stdout)
    assert proc.returncode == 0, f"C simulation failed:\n{proc.stdout}\n{proc.stderr}"
    cases, exact = map(int, re.search(r"cases: (\d+), bit-exact against the fp32 oracle: (\d+)", proc.stdout).groups())
    assert cases >= 800 and exact == cases
    for oracle in ("fp32", "double"):
        err = float(re.search(rf"max relative error vs {oracle} oracle: (\S+)", proc.stdout).group(1))
        assert err <= TOLERANCE, f"max relative error vs the {oracle} oracle is {err:.3g}"


def test_matches_nsp_cpu_kernel(kernel_lib):
    records = compare_with_nsp(str(kernel_lib))
    worst = max(records, key=lambda r: r["rel_error"])
    print(f"max relative error vs fused_update ({worst['isa']}): {worst['rel_error']:.3g} at {worst['case']}")
    assert worst["rel_error"] <= TOLERANCE, worst
    if records[0]["isa"] == "portable":
        assert all(r["exact"] for r in records), [r["case"] for r in records if not r["exact"]]


def test_bit_exact_against_portable_cpu_kernel(kernel_lib):
    env = dict(os.environ, NSP_KERNEL_ISA="portable")
    proc = subprocess.run([sys.executable, __file__, str(kernel_lib)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["isa"] for r in records} == {"portable"}
    inexact = [r["case"] for r in records if not r["exact"]]
    assert not inexact, f"not bit-identical to nsp's portable kernel: {inexact}"


if __name__ == "__main__":
    print(json.dumps(compare_with_nsp(sys.argv[1])))
