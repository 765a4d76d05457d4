"""Registers the C++ extension's XLA FFI targets with JAX (once, at import; ``nsp.engine`` loads the extension).

The store update's targets are registered for the CPU and for CUDA devices (ffi/xla/cuda/cuda_stage.cc: the handler
stages the gradient into pinned host memory, runs the engine, copies the new params back; it loads the CUDA
runtime itself at its first call, so nothing here needs CUDA). ``NSP_CUDA_MODEL``, set to the software model of
the CUDA entry points (ffi/xla/cuda/cuda_model.cc, built by the tests), registers those CUDA handlers for the CPU
instead of the CPU ones: every store update of the process then goes through the CUDA handler, over host memory.
"""

from __future__ import annotations

import importlib.util
import os

import jax

from nsp import engine as native

CUDA_MODEL = os.environ.get("NSP_CUDA_MODEL") or None

_targets = dict(native.registrations())
_cuda = native.cuda_registrations()
if CUDA_MODEL is not None:
    native.cuda_use_library(CUDA_MODEL)  # a bad path fails here, at import, naming it
    _targets.update(_cuda["host"])
for _name, _capsule in _targets.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


def _cuda_runtime_dirs() -> str:
    """Where JAX's CUDA wheels put libcudart (nvidia/cuda_runtime/lib), if they are installed."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.submodule_search_locations:
        return ""
    return ":".join(os.path.join(d, "lib") for d in spec.submodule_search_locations)


if CUDA_MODEL is None:
    # Registering for CUDA initialises nothing: JAX keeps the targets until a CUDA backend starts (and never
    # uses them where none does).
    native.cuda_search_dirs(_cuda_runtime_dirs())
    for _name, _capsule in _cuda["device"].items():
        try:
            jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
        except Exception:  # noqa: BLE001  (a JAX that refuses a platform it lacks: nothing to register then)
            break


def cuda_stats() -> dict[str, int]:
    """Counters of the store update's CUDA handlers in this process: ``calls``, ``pinned_allocs`` and
    ``pinned_bytes`` (pinned host buffers, reused across steps), ``copies_down``/``bytes_down`` and
    ``copies_up``/``bytes_up`` (``params_bytes_up``: of those, the new params), ``syncs``, ``buffer_waits``
    (calls that waited for an earlier step's copies up) and ``failed_copies``."""
    return dict(native.cuda_stats())

native.engine_cpus()  # a bad NSP_ENGINE_CPUS fails here, at import, with a message naming it
native.kernel_isa()  # and so does a bad NSP_KERNEL_ISA (or one naming an ISA this CPU lacks), or NSP_CRC32C_ISA


def kernel_isa() -> str:
    """The instruction set the update kernels dispatch to on this CPU: ``"avx512"``, ``"avx2-fma"`` or
    ``"portable"``.

    Set ``NSP_KERNEL_ISA`` to one of those before import to force it; one this CPU lacks fails the import.
    """
    return native.kernel_isa()


def get_num_threads() -> int:
    """Threads the update kernels use (``NSP_NUM_THREADS``, else one per CPU of ``NSP_ENGINE_CPUS``, else every
    core)."""
    return native.get_num_threads()


def set_num_threads(n: int) -> None:
    """Sets the threads the update kernels use (``n >= 1``)."""
    native.set_num_threads(int(n))


def engine_cpus() -> list[int]:
    """The CPUs ``NSP_ENGINE_CPUS`` reserves for the update work; empty when it is unset.

    ``NSP_ENGINE_CPUS`` (a CPU list such as ``"1"`` or ``"2-3,6"``, read once, at import) pins the update
    kernels and the store engine -- its page readers and writers, a staleness-1 step running in the background --
    to those CPUs, apart from the cores the training step's own compute uses: what a host whose forward/backward
    runs on an accelerator has anyway. Unset, the update runs wherever its caller runs.
    """
    return list(native.engine_cpus())
