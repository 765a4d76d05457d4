"""``nsp ckpt reshard``: a whole checkpoint step written again for another shard and process count, offline.

The step's store item is re-cut (``reshard.py``) into the new layout, split into the parts each process of the new
layout restores (``store/process-NNNNN``, or one snapshot for one process); the train state keeps everything but
its flat vectors as long as the old layout's padded total (Top-K's error-feedback residual), which are re-cut the
same way (their real elements, then the new padding's zeros); the meta item records the new counts. A run of that
layout resumes from the result as from its own checkpoint, with no resharding left to do. The output is built
under a temporary name beside ``out_dir`` and renamed into place: it exists only complete.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from nsp.storage.export import link_or_copy
from nsp.storage.format import StoreError
from nsp.storage.orbax_handler import load_train_state
from nsp.storage.reshard import COPY_THREADS, ItemSource, layout_for, process_shards, write_snapshot

#: The train state's leaves that are flat vectors of the store layout (``nsp.optim.TopKState``'s field).
FLAT_STATE_KEYS = ("residual",)


def checkpoint_step_dir(path: str | os.PathLike) -> Path:
    """``path`` as a checkpoint step directory: itself when it holds a ``store`` item, else (a checkpoint
    directory, ``RUN/ckpt``) its newest step."""
    path = Path(path).absolute()
    if (path / "store").is_dir():
        return path
    steps = sorted((int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / "store").is_dir()),
                   reverse=True) if path.is_dir() else []
    if not steps:
        raise StoreError(f"{path} is neither a checkpoint step (no store item) nor a checkpoint directory holding "
                         "one")
    return path / str(steps[0])


def read_step_meta(step_dir: Path) -> dict:
    """The step's meta item (JSON), or {} when it has none."""
    path = step_dir / "meta" / "metadata"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(f"the meta item {path} cannot be read ({e})") from None


def reshard_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, num_shards: int, *,
                       processes: int = 1) -> dict:
    """Writes checkpoint step ``checkpoint`` (a step directory, or a checkpoint directory: its newest step) again as
    ``out_dir/STEP`` for a run of ``processes`` processes with ``num_shards`` store shards in all (one a device).

    Returns a summary: step, version, the old and new counts, bytes read and written, seconds.
    """
    t0 = time.perf_counter()
    step_dir = checkpoint_step_dir(checkpoint)
    out = Path(out_dir).absolute()
    if out.exists():
        raise StoreError(f"output directory {out} already exists")
    if not out.parent.is_dir():
        raise StoreError(f"cannot create {out}: directory {out.parent} does not exist")
    if num_shards < 1:
        raise StoreError(f"--shards must be at least 1, got {num_shards}")
    process_shards(num_shards, processes, 0)  # refuses a count that does not split evenly
    meta = read_step_meta(step_dir)
    source = ItemSource(step_dir / "store", processes=meta.get("process_count"))
    # Who wrote the step: the meta says, else the parts do (a lone snapshot: one process).
    from_processes = meta.get("process_count") or len(source.parts)
    source.check()  # every old shard is needed: refuse before writing anything
    new = layout_for(source.layout, num_shards, int(source.meta["page_bytes"]))
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    dest = tmp / step_dir.name
    dest.mkdir(parents=True)
    written = 0
    try:
        item = dest / "store"
        if processes == 1:
            written += write_snapshot(source, item, num_shards)["written_bytes"]
        else:
            item.mkdir()
            # The parts at once, their pages copied by one pool of threads: no thread waits for a part's last pages.
            with concurrent.futures.ThreadPoolExecutor(COPY_THREADS) as pool, \
                    concurrent.futures.ThreadPoolExecutor(processes) as parts:
                written += sum(parts.map(lambda q: write_snapshot(
                    source, item / f"process-{q:05d}", num_shards, shards=process_shards(num_shards, processes, q),
                    pool=pool)["written_bytes"], range(processes)))
        recut = _copy_train_state(step_dir, dest, source.layout.padded_total, new.padded_total, new.total)
        if meta or (step_dir / "meta").is_dir():
            shutil.copytree(step_dir / "meta", dest / "meta")
            meta = dict(meta, num_shards=num_shards, process_count=processes,
                        resharded_from={"path": str(step_dir), "num_shards": source.layout.num_shards,
                                        "process_count": from_processes})
            (dest / "meta" / "metadata").write_text(json.dumps(meta))
        for name in ("_CHECKPOINT_METADATA", "commit_success.txt"):
            if (step_dir / name).exists():
                shutil.copyfile(step_dir / name, dest / name)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"step": int(step_dir.name) if step_dir.name.isdigit() else step_dir.name, "path": str(out / step_dir.name),
            "version": source.version, "from_shards": source.layout.num_shards,
            "from_processes": from_processes,
            "num_shards": num_shards, "processes": processes, "train_state_recut": recut,
            "read_bytes": source.layout.padded_total * 4 * len(source.states), "written_bytes": written,
            "seconds": time.perf_counter() - t0}


def _copy_train_state(step_dir: Path, dest: Path, old_padded: int, new_padded: int, total: int) -> list[str]:
    """The step's train state into ``dest``: linked file by file when no leaf depends on the shard count, else
    restored, its flat vectors re-cut, and saved again. Returns the re-cut leaves' paths."""
    src = step_dir / "train_state"
    if not src.is_dir():
        return []
    tree = load_train_state(step_dir)
    recut: list[str] = []

    def cut(path, leaf):
        name = getattr(path[-1], "key", getattr(path[-1], "name", None)) if path else None
        if (old_padded != new_padded and name in FLAT_STATE_KEYS and getattr(leaf, "shape", None) == (old_padded,)):
            recut.append(jax.tree_util.keystr(path))
            flat = np.asarray(leaf)
            return np.concatenate([flat[:total], np.zeros(new_padded - total, flat.dtype)])
        return leaf

    tree = jax.tree_util.tree_map_with_path(cut, tree)
    if not recut:
        shutil.copytree(src, dest / "train_state", copy_function=link_or_copy)
        return []
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(dest / "train_state", tree)
    ckptr.wait_until_finished()
    ckptr.close()
    return recut

