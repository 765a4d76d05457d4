"""Rebuilding a store from a snapshot (``snapshot.py``), into either tier, bit-identically: the whole store, or
the shards of one process of several (from that process's part of a checkpoint).

A ``file``/``csd`` restore lays the snapshot's pages into a new store directory in the store's own format
(``format.py``: the snapshot's version in its slot, an empty other slot, shard identities and manifests naming a
new store id, ``nsp_store.json`` last) and then opens it with ``nsp.storage.open``, like any store. Pages are hard
links where they can be (``placement.py``): safe both ways, since neither the store nor a snapshot ever writes
into a page file another link shares. A ``memory`` restore loads the snapshot's arrays into a new memory store.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nsp.storage.format import (METADATA, SHARD_ID, TIERS, StoreError, array_dir, atomic_write_json, fsync_dir,
                                fsync_file, lock_holder, page_files, read_json, recorded_path, shard_dir, slot_of,
                                store_slots, trailer_checksums, write_manifest, write_shard_id)
from nsp.storage.layout import PAGES_IN_FLIGHT_DEFAULT, Layout
from nsp.storage.opening import open as open_store
from nsp.storage.placement import Placer, check_mode, clear_dir, prepare_empty_dir
from nsp.storage.snapshot import CHECKSUMS, load_snapshot_info, open_snapshot_array
from nsp.storage.store import OptimizerSpec, StateStore

RESTORING = "RESTORING"  # marker in a store directory while restore_store builds it


def snapshot_shards(info: dict) -> list[int]:
    """The shards a snapshot holds (all of them unless it is one process's part)."""
    return list(info.get("local_shards", range(info["layout"]["num_shards"])))


def restore_store(
    snapshot_dir: str | os.PathLike,
    store_path: str | os.PathLike | None = None,
    *,
    tier: str = "file",
    shard_paths: list[str | os.PathLike] | None = None,
    overwrite: bool = False,
    mode: str = "auto",
    pages_in_flight: int = PAGES_IN_FLIGHT_DEFAULT,
    shards: Sequence[int] | None = None,
) -> StateStore:
    """Rebuilds a store from a snapshot and opens it (``nsp.storage.open``); it reads bit-identically.

    Args:
      snapshot_dir: a directory made by ``snapshot_store`` (or a checkpoint's ``store`` item).
      store_path: the new store's directory (``file``/``csd``); ``None`` for the ``memory`` tier.
      tier: the tier to restore into, whatever tier the snapshot came from.
      shard_paths: one directory per shard (default ``store_path/shards/NNNNN``); each must be new or empty.
      overwrite: replace an existing store at ``store_path`` (and its shard directories). Without it an
        existing, non-empty ``store_path`` is an error. A directory that is not an nsp store is never deleted.
      mode: how pages get into the new store: ``"auto"`` (hard links, else copies), ``"link"``, ``"copy"``.
        Links are safe both ways: the store replaces pages by rename and never writes into a linked file.
      pages_in_flight: passed to ``nsp.storage.open``.
      shards: restore only these shards, from one process's part of a multi-process checkpoint (each process
        snapshots only its own shards), which must hold exactly these; the store is opened with
        ``nsp.storage.open(..., shards=shards)``. The memory tier ignores ``store_path`` then.

    Returns:
      The open ``StateStore`` at the snapshot's version, its ``restore_info`` saying where it came from and how
      the pages got there. Note: only that version is restored; the slot of the version before it is empty, so
      do not replay the step before the snapshot on the restored store.
    """
    check_mode(mode)
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
    info = load_snapshot_info(snapshot_dir)
    if shards is not None:
        held = snapshot_shards(info)
        if sorted(shards) != held:
            raise StoreError(f"snapshot {info['path']} holds shards {held} of {info['layout']['num_shards']}, this "
                             f"process needs shards {sorted(shards)}: the checkpoint was written by a run with "
                             "another process or device count (reshard it: nsp.storage.reshard.restore_resharded, "
                             "or `nsp ckpt reshard CKPT OUT --shards M --processes P` offline)")
    snap = Path(info["path"])
    meta = read_json(snap / METADATA, "snapshot store metadata")
    n = info["layout"]["num_shards"]
    local = list(range(n)) if shards is None else list(shards)
    if tier == "memory":
        if shards is None and (store_path is not None or shard_paths):
            raise ValueError("the memory tier keeps its state in RAM: pass no store_path or shard_paths")
        return _restore_memory(snap, info, meta, pages_in_flight, shards)
    if store_path is None:
        raise ValueError(f"the {tier} tier needs a store_path")
    root = Path(store_path).absolute()
    if not root.parent.exists():
        raise StoreError(f"cannot create store {root}: directory {root.parent} does not exist")
    if _resolves_inside(root, snap):
        raise StoreError(f"cannot restore into {root}: it lies inside the snapshot {snap}")
    remove_existing_store(root, snap, overwrite)
    if shard_paths is not None:
        if len(shard_paths) != n:
            raise ValueError(f"got {len(shard_paths)} shard_paths for a snapshot of {n} shards")
        paths = [Path(p).absolute() for p in shard_paths]
    else:
        paths = [shard_dir(root, i) for i in range(n)]
    root_existed = root.exists()
    root.mkdir(exist_ok=True)
    # While this marker exists the directory is an unfinished restore (nsp.storage.open would see no store:
    # the metadata is written last) and restore_store(..., overwrite=True) may clear it.
    atomic_write_json(root / RESTORING, {"snapshot": str(snap), "shard_paths": [str(paths[i]) for i in local]})
    made_shards: list[tuple[Path, bool]] = []
    try:
        for i in local:
            made_shards.append((paths[i], prepare_empty_dir(paths[i], "shard directory")))
        version = int(info["version"])
        store_id = uuid.uuid4().hex
        placer = Placer(mode)
        for i in local:
            place_shard(placer, snap, info, meta, i, paths[i], store_id, root)
        # A restored store is a new store: its own identity, its shards recorded relative to it where they can be.
        meta = dict(meta, tier=tier, store_id=store_id, shard_paths=[recorded_path(s, root) for s in paths])
        atomic_write_json(root / METADATA, meta)  # last: from here on it is a store
        (root / RESTORING).unlink()
        fsync_dir(root)
    except BaseException:
        for shard, existed in made_shards:
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


def place_shard(placer: Placer, snap: Path, info: dict, meta: dict, i: int, shard: Path, store_id: str,
                root: Path) -> None:
    """Shard ``i`` of snapshot ``snap`` laid into the empty directory ``shard`` of the store at ``root`` (id
    ``store_id``): its arrays in the snapshot version's slot, its page checksums, its identity and its manifest."""
    version = int(info["version"])
    slots = store_slots(meta)  # a one-slot store's snapshot restores to a one-slot store: its version in slot 0
    slot = slot_of(slots, version)
    for state in info["states"]:
        _place_array(placer, shard_dir(snap, i) / state, shard, slot, state, other_slot=slots == 2)
    recorded = shard_dir(snap, i) / CHECKSUMS
    if recorded.exists():
        tables = read_json(recorded, "snapshot page checksums")["checksums"]
    elif meta.get("checksum"):
        # A snapshot that records none (the memory tier's, written by tensorstore): each page's own trailer is
        # what it must hold from now on.
        tables = {"version": version,
                  **{state: trailer_checksums(array_dir(shard, slot, state)) for state in info["states"]}}
    else:
        tables = {}
    write_shard_id(shard, store_id, i, root)
    write_manifest(shard, store_id, i, version, {str(slot): tables} if tables else {})


def _place_array(placer: Placer, src: Path, shard: Path, slot: int, state: str, other_slot: bool = True) -> None:
    """A snapshot array into ``slot`` of a new shard, and an empty array in the other slot (the next update
    writes it)."""
    zarr_json = read_json(src / "zarr.json", "snapshot array metadata")
    dst = array_dir(shard, slot, state)
    (dst / "c").mkdir(parents=True)
    shutil.copyfile(src / "zarr.json", dst / "zarr.json")
    for name, size in page_files(src):
        placer.place(src / "c" / name, dst / "c" / name, size)
    if placer.copied or placer.reflinked:
        for name, _ in page_files(dst):
            fsync_file(dst / "c" / name)
    if not other_slot:
        for d in (dst / "c", dst, dst.parent):
            fsync_dir(d)
        return
    other = array_dir(shard, 1 - slot, state)
    (other / "c").mkdir(parents=True)
    atomic_write_json(other / "zarr.json", _other_slot_metadata(zarr_json, 1 - slot))
    for d in (dst / "c", dst, other / "c", other, dst.parent, other.parent):
        fsync_dir(d)


def _other_slot_metadata(zarr_json: dict, slot: int) -> dict:
    meta = json.loads(json.dumps(zarr_json))
    meta.setdefault("attributes", {}).setdefault("nsp", {})["slot"] = slot
    return meta


def _restore_memory(snap: Path, info: dict, meta: dict, pages_in_flight: int,
                    shards: Sequence[int] | None) -> StateStore:
    version = int(info["version"])
    n = info["layout"]["num_shards"]
    store = open_store(None, tier="memory", num_shards=n, page_bytes=int(meta["page_bytes"]),
                       pages_in_flight=pages_in_flight, checksum=bool(meta["checksum"]), shards=shards)
    try:
        store.attach(Layout.from_json(meta["layout"]), OptimizerSpec(**meta["optimizer"]), version)
        for i in range(n) if shards is None else shards:
            for state in info["states"]:
                arr = np.ascontiguousarray(open_snapshot_array(snap, i, state).read().result(), np.float32)
                store.load_state(state, i, arr)
    except BaseException:
        store.close()
        raise
    store.restore_info = {"snapshot": str(snap), "version": version, "method": "tensorstore"}
    return store


# ---- replacing an existing store ---------------------------------------------------------------------------------


def _resolves_inside(path: Path, parent: Path) -> bool:
    """Whether ``path`` lies under ``parent`` once symlinks are resolved (what deleting one would reach)."""
    try:
        path.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


def _check_not_locked(root: Path) -> None:
    holder = lock_holder(root)
    if holder is not None:
        raise StoreError(f"store {root} is open for writing ({holder}); close it before overwriting it")


def remove_existing_store(root: Path, snap: Path, overwrite: bool) -> None:
    if not root.exists():
        return
    if not root.is_dir():
        raise StoreError(f"store path {root} exists and is not a directory")
    if not any(root.iterdir()):
        return
    is_store, is_partial = (root / METADATA).exists(), (root / RESTORING).exists()
    if not overwrite:
        what = "a store" if is_store else ("an unfinished restore" if is_partial else "files")
        raise StoreError(f"{root} already holds {what}; pass overwrite=True to replace it")
    if not (is_store or is_partial):
        raise StoreError(f"{root} is not empty and holds no nsp store: refusing to delete it even with "
                         "overwrite=True (remove it yourself)")
    shards: list[Path] = []
    if is_store:
        try:
            shards = [root / p for p in read_json(root / METADATA, "store metadata").get("shard_paths", [])]
        except StoreError:
            shards = []
    if is_partial:
        try:
            shards += [Path(p) for p in json.loads((root / RESTORING).read_text()).get("shard_paths", [])]
        except (OSError, json.JSONDecodeError):
            pass
    for victim in [root, *shards]:
        if _resolves_inside(snap, victim):
            raise StoreError(f"the snapshot {snap} lies inside {victim}, which overwriting would delete")
    _check_not_locked(root)
    for shard in shards:
        if shard.exists() and not _resolves_inside(shard, root):
            _check_not_locked(shard)
            owner = _shard_owner_root(shard)
            if owner not in (None, str(root)):
                raise StoreError(f"{root} names shard {shard}, which belongs to the store at {owner}: refusing "
                                 "to delete it")
            remove_tree(shard)
    remove_tree(root)


def remove_tree(path: Path) -> None:
    """Removes the directory ``path`` and what it holds; of a mount point (a store or shard directory that is a
    disk of its own), only what it holds: the directory itself cannot go."""
    if not os.path.ismount(path):
        shutil.rmtree(path)
        return
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _shard_owner_root(shard: Path) -> str | None:
    try:
        owner = read_json(shard / SHARD_ID, "shard identity")
    except StoreError:
        return None
    return owner.get("root") if isinstance(owner, dict) else None
