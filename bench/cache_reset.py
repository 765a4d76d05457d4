"""A reset of the last-level cache between timed calls, so that no contender's call depends on who ran before it.

A 64M-param Adam update streams 1 GiB; a last-level cache of a few hundred MiB ends a call full of that call's
lines, dirty ones among them. The next call then finds either its own data there (a head start) or another
contender's dirty lines to write back first (a handicap), depending on the order. Reading a buffer twice the
cache's size, untouched by any contender, before every call leaves the cache holding clean lines of nobody's data:
each call starts the same way.
"""

from __future__ import annotations

import os

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
