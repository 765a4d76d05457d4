"""One fp32 Adam step in place, as each library under comparison runs it; the update benchmarks time these.

  nsp_adam_step     nsp's fused kernel (fused_update) under jax.jit with p, m and v donated, so that the kernel
                    writes its outputs over its inputs (28 B/param dense)
  torch_fused_adam  torch.optim.Adam(fused=True) on zero-copy views of numpy arrays: the arrays themselves are
                    updated (the fastest in-RAM kernel in bench/update_kernel.py's runs here)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np

from nsp.primitives import fused_update


def nsp_adam_step(lr: float, b1: float = 0.9, b2: float = 0.999, eps: float | None = None):
    """The jitted ``step(p, g, m, v, t, indices=None) -> (p, m, v)``: one Adam step of fused_update with p, m and v
    donated (``g`` and ``indices``: a dense gradient, or Top-K values and their sorted int32 indices)."""

    @functools.partial(jax.jit, donate_argnums=(0, 2, 3))
    def step(p, g, m, v, t, indices=None):
        return fused_update(p, g, m, v, kind="adam", step=t, lr=lr, b1=b1, b2=b2, eps=eps, indices=indices)[:3]

    return step


def torch_fused_adam(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, *, threads: int, lr: float,
                     b1: float = 0.9, b2: float = 0.999,
                     eps: float = 1e-8) -> tuple[Callable[[int], None] | None, str]:
    """``(step, description)``: ``step(t)`` runs Adam step ``t`` (1-based) of torch's fused CPU Adam on the float32
    arrays ``p, m, v`` in place with gradient ``g``, on ``threads`` threads. ``(None, why)`` when torch is not
    installed or has no fused CPU Adam."""
    try:
        import torch
    except ImportError:
        return None, "not installed (pip install '.[bench]')"
    torch.set_num_threads(threads)
    views = [torch.from_numpy(a) for a in (p, m, v)]
    param = torch.nn.Parameter(views[0])
    param.grad = torch.from_numpy(g)
    assert param.data_ptr() == p.ctypes.data, "torch did not wrap the host buffer in place"
    try:
        opt = torch.optim.Adam([param], lr=lr, betas=(b1, b2), eps=eps, fused=True)
    except (RuntimeError, TypeError) as e:  # older torch: no fused CPU Adam
        return None, f"torch {torch.__version__}: fused CPU Adam unavailable ({e})"
    step_t = torch.zeros((), dtype=torch.float32)
    opt.state[param] = {"step": step_t, "exp_avg": views[1], "exp_avg_sq": views[2]}

    def step(t: int) -> None:
        step_t.fill_(t - 1)  # the optimizer counts it up before the bias correction
        opt.step()

    return step, f"torch {torch.__version__} fused Adam on zero-copy views, {threads} threads"
