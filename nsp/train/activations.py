"""``--offload-activations``: the spill area a run's blocks send their backward-pass activations to."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import jax
from flax import nnx

import nsp.offload
import nsp.rss
from nsp.offload import planner
from nsp.offload.blocks import block_function
from nsp.train.config import TrainConfig, TrainError
from nsp.train.step import loss_fn

#: The plan of --offload-activations auto|BUDGET, in the run directory.
PLAN_FILE = "offload_plan.json"

#: Free space the spill directory must have beyond one step's activations (other writers share the disk).
SPILL_MARGIN = 1.25


def spill_setup(config: TrainConfig, graphdef, params, log: Callable[[str], None], batch: Any = None,
                mesh: Any = None, store: Any = None) -> tuple[Callable | None, nsp.offload.SpillArea | None]:
    """``(block_call, area)`` for ``make_train_step``: ``(None, None)`` with ``--offload-activations none``.

    ``all`` offloads every block; ``auto`` or a budget (``6GiB``) runs FlashNeuron's planner
    (``nsp.offload.planner``) on ``batch`` (the run's first) for that peak (``auto``: what the process holds now
    plus 90% of the memory available), offloads the blocks it picks, and writes the plan to
    ``RUN_DIR/offload_plan.json`` (``nsp plan --activations --run-dir RUN_DIR`` prints it beside what the run
    measured). Checks before the first step that the spill directory holds one step's activations (traced
    abstractly from a block: ``nsp.offload.spilled_bytes``) with a margin, and says how much goes there per step.

    Raises:
      TrainError: a spill directory that cannot be made or written, or too small; a budget the planner cannot
        meet.
    """
    if config.offload_activations == "none":
        return None, None
    if config.offload_to == "host":
        host = nsp.offload.HostMemory()
        log("activations: every block's backward-pass activations go to the devices' pinned host memory"
            + ("" if host.moves_data else " (on a CPU that is where they are: nothing is saved)"))
        return nsp.offload.offload_blocks(host), host
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
    if config.offload_activations == "all":
        log(f"activations: {len(model.h)} blocks' backward-pass activations ({per_step / 1e6:,.1f} MB a step"
            + (", less where the sparse format shrinks them" if sparse else "") + f") go to {area.path}")
        return nsp.offload.offload_blocks(area, sparse=sparse), area
    try:
        profile, plan = _plan(config, graphdef, params, model, batch, mesh, area, log, _update_bytes(store))
    except BaseException:
        area.close()
        raise
    for line in planner.describe(plan, profile).splitlines():
        log(line)
    nsp.rss.release_free_memory()  # what the profiling freed
    nsp.rss.reset_peak()  # the run's peak RSS from here is its steps', which the plan predicts
    if not plan.layers:
        area.close()
        return None, None
    return nsp.offload.offload_blocks(area, sparse=plan.sparse, layers=plan.layers, num_layers=len(model.h)), area


def _update_bytes(store: Any) -> int:
    """What the store's update holds beside the step: the file tier's page buffers (``pages_in_flight`` sets of
    param, m and v pages per local shard; allocated at the first update)."""
    if store is None or store.tier == "memory":
        return 0
    return int(store.pages_in_flight) * 3 * int(store.page_bytes) * len(store.local_shards)


def _plan(config: TrainConfig, graphdef, params, model, batch, mesh, area, log, extra_bytes: int = 0):
    """``(profile, plan)`` for ``--offload-activations auto|BUDGET``, the plan written to the run directory.

    On several devices of one process (a mesh) the planner profiles the whole batch on the first device: the
    activations all devices hold together are those of the whole batch, and their spills share the one area and
    its disk. What it does not see is that each further device computes its own gradients, a replica of the
    params' size: that is added to what the step holds beside the forward/backward.
    """
    if batch is None:
        raise TrainError("internal error: the planner needs the run's first batch")
    devices = 1 if mesh is None else int(mesh.devices.size)
    if devices > 1 and jax.process_count() > 1:
        raise TrainError("--offload-activations auto|BUDGET plans one process's step; with several processes each "
                         "would profile its own machine and could pick another plan: give --offload-activations all")
    budget = (planner.available_budget() if config.offload_activations == "auto"
              else planner.parse_budget(config.offload_activations))

    def loss_of(p, b, block_call):
        return loss_fn(graphdef, p, b, block_call=block_call)

    if devices > 1:
        # The params' replica on the first device, so that the profiling steps run once, on one device, instead
        # of on every device of the mesh.
        first = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])
        params = jax.device_put(params, first)
        model = nnx.merge(graphdef, params)
        gradients = (devices - 1) * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        log(f"offload planner: {devices} devices: the whole batch profiled on one; the other devices' gradients "
            f"({gradients / 2**30:.2f} GiB) counted beside the step")
        extra_bytes += gradients
        batch = jax.device_put(batch, first)
    profile = planner.profile_blocks(model, loss_of, params, jax.numpy.asarray(batch), area.path.parent, log)
    plan = planner.plan_offload(profile, budget, extra_bytes)
    planner.write_plan(Path(config.run_dir) / PLAN_FILE, profile, plan)
    if not plan.fits:
        raise TrainError("--offload-activations " + config.offload_activations + ": " + "; ".join(plan.notes))
    return profile, plan


def close(area: Any) -> None:
    if area is not None:
        area.close()
