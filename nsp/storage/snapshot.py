"""Snapshots of a store's committed version by hard link, and reading them back.

A store's committed version ``t`` lives in slot ``t % 2`` of every shard as zarr v3 arrays, one file per page.
A page file another link shares is never overwritten in place: the engine rewrites in place only a file with one
link (fastest: its blocks are allocated already), and replaces any other (a temporary file renamed over it, a new
inode). A hard link to a page file therefore keeps that page's bytes forever, whatever the store writes later. A
snapshot is just those links::

    DEST/SNAPSHOT.json                         written last (atomically): version, layout summary, file list
    DEST/nsp_store.json                        a copy of the store's metadata (layout, optimizer, tier)
    DEST/shards/NNNNN/{param,mu,nu}/zarr.json  the committed slot's array metadata (copied: tiny)
    DEST/shards/NNNNN/{param,mu,nu}/c/<page>   the committed slot's pages: hard links (no byte is copied)
    DEST/shards/NNNNN/CHECKSUMS.json           the manifest's page checksums of that version (file tier)

Every array is a plain zarr v3 array that ``tensorstore.open`` reads (``shards/NNNNN/STATE``: the shard's part of
the padded flat vector, see ``nsp.storage.layout``). A directory without ``SNAPSHOT.json`` is a snapshot that did
not finish (or no snapshot at all) and is refused by everything here.

When ``DEST`` is on another file system than the store (``EXDEV``) — or hard links fail otherwise — pages are
cloned or copied by the kernel (``placement.Placer``); the returned info says so (``method``,
``fallback_reason``). The ``memory`` tier has no files: its committed state is written out through tensorstore in
the same format, so any snapshot restores into either tier (``restore.py``).

**Single writer.** The store has one writer, and a snapshot must not run while an update does: call
``snapshot_store`` between steps — the trainer does. Jitted steps still queued in JAX's dispatch are waited for
(``store.version`` does) before the committed version is read.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import tensorstore as ts

from nsp.storage.format import (MANIFEST, METADATA, STATES, StoreError, array_dir, atomic_write_json, fsync_dir,
                                fsync_file, page_files, read_json, shard_dir, zarr_spec)
from nsp.storage.layout import Layout
from nsp.storage.placement import Placer, check_mode, clear_dir, prepare_empty_dir
from nsp.storage.store import StateStore

SNAPSHOT = "SNAPSHOT.json"
SNAPSHOT_FORMAT = "nsp-snapshot"
SNAPSHOT_FORMAT_VERSION = 1
CHECKSUMS = "CHECKSUMS.json"  # a file snapshot's page checksums, per shard

_DEBUG_COUNTS: dict[str, int] = {}


def _debug_kill_point(variable: str) -> None:
    """Fault-campaign hook, off unless ``variable`` is set: SIGKILL this process the Nth time it gets here."""
    at = os.environ.get(variable)
    if at is None:
        return
    _DEBUG_COUNTS[variable] = _DEBUG_COUNTS.get(variable, 0) + 1
    if _DEBUG_COUNTS[variable] >= int(at):
        os.kill(os.getpid(), signal.SIGKILL)


def _layout_summary(layout: Layout) -> dict:
    return {
        "num_shards": layout.num_shards,
        "page_elems": layout.page_elems,
        "total": layout.total,
        "shard_size": layout.shard_size,
        "padded_total": layout.padded_total,
        "pages_per_shard": layout.pages_per_shard,
        "num_leaves": len(layout.leaves),
    }


def snapshot_store(store: StateStore, dest: str | os.PathLike, *, mode: str = "auto") -> dict:
    """Makes an immutable snapshot of ``store``'s committed version at ``dest`` (see the module docstring).

    Call it between updates (the store is single-writer; nothing may update it meanwhile).

    Args:
      store: an open, initialized ``StateStore`` (any tier).
      dest: a directory that does not exist yet, or an empty one. Put it on the file system of the store's
        shards so that pages can be hard-linked.
      mode: ``"auto"`` (hard links, falling back to reflink/copy when links fail), ``"link"`` (links or an
        error), ``"copy"`` (always copy; for a snapshot meant to leave the machine's disk).

    Returns:
      The snapshot's description (the content of ``SNAPSHOT.json`` less the file list) plus ``method``
      (``link``, ``reflink``, ``copy``, ``tensorstore`` for the memory tier, or a mix like ``link+copy``),
      ``fallback_reason`` (why pages were copied, or None), file and byte counts, and ``seconds``.
    """
    t0 = time.perf_counter()
    check_mode(mode)
    if store.closed:
        raise StoreError("cannot snapshot a closed store")
    # store.version waits for the steps already dispatched (and background ones): their updates land first.
    if not store.initialized or store.version is None:
        raise StoreError("the store holds no state yet: nothing to snapshot")
    dest = Path(dest).absolute()
    existed = prepare_empty_dir(dest, "snapshot directory")
    try:
        if store.tier == "memory":
            files, placer_info = _snapshot_memory(store, dest)
        else:
            files, placer_info = _snapshot_files(store, dest, mode)
        info = _finish_snapshot(store, dest, files, placer_info)
    except BaseException:
        clear_dir(dest, existed)
        raise
    info["seconds"] = time.perf_counter() - t0
    if info.get("fallback_reason"):
        _warn_copied(store, dest, info["fallback_reason"])
    return info


# (store id, destination's file system) pairs already warned about: a run checkpointing to another file system
# than its store's would say the same at every checkpoint (each under another directory, so Python's own once-only
# rule for warnings does not catch it).
_COPY_WARNED: set[tuple[str, int]] = set()


def _warn_copied(store: StateStore, dest: Path, reason: str) -> None:
    key = (str(store.store_id), os.stat(dest).st_dev)
    if key in _COPY_WARNED:
        return
    _COPY_WARNED.add(key)
    warnings.warn(f"snapshot {dest}: {reason} (said once: later snapshots of this store onto that file system "
                  "copy too)", stacklevel=3)


def _snapshot_files(store: StateStore, dest: Path, mode: str) -> tuple[list[dict], dict]:
    version = store.version
    slot = store.slot_of(version)
    used = store.optimizer.states_used()
    for shard in store.local_shard_paths:
        held = read_json(shard / MANIFEST, "shard manifest").get("version")
        # A one-slot shard holds only its committed version (its pages are switched in by rename, so the links
        # made here keep that version's bytes whatever later updates write).
        if store.slots == 1 and held != version:
            raise StoreError(f"shard {shard} is at version {held}, the open store at {version}: a one-slot store "
                             "snapshots only a version every shard holds; reopen it (recovery brings them level)")
        # A shard may have committed one version ahead of the others (a failed multi-shard update); its slot
        # `version % 2` still holds `version` whole. Anything else means someone else wrote this store.
        if held not in (version, version + 1):
            raise StoreError(f"shard {shard} is at version {held}, the open store at {version}: the store was "
                             "changed behind this process's back; reopen it")
    placer = Placer(mode)
    files: list[dict] = []
    made_dirs: list[Path] = [dest / "shards"]
    for i, shard in zip(store.local_shards, store.local_shard_paths):
        shard_dest = shard_dir(dest, i)
        made_dirs.append(shard_dest)
        for state, is_used in zip(STATES, used):
            if not is_used:
                continue
            src = array_dir(shard, slot, state)
            dst = shard_dest / state
            (dst / "c").mkdir(parents=True)
            made_dirs += [dst, dst / "c"]
            shutil.copyfile(src / "zarr.json", dst / "zarr.json")  # tiny; copied so nothing can share it
            files.append({"path": str((dst / "zarr.json").relative_to(dest)),
                          "bytes": (dst / "zarr.json").stat().st_size})
            for name, size in page_files(src):
                placer.place(src / "c" / name, dst / "c" / name, size)
                files.append({"path": f"{dst.relative_to(dest)}/c/{name}", "bytes": size})
        # What each page must hold (the manifest's checksums of this version's slot): restore hands them to the
        # restored store, so a page swapped inside the snapshot is still found.
        tables = read_json(shard / MANIFEST, "shard manifest").get("checksums", {}).get(str(slot), {})
        atomic_write_json(shard_dest / CHECKSUMS, {"version": version, "checksums": tables})
        files.append({"path": str((shard_dest / CHECKSUMS).relative_to(dest)),
                      "bytes": (shard_dest / CHECKSUMS).stat().st_size})
    shutil.copyfile(store.root / METADATA, dest / METADATA)
    # Durability, once everything is in place (one journal commit covers most of it): the copied files' data,
    # then the new directory entries. Linked pages point at data the store synced when it committed them.
    for f in files:
        if placer.copied or placer.reflinked or f["path"].endswith("zarr.json"):
            fsync_file(dest / f["path"])
    fsync_file(dest / METADATA)
    for d in reversed(made_dirs):
        fsync_dir(d)
    return files, placer.info()


def _snapshot_memory(store: StateStore, dest: Path) -> tuple[list[dict], dict]:
    version = store.version
    layout = store.layout
    size = layout.shard_size
    files: list[dict] = []
    nbytes = 0
    for state, is_used in zip(STATES, store.optimizer.states_used()):
        if not is_used:
            continue
        for i in store.local_shards:
            path = shard_dir(dest, i) / state
            # Written without per-file syncs (made durable below, once, with fsync).
            spec = zarr_spec(path, size, layout.page_elems, store.checksum, state, version % 2, sync=False)
            arr = ts.open(spec, create=True).result()
            arr.write(store.read_shard(state, i, version)).result()
            for name, fsize in [("zarr.json", (path / "zarr.json").stat().st_size)] + [
                    (f"c/{n}", s) for n, s in page_files(path)]:
                fsync_file(path / name)
                files.append({"path": str((path / name).relative_to(dest)), "bytes": fsize})
                nbytes += fsize
            if (path / "c").exists():
                fsync_dir(path / "c")
            fsync_dir(path)
    for i in store.local_shards:
        fsync_dir(shard_dir(dest, i))
    fsync_dir(dest / "shards")
    atomic_write_json(dest / METADATA, store.metadata())
    return files, {"method": "tensorstore", "fallback_reason": None, "linked_files": 0, "linked_bytes": 0,
                   "reflinked_files": 0, "reflinked_bytes": 0, "copied_files": len(files), "copied_bytes": nbytes}


def _finish_snapshot(store: StateStore, dest: Path, files: list[dict], placer_info: dict) -> dict:
    used = store.optimizer.states_used()
    record = {
        "format": SNAPSHOT_FORMAT,
        "format_version": SNAPSHOT_FORMAT_VERSION,
        "version": int(store.version),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": {"tier": store.tier, "root": str(store.root) if store.root else None,
                   "shard_paths": [str(p) for p in store.shard_paths]},
        "page_bytes": store.page_bytes,
        "checksum": store.checksum,
        "layout": _layout_summary(store.layout),
        "optimizer": dataclasses.asdict(store.optimizer),
        "states": [s for s, u in zip(STATES, used) if u],
        "arrays": "shards/{shard:05d}/{state}",
        # The shards this snapshot holds: all, or one process's part of a multi-process checkpoint.
        **({"local_shards": list(store.local_shards)} if store.is_partial else {}),
        **placer_info,
        "num_files": len(files),
        "total_bytes": sum(f["bytes"] for f in files),
        "files": files,
    }
    fsync_dir(dest)
    _debug_kill_point("NSP_DEBUG_KILL_AT_SNAPSHOT")
    atomic_write_json(dest / SNAPSHOT, record)  # last: its presence is what makes the snapshot valid
    info = {k: v for k, v in record.items() if k != "files"}
    info["path"] = str(dest)
    return info


# ---- reading snapshots -------------------------------------------------------------------------------------------


def load_snapshot_info(snapshot_dir: str | os.PathLike, *, check_files: bool = True) -> dict:
    """Reads and checks a snapshot's ``SNAPSHOT.json``; with ``check_files`` every listed file must exist with
    its recorded size. Raises ``StoreError`` naming what is wrong (missing, unfinished, damaged)."""
    snap = Path(snapshot_dir).absolute()
    if not snap.exists():
        raise StoreError(f"snapshot {snap} does not exist")
    if not snap.is_dir():
        raise StoreError(f"snapshot {snap} is not a directory")
    if not (snap / SNAPSHOT).exists():
        if (snap / "store" / SNAPSHOT).exists():
            raise StoreError(f"{snap} is a checkpoint step directory: its snapshot is {snap / 'store'}")
        raise StoreError(f"{snap} is not a complete nsp snapshot: {SNAPSHOT} is missing (the snapshot was "
                         "interrupted before it finished, or this is not a snapshot)")
    info = read_json(snap / SNAPSHOT, "snapshot description")
    if info.get("format") != SNAPSHOT_FORMAT:
        raise StoreError(f"{snap / SNAPSHOT} is not an nsp snapshot description")
    if info.get("format_version") != SNAPSHOT_FORMAT_VERSION:
        raise StoreError(f"snapshot {snap} has format version {info.get('format_version')}; this nsp reads "
                         f"{SNAPSHOT_FORMAT_VERSION}")
    if not (snap / METADATA).exists():
        raise StoreError(f"snapshot {snap} is damaged: {METADATA} is missing")
    if check_files:
        for f in info["files"]:
            path = snap / f["path"]
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise StoreError(f"snapshot {snap} is damaged: {f['path']} is missing") from None
            if size != f["bytes"]:
                raise StoreError(f"snapshot {snap} is damaged: {f['path']} has {size} bytes, expected {f['bytes']}")
    info["path"] = str(snap)
    return info


def open_snapshot_array(snap: Path, shard: int, state: str) -> ts.TensorStore:
    """A snapshot's array of ``state`` in ``shard``, opened for reading with plain tensorstore."""
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(shard_dir(snap, shard) / state)}},
                   open=True, read=True).result()


def read_snapshot(snapshot_dir: str | os.PathLike, state: str = "param") -> np.ndarray:
    """The padded flat fp32 vector of ``state`` in a snapshot, read with plain tensorstore (no store opened)."""
    info = load_snapshot_info(snapshot_dir, check_files=False)
    if state not in info["states"]:
        raise ValueError(f"the snapshot holds no state {state!r} (it holds {info['states']})")
    snap = Path(info["path"])
    n, size = info["layout"]["num_shards"], info["layout"]["shard_size"]
    out = np.empty(n * size, np.float32)
    for i in range(n):
        out[i * size:(i + 1) * size] = open_snapshot_array(snap, i, state).read().result()
    return out
