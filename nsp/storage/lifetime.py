"""What a store holds outside Python's reach (C++ engines, their registry handles, writer locks, threads) and the
order it lets go of them, kept apart from the ``StateStore`` object so that a finalizer can hold it."""

from __future__ import annotations

import concurrent.futures
import sys
from typing import Any

import jax

from nsp import engine as native
from nsp.storage.format import release_locks


def effects_barrier() -> None:
    """Waits for the side-effecting computations this thread dispatched (jitted steps run asynchronously)."""
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001  (a failed step raises its error to its own caller, from its outputs)
        pass


class Lifetime:
    """What a store must release, apart from the store object so that a finalizer can hold it.

    The C++ side keeps each engine alive while its registry handle or a running step holds it, so nothing here
    can free an engine under a step. What remains is the order: the handles stay registered until the steps
    already dispatched have run, or a queued step would find its store gone.
    """

    def __init__(self, num_shards: int):
        self.engines: list[Any] = []  # nsp.engine.ShardEngine, one per shard
        self.handles: list[int] = []  # their registry handles, once a jitted step asked for them
        self.lock_fds: list[int] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=num_shards, thread_name_prefix="nsp-shard")
        self.released = False

    def release(self, *, from_finalizer: bool = False) -> list[Exception]:
        """Waits for dispatched steps and background updates, then lets go of everything; returns the errors of
        background updates (they have nowhere else to go)."""
        if self.released:
            return []
        self.released = True
        # A finalizer can run on a pool thread (garbage collection happens wherever Python allocates): never
        # join the pool from there.
        self.pool.shutdown(wait=not from_finalizer)
        errors = self.wait()
        for handle in self.handles:
            native.unregister_engine(handle)
        for engine in self.engines:
            engine.release()
        self.handles, self.engines = [], []
        release_locks(self.lock_fds)
        self.lock_fds = []
        return errors

    def wait(self) -> list[Exception]:
        """Waits for the steps already dispatched (jitted steps run asynchronously) and every background update;
        returns the background updates' errors."""
        if self.handles:
            effects_barrier()
        errors = []
        for engine in self.engines:
            try:
                engine.wait()
            except RuntimeError as e:
                errors.append(e)
        return errors

    def release_dropped(self) -> None:
        """The finalizer of a store dropped without ``close()`` (also run at interpreter exit)."""
        for error in self.release(from_finalizer=True):
            print(f"nsp: a background update of a store dropped without close() failed: {error}", file=sys.stderr)
