"""Probes of the update kernels and the machine they run on: what its memory can stream, measured the kernels' way,
and how long the kernels themselves ran.

The fused Adam update moves 28 bytes per parameter (p, g, m, v in; p, m, v out) with little arithmetic, so its
ceiling is the memory bandwidth of those streams. ``stream_roofline`` moves the same bytes on the same thread pool,
split into the same tasks and with the same instruction set as the kernel, but with trivial arithmetic: one
call's time is the roofline an update of that size is judged against.
"""

from __future__ import annotations

import numpy as np

from nsp import engine


def stream_roofline(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
    """Streams ``p, g, m, v`` in and ``p, m, v`` out (28 B/param) on the update kernels' threads
    (``get_num_threads``), changing their values by trivial arithmetic.

    All four are 1-D, C-contiguous float32 numpy arrays of one length; ``p, m, v`` are written in place (``g`` is
    only read). Releases the GIL while it runs.
    """
    engine.stream_roofline(p, g, m, v)


def kernel_time() -> tuple[int, float]:
    """``(calls, seconds)``: how many times the update kernels ran in this process (``fused_update``, the stores'
    updates: every path) and the wall time spent inside them. The difference across a step tells the kernel's own
    time from the overhead around it (a jitted call's dispatch, a store's I/O).

    Example::

        calls0, s0 = kernel_time()
        p, m, v = step(p, g, m, v, t)          # a jitted fused_update
        calls1, s1 = kernel_time()
        print(f"{calls1 - calls0} kernel call(s), {(s1 - s0) * 1e3:.1f} ms inside the kernel")
    """
    calls, seconds = engine.kernel_time()
    return int(calls), float(seconds)
