"""Every instruction set the CPU has, forced one at a time: the update kernels (NSP_KERNEL_ISA) against optax and
against one another, and the CRC-32C implementations (NSP_CRC32C_ISA) against one another and a reference.
Forcing one the CPU lacks must fail at import with a message, never run into an illegal instruction.

Which ISAs the CPU has is read here from /proc/cpuinfo, apart from the library's own detection, so a detection
that missed (or invented) one fails these tests instead of going unnoticed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nsp.primitives import kernel_isa

KERNEL_ISAS = ("portable", "avx2-fma", "avx512")
CRC_ISAS = ("portable", "sse4.2", "pclmul", "vpclmul-avx2", "vpclmul-avx512")
TESTS = Path(__file__).resolve().parent


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


FLAGS = cpu_flags()
NEEDS = {
    "portable": set(),
    "avx2-fma": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"},
}
CRC_NEEDS = {
    "portable": set(),
    "sse4.2": {"sse4_2"},
    "pclmul": {"sse4_2", "pclmulqdq"},
    "vpclmul-avx2": {"sse4_2", "pclmulqdq", "avx2", "vpclmulqdq"},
    "vpclmul-avx512": {"sse4_2", "pclmulqdq", "avx2", "vpclmulqdq", "avx512f", "avx512vl"},
}


def supported_isas() -> list[str]:
    return [isa for isa in KERNEL_ISAS if NEEDS[isa] <= FLAGS]


def supported_crc_isas() -> list[str]:
    return [isa for isa in CRC_ISAS if CRC_NEEDS[isa] <= FLAGS]


def run_python(code: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("NSP_KERNEL_ISA", None)
    env.pop("NSP_CRC32C_ISA", None)
    env.update(env_vars)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_detected_isa_is_the_best_the_cpu_has():
    if os.environ.get("NSP_KERNEL_ISA"):
        pytest.skip("NSP_KERNEL_ISA forces this process's ISA")
    if not FLAGS:
        pytest.skip("no /proc/cpuinfo to compare with")
    assert kernel_isa() == supported_isas()[-1]


# ---- update kernels -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_optax_oracle_under_each_isa(isa):
    """The optax-oracle tests of test_fused_update.py under `isa`, in a subprocess with NSP_KERNEL_ISA set (the
    in-process run of that file covers the ISA this process uses). Smaller arrays than there, to keep it short."""
    if isa not in supported_isas():
        pytest.skip(f"this CPU lacks {isa} (test_forcing_an_isa_the_cpu_lacks_fails_at_import covers that)")
    if isa == kernel_isa():
        pytest.skip(f"{isa} is this process's ISA: test_fused_update.py runs these tests under it")
    selection = ("matches_optax or bf16_gradients or bf16_compressed or lazy or bf16_output or first_step "
                 "or sort_indices or thread_count or kernel_isa_is_reported")
    env = dict(os.environ, NSP_KERNEL_ISA=isa, NSP_TEST_QUICK_ORACLE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(TESTS / "test_fused_update.py"),
         "-k", selection],
        env=env, capture_output=True, text=True, timeout=600, cwd=TESTS.parent)
    assert proc.returncode == 0, f"under NSP_KERNEL_ISA={isa}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_the_finiteness_scan_under_each_isa(isa):
    """test_storage.py's NaN/Inf scan test under `isa` (each ISA has its own scan)."""
    if isa not in supported_isas():
        pytest.skip(f"this CPU lacks {isa} (test_forcing_an_isa_the_cpu_lacks_fails_at_import covers that)")
    if isa == kernel_isa():
        pytest.skip(f"{isa} is this process's ISA: test_storage.py runs the test under it")
    env = dict(os.environ, NSP_KERNEL_ISA=isa)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(TESTS / "test_storage.py"),
         "-k", "all_finite_finds_nan_and_inf_anywhere"],
        env=env, capture_output=True, text=True, timeout=300, cwd=TESTS.parent)
    assert proc.returncode == 0, f"under NSP_KERNEL_ISA={isa}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert "1 passed" in proc.stdout, proc.stdout[-2000:]


def test_every_isa_computes_what_the_portable_kernels_do():
    """Each kind, dense and lazy, bf16 gradients and bf16 param copies (test_fused_update's ISA script) under
    every ISA the CPU has: within the last bit of the portable kernels (FMA contraction may differ there), and
    the AVX2 and AVX-512 kernels bit for bit, since they run the same operations in the same order."""
    from test_fused_update import _ISA_SCRIPT

    results = {}
    for isa in supported_isas():
        proc = run_python(_ISA_SCRIPT, NSP_KERNEL_ISA=isa)
        assert proc.returncode == 0, f"{isa}: {proc.stderr[-3000:]}"
        results[isa] = json.loads(proc.stdout)
        assert results[isa]["isa"] == isa
    reference = results["portable"]
    for isa, result in results.items():
        for kind in sorted(set(reference) - {"isa"}):
            a, b = np.asarray(reference[kind]), np.asarray(result[kind])
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-6 * np.max(np.abs(a)), err_msg=f"{isa} {kind}")
    if "avx2-fma" in results and "avx512" in results:
        for kind in sorted(set(reference) - {"isa"}):
            np.testing.assert_array_equal(results["avx512"][kind], results["avx2-fma"][kind], err_msg=kind)


_KNOB_SCRIPT = r"""
import json, sys
import jax.numpy as jnp, numpy as np
from nsp.primitives import fused_update, set_num_threads
set_num_threads(2)
rng = np.random.default_rng(0)
n = 600_001  # several tasks of 65536 elements, and a tail
p, g, m = (jnp.asarray(rng.standard_normal(n), jnp.float32) for _ in range(3))
v = jnp.asarray(rng.random(n), jnp.float32)
r = fused_update(p, g, m, v, kind="adamw", step=3, lr=0.01, weight_decay=0.1)
json.dump([np.asarray(x).view(np.uint32)[::997].tolist() for x in r[:3]], sys.stdout)
"""


def test_the_kernel_tuning_knobs_change_no_result():
    """NSP_KERNEL_PREFETCH, NSP_KERNEL_PREFETCH_LEVEL and NSP_KERNEL_TASK_ELEMS (the knobs bench/kernel_sweep.py
    --hypotheses measures) change how the pass is cut and prefetched, never what it computes: bit for bit the
    defaults' results."""
    results = {}
    for label, knobs in {"defaults": {}, "no prefetch": {"NSP_KERNEL_PREFETCH": "0"},
                         "small tasks": {"NSP_KERNEL_TASK_ELEMS": "65536", "NSP_KERNEL_PREFETCH": "1024"},
                         "prefetch into L2": {"NSP_KERNEL_PREFETCH_LEVEL": "2"},
                         "prefetch into the last level": {"NSP_KERNEL_PREFETCH_LEVEL": "3"}}.items():
        proc = run_python(_KNOB_SCRIPT, **knobs)
        assert proc.returncode == 0, f"{label}: {proc.stderr[-3000:]}"
        results[label] = json.loads(proc.stdout)
    for label, result in results.items():
        assert result == results["defaults"], label


def _assert_clear_error(proc: subprocess.CompletedProcess, variable: str, value: str, why: str) -> None:
    assert proc.returncode != -signal.SIGILL, f"{variable}={value} ran into an illegal instruction"
    assert proc.returncode == 1, f"{variable}={value}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "ValueError" in proc.stderr and f"{variable}='{value}' {why}" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("isa", [*KERNEL_ISAS, "avx2"])
def test_forcing_an_isa_the_cpu_lacks_fails_at_import(isa):
    if isa in supported_isas():
        pytest.skip(f"this CPU has {isa}: the tests above force it")
    proc = run_python("import nsp.primitives", NSP_KERNEL_ISA=isa)
    if isa == "avx2":  # not a name of ours
        _assert_clear_error(proc, "NSP_KERNEL_ISA", isa, "is not one of portable, avx2-fma, avx512")
    else:
        _assert_clear_error(proc, "NSP_KERNEL_ISA", isa, "asks for kernels this CPU cannot run: it lacks")
        missing = sorted(NEEDS[isa] - FLAGS)
        assert missing[0] in proc.stderr, proc.stderr[-3000:]


# ---- CRC-32C ------------------------------------------------------------------------------------------------

# Lengths around every implementation's boundaries: the 512/1024-byte thresholds and 128/256-byte steps of the
# VPCLMULQDQ folds, the 15872-byte blocks that interleave crc32 with them, PCLMUL's 5632-byte blocks, crc32's
# three 4096-byte lanes; then a 4 MiB page and random lengths, each at several offsets, and continued calls.
_CRC_SCRIPT = r"""
import json, sys
import numpy as np
from nsp import _nsp_ffi
_nsp_ffi.kernel_isa()  # a bad NSP_CRC32C_ISA raises here
rng = np.random.default_rng(7)
data = rng.integers(0, 256, (4 << 20) + 64, dtype=np.uint8)
lengths = [0, 1, 7, 8, 15, 16, 17, 127, 128, 129, 255, 256, 257, 511, 512, 513, 639, 640, 1023, 1024, 1025,
           1151, 1280, 1281, 4095, 4096, 5631, 5632, 5633, 3 * 4096 - 1, 3 * 4096, 3 * 4096 + 9, 15871, 15872,
           15873, 2 * 15872 + 511, 2 * 15872 + 512, 3 * 15872 + 1024 + 255, 65536, 65536 + 13]
lengths += [int(n) for n in rng.integers(0, 200_000, 40)]
out = {"whole": [], "pieces": []}
for n in lengths:
    for offset in (0, 1, 3, 8, 13):
        out["whole"].append(_nsp_ffi.crc32c(data[offset:offset + n]))
page = data[5:5 + (4 << 20)]
out["page"] = _nsp_ffi.crc32c(page)
crc = 0
for cut in np.array_split(np.arange(page.size), 9):  # continued across uneven pieces
    crc = _nsp_ffi.crc32c(page[cut[0]:cut[-1] + 1], crc=crc)
out["pieces"] = crc
out["check"] = _nsp_ffi.crc32c(np.frombuffer(b"123456789", np.uint8))
json.dump(out, sys.stdout)
"""


def _crc32c_table_reference(data: bytes) -> int:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def test_every_crc32c_implementation_agrees():
    """Each CRC-32C implementation the CPU has (NSP_CRC32C_ISA), on the same buffers: equal to one another, the
    standard check value, and a Python reference where it is quick."""
    results = {}
    for isa in supported_crc_isas():
        proc = run_python(_CRC_SCRIPT, NSP_CRC32C_ISA=isa)
        assert proc.returncode == 0, f"{isa}: {proc.stderr[-3000:]}"
        results[isa] = json.loads(proc.stdout)
        assert results[isa]["check"] == 0xE3069283, isa
        assert results[isa]["pieces"] == results[isa]["page"], isa
    reference = results["portable"]
    for isa, result in results.items():
        assert result["page"] == reference["page"], isa
        mismatches = [i for i, (a, b) in enumerate(zip(reference["whole"], result["whole"])) if a != b]
        assert not mismatches, f"{isa} differs from the table-driven CRC at cases {mismatches[:10]}"
    # And the table-driven one against the Python reference on some of the lengths (offset 1).
    data = np.random.default_rng(7).integers(0, 256, (4 << 20) + 64, dtype=np.uint8)
    for index, n in enumerate([0, 1, 7, 8, 15, 16, 17, 127, 128, 129, 255, 256, 257, 511, 512, 513, 639, 640,
                               1023, 1024, 1025, 1151, 1280, 1281, 4095, 4096, 5631, 5632, 5633, 3 * 4096 - 1,
                               3 * 4096, 3 * 4096 + 9, 15871, 15872, 15873]):
        assert reference["whole"][5 * index + 1] == _crc32c_table_reference(data[1:1 + n].tobytes()), n


@pytest.mark.parametrize("isa", [*CRC_ISAS, "avx512"])
def test_forcing_a_crc32c_the_cpu_lacks_fails_at_import(isa):
    if isa in supported_crc_isas():
        pytest.skip(f"this CPU has {isa}: test_every_crc32c_implementation_agrees forces it")
    proc = run_python("import nsp.primitives", NSP_CRC32C_ISA=isa)
    if isa == "avx512":  # a kernel ISA's name, not a CRC's
        _assert_clear_error(proc, "NSP_CRC32C_ISA", isa, "is not one of portable, sse4.2, pclmul")
    else:
        _assert_clear_error(proc, "NSP_CRC32C_ISA", isa, "asks for a CRC-32C this CPU cannot run")
