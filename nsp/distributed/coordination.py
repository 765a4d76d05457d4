"""The coordination service as every module of ``nsp.distributed`` uses it: its client, barriers, and the error
a run's processes raise when they cannot go on together.

``runtime`` (joining and leaving the run) and ``agree`` (agreeing on versions and failures) both build on this
module, and neither on the other.
"""

from __future__ import annotations

import itertools

import jax

_COUNTER = itertools.count()
AGREE_TIMEOUT_S = 300  # how long a process waits for the others to report (a dead one ends it sooner: watchdog)


class DistributedError(RuntimeError):
    """The processes of a run cannot start, agree or go on together (the message says which and why)."""


def service_client():
    """JAX's distributed-runtime client (its key-value store, barriers and liveness queries), once joined."""
    from jax._src import distributed as _distributed

    return _distributed.global_state.client


def client():
    """The distributed-runtime client of this process (``None`` when it runs alone)."""
    return service_client() if jax.distributed.is_initialized() else None


def sequence_number() -> int:
    """The next number of this process's sequence of coordination keys and barriers: every process calls the
    same functions in the same order, so the n-th one has the same number on each."""
    return next(_COUNTER)


def barrier(name: str, timeout_s: float = AGREE_TIMEOUT_S) -> None:
    """Waits until every process gets here (a no-op alone)."""
    c = client()
    if c is not None:
        c.wait_at_barrier(f"{name}-{sequence_number()}", int(timeout_s * 1000))
