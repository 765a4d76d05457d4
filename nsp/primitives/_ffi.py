"""Loads the C++ extension and registers its XLA FFI targets with JAX (once, at import)."""

from __future__ import annotations

import jax

from nsp import _nsp_ffi

for _name, _capsule in _nsp_ffi.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

_nsp_ffi.engine_cpus()  # a bad NSP_ENGINE_CPUS fails here, at import, with a message naming it
_nsp_ffi.kernel_isa()  # and so does a bad NSP_KERNEL_ISA (or one naming an ISA this CPU lacks), or NSP_CRC32C_ISA


def kernel_isa() -> str:
    """The instruction set the update kernels dispatch to on this CPU: ``"avx512"``, ``"avx2-fma"`` or
    ``"portable"``.

    Set ``NSP_KERNEL_ISA`` to one of those before import to force it; one this CPU lacks fails the import.
    """
    return _nsp_ffi.kernel_isa()


def get_num_threads() -> int:
    """Threads the update kernels use (``NSP_NUM_THREADS``, else one per CPU of ``NSP_ENGINE_CPUS``, else every
    core)."""
    return _nsp_ffi.get_num_threads()


def set_num_threads(n: int) -> None:
    """Sets the threads the update kernels use (``n >= 1``)."""
    _nsp_ffi.set_num_threads(int(n))


def engine_cpus() -> list[int]:
    """The CPUs ``NSP_ENGINE_CPUS`` reserves for the update work; empty when it is unset.

    ``NSP_ENGINE_CPUS`` (a CPU list such as ``"1"`` or ``"2-3,6"``, read once, at import) pins the update
    kernels and the store engine -- its page readers and writers, a staleness-1 step running in the background --
    to those CPUs, apart from the cores the training step's own compute uses: what a host whose forward/backward
    runs on an accelerator has anyway. Unset, the update runs wherever its caller runs.
    """
    return list(_nsp_ffi.engine_cpus())
