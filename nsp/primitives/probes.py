"""Probes of the machine the update kernels run on: what its memory can stream, measured the kernels' way.

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
