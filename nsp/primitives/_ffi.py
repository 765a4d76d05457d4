"""Loads the C++ extension and registers its XLA FFI targets with JAX (once, at import)."""

from __future__ import annotations

import jax

from nsp import _nsp_ffi

for _name, _capsule in _nsp_ffi.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


def kernel_isa() -> str:
    """The instruction set the update kernels dispatch to on this CPU: ``"avx2-fma"`` or ``"portable"``.

    Set ``NSP_KERNEL_ISA=portable`` before import to force the portable kernels.
    """
    return _nsp_ffi.kernel_isa()


def get_num_threads() -> int:
    """Threads the update kernels use (``NSP_NUM_THREADS``, else every core)."""
    return _nsp_ffi.get_num_threads()


def set_num_threads(n: int) -> None:
    """Sets the threads the update kernels use (``n >= 1``)."""
    _nsp_ffi.set_num_threads(int(n))
