"""Output buffers for eager ``fused_update`` calls: the arrays of earlier calls, reused once nobody holds them.

Under ``jax.jit`` with donation the update writes over its inputs. Called eagerly it cannot: the caller still
holds ``param``, ``mu`` and ``nu``, so every call needs new output arrays. Large new arrays come from fresh
pages of memory (the allocator maps them anew and unmaps them when freed), and the kernel's pass then pays a
page fault per 4 KiB: measured at 64M params, 5-8x the pass itself.

So an eager call donates, as its output buffers, arrays an earlier eager call returned that the caller has
since dropped: a loop ``p, m, v = fused_update(p, g, m, v, ...)`` writes step ``t + 1`` into the memory of step
``t - 1``. An array is reused only when this module holds the last reference to it: nobody else can see it
change. The price is memory: between calls the previous step's arrays stay allocated (one more copy of the
state, what the call itself needs at its peak anyway); ``release_eager_buffers()`` frees them.
"""

from __future__ import annotations

import sys
import threading

import jax

# Outputs of the last few eager calls (each call's param, mu, nu and bf16 copy), oldest first.
_KEEP = 8
_held: list[jax.Array] = []
_lock = threading.Lock()


def take(avals: list[jax.ShapeDtypeStruct], device) -> list[jax.Array]:
    """For each entry of ``avals``, a held array of its shape and dtype on ``device`` that only this module still
    references (where there is one), removed from the pool."""
    with _lock:
        found: list[int] = []
        for aval in avals:
            for i in range(len(_held)):
                a = _held[i]
                # Three references: the list, `a`, and getrefcount's argument. Any other holder keeps it.
                if (i not in found and a.shape == aval.shape and a.dtype == aval.dtype
                        and sys.getrefcount(a) == 3 and not a.is_deleted() and a.devices() == {device}):
                    found.append(i)
                    break
        arrays = [_held[i] for i in found]
        for i in sorted(found, reverse=True):
            del _held[i]
        return arrays


def hold(arrays) -> None:
    """Keeps an eager call's outputs, to be reused once the caller drops them."""
    with _lock:
        _held.extend(a for a in arrays if a is not None)
        del _held[:-_KEEP]


def release_eager_buffers() -> None:
    """Frees the arrays eager ``fused_update`` calls keep for reuse (those the caller still holds stay alive)."""
    with _lock:
        _held.clear()
