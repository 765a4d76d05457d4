"""Rebuilding one process's shards of a store from its part of a multi-process checkpoint.

Each process of a run snapshots only its own shards (``snapshot_store`` of a store opened with ``shards=``), so
its part of a checkpoint holds those shards and the store's metadata. ``restore_local`` lays them into the
process's store directory the way ``nsp.storage.restore_store`` lays a whole snapshot (same format, same
checks: the snapshot's version in its slot, a new store id, the metadata written last) and opens the store with
the same shards. A snapshot of other shards (the run had another process count or device count) is refused.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nsp.storage.format import METADATA, StoreError, atomic_write_json, fsync_dir, read_json, recorded_path, shard_dir
from nsp.storage.layout import PAGES_IN_FLIGHT_DEFAULT, Layout
from nsp.storage.opening import open as open_store
from nsp.storage.placement import Placer, check_mode, clear_dir, prepare_empty_dir
from nsp.storage.restore import RESTORING, place_shard, remove_existing_store
from nsp.storage.snapshot import load_snapshot_info, open_snapshot_array
from nsp.storage.store import OptimizerSpec, StateStore


def snapshot_shards(info: dict) -> list[int]:
    """The shards a snapshot holds (all of them unless it is one process's part)."""
    return list(info.get("local_shards", range(info["layout"]["num_shards"])))


def restore_local(snapshot_dir: str | os.PathLike, store_path: str | os.PathLike | None, shards: Sequence[int], *,
                  tier: str = "file", overwrite: bool = False, mode: str = "auto",
                  pages_in_flight: int = PAGES_IN_FLIGHT_DEFAULT) -> StateStore:
    """Restores shards ``shards`` of a store from ``snapshot_dir`` (which must hold exactly those) at
    ``store_path`` (``None`` for the memory tier) and opens them (``nsp.storage.open(..., shards=shards)``)."""
    check_mode(mode)
    info = load_snapshot_info(snapshot_dir)
    held = snapshot_shards(info)
    if sorted(shards) != held:
        raise StoreError(f"snapshot {info['path']} holds shards {held} of {info['layout']['num_shards']}, this "
                         f"process needs shards {sorted(shards)}: the checkpoint was written by a run with another "
                         "process or device count (resume with the same number of processes and devices per process)")
    snap = Path(info["path"])
    meta = read_json(snap / METADATA, "snapshot store metadata")
    n, version = info["layout"]["num_shards"], int(info["version"])
    if tier == "memory":
        store = open_store(None, tier="memory", num_shards=n, page_bytes=int(meta["page_bytes"]),
                           pages_in_flight=pages_in_flight, checksum=bool(meta["checksum"]), shards=shards)
        try:
            store.attach(Layout.from_json(meta["layout"]), OptimizerSpec(**meta["optimizer"]), version)
            for i in shards:
                for state in info["states"]:
                    arr = open_snapshot_array(snap, i, state).read().result()
                    store.load_state(state, i, np.ascontiguousarray(arr, np.float32))
        except BaseException:
            store.close()
            raise
        return store
    if store_path is None:
        raise ValueError(f"the {tier} tier needs a store_path")
    root = Path(store_path).absolute()
    if not root.parent.exists():
        raise StoreError(f"cannot create store {root}: directory {root.parent} does not exist")
    remove_existing_store(root, snap, overwrite)
    paths = [shard_dir(root, i) for i in range(n)]
    root_existed = root.exists()
    root.mkdir(exist_ok=True)
    atomic_write_json(root / RESTORING, {"snapshot": str(snap), "shard_paths": [str(paths[i]) for i in shards]})
    made: list[tuple[Path, bool]] = []
    try:
        store_id, placer = uuid.uuid4().hex, Placer(mode)
        for i in shards:
            made.append((paths[i], prepare_empty_dir(paths[i], "shard directory")))
            place_shard(placer, snap, info, meta, i, paths[i], store_id, root)
        meta = dict(meta, tier=tier, store_id=store_id, shard_paths=[recorded_path(s, root) for s in paths])
        atomic_write_json(root / METADATA, meta)
        (root / RESTORING).unlink()
        fsync_dir(root)
    except BaseException:
        for shard, existed in made:
            clear_dir(shard, existed)
        clear_dir(root, root_existed)
        raise
    store = open_store(root, tier=tier, num_shards=n, page_bytes=int(meta["page_bytes"]),
                       pages_in_flight=pages_in_flight, shards=shards)
    if store.version != version:
        store.close()
        raise StoreError(f"restored store {root} opened at version {store.version}, expected {version}")
    store.restore_info = {"snapshot": str(snap), "version": version, **placer.info()}
    return store
