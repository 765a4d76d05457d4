"""The software models of the vendor libraries (ffi/backends/xrt/xrt_model.cc, ffi/backends/axdimm/axdimm_model.cc),
driven through ctypes exactly as a backend would call the real ones: XRT's C API (libxrt_model.so, a SmartSSD's FPGA)
and the AXDIMM runtime API as nsp reads it from the paper (libaxdimm_model.so).

Each test builds the model library with the system C++ compiler, moves a page in, runs the update, moves it back
and holds the result against nsp's CPU kernel (``fused_update``): within 1e-6 relative, bit for bit when nsp's
kernels run the portable ISA. Then the rules the hardware imposes (the AXDIMM arbiter blocking host access, finite
device memory) and the injected faults: each gives its error once and the next call succeeds.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("hls_kernel_helpers", Path(__file__).with_name("test_hls_kernel.py"))
hk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hk)

MODELS = {name: hk.ROOT / "ffi" / "backends" / name.removesuffix("_model") for name in ("xrt_model", "axdimm_model")}
P = ctypes.c_void_p
N = 5000          # elements per tensor
PAGE = 3000       # XRT runs: two pages (sub-buffers), the second with index_base = PAGE
ADAM = hk.CONFIGS["adam"]
ADAMW = hk.CONFIGS["adamw_wd"]
STEP, LR = 7, 3e-3

# XRT's values (ffi/backends/xrt/vendor/xrt_c_api.h)
BO_P2P = 1 << 30
SYNC_TO_DEVICE, SYNC_FROM_DEVICE = 0, 1
ERT_COMPLETED, ERT_ERROR = 4, 5
# AXDIMM status codes (ffi/backends/axdimm/vendor/axdimm_api.h)
AX_OK, AX_EINVAL, AX_ENOMEM, AX_EACCES, AX_EMODE, AX_EBUSY, AX_EIO, AX_EKERNEL = range(8)
MODE_NORMAL, MODE_ACC = 0, 1


def build_model(cxx: str, out_dir: Path, name: str) -> Path:
    sources = [MODELS[name] / f"{name}.cc", *hk.KERNEL_SOURCES]
    return hk.compile_cxx(cxx, sources, out_dir / f"lib{name}.so", "-shared", "-fPIC")


@pytest.fixture(scope="module")
def cxx() -> str:
    compiler = hk.find_cxx()
    if compiler is None:
        pytest.skip("no C++ compiler found (tried $CXX, c++, g++, clang++): the vendor models are built from source")
    return compiler


def check_against_nsp(got: dict, cfg: dict, state: dict, grad, idx, *, lazy: bool = False) -> float:
    """Asserts the model's result equals fused_update's within 1e-6 (bit for bit on the portable ISA)."""
    import ml_dtypes

    from nsp.primitives import kernel_isa

    ref = hk.nsp_update(cfg, state, grad, idx, step=STEP, lr=LR, lazy=lazy)
    err = max(hk.rel_error(got[k], ref[k], state[k]) for k in ("p", "m", "v"))
    assert err <= hk.TOLERANCE, f"relative error {err:.3g} against fused_update"
    # The bf16 copy is the model's own fp32 result rounded to nearest even, whatever nsp's ISA.
    assert np.array_equal(got["p16"], got["p"].astype(ml_dtypes.bfloat16).view(np.uint16))
    if kernel_isa() == "portable":
        assert np.array_equal(got["p16"], ref["p16"])
        for k in ("p", "m", "v"):
            assert np.array_equal(got[k].view(np.uint32), ref[k].view(np.uint32)), k
    return err


def grad_bytes(grad: np.ndarray) -> np.ndarray:
    """The gradient's raw bytes as the device gets them (bf16 as uint16 bits)."""
    return np.ascontiguousarray(grad).view(np.uint16 if grad.dtype != np.float32 else np.float32)


def coefficients(lib, cfg: dict) -> np.ndarray:
    coeffs = np.zeros(16, np.float32)
    err = lib.nsp_hls_make_coeffs(hk.KINDS[cfg["kind"]], LR, STEP, cfg["b1"], cfg["b2"], cfg["eps"],
                                  cfg.get("weight_decay", 0.0), 0.0, coeffs.ctypes.data)
    assert err is None, err
    return coeffs


# ---------------------------------------------------------------------------------------------------------------
# XRT
# ---------------------------------------------------------------------------------------------------------------


class Xrt:
    """libxrt_model.so with the signatures of ffi/backends/xrt/vendor/xrt_c_api.h declared."""

    def __init__(self, path: Path):
        lib = self.lib = ctypes.CDLL(str(path), use_errno=True)
        sig = {
            "xrtDeviceOpen": (P, [ctypes.c_uint]), "xrtDeviceClose": (ctypes.c_int, [P]),
            "xrtDeviceLoadXclbinFile": (ctypes.c_int, [P, ctypes.c_char_p]),
            "xrtDeviceGetXclbinUUID": (ctypes.c_int, [P, ctypes.c_char_p]),
            "xrtPLKernelOpen": (P, [P, ctypes.c_char_p, ctypes.c_char_p]), "xrtKernelClose": (ctypes.c_int, [P]),
            "xrtBOAlloc": (P, [P, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint32]),
            "xrtBOSubAlloc": (P, [P, ctypes.c_size_t, ctypes.c_size_t]), "xrtBOFree": (ctypes.c_int, [P]),
            "xrtBOMap": (P, [P]), "xrtBOSync": (ctypes.c_int, [P, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t]),
            "xrtBOWrite": (ctypes.c_int, [P, P, ctypes.c_size_t, ctypes.c_size_t]),
            "xrtBORead": (ctypes.c_int, [P, P, ctypes.c_size_t, ctypes.c_size_t]),
            "nspXrtP2PRead": (ctypes.c_int, [P, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int64]),
            "nspXrtP2PWrite": (ctypes.c_int, [P, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int64]),
            "xrtRunOpen": (P, [P]), "xrtRunStart": (ctypes.c_int, [P]), "xrtRunWait": (ctypes.c_int, [P]),
            "xrtRunClose": (ctypes.c_int, [P]),
            "xrtErrorGetString": (ctypes.c_int, [P, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t, P]),
            "nsp_hls_make_coeffs": (ctypes.c_char_p, [ctypes.c_int32, ctypes.c_float, ctypes.c_int64]
                                    + [ctypes.c_double] * 5 + [P]),
            "nsp_hls_flags": (ctypes.c_uint32, [ctypes.c_int32, ctypes.c_int32, ctypes.c_int, ctypes.c_int,
                                                ctypes.c_double, ctypes.c_int]),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        lib.xrtRunSetArg.restype = ctypes.c_int  # variadic: arguments passed as explicit ctypes values

    def message(self, code: int) -> str:
        buf = ctypes.create_string_buffer(512)
        self.lib.xrtErrorGetString(None, code, buf, len(buf), None)
        return buf.value.decode()

    def open(self, tmp_path: Path):
        """A device with the updater loaded, and the kernel: (device, kernel)."""
        dev = self.lib.xrtDeviceOpen(0)
        assert dev
        xclbin = tmp_path / "nsp_updater.xclbin"
        xclbin.write_bytes(b"model xclbin")
        assert self.lib.xrtDeviceLoadXclbinFile(dev, str(xclbin).encode()) == 0
        uuid = ctypes.create_string_buffer(16)
        assert self.lib.xrtDeviceGetXclbinUUID(dev, uuid) == 0
        kernel = self.lib.xrtPLKernelOpen(dev, uuid, b"nsp_update_page")
        assert kernel, self.message(ctypes.get_errno())
        return dev, kernel

    def alloc(self, dev, nbytes: int, flags: int = 0):
        bo = self.lib.xrtBOAlloc(dev, nbytes, flags, 0)
        assert bo, self.message(ctypes.get_errno())
        return bo

    def upload(self, dev, array: np.ndarray):
        """A normal BO holding ``array`` on the device (written to its host side, then synced)."""
        bo = self.alloc(dev, max(array.nbytes, 4))
        if array.nbytes:
            assert self.lib.xrtBOWrite(bo, array.ctypes.data, array.nbytes, 0) == 0
            assert self.lib.xrtBOSync(bo, SYNC_TO_DEVICE, array.nbytes, 0) == 0
        return bo

    def set_args(self, run, bos: list, scalars: list[int]) -> None:
        for i, bo in enumerate(bos):
            assert self.lib.xrtRunSetArg(P(run), ctypes.c_int(i), P(bo)) == 0
        for i, value in enumerate(scalars):
            assert self.lib.xrtRunSetArg(P(run), ctypes.c_int(len(bos) + i), ctypes.c_uint32(value & 0xFFFFFFFF)) == 0


@pytest.fixture(scope="module")
def xrt(cxx, tmp_path_factory) -> Xrt:
    return Xrt(build_model(cxx, tmp_path_factory.mktemp("xrt_model"), "xrt_model"))


def xrt_update(x: Xrt, tmp_path: Path, cfg: dict, state: dict, grad, idx, *, run_hook=None) -> dict:
    """One Adam step on the XRT model, as a SmartSSD backend would run it.

    The state goes to a file (the SSD), comes into P2P buffers with nspXrtP2PRead, is updated page by page (two
    runs on sub-buffers, the second with index_base = PAGE and its share of the Top-K pairs) and goes back with
    nspXrtP2PWrite; gradient and coefficients travel as normal BOs, the bf16 copy comes back by sync + read.
    ``run_hook(run_index, state_after_wait)`` may inspect each run's outcome.
    """
    lib = x.lib
    dev, kernel = x.open(tmp_path)
    path = tmp_path / "state.bin"
    path.write_bytes(b"".join(state[k].tobytes() for k in ("p", "m", "v")))
    fd = os.open(path, os.O_RDWR)
    nbytes = 4 * N
    state_bos = [x.alloc(dev, nbytes, BO_P2P) for _ in range(3)]
    for i, bo in enumerate(state_bos):
        assert lib.nspXrtP2PRead(bo, fd, nbytes, 0, i * nbytes) == 0, x.message(ctypes.get_errno())
    raw = grad_bytes(grad)
    grad_bo = x.upload(dev, raw)
    idx_bo = x.upload(dev, idx if idx is not None else np.zeros(1, np.int32))
    coeff_bo = x.upload(dev, coefficients(lib, cfg))
    p16_bo = x.alloc(dev, 2 * N)
    bf16 = grad.dtype != np.float32
    fmt = (2 if idx is not None else 0) + int(bf16)
    flags = lib.nsp_hls_flags(hk.KINDS[cfg["kind"]], fmt, 0, 0, 0.0, 1)
    run = lib.xrtRunOpen(kernel)
    subs = []

    def sub(bo, width: int, offset: int, count: int):
        """A sub-buffer of ``count`` elements of ``width`` bytes at element ``offset`` (freed at the end)."""
        subs.append(lib.xrtBOSubAlloc(bo, width * count, width * offset))
        assert subs[-1], x.message(ctypes.get_errno())
        return subs[-1]

    for page, (base, n) in enumerate([(0, PAGE), (PAGE, N - PAGE)]):
        p_, m_, v_ = (sub(bo, 4, base, n) for bo in state_bos)
        if idx is None:
            g_, i_, count = sub(grad_bo, raw.itemsize, base, n), idx_bo, 0
        else:
            lo, hi = np.searchsorted(idx, [base, base + n])
            count = int(hi - lo)
            g_ = sub(grad_bo, raw.itemsize, int(lo), max(count, 1))
            i_ = sub(idx_bo, 4, int(lo), max(count, 1))
        g32, g16 = (None, g_) if bf16 else (g_, None)
        x.set_args(run, [p_, m_, v_, p_, m_, v_, sub(p16_bo, 2, base, n), g32, g16, i_, coeff_bo],
                   [n, count, base, flags])
        assert lib.xrtRunStart(run) == 0, x.message(ctypes.get_errno())
        state_after = lib.xrtRunWait(run)
        if run_hook is not None:
            run_hook(page, state_after)
        else:
            assert state_after == ERT_COMPLETED, x.message(errno.EIO)
    for i, bo in enumerate(state_bos):
        assert lib.nspXrtP2PWrite(bo, fd, nbytes, 0, i * nbytes) == 0
    p16 = np.zeros(N, np.uint16)
    assert lib.xrtBOSync(p16_bo, SYNC_FROM_DEVICE, 2 * N, 0) == 0
    assert lib.xrtBORead(p16_bo, p16.ctypes.data, 2 * N, 0) == 0
    os.close(fd)
    out = np.frombuffer(path.read_bytes(), np.float32)
    assert lib.xrtRunClose(run) == 0
    for bo in subs + state_bos + [grad_bo, idx_bo, coeff_bo, p16_bo]:
        assert lib.xrtBOFree(bo) == 0
    assert lib.xrtKernelClose(kernel) == 0
    assert lib.xrtDeviceClose(dev) == 0
    return {"p": out[:N].copy(), "m": out[N:2 * N].copy(), "v": out[2 * N:].copy(), "p16": p16}


def make_case(fmt: str, cfg: dict = ADAM, seed: int = 0):
    state, grad, idx = hk.random_case(seed, cfg, fmt, False)
    state = {k: a[:N].copy() for k, a in state.items()}
    if idx is not None:
        keep = idx < N
        idx, grad = np.ascontiguousarray(idx[keep]), np.ascontiguousarray(grad[keep])
    else:
        grad = np.ascontiguousarray(grad[:N])
    return state, grad, idx


@pytest.mark.parametrize("fmt", ["dense_f32", "topk_f32", "dense_bf16", "topk_bf16"])
def test_xrt_model_matches_nsp(xrt, tmp_path, fmt):
    state, grad, idx = make_case(fmt)
    got = xrt_update(xrt, tmp_path, ADAM, state, grad, idx)
    check_against_nsp(got, ADAM, state, grad, idx)


def test_xrt_model_device_memory_is_finite(xrt, monkeypatch):
    monkeypatch.setenv("NSP_XRT_MODEL_DDR_BYTES", str(1 << 20))
    lib = xrt.lib
    dev = lib.xrtDeviceOpen(0)
    first = xrt.alloc(dev, 768 << 10, BO_P2P)
    assert lib.xrtBOAlloc(dev, 512 << 10, 0, 0) is None
    assert ctypes.get_errno() == errno.ENOMEM
    assert "free" in xrt.message(errno.ENOMEM)
    assert lib.xrtDeviceClose(dev) == errno.EBUSY  # a buffer is still allocated
    assert lib.xrtBOFree(first) == 0
    second = xrt.alloc(dev, 512 << 10)
    assert lib.xrtBOFree(second) == 0 and lib.xrtDeviceClose(dev) == 0


def test_xrt_model_injected_run_fault(xrt, tmp_path, monkeypatch):
    monkeypatch.setenv("NSP_XRT_MODEL_FAIL_RUN_AT", "1")
    state, grad, idx = make_case("topk_f32")
    outcomes = []

    def hook(page, run_state):
        outcomes.append((run_state, xrt.message(errno.EIO) if run_state != ERT_COMPLETED else ""))

    got = xrt_update(xrt, tmp_path, ADAM, state, grad, idx, run_hook=hook)
    assert outcomes[0][0] == ERT_ERROR and "injected kernel fault" in outcomes[0][1]
    assert outcomes[1][0] == ERT_COMPLETED  # the next run succeeds
    # The failed run touched nothing: its page is as it was, the other page is updated.
    assert np.array_equal(got["p"][:PAGE], state["p"][:PAGE])
    ref = hk.nsp_update(ADAM, state, grad, idx, step=STEP, lr=LR, lazy=False)
    assert hk.rel_error(got["p"][PAGE:], ref["p"][PAGE:], state["p"][PAGE:]) <= hk.TOLERANCE


def test_xrt_model_injected_dma_fault(xrt, tmp_path, monkeypatch):
    monkeypatch.setenv("NSP_XRT_MODEL_FAIL_DMA_AT", "2")
    lib = xrt.lib
    dev = lib.xrtDeviceOpen(0)
    data = np.arange(256, dtype=np.float32)
    bo = xrt.alloc(dev, data.nbytes)
    assert lib.xrtBOWrite(bo, data.ctypes.data, data.nbytes, 0) == 0              # transfer 1
    assert lib.xrtBOSync(bo, SYNC_TO_DEVICE, data.nbytes, 0) == errno.EIO        # transfer 2: injected
    assert "injected DMA fault" in xrt.message(errno.EIO)
    assert lib.xrtBOSync(bo, SYNC_TO_DEVICE, data.nbytes, 0) == 0                # the retry succeeds
    back = np.zeros_like(data)
    assert lib.xrtBOSync(bo, SYNC_FROM_DEVICE, data.nbytes, 0) == 0
    assert lib.xrtBORead(bo, back.ctypes.data, data.nbytes, 0) == 0
    assert np.array_equal(back, data)
    assert lib.xrtBOFree(bo) == 0 and lib.xrtDeviceClose(dev) == 0


def test_xrt_model_refuses_bad_topk_run(xrt, tmp_path):
    lib = xrt.lib
    dev, kernel = xrt.open(tmp_path)
    state = [xrt.upload(dev, np.zeros(16, np.float32)) for _ in range(3)]
    idx = xrt.upload(dev, np.array([3, 1], np.int32))  # unsorted
    vals = xrt.upload(dev, np.ones(2, np.float32))
    coeff = xrt.upload(dev, coefficients(lib, ADAM))
    run = lib.xrtRunOpen(kernel)
    xrt.set_args(run, [*state, *state, None, vals, None, idx, coeff], [16, 2, 0, lib.nsp_hls_flags(0, 2, 0, 0, 0.0, 0)])
    assert lib.xrtRunStart(run) == errno.EINVAL
    assert "unsorted" in xrt.message(errno.EINVAL)
    assert lib.xrtRunClose(run) == 0
    for bo in [*state, idx, vals, coeff]:
        lib.xrtBOFree(bo)
    assert lib.xrtKernelClose(kernel) == 0 and lib.xrtDeviceClose(dev) == 0


# ---------------------------------------------------------------------------------------------------------------
# AXDIMM
# ---------------------------------------------------------------------------------------------------------------


class AdamArgs(ctypes.Structure):
    """nspAxdimmAdamArgs (ffi/backends/axdimm/vendor/axdimm_api.h)."""

    _fields_ = [("struct_size", ctypes.c_uint32), ("kind", ctypes.c_int32), ("grad_format", ctypes.c_int32),
                ("lazy", ctypes.c_int32), ("p", ctypes.c_uint64), ("m", ctypes.c_uint64), ("v", ctypes.c_uint64),
                ("grad", ctypes.c_uint64), ("indices", ctypes.c_uint64), ("p_bf16", ctypes.c_uint64),
                ("nparams", ctypes.c_int64), ("topk_count", ctypes.c_int64), ("index_base", ctypes.c_int64),
                ("step", ctypes.c_int64), ("lr", ctypes.c_float), ("reserved", ctypes.c_int32),
                ("b1", ctypes.c_double), ("b2", ctypes.c_double), ("eps", ctypes.c_double),
                ("weight_decay", ctypes.c_double)]


class Axdimm:
    """libaxdimm_model.so with the signatures of ffi/backends/axdimm/vendor/axdimm_api.h declared."""

    def __init__(self, path: Path):
        lib = self.lib = ctypes.CDLL(str(path))
        u64 = ctypes.c_uint64
        sig = {
            "nspAxdimmOpen": [ctypes.c_char_p, ctypes.POINTER(P)], "nspAxdimmClose": [P],
            "nspAxdimmMallocX": [P, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(u64)], "nspAxdimmFreeX": [P, u64],
            "nspAxdimmMemInfo": [P, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
            "nspAxdimmMemcpyH2X": [P, u64, P, ctypes.c_size_t], "nspAxdimmMemcpyX2H": [P, P, u64, ctypes.c_size_t],
            "nspAxdimmSetArbiterAcc": [P, ctypes.c_int], "nspAxdimmSetArbiterNormal": [P, ctypes.c_int],
            "nspAxdimmGetArbiterMode": [P, ctypes.c_int, ctypes.POINTER(ctypes.c_int)],
            "nspAxdimmRunAdamAsync": [P, ctypes.POINTER(AdamArgs), ctypes.c_int],
            "nspAxdimmWait": [P, ctypes.c_int], "nspAxdimmPoll": [P, ctypes.c_int, ctypes.POINTER(ctypes.c_int)],
        }
        for name, argtypes in sig.items():
            getattr(lib, name).restype, getattr(lib, name).argtypes = ctypes.c_int, argtypes
        lib.nspAxdimmLastError.restype, lib.nspAxdimmLastError.argtypes = ctypes.c_char_p, []

    def error(self) -> str:
        return self.lib.nspAxdimmLastError().decode()

    def open(self):
        h = P()
        assert self.lib.nspAxdimmOpen(b"/dev/axdimm0", ctypes.byref(h)) == AX_OK
        return h

    def malloc(self, h, nbytes: int, channel: int) -> int:
        addr = ctypes.c_uint64()
        assert self.lib.nspAxdimmMallocX(h, nbytes, channel, ctypes.byref(addr)) == AX_OK, self.error()
        return addr.value

    def put(self, h, array: np.ndarray, channel: int) -> int:
        addr = self.malloc(h, max(array.nbytes, 4), channel)
        if array.nbytes:
            assert self.lib.nspAxdimmMemcpyH2X(h, addr, array.ctypes.data, array.nbytes) == AX_OK, self.error()
        return addr

    def get(self, h, addr: int, like: np.ndarray) -> np.ndarray:
        out = np.zeros_like(like)
        assert self.lib.nspAxdimmMemcpyX2H(h, out.ctypes.data, addr, out.nbytes) == AX_OK, self.error()
        return out


@pytest.fixture(scope="module")
def axdimm(cxx, tmp_path_factory) -> Axdimm:
    return Axdimm(build_model(cxx, tmp_path_factory.mktemp("axdimm_model"), "axdimm_model"))


def axdimm_launch(ax: Axdimm, h, cfg: dict, state: dict, grad, idx, channel: int) -> tuple[dict, AdamArgs]:
    """Copies a tensor's state and gradient onto ``channel`` and launches Adam there (acceleration mode on).

    Returns the module addresses and the launch arguments.
    """
    addrs = {k: ax.put(h, state[k], channel) for k in ("p", "m", "v")}
    raw = grad_bytes(grad)
    addrs["grad"] = ax.put(h, raw, channel)
    addrs["indices"] = ax.put(h, idx, channel) if idx is not None else 0
    addrs["p_bf16"] = ax.malloc(h, 2 * N, channel)
    bf16 = grad.dtype != np.float32
    args = AdamArgs(struct_size=ctypes.sizeof(AdamArgs), kind=hk.KINDS[cfg["kind"]],
                    grad_format=(2 if idx is not None else 0) + int(bf16), lazy=0, nparams=N,
                    topk_count=0 if idx is None else idx.size, index_base=0, step=STEP, lr=LR, b1=cfg["b1"],
                    b2=cfg["b2"], eps=cfg["eps"], weight_decay=cfg.get("weight_decay", 0.0), **addrs)
    assert ax.lib.nspAxdimmSetArbiterAcc(h, channel) == AX_OK
    assert ax.lib.nspAxdimmRunAdamAsync(h, ctypes.byref(args), channel) == AX_OK, ax.error()
    return addrs, args


def axdimm_collect(ax: Axdimm, h, addrs: dict, state: dict, channel: int) -> dict:
    """Waits for the channel's kernel, hands the channel back to the host and reads the results."""
    assert ax.lib.nspAxdimmWait(h, channel) == AX_OK, ax.error()
    assert ax.lib.nspAxdimmSetArbiterNormal(h, channel) == AX_OK
    got = {k: ax.get(h, addrs[k], state[k]) for k in ("p", "m", "v")}
    got["p16"] = ax.get(h, addrs["p_bf16"], np.zeros(N, np.uint16))
    return got


@pytest.mark.parametrize("fmt,cfg", [("dense_f32", ADAM), ("topk_f32", ADAM), ("dense_bf16", ADAM),
                                     ("topk_bf16", ADAMW)])
def test_axdimm_model_matches_nsp(axdimm, fmt, cfg):
    h = axdimm.open()
    state, grad, idx = make_case(fmt, cfg, seed=3)
    addrs, _ = axdimm_launch(axdimm, h, cfg, state, grad, idx, channel=1)
    check_against_nsp(axdimm_collect(axdimm, h, addrs, state, 1), cfg, state, grad, idx)
    assert axdimm.lib.nspAxdimmClose(h) == AX_OK


def test_axdimm_model_channels_run_side_by_side(axdimm):
    h = axdimm.open()
    cases = [make_case("dense_f32", ADAM, seed=5), make_case("topk_f32", ADAM, seed=6)]
    launched = [axdimm_launch(axdimm, h, ADAM, *case, channel=ch)[0] for ch, case in enumerate(cases)]
    for ch, (case, addrs) in enumerate(zip(cases, launched)):
        check_against_nsp(axdimm_collect(axdimm, h, addrs, case[0], ch), ADAM, *case)
    assert axdimm.lib.nspAxdimmClose(h) == AX_OK


def test_axdimm_model_arbiter_blocks_host_access(axdimm):
    lib, h = axdimm.lib, axdimm.open()
    data = np.arange(64, dtype=np.float32)
    a0, a1 = axdimm.put(h, data, 0), axdimm.put(h, data, 1)
    assert lib.nspAxdimmSetArbiterAcc(h, 0) == AX_OK
    mode = ctypes.c_int()
    assert lib.nspAxdimmGetArbiterMode(h, 0, ctypes.byref(mode)) == AX_OK and mode.value == MODE_ACC
    assert lib.nspAxdimmMemcpyH2X(h, a0, data.ctypes.data, data.nbytes) == AX_EACCES
    assert "acceleration mode" in axdimm.error()
    assert lib.nspAxdimmMemcpyX2H(h, data.ctypes.data, a0, data.nbytes) == AX_EACCES
    assert np.array_equal(axdimm.get(h, a1, data), data)  # the other channel stays open to the host
    args = AdamArgs(struct_size=ctypes.sizeof(AdamArgs), kind=0, p=a1, m=a1, v=a1, grad=a1, nparams=16, step=1,
                    lr=1e-3, b1=0.9, b2=0.999, eps=1e-8)
    assert lib.nspAxdimmRunAdamAsync(h, ctypes.byref(args), 1) == AX_EMODE  # channel 1 is in normal mode
    assert lib.nspAxdimmRunAdamAsync(h, ctypes.byref(args), 0) == AX_EINVAL  # its buffers lie on channel 1
    assert "its own DRAM" in axdimm.error()
    assert lib.nspAxdimmSetArbiterNormal(h, 0) == AX_OK
    assert np.array_equal(axdimm.get(h, a0, data), data)
    assert lib.nspAxdimmClose(h) == AX_OK


def test_axdimm_model_capacity(axdimm, monkeypatch):
    monkeypatch.setenv("NSP_AXDIMM_MODEL_BYTES", str(2 << 20))  # 1 MiB per channel
    lib, h = axdimm.lib, axdimm.open()
    cap, free = ctypes.c_size_t(), ctypes.c_size_t()
    assert lib.nspAxdimmMemInfo(h, 0, ctypes.byref(cap), ctypes.byref(free)) == AX_OK
    assert cap.value == free.value == 1 << 20
    first = axdimm.malloc(h, 768 << 10, 0)
    addr = ctypes.c_uint64()
    assert lib.nspAxdimmMallocX(h, 512 << 10, 0, ctypes.byref(addr)) == AX_ENOMEM
    assert "free" in axdimm.error()
    axdimm.malloc(h, 512 << 10, 1)  # the other channel has its own memory
    assert lib.nspAxdimmFreeX(h, first) == AX_OK
    axdimm.malloc(h, 512 << 10, 0)  # freed space is usable again
    assert lib.nspAxdimmClose(h) == AX_OK


def test_axdimm_model_injected_kernel_fault(axdimm, monkeypatch):
    monkeypatch.setenv("NSP_AXDIMM_MODEL_FAIL_KERNEL_AT", "1")
    lib, h = axdimm.lib, axdimm.open()
    state, grad, idx = make_case("dense_f32", ADAM, seed=8)
    addrs, args = axdimm_launch(axdimm, h, ADAM, state, grad, idx, channel=0)
    assert lib.nspAxdimmWait(h, 0) == AX_EKERNEL
    assert "injected kernel fault" in axdimm.error()
    assert lib.nspAxdimmSetArbiterNormal(h, 0) == AX_OK
    assert np.array_equal(axdimm.get(h, addrs["p"], state["p"]), state["p"])  # nothing was written
    assert lib.nspAxdimmSetArbiterAcc(h, 0) == AX_OK
    assert lib.nspAxdimmRunAdamAsync(h, ctypes.byref(args), 0) == AX_OK  # the next launch succeeds
    check_against_nsp(axdimm_collect(axdimm, h, addrs, state, 0), ADAM, state, grad, idx)
    assert lib.nspAxdimmClose(h) == AX_OK


def test_axdimm_model_injected_copy_fault(axdimm, monkeypatch):
    monkeypatch.setenv("NSP_AXDIMM_MODEL_FAIL_COPY_AT", "2")
    lib, h = axdimm.lib, axdimm.open()
    data = np.arange(32, dtype=np.float32)
    addr = axdimm.put(h, data, 0)                                                  # copy 1
    back = np.zeros_like(data)
    assert lib.nspAxdimmMemcpyX2H(h, back.ctypes.data, addr, data.nbytes) == AX_EIO  # copy 2: injected
    assert "injected copy fault" in axdimm.error() and not back.any()
    assert np.array_equal(axdimm.get(h, addr, data), data)                          # the retry succeeds
    assert lib.nspAxdimmClose(h) == AX_OK
