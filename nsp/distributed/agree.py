"""What the processes of a run agree on: the committed store version, and whether a step of set-up worked.

Everything goes through JAX's own runtime: the versions through a small jitted all-gather
(``multihost_utils.process_allgather``), a failure's message through the coordination service's key-value store,
waiting through its barriers. With one process each function answers at once from local values.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from nsp.distributed.coordination import AGREE_TIMEOUT_S, DistributedError, barrier, client, sequence_number

__all__ = ["AGREE_TIMEOUT_S", "FAILED_WAIT_S", "Unanswered", "agree_committed", "agree_steps", "agree_version",
           "all_succeed", "barrier"]


def agree_version(local_version: int) -> tuple[int, int, float]:
    """``(lowest, highest, seconds)`` of every process's committed store version (one jitted all-gather).

    A version counts as committed by the run only once every process committed its shards: the lowest."""
    t0 = time.perf_counter()
    if jax.process_count() == 1:
        return int(local_version), int(local_version), 0.0
    from jax.experimental import multihost_utils

    versions = np.asarray(multihost_utils.process_allgather(np.int32(local_version)))
    return int(versions.min()), int(versions.max()), time.perf_counter() - t0


def agree_committed(local_version: int) -> int:
    """The version every process committed; an error when they differ (a step some process did not commit)."""
    low, high, _ = agree_version(local_version)
    if low != high:
        raise DistributedError(f"the processes' stores are at versions {low}..{high}: a step was not committed by "
                               "every process (process "
                               f"{jax.process_index()} is at {local_version})")
    return low


def agree_steps(local_steps) -> list[list[int]]:
    """Every process's ``local_steps`` (checkpoint steps, say), in process order: two small jitted all-gathers
    (the counts, then the steps padded to the longest list)."""
    mine = sorted(int(s) for s in local_steps)
    if jax.process_count() == 1:
        return [mine]
    from jax.experimental import multihost_utils

    counts = np.asarray(multihost_utils.process_allgather(np.int32(len(mine))))
    width = max(1, int(counts.max()))
    padded = np.full(width, -1, np.int32)
    padded[:len(mine)] = mine
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, width)
    return [[int(s) for s in row[:n]] for row, n in zip(gathered, counts)]


class Unanswered(DistributedError):
    """``all_succeed`` on a process where ``what`` failed: some other process did not report within
    ``FAILED_WAIT_S``. It may wait in a collective inside ``what`` that this process's failure left unfinished
    (orbax's barriers in a restore, say), where no key reaches it: the run cannot stop together, and this process
    stops it alone (its message says what failed here; ``nsp.distributed.stop`` tells the others)."""


#: How long a process where ``what`` failed waits for the others' outcomes (``all_succeed``): those still at work
#: report sooner or are stopped, since the run stops anyway.
FAILED_WAIT_S = 20


def all_succeed(what: str, error: BaseException | None) -> None:
    """Tells every process whether ``what`` worked here, and raises on every process if it failed on any.

    Each process calls it once with its own outcome (``None``: it worked); the message names the processes that
    failed and why, so every process stops with the same clear error and none goes on alone. Where ``what``
    failed, the others' outcomes are awaited ``FAILED_WAIT_S`` at most (then ``Unanswered``)."""
    c = client()
    if c is None:
        if error is not None:
            raise error
        return
    tag = f"nsp/{what.replace(' ', '-')}/{sequence_number()}"
    me, n = jax.process_index(), jax.process_count()
    c.key_value_set(f"{tag}/{me}", "" if error is None else (str(error) or type(error).__name__))
    failed: dict[str, list[int]] = {}  # each message, with the processes that failed with it
    deadline = time.monotonic() + (AGREE_TIMEOUT_S if error is None else FAILED_WAIT_S)
    for p in range(n):
        try:
            message = c.blocking_key_value_get(f"{tag}/{p}", max(1, int((deadline - time.monotonic()) * 1000)))
        except Exception:  # noqa: BLE001  (jaxlib's timeout error)
            if error is None:
                raise
            raise Unanswered(f"{what} failed on process {me}: {str(error) or type(error).__name__} (process {p} "
                             f"did not report within {FAILED_WAIT_S} s)") from None
        if message:
            failed.setdefault(message, []).append(p)
    if failed:
        count = sum(len(ps) for ps in failed.values())
        raise DistributedError(f"{what} failed on {count} of {n} processes; nothing was committed. " + "; ".join(
            (f"process {ps[0]}" if len(ps) == 1 else f"processes {', '.join(map(str, ps))}") + f": {message}"
            for message, ps in failed.items()))
