"""Resuming a run that saves no checkpoints (``--no-checkpoints``) from its store's committed version.

A model whose store fills most of its disk has no room for a checkpoint (a snapshot's hard links pin a version's
pages, so the next update's writes of them take new space). Its store is still crash-safe on its own: a kill
leaves version ``t`` or ``t + 1`` whole. What the store does not know is the run's step: a step whose gradient
was not finite is skipped without a new version. So after every step such a run records, in ``RECORD`` beside
its metrics, the store version that step left and the step's number (replaced atomically). On ``--resume`` the
store's committed version ``V`` and the record ``(v, s)`` give the step:

- ``V == v``: the step after ``s`` never committed (killed during its update) or was skipped: resume at ``s``
  (a skipped step is skipped again: the same batch, the same params);
- ``V == v + 1``: the step after ``s`` committed and the kill came before its record: resume at ``s + 1``.

The params come back from the store's fp32 master, leaf by leaf (``StateStore.read_leaves``), rounded to bf16:
what the step held, since with ``float32_updates`` the storage transform lands bf16 params on exactly that
rounding of the master (``nsp.optim.scale_by_storage``). That needs ``--bf16-params`` (fp32 params land within an
ulp of the master where a step crosses zero), and the rest of the optimizer state must be in the store too,
which rules out ``--staleness 1`` (the step's params are one update behind the store), Top-K (its error-feedback
residual lives beside the params), the memory tier and multi-process runs (``why_not``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from nsp.train.config import TrainConfig

#: The record of the last step and the store version it left, in the run directory.
RECORD = "store_step.json"


def why_not(config: TrainConfig) -> str | None:
    """Why a run of ``config`` cannot resume from its store (None when it can)."""
    if config.tier == "memory":
        return "the memory tier keeps nothing on disk"
    if not config.bf16_params:
        return ("float32 params are the master only to within an ulp where a step crosses zero (--bf16-params "
                "land on its rounding exactly)")
    if config.staleness:
        return "with --staleness 1 the step's params are one update behind the store"
    if config.topk:
        return "Top-K's error-feedback residual is not kept in the store"
    if jax.process_count() > 1:
        return "a multi-process run resumes from checkpoints only"
    return None


def write_record(run_dir: Path, version: int, step: int) -> None:
    """Records that step ``step`` left the store at ``version`` (atomically: a kill leaves the old record or the
    new one)."""
    path = Path(run_dir) / RECORD
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"version": int(version), "step": int(step)}) + "\n")
    os.replace(tmp, path)


def step_to_resume(run_dir: Path, version: int) -> int:
    """The step a run resumes at, from its record and the store's committed ``version`` (module docstring).

    Raises:
      ValueError: no record, or one that the store's version does not follow.
    """
    path = Path(run_dir) / RECORD
    try:
        record = json.loads(path.read_text())
        recorded, step = int(record["version"]), int(record["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} does not say which step the store's version belongs to ({e})") from None
    if version == recorded:
        return step
    if version == recorded + 1:
        return step + 1
    raise ValueError(f"the store is at version {version}, but {path} records step {step} at version {recorded}: "
                     "the store is not this run's (or was changed since)")


def params_from_store(store, template: Any) -> Any:
    """The params tree of ``template`` (arrays or ``jax.ShapeDtypeStruct`` leaves, in the store's layout order)
    filled from the store's committed fp32 master, one leaf at a time, each cast to its template leaf's dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(template)
    out = []
    for like, (leaf, master) in zip(leaves, store.read_leaves("param"), strict=True):
        if tuple(like.shape) != tuple(leaf.shape):
            raise ValueError(f"the store's leaf {leaf.path} has shape {leaf.shape}, the model's {tuple(like.shape)}")
        out.append(jnp.asarray(master).astype(like.dtype))
        del master
    return jax.tree_util.tree_unflatten(treedef, out)

