"""The training process itself: its malloc (``lean_malloc``), joining the other processes of a multi-process run
(``join``), and the small helpers that keep those processes in step: ``together`` (a set-up action that either
succeeds on every process or fails on every one), ``any_process`` (a flag set on any of them) and
``store_path`` (this process's part of the store); ``forget_failed_steps``, for a run that stops on a failed step.

Nothing here knows the model or the step; ``nsp.train.setup`` and the loop (``nsp.train.trainer``) use these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

import nsp.distributed
import nsp.storage
from nsp.train.config import TrainConfig, TrainError


def lean_malloc() -> None:
    """glibc's malloc as ``bench/max_model.py`` runs its attempts: blocks from 128 KiB up mmapped (and unmapped
    when freed; glibc's default raises that threshold to the size of the blocks freed, which then stay in the
    heap), two arenas. For ``bf16_params`` runs near the machine's memory; a no-op elsewhere than glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD (also turns glibc's dynamic threshold off)
        libc.mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def join(config: TrainConfig) -> None:
    """Joins the run's other processes (``--coordinator``/``--num-processes``/``--process-id``, or what JAX
    detects; a lone process when there are none). Raises ``TrainError`` when they cannot be reached."""
    try:
        nsp.distributed.initialize(config.coordinator or None, config.num_processes or None,
                                   config.process_id if config.process_id >= 0 else None,
                                   heartbeat_timeout_s=config.heartbeat_timeout)
    except nsp.distributed.DistributedError as e:
        raise TrainError(str(e)) from None


def store_path(config: TrainConfig) -> Path:
    """This process's store directory: ``config.store_path``, or its ``process-NNNNN`` in a multi-process run."""
    if jax.process_count() == 1:
        return config.store_path
    return config.store_path / f"process-{jax.process_index():05d}"


def together(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every process; when it fails on any, every process raises ``TrainError`` naming which and why
    (a lone process raises its own error as before). When ``fn`` holds collectives (orbax's restore does) a
    failure on one process can leave the others waiting in one: that process then raises its own error after
    ``nsp.distributed.agree.FAILED_WAIT_S``, and ``nsp train`` stops the others with it (``nsp.distributed.stop``)."""
    if jax.process_count() == 1:
        return fn()
    result, error = None, None
    try:
        result = fn()
    except (nsp.storage.StoreError, TrainError, OSError, ValueError) as e:
        error = e
    try:
        nsp.distributed.all_succeed(what, error)
    except nsp.distributed.DistributedError as e:
        if result is not None and hasattr(result, "close"):
            result.close()
        if not isinstance(e, nsp.distributed.Unanswered):  # else some process cannot hear: the command stops the run
            nsp.distributed.finish()  # every process knows: leave in order (process 0, the service's host, last)
        raise TrainError(str(e)) from None
    return result


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is set on any process (one small all-gather)."""
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def forget_failed_steps() -> None:
    """Waits for the steps already dispatched, then drops JAX's record of them, a failed one's error included.

    JAX keeps the last side-effecting computation of each device (the store update and the spill area's calls are
    such computations) and waits on it again at every ``jax.effects_barrier`` and at interpreter exit, raising a
    failed step's error each time: once the run has reported that error, the exit would print it twice more as
    "Exception ignored in atexit callback" tracebacks. JAX has no public call for this; where its internals
    differ, nothing is dropped (the exit is then only noisier).
    """
    try:
        from jax._src import dispatch

        tokens = dispatch.runtime_tokens
        pending = [*tokens.current_tokens.values(), *tokens.output_runtime_tokens.values()]
    except (ImportError, AttributeError):
        return
    for token in pending:  # each one: a failed token does not stop the wait for the others
        try:
            token.block_until_ready()
        except Exception:  # noqa: BLE001  (the error was reported where the step's output was read)
            pass
    tokens.clear()
