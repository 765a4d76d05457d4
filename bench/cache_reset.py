"""What runs before each timed call of an interleaved benchmark, so that no call depends on who ran before it or
on how long its own memory sat idle.

A 64M-param Adam update streams 1 GiB; a last-level cache of a few hundred MiB ends a call full of that call's
lines, dirty ones among them. The next call would find another contender's dirty lines to write back first.
Reading a buffer twice the cache's size, untouched by any contender (CacheReset), leaves the cache holding clean
lines of nobody's data. Then pre_touch reads the contender's own arrays (idle memory is slow to touch again on a
virtual machine), and the contender's warm-up call wakes its threads (before_call runs the three in that order).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable

import numpy as np

DEFAULT_LLC_MIB = 64  # when sysfs names no cache


def llc_mib() -> int:
    """The largest cache sysfs lists for CPU 0, in MiB (rounded up), or DEFAULT_LLC_MIB."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        return DEFAULT_LLC_MIB
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return -(-best // (1 << 20)) if best else DEFAULT_LLC_MIB


class CacheReset:
    """Called before a timed call: reads ``mib`` MiB of its own (written once, so its pages are real) with numpy,
    leaving the last-level cache holding clean lines of this buffer only."""

    def __init__(self, mib: int):
        if mib <= 0:
            raise ValueError(f"a cache reset needs a positive size in MiB, got {mib}")
        self.buffer = np.ones((mib << 20) // 8, np.float64)
        self.mib = mib

    def __call__(self) -> None:
        self.buffer.sum()


def before_call(reset: Callable[[], None] | None, warm_up: Callable[[], None] | None,
                touch: Callable[[], Iterable] | None = None) -> Callable[[], None]:
    """What runs, untimed, right before a timed sample: the cache reset, a read of the contender's own arrays
    (``touch`` lists them; see pre_touch), then the contender's warm-up call (its own work on a small state, so
    that its threads are awake as after a training step's backward pass)."""

    def fn() -> None:
        if reset is not None:
            reset()
        if touch is not None:
            pre_touch(touch())
        if warm_up is not None:
            warm_up()

    return fn


def host_view(array) -> np.ndarray:
    """A numpy view of a host array's memory without a reference held by its owner: a numpy array itself, a torch
    tensor's ``.numpy()``, or a CPU jax array's buffer read through its address (``np.asarray`` on a jax array
    would keep a copy cached on it, and a donated array with a view alive is copied instead of reused)."""
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "unsafe_buffer_pointer"):  # a single-device jax array on the CPU
        n = array.size * array.dtype.itemsize
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(array.unsafe_buffer_pointer()))
    if hasattr(array, "detach"):  # a torch tensor
        return array.detach().numpy()
    raise TypeError(f"cannot view {type(array).__name__} as host memory")


def pre_touch(arrays: Iterable) -> None:
    """Reads every byte of ``arrays`` once. On the virtual machines these records come from, memory left idle for
    a fraction of a second is slow to touch again: a 64 MB numpy array read 5.6 ms back to back, 12.6 ms after
    0.2 s idle and 35.8 ms after 1 s (whatever the host does with idle guest memory, no fault inside the guest).
    In an interleaved benchmark every contender's arrays sit idle while the others run, so each timed call would
    pay that; a read right before it leaves the arrays as a back-to-back call finds them."""
    for array in arrays:
        view = host_view(array).reshape(-1).view(np.uint8)
        usable = view.size - view.size % 8
        view[:usable].view(np.uint64).max(initial=0)
        view[usable:].max(initial=0)
