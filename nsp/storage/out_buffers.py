"""Recycled output arrays for the eager ``StateStore.update``: fresh-looking arrays on memory already touched.

``store.update(grad, ...)`` hands back a new params array each call. Allocated afresh, that array's first touch
(a page fault per page, the pages zeroed, on a virtual machine often handed back by its host in between) costs
several times the update's own pass: at 22M params here, 131 ms against 21 ms with a reused array
(``bench/store_update.py``'s "numpy in and out" and "params_into reused" rows). A caller that keeps no older
result (``out = store.update(...)`` in a loop) can pass ``params_into``; ``OutputBuffers`` gives every other
caller the same speed without that care.

How: each array handed out is a view over a buffer this object keeps, through a small lease object that is the
array's ``base``. While the array, or any view of it, or anything that keeps it alive (a zero-copy JAX array
included) lives, the lease lives and the buffer is the caller's alone. When the last of them is dropped, the lease
puts the buffer back on the free list, and the next update writes into it: its pages are already resident. So a
result is never overwritten while it can still be read: nothing like a reused ``params_into`` changing under a
caller that kept it.

At most ``keep`` free buffers are held per (size, dtype): the steady state of ``out = store.update(...)`` needs
two (the new result is taken before the old one is dropped). ``clear()`` (``StateStore.close``) lets them go.
Every buffer starts on a page (``ALIGN``), so the kernels write the params with streaming stores.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


#: Alignment of the buffers: the kernels write a separate params array with streaming stores (its lines are not
#: read first) only where it starts on a 64-byte line; numpy's own large arrays start 16 bytes past a page (the
#: allocator's header), which made every line of the params copy be read before it was written (36 B/param moved
#: instead of 32).
ALIGN = 4096


def aligned_empty(size: int, dtype: Any, align: int = ALIGN) -> np.ndarray:
    """``np.empty(size, dtype)`` starting on an ``align``-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(size * dtype.itemsize + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + size * dtype.itemsize].view(dtype)


class _Lease:
    """The ``base`` of one handed-out array: it holds the buffer and gives it back when the array is gone."""

    __slots__ = ("__array_interface__", "_owner", "_buffer")

    def __init__(self, owner: OutputBuffers, buffer: np.ndarray):
        self._owner = owner
        self._buffer = buffer
        self.__array_interface__ = buffer.__array_interface__

    def __del__(self) -> None:
        owner = self._owner
        if owner is not None:
            owner._give_back(self._buffer)


class OutputBuffers:
    """Hands out arrays over recycled buffers (module docstring). Thread-safe."""

    def __init__(self, keep: int = 2):
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = keep
        self._free: dict[tuple[int, str], list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._open = True
        self.reused = 0  # arrays handed out over a recycled buffer (tests and benchmarks read it)
        self.allocated = 0  # arrays that needed a fresh buffer

    def take(self, size: int, dtype: Any) -> np.ndarray:
        """A writeable, C-contiguous array of ``size`` elements of ``dtype``, contents undefined, that no one else
        holds."""
        key = (int(size), np.dtype(dtype).str)
        with self._lock:
            free = self._free.get(key)
            buffer = free.pop() if free else None
            if buffer is not None:
                self.reused += 1
            else:
                self.allocated += 1
        if buffer is None:
            buffer = aligned_empty(size, dtype)
        if not self._open:  # a closed store's results still work; they are simply not recycled
            return buffer
        out = np.asarray(_Lease(self, buffer))
        assert out.ctypes.data == buffer.ctypes.data and out.flags.writeable
        return out

    def _give_back(self, buffer: np.ndarray) -> None:
        key = (buffer.size, buffer.dtype.str)
        with self._lock:
            if not self._open:
                return
            free = self._free.setdefault(key, [])
            if len(free) < self.keep:
                free.append(buffer)

    def clear(self) -> None:
        """Drops the free buffers and stops recycling (arrays still held stay valid: each owns its buffer)."""
        with self._lock:
            self._open = False
            self._free.clear()

    def held_bytes(self) -> int:
        """Bytes of free buffers held for reuse."""
        with self._lock:
            return sum(b.nbytes for free in self._free.values() for b in free)
