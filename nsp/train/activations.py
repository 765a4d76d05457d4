"""``--offload-activations``: the spill area a run's blocks send their backward-pass activations to."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import jax
from flax import nnx

import nsp.offload
from nsp.offload.blocks import block_function
from nsp.train.config import TrainConfig, TrainError

#: Free space the spill directory must have beyond one step's activations (other writers share the disk).
SPILL_MARGIN = 1.25


def spill_setup(config: TrainConfig, graphdef, params,
                log: Callable[[str], None]) -> tuple[Callable | None, nsp.offload.SpillArea | None]:
    """``(block_call, area)`` for ``make_train_step``: ``(None, None)`` with ``--offload-activations none``.

    Checks before the first step that the spill directory holds one step's activations (traced abstractly from
    a block: ``nsp.offload.spilled_bytes``) with a margin, and says how much goes there per step.

    Raises:
      TrainError: a spill directory that cannot be made or written, or too small.
    """
    if config.offload_activations == "none":
        return None, None
    directory = Path(config.spill_dir or Path(config.run_dir) / "spill")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        area = nsp.offload.SpillArea(directory)
    except (OSError, ValueError) as e:
        raise TrainError(f"--spill-dir {directory}: {e}") from None
    model = nnx.merge(graphdef, params)
    apply, state = block_function(model.h[0])
    width = model.wte.embedding.shape[1]
    # The whole batch (all devices' rows; each process spills its own devices' into its own area).
    x = jax.ShapeDtypeStruct((config.batch, config.seq, width), model.wte.embedding.dtype)
    per_step = nsp.offload.spilled_bytes(apply, state, x) * len(model.h)
    free = shutil.disk_usage(area.path).free
    if free < SPILL_MARGIN * per_step:
        area.close()
        raise TrainError(f"--spill-dir {directory} has {free / 1e9:.2f} GB free; a step spills up to "
                         f"{per_step / 1e9:.2f} GB of activations (x{SPILL_MARGIN} margin): free space, pick another "
                         "--spill-dir, or lower --batch or --seq")
    sparse = config.activation == "relu"
    log(f"activations: {len(model.h)} blocks' backward-pass activations ({per_step / 1e6:,.1f} MB a step"
        + (", less where the sparse format shrinks them" if sparse else "") + f") go to {area.path}")
    return nsp.offload.offload_blocks(area, sparse=sparse), area


def close(area: Any) -> None:
    if area is not None:
        area.close()
