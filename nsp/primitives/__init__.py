"""JAX-facing operations: the fused near-storage update kernel, the store update, Top-K compression; and the
memory-streaming probe the kernel is measured against."""

from nsp.primitives._eager_buffers import release_eager_buffers
from nsp.primitives._ffi import engine_cpus, get_num_threads, kernel_isa, set_num_threads
from nsp.primitives.fused_update import FusedUpdateResult, fused_update, uses_mu, uses_nu
from nsp.primitives.probes import kernel_time, stream_roofline
from nsp.primitives.staged_update import store_update_staged
from nsp.primitives.store_update import StoreUpdateResult, store_update, store_update_leaves
from nsp.primitives.topk import kept_count, topk_compress, topk_decompress

__all__ = [
    "FusedUpdateResult",
    "StoreUpdateResult",
    "engine_cpus",
    "fused_update",
    "get_num_threads",
    "kept_count",
    "kernel_isa",
    "kernel_time",
    "release_eager_buffers",
    "set_num_threads",
    "store_update",
    "store_update_leaves",
    "store_update_staged",
    "stream_roofline",
    "topk_compress",
    "topk_decompress",
    "uses_mu",
    "uses_nu",
]
