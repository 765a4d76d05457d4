"""JAX-facing operations: the fused near-storage update kernel and Top-K gradient compression."""

from nsp.primitives._ffi import get_num_threads, kernel_isa, set_num_threads
from nsp.primitives.fused_update import FusedUpdateResult, fused_update, uses_mu, uses_nu

__all__ = [
    "FusedUpdateResult",
    "fused_update",
    "get_num_threads",
    "kernel_isa",
    "set_num_threads",
    "uses_mu",
    "uses_nu",
]
