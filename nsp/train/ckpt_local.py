"""Checkpoints on hosts that share nothing (``nsp train --ckpt-local``): each process keeps its own complete steps.

A multi-process run normally writes one checkpoint step from every process into one directory all of them see
(orbax's convention): each process's part of the store, and the train state from process 0. Hosts with only
their own disks cannot do that. With ``--ckpt-local`` each process keeps a complete checkpoint of its own in its
``RUN_DIR/ckpt`` (``make_checkpoint_manager(..., local=True)``): its part of the store
(``STEP/store/process-NNNNN``, as in the shared layout), its own copy of the train state (params and optax state
are replicated: every process holds all of it) and the meta, finalised by that process alone. What ties the
processes' copies into one run is agreement over JAX's runtime, never a file the others read:

- ``check_not_shared``: at start each process writes a marker with a token of this run into its checkpoint
  directory and looks for the others' markers; one it sees means the directory is shared, and the run stops
  (two processes would each write the same step as its only writer);
- ``common_step``: ``--resume`` restores the newest step that every process holds finalised (an all-gather of
  each process's steps), and each process first removes its steps newer than that (a step some process never
  finished); a run whose processes hold steps but none in common stops with each process's steps named;
- ``check_resumable``: a step written with ``--ckpt-local`` resumes only with it, on the layout that wrote it, and
  a step written without it only without it;
- ``after_save``: after each save the processes agree that every one of them finalised the step, and only then
  each removes its own steps beyond ``--keep-checkpoints`` (so a step every process holds is never removed before
  a newer one is held by every process).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import jax
import numpy as np

import nsp.distributed
from nsp.storage import checkpoint as ckpt
from nsp.train import process
from nsp.train.config import TrainConfig, TrainError

MARKER = ".nsp-ckpt-local-process-{:05d}"  # in each process's checkpoint directory: this run's token


def is_marker(path: Path) -> bool:
    """Whether ``path`` is a process's marker (``MARKER``), which is no run's file."""
    return path.name.startswith(MARKER.split("{")[0])


def active(config: TrainConfig) -> bool:
    """Whether the run keeps share-nothing checkpoints (``--ckpt-local`` and more than one process; one process
    keeps all of its checkpoint itself anyway)."""
    return config.ckpt_local and jax.process_count() > 1


def _run_token() -> str:
    """A token of this run, the same on every process (process 0's random number)."""
    from jax.experimental import multihost_utils

    mine = np.int32(int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)
    return f"{int(multihost_utils.broadcast_one_to_all(mine)):08x}"


def check_not_shared(ckpt_dir: Path) -> None:
    """Stops every process (``TrainError``) when any of them sees another's checkpoint directory: the
    directories must be each process's own. Called by every process at start."""
    token = _run_token()
    me, n = jax.process_index(), jax.process_count()

    def mark():
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / MARKER.format(me)).write_text(token)

    process.together("writing this process's marker into its checkpoint directory", mark)

    def look():
        seen = [p for p in range(n) if p != me and _read(ckpt_dir / MARKER.format(p)) == token]
        if seen:
            raise TrainError(f"--ckpt-local: {ckpt_dir} is shared with process(es) {seen} (their markers are in it); "
                             "drop --ckpt-local on a shared checkpoint directory, or give each process its own")

    process.together("checking that each process's checkpoint directory is its own", look)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def held_steps(ckpt_dir: Path) -> list[int]:
    """The steps this process holds finalised in its ``ckpt_dir`` (an unfinished save is not one)."""
    if not ckpt_dir.is_dir():
        return []
    manager = ckpt.make_checkpoint_manager(ckpt_dir, max_to_keep=None, local=True)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


def _describe(each: list[list[int]]) -> str:
    return "; ".join(f"process {p}: {steps or 'none'}" for p, steps in enumerate(each))


def common_step(ckpt_dir: Path, log: Callable[[str], None] | None = None) -> int | None:
    """The newest step every process holds finalised (every process calls it; all get the same answer), or
    ``None`` when no process holds any. Raises ``TrainError`` when processes hold steps but none in common."""
    each = nsp.distributed.agree_steps(held_steps(ckpt_dir))
    common = set(each[0]).intersection(*each[1:])
    if common:
        step = max(common)
        if log is not None and any(steps[-1] != step for steps in each):
            log(f"--ckpt-local: the processes' newest checkpoints differ ({_describe(each)}); step {step} is the "
                "newest every process holds")
        return step
    if any(each):
        raise TrainError(f"--ckpt-local: no checkpoint step is held by every process ({_describe(each)}): a "
                         "process's checkpoint directory was lost or replaced; there is no step to resume all "
                         "processes from")
    return None


def check_resumable(meta: dict, step: int, local: bool, processes: int, num_shards: int) -> None:
    """Raises ``TrainError`` when the checkpoint of ``step`` (its ``meta``) cannot be resumed by this run: one
    written with ``--ckpt-local`` by a run without it (``local``: this run keeps share-nothing checkpoints), or the
    other way round, or one written with ``--ckpt-local`` on another layout (``processes`` processes, ``num_shards``
    store shards in all: resharding reads every process's part, which no host sees)."""
    written = bool(meta.get("ckpt_local"))
    if written != local:
        how = "with" if written else "without"
        raise TrainError(f"the checkpoint at step {step} was written {how} --ckpt-local (each process's own "
                         f"checkpoint directory): resume it {how} --ckpt-local, on as many processes")
    saved_processes, saved_shards = meta.get("process_count", 1), meta.get("num_shards", num_shards)
    if local and (saved_processes != processes or saved_shards != num_shards):
        raise TrainError(f"the checkpoint at step {step} was written by {saved_processes} process(es) with "
                         f"{saved_shards} store shards, this run has {processes} with {num_shards}: --ckpt-local "
                         "checkpoints resume only on the layout that wrote them (resharding reads every process's "
                         "part)")


def discard_newer(manager, step: int, log: Callable[[str], None]) -> None:
    """Removes this process's steps newer than ``step`` (the one every process resumes from): steps some other
    process never finalised, which the run now redoes."""
    newer = [s for s in manager.all_steps() if s > step]
    if newer:
        log(f"--ckpt-local: process {jax.process_index()} removes its checkpoint step(s) {newer}, which not every "
            f"process holds (the run goes on from step {step})")
    for s in newer:
        manager.delete(s)


def after_save(manager, step: int, keep: int) -> None:
    """Once every process holds ``step`` finalised, removes this process's steps beyond the newest ``keep``.
    Raises ``TrainError`` (on every process) when some process does not hold it."""
    each = nsp.distributed.agree_steps(manager.all_steps())
    missing = [p for p, steps in enumerate(each) if step not in steps]
    if missing:
        raise TrainError(f"--ckpt-local: the checkpoint of step {step} is not finalised on process(es) {missing} "
                         f"({_describe(each)})")
    for s in sorted(manager.all_steps())[:-keep]:
        manager.delete(s)


def start_afresh(ckpt_dir: Path) -> None:
    """Removes this process's checkpoint directory (a run that stopped before its first checkpoint)."""
    if ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
