"""Checkpoints straight from the storage tier: snapshots by hard link, restore, orbax integration, export.

A store's committed version ``t`` lives in slot ``t % 2`` of every shard as zarr v3 arrays, one file per page.
A page file another link shares is never overwritten in place: the engine rewrites in place only a file with one
link (fastest: its blocks are allocated already), and replaces any other (a temporary file renamed over it, a new
inode). A hard link to a page file therefore keeps that page's bytes forever, whatever the store writes later. A
snapshot is just those links::

    DEST/SNAPSHOT.json                         written last (atomically): version, layout summary, file list
    DEST/nsp_store.json                        a copy of the store's metadata (layout, optimizer, tier)
    DEST/shards/NNNNN/{param,mu,nu}/zarr.json  the committed slot's array metadata (copied: tiny)
    DEST/shards/NNNNN/{param,mu,nu}/c/<page>   the committed slot's pages: hard links (no byte is copied)

Every array is a plain zarr v3 array that ``tensorstore.open`` reads (``shards/NNNNN/STATE``: the shard's part of
the padded flat vector, see ``nsp.storage.layout``). A directory without ``SNAPSHOT.json`` is a snapshot that did
not finish (or no snapshot at all) and is refused by everything here.

When ``DEST`` is on another file system than the store (``EXDEV``) — or hard links fail otherwise — pages are
cloned (``FICLONE`` reflink) or copied by the kernel (``shutil.copy2``: ``sendfile``, never through Python
buffers); the returned info says so (``method``, ``fallback_reason``). The ``memory`` tier has no files: its
committed state is written out through tensorstore in the same format, so any snapshot restores into either tier.

**Single writer.** The store has one writer, and a snapshot must not run while an update does: call
``snapshot_store`` (or ``save_checkpoint``) between steps — the trainer does. Jitted steps still queued in JAX's
dispatch are waited for (``jax.effects_barrier``) before the committed version is read.

orbax: ``StoreCheckpointHandler`` with ``StoreSave`` / ``StoreRestore`` args saves the store item of an
``ocp.CheckpointManager`` (``make_checkpoint_manager``, ``save_checkpoint``, ``restore_checkpoint``). Keep-N
deletes old step directories, i.e. only their links; the live store's files are untouched.

``export_checkpoint`` writes a checkpoint others read without nsp: orbax ``StandardCheckpointer`` pytrees of the
fp32 master params and the moments, shaped like the original parameter tree.
"""

from __future__ import annotations

import ast
import dataclasses
import errno
import fcntl
import json
import os
import signal
import re
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from nsp.storage import store as store_lib
from nsp.storage.layout import PAGES_IN_FLIGHT_DEFAULT, Layout
from nsp.storage.store import (
    MANIFEST,
    METADATA,
    SHARD_ID,
    STATES,
    OptimizerSpec,
    StateStore,
    StoreError,
    _atomic_write_json,
    _fsync_dir,
    _read_json,
    _recorded_path,
)

SNAPSHOT = "SNAPSHOT.json"
SNAPSHOT_FORMAT = "nsp-snapshot"
SNAPSHOT_FORMAT_VERSION = 1
CHECKSUMS = "CHECKSUMS.json"  # a file snapshot's page checksums, per shard
RESTORING = "RESTORING"  # marker in a store directory while restore_store builds it
ITEM_NAMES = ("store", "train_state", "meta")
MODES = ("auto", "link", "copy")
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
_LINK_FALLBACK_ERRNOS = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}

__all__ = [
    "SNAPSHOT", "StoreCheckpointHandler", "StoreRestore", "StoreSave", "export_checkpoint", "load_snapshot_info",
    "make_checkpoint_manager", "restore_checkpoint", "restore_store", "save_checkpoint", "snapshot_store",
]


# ---- small file helpers --------------------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_DEBUG_COUNTS: dict[str, int] = {}


def _debug_kill_point(variable: str) -> None:
    """Fault-campaign hook, off unless ``variable`` is set: SIGKILL this process the Nth time it gets here."""
    at = os.environ.get(variable)
    if at is None:
        return
    _DEBUG_COUNTS[variable] = _DEBUG_COUNTS.get(variable, 0) + 1
    if _DEBUG_COUNTS[variable] >= int(at):
        os.kill(os.getpid(), signal.SIGKILL)


class _Placer:
    """Puts files at new paths by hard link, falling back to reflink / kernel copy; counts what it did."""

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.mode = mode
        self.linking = mode != "copy"
        self.fallback_reason: str | None = None
        self.can_reflink = True
        self.linked = self.reflinked = self.copied = 0
        self.linked_bytes = self.reflinked_bytes = self.copied_bytes = 0

    def place(self, src: Path, dst: Path, size: int) -> None:
        if self.linking:
            try:
                os.link(src, dst)
                self.linked += 1
                self.linked_bytes += size
                return
            except OSError as e:
                if self.mode == "link" or e.errno not in _LINK_FALLBACK_ERRNOS:
                    raise StoreError(f"cannot hard-link {src} to {dst}: {e.strerror}") from e
                self.linking = False  # the same for every later file: stop trying
                self.fallback_reason = (f"hard links failed ({errno.errorcode.get(e.errno, e.errno)}: {e.strerror}; "
                                        f"{'another file system' if e.errno == errno.EXDEV else 'not supported'}): "
                                        "pages were copied")
        if self.can_reflink and self._reflink(src, dst):
            self.reflinked += 1
            self.reflinked_bytes += size
            return
        self.can_reflink = False  # failed once: the same for every later file
        shutil.copy2(src, dst)  # sendfile / copy_file_range: the kernel copies, not Python
        self.copied += 1
        self.copied_bytes += size

    @staticmethod
    def _reflink(src: Path, dst: Path) -> bool:
        try:
            sfd = os.open(src, os.O_RDONLY)
        except OSError:
            return False
        try:
            dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError:
            os.close(sfd)
            return False
        ok = False
        try:
            fcntl.ioctl(dfd, _FICLONE, sfd)
            ok = True
        except OSError:
            pass
        finally:
            os.close(dfd)
            os.close(sfd)
        if ok:
            shutil.copystat(src, dst)
        else:
            os.unlink(dst)
        return ok

    def method(self) -> str:
        used = [name for name, n in (("link", self.linked), ("reflink", self.reflinked), ("copy", self.copied)) if n]
        return "+".join(used) or ("link" if self.linking else "copy")

    def info(self) -> dict:
        return {
            "method": self.method(),
            "fallback_reason": self.fallback_reason,
            "linked_files": self.linked, "linked_bytes": self.linked_bytes,
            "reflinked_files": self.reflinked, "reflinked_bytes": self.reflinked_bytes,
            "copied_files": self.copied, "copied_bytes": self.copied_bytes,
        }


def _page_files(array_dir: Path) -> list[tuple[str, int]]:
    """(name, bytes) of the page files of a zarr array (``c/<page>``), in page order; temporaries skipped."""
    chunk_dir = array_dir / "c"
    try:
        entries = [(e.name, e.stat().st_size) for e in os.scandir(chunk_dir) if e.name.isdigit() and e.is_file()]
    except FileNotFoundError:
        return []
    return sorted(entries, key=lambda x: int(x[0]))


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


def _store_metadata(store: StateStore) -> dict:
    """What ``nsp_store.json`` holds (the memory tier has no file: built from the open store)."""
    return {
        "format": "nsp-store",
        "format_version": store_lib.FORMAT_VERSION,
        "store_id": store.store_id,
        "tier": store.tier,
        "page_bytes": store.page_bytes,
        "checksum": store.checksum,
        "shard_paths": [str(p) for p in store.shard_paths],
        "layout": store.layout.to_json(),
        "optimizer": dataclasses.asdict(store.optimizer),
    }


def _zarr_spec(path: Path, shard_size: int, page_elems: int, checksum: bool, state: str, slot: int) -> dict:
    """The zarr v3 array a store slot holds (the same as ``StateStore._create_arrays``)."""
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if checksum:
        codecs.append({"name": "crc32c"})
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
        "context": {"file_io_sync": False},  # made durable below, once, with fsync
        "metadata": {
            "shape": [shard_size],
            "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [page_elems]}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": codecs,
            "fill_value": 0.0,
            "attributes": {"nsp": {"state": state, "slot": slot}},
        },
    }


def _prepare_empty_dir(path: Path, what: str) -> bool:
    """Creates ``path`` (parents too) or accepts an existing empty directory; returns whether it existed."""
    if path.exists():
        if not path.is_dir():
            raise StoreError(f"{what} {path} exists and is not a directory")
        if any(path.iterdir()):
            raise StoreError(f"{what} {path} is not empty")
        return True
    try:
        path.mkdir(parents=True)
    except OSError as e:
        raise StoreError(f"cannot create {what} {path}: {e.strerror}") from None
    return False


def _clear_dir(path: Path, existed: bool) -> None:
    """Removes what a failed snapshot/restore put under ``path`` (and ``path`` itself if we made it)."""
    if not path.exists():
        return
    if existed:
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


# ---- snapshots -----------------------------------------------------------------------------------------------


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
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if getattr(store, "_closed", False):
        raise StoreError("cannot snapshot a closed store")
    # store.version waits for the steps already dispatched (and background ones): their updates land first.
    if not store.initialized or store.version is None:
        raise StoreError("the store holds no state yet: nothing to snapshot")
    dest = Path(dest).absolute()
    existed = _prepare_empty_dir(dest, "snapshot directory")
    try:
        if store.tier == "memory":
            files, placer_info = _snapshot_memory(store, dest)
        else:
            files, placer_info = _snapshot_files(store, dest, mode)
        info = _finish_snapshot(store, dest, files, placer_info)
    except BaseException:
        _clear_dir(dest, existed)
        raise
    info["seconds"] = time.perf_counter() - t0
    if info.get("fallback_reason"):
        warnings.warn(f"snapshot {dest}: {info['fallback_reason']}", stacklevel=2)
    return info


def _snapshot_files(store: StateStore, dest: Path, mode: str) -> tuple[list[dict], dict]:
    version = store.version
    slot = version % 2
    used = store.optimizer.states_used()
    for shard in store.shard_paths:
        held = _read_json(shard / MANIFEST, "shard manifest").get("version")
        # A shard may have committed one version ahead of the others (a failed multi-shard update); its slot
        # `version % 2` still holds `version` whole. Anything else means someone else wrote this store.
        if held not in (version, version + 1):
            raise StoreError(f"shard {shard} is at version {held}, the open store at {version}: the store was "
                             "changed behind this process's back; reopen it")
    placer = _Placer(mode)
    files: list[dict] = []
    made_dirs: list[Path] = [dest / "shards"]
    for i, shard in enumerate(store.shard_paths):
        shard_dest = dest / "shards" / f"{i:05d}"
        made_dirs.append(shard_dest)
        for state, is_used in zip(STATES, used):
            if not is_used:
                continue
            src = shard / f"slot{slot}" / state
            dst = shard_dest / state
            (dst / "c").mkdir(parents=True)
            made_dirs += [dst, dst / "c"]
            shutil.copyfile(src / "zarr.json", dst / "zarr.json")  # tiny; copied so nothing can share it
            files.append({"path": str((dst / "zarr.json").relative_to(dest)),
                          "bytes": (dst / "zarr.json").stat().st_size})
            for name, size in _page_files(src):
                placer.place(src / "c" / name, dst / "c" / name, size)
                files.append({"path": f"{dst.relative_to(dest)}/c/{name}", "bytes": size})
        # What each page must hold (the manifest's checksums of this version's slot): restore hands them to the
        # restored store, so a page swapped inside the snapshot is still found.
        tables = _read_json(shard / MANIFEST, "shard manifest").get("checksums", {}).get(str(slot), {})
        _atomic_write_json(shard_dest / CHECKSUMS, {"version": version, "checksums": tables})
        files.append({"path": str((shard_dest / CHECKSUMS).relative_to(dest)),
                      "bytes": (shard_dest / CHECKSUMS).stat().st_size})
    shutil.copyfile(store.root / METADATA, dest / METADATA)
    # Durability, once everything is in place (one journal commit covers most of it): the copied files' data,
    # then the new directory entries. Linked pages point at data the store synced when it committed them.
    for f in files:
        if placer.copied or placer.reflinked or f["path"].endswith("zarr.json"):
            _fsync_file(dest / f["path"])
    _fsync_file(dest / METADATA)
    for d in reversed(made_dirs):
        _fsync_dir(d)
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
        flat = store.read(state, version)
        for i in range(store.num_shards):
            path = dest / "shards" / f"{i:05d}" / state
            spec = _zarr_spec(path, size, layout.page_elems, store.checksum, state, version % 2)
            arr = ts.open(spec, create=True).result()
            arr.write(flat[i * size:(i + 1) * size]).result()
            for name, fsize in [("zarr.json", (path / "zarr.json").stat().st_size)] + [
                    (f"c/{n}", s) for n, s in _page_files(path)]:
                _fsync_file(path / name)
                files.append({"path": str((path / name).relative_to(dest)), "bytes": fsize})
                nbytes += fsize
            if (path / "c").exists():
                _fsync_dir(path / "c")
            _fsync_dir(path)
        del flat
    for i in range(store.num_shards):
        _fsync_dir(dest / "shards" / f"{i:05d}")
    _fsync_dir(dest / "shards")
    _atomic_write_json(dest / METADATA, _store_metadata(store))
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
        **placer_info,
        "num_files": len(files),
        "total_bytes": sum(f["bytes"] for f in files),
        "files": files,
    }
    _fsync_dir(dest)
    _debug_kill_point("NSP_DEBUG_KILL_AT_SNAPSHOT")
    _atomic_write_json(dest / SNAPSHOT, record)  # last: its presence is what makes the snapshot valid
    info = {k: v for k, v in record.items() if k != "files"}
    info["path"] = str(dest)
    return info


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
    info = _read_json(snap / SNAPSHOT, "snapshot description")
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


def _snapshot_array(snap: Path, shard: int, state: str) -> ts.TensorStore:
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                    "path": str(snap / "shards" / f"{shard:05d}" / state)}},
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
        out[i * size:(i + 1) * size] = _snapshot_array(snap, i, state).read().result()
    return out


# ---- restore -------------------------------------------------------------------------------------------------


def _check_not_locked(root: Path) -> None:
    lock = root / "LOCK"
    if not lock.exists():
        return
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise StoreError(f"store {root} is open for writing ({lock.read_text().strip() or 'another process'}); "
                         "close it before overwriting it") from None
    finally:
        os.close(fd)  # drops the lock again


def _inside(path: Path, parent: Path) -> bool:
    try:
        path.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


def _remove_existing_store(root: Path, snap: Path, overwrite: bool) -> None:
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
            shards = [root / p for p in _read_json(root / METADATA, "store metadata").get("shard_paths", [])]
        except StoreError:
            shards = []
    if is_partial:
        try:
            shards += [Path(p) for p in json.loads((root / RESTORING).read_text()).get("shard_paths", [])]
        except (OSError, json.JSONDecodeError):
            pass
    for victim in [root, *shards]:
        if _inside(snap, victim):
            raise StoreError(f"the snapshot {snap} lies inside {victim}, which overwriting would delete")
    _check_not_locked(root)
    for shard in shards:
        if shard.exists() and not _inside(shard, root):
            _check_not_locked(shard)
            owner = _shard_owner_root(shard)
            if owner not in (None, str(root)):
                raise StoreError(f"{root} names shard {shard}, which belongs to the store at {owner}: refusing "
                                 "to delete it")
            shutil.rmtree(shard)
    shutil.rmtree(root)


def _trailer_checksums(array_dir: Path) -> list[int]:
    """The CRC-32C trailer (the zarr crc32c codec's last 4 bytes, little-endian) of each page file, in page order."""
    crcs = []
    for name, size in _page_files(array_dir):
        with open(array_dir / "c" / name, "rb") as f:
            f.seek(size - 4)
            crcs.append(int.from_bytes(f.read(4), "little"))
    return crcs


def _shard_owner_root(shard: Path) -> str | None:
    try:
        owner = _read_json(shard / SHARD_ID, "shard identity")
    except StoreError:
        return None
    return owner.get("root") if isinstance(owner, dict) else None


def _other_slot_metadata(zarr_json: dict, slot: int) -> dict:
    meta = json.loads(json.dumps(zarr_json))
    meta.setdefault("attributes", {}).setdefault("nsp", {})["slot"] = slot
    return meta


def restore_store(
    snapshot_dir: str | os.PathLike,
    store_path: str | os.PathLike | None = None,
    *,
    tier: str = "file",
    shard_paths: list[str | os.PathLike] | None = None,
    overwrite: bool = False,
    mode: str = "auto",
    pages_in_flight: int = PAGES_IN_FLIGHT_DEFAULT,
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

    Returns:
      The open ``StateStore`` at the snapshot's version. Note: only that version is restored; the slot of the
      version before it is empty, so do not replay the step before the snapshot on the restored store.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if tier not in store_lib.TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {store_lib.TIERS}")
    info = load_snapshot_info(snapshot_dir)
    snap = Path(info["path"])
    meta = _read_json(snap / METADATA, "snapshot store metadata")
    if tier == "memory":
        if store_path is not None or shard_paths:
            raise ValueError("the memory tier keeps its state in RAM: pass no store_path or shard_paths")
        return _restore_memory(snap, info, meta, pages_in_flight)
    if store_path is None:
        raise ValueError(f"the {tier} tier needs a store_path")
    root = Path(store_path).absolute()
    if not root.parent.exists():
        raise StoreError(f"cannot create store {root}: directory {root.parent} does not exist")
    if _inside(root, snap):
        raise StoreError(f"cannot restore into {root}: it lies inside the snapshot {snap}")
    n = info["layout"]["num_shards"]
    _remove_existing_store(root, snap, overwrite)
    if shard_paths is not None:
        if len(shard_paths) != n:
            raise ValueError(f"got {len(shard_paths)} shard_paths for a snapshot of {n} shards")
        shards = [Path(p).absolute() for p in shard_paths]
    else:
        shards = [root / "shards" / f"{i:05d}" for i in range(n)]
    root_existed = root.exists()
    root.mkdir(exist_ok=True)
    # While this marker exists the directory is an unfinished restore (nsp.storage.open would see no store:
    # the metadata is written last) and restore_store(..., overwrite=True) may clear it.
    _atomic_write_json(root / RESTORING, {"snapshot": str(snap), "shard_paths": [str(s) for s in shards]})
    made_shards: list[tuple[Path, bool]] = []
    try:
        for shard in shards:
            made_shards.append((shard, _prepare_empty_dir(shard, "shard directory")))
        version = int(info["version"])
        slot = version % 2
        store_id = uuid.uuid4().hex
        placer = _Placer(mode)
        for i, shard in enumerate(shards):
            for state in info["states"]:
                src = snap / "shards" / f"{i:05d}" / state
                zarr_json = _read_json(src / "zarr.json", "snapshot array metadata")
                dst = shard / f"slot{slot}" / state
                (dst / "c").mkdir(parents=True)
                shutil.copyfile(src / "zarr.json", dst / "zarr.json")
                for name, size in _page_files(src):
                    placer.place(src / "c" / name, dst / "c" / name, size)
                if placer.copied or placer.reflinked:
                    for name, _ in _page_files(dst):
                        _fsync_file(dst / "c" / name)
                other = shard / f"slot{1 - slot}" / state
                (other / "c").mkdir(parents=True)
                _atomic_write_json(other / "zarr.json", _other_slot_metadata(zarr_json, 1 - slot))
                for d in (dst / "c", dst, other / "c", other, dst.parent, other.parent):
                    _fsync_dir(d)
            recorded = snap / "shards" / f"{i:05d}" / CHECKSUMS
            if recorded.exists():
                tables = _read_json(recorded, "snapshot page checksums")["checksums"]
            elif meta.get("checksum"):
                # A snapshot that records none (the memory tier's, written by tensorstore): each page's own
                # trailer is what it must hold from now on.
                tables = {"version": version,
                          **{state: _trailer_checksums(shard / f"slot{slot}" / state) for state in info["states"]}}
            else:
                tables = {}
            _atomic_write_json(shard / SHARD_ID, {"store": store_id, "shard": i, "root": str(root)})
            _atomic_write_json(shard / MANIFEST, {"store": store_id, "shard": i, "version": version,
                                                  "checksums": {str(slot): tables} if tables else {}})
        # A restored store is a new store: its own identity, its shards recorded relative to it where they can be.
        meta = dict(meta, tier=tier, store_id=store_id, shard_paths=[_recorded_path(s, root) for s in shards])
        _atomic_write_json(root / METADATA, meta)  # last: from here on it is a store
        (root / RESTORING).unlink()
        _fsync_dir(root)
    except BaseException:
        for shard, existed in made_shards:
            _clear_dir(shard, existed)
        _clear_dir(root, root_existed)
        raise
    store = store_lib.open(root, tier=tier, num_shards=n, page_bytes=int(meta["page_bytes"]),
                           pages_in_flight=pages_in_flight)
    if store.version != version:
        store.close()
        raise StoreError(f"restored store {root} opened at version {store.version}, expected {version}")
    store.restore_info = {"snapshot": str(snap), "version": version, **placer.info()}
    return store


def _restore_memory(snap: Path, info: dict, meta: dict, pages_in_flight: int) -> StateStore:
    version = int(info["version"])
    n = info["layout"]["num_shards"]
    store = store_lib.open(None, tier="memory", num_shards=n, page_bytes=int(meta["page_bytes"]),
                           pages_in_flight=pages_in_flight, checksum=bool(meta["checksum"]))
    try:
        # No public StateStore call loads a given version's state: set it up as _open_existing does for files.
        store.layout = Layout.from_json(meta["layout"])
        store.optimizer = OptimizerSpec(**meta["optimizer"])
        store._make_engines(create=False, version=version)
        for i, engine in enumerate(store._engines):
            for state in info["states"]:
                arr = np.ascontiguousarray(_snapshot_array(snap, i, state).read().result(), np.float32)
                engine.write_state(version % 2, STATES.index(state), arr)
    except BaseException:
        store.close()
        raise
    store.restore_info = {"snapshot": str(snap), "version": version, "method": "tensorstore"}
    return store


# ---- orbax -----------------------------------------------------------------------------------------------------


class StoreCheckpointHandler(ocp.CheckpointHandler):
    """orbax handler for a ``StateStore`` item: ``save`` snapshots the store into the item directory (hard
    links), ``restore`` rebuilds a store from it. Saving is synchronous: when ``CheckpointManager.save`` returns,
    the snapshot is complete and the store may be updated again."""

    def __init__(self):
        self.last_info: dict | None = None

    def save(self, directory, args: StoreSave) -> None:
        self.last_info = snapshot_store(args.store, Path(str(directory)), mode=args.mode)

    def restore(self, directory, args: StoreRestore | None = None) -> StateStore:
        if args is None:
            raise StoreError("restoring a store item needs StoreRestore(store_path=...): where to rebuild it")
        return restore_store(Path(str(directory)), args.store_path, tier=args.tier, shard_paths=args.shard_paths,
                             overwrite=args.overwrite, mode=args.mode, pages_in_flight=args.pages_in_flight)

    def metadata(self, directory) -> dict | None:
        try:
            info = load_snapshot_info(Path(str(directory)), check_files=False)
        except StoreError:
            return None
        info.pop("files", None)
        return info


@ocp.args.register_with_handler(StoreCheckpointHandler, for_save=True)
@dataclasses.dataclass
class StoreSave(ocp.args.CheckpointArgs):
    """Save args of a store item: the open store, and ``mode`` (see ``snapshot_store``)."""

    store: StateStore
    mode: str = "auto"


@ocp.args.register_with_handler(StoreCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class StoreRestore(ocp.args.CheckpointArgs):
    """Restore args of a store item (see ``restore_store``)."""

    store_path: str | os.PathLike | None
    tier: str = "file"
    shard_paths: list[str | os.PathLike] | None = None
    overwrite: bool = False
    mode: str = "auto"
    pages_in_flight: int = PAGES_IN_FLIGHT_DEFAULT


def make_checkpoint_manager(directory: str | os.PathLike, max_to_keep: int | None = 3, *,
                            enable_async_checkpointing: bool = True, **options: Any) -> ocp.CheckpointManager:
    """An ``ocp.CheckpointManager`` with items ``store`` (tier snapshot), ``train_state`` (pytree), ``meta``
    (JSON). Put ``directory`` on the store's file system, or pages get copied instead of linked. Extra keyword
    arguments go to ``ocp.CheckpointManagerOptions``."""
    directory = Path(directory).absolute()
    opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                        enable_async_checkpointing=enable_async_checkpointing, **options)
    return ocp.CheckpointManager(directory, options=opts, item_names=ITEM_NAMES)


def save_checkpoint(manager: ocp.CheckpointManager, step: int, store: StateStore, train_state: Any = None,
                    meta: dict | None = None, *, wait: bool = True) -> dict:
    """Saves a checkpoint of ``store`` (its committed version), ``train_state`` and ``meta`` at ``step``.

    The store snapshot is complete when this returns, whatever ``wait``; the train state is written
    asynchronously by orbax and ``wait=True`` (default) waits for it and for the step's finalisation. With
    ``wait=False`` call ``manager.wait_until_finished()`` before reading the checkpoint back.

    Returns ``{"step", "saved", "version", "snapshot": info}`` (``info`` as from ``snapshot_store``, with the
    ``method`` used: links unless the manager's directory is on another file system).
    """
    items = {"store": StoreSave(store)}
    if train_state is not None:
        items["train_state"] = ocp.args.StandardSave(train_state)
    if meta is not None:
        items["meta"] = ocp.args.JsonSave(meta)
    version = store.version
    saved = manager.save(step, args=ocp.args.Composite(**items))
    if wait:
        manager.wait_until_finished()
    out = {"step": step, "saved": bool(saved), "version": version, "snapshot": None}
    if saved:
        snap = Path(str(manager.directory)) / str(step) / "store"
        if (snap / SNAPSHOT).exists():
            info = load_snapshot_info(snap, check_files=False)
            info.pop("files", None)
            out["snapshot"] = info
    return out


def restore_checkpoint(manager: ocp.CheckpointManager, step: int | None, store_path: str | os.PathLike | None,
                       train_state_template: Any = None, *, tier: str = "file",
                       shard_paths: list[str | os.PathLike] | None = None, overwrite: bool = False,
                       mode: str = "auto",
                       pages_in_flight: int = PAGES_IN_FLIGHT_DEFAULT) -> tuple[StateStore, Any, dict | None]:
    """Restores ``(store, train_state, meta)`` of ``step`` (``None``: the latest). The store is rebuilt at
    ``store_path`` (see ``restore_store``); ``train_state`` follows ``train_state_template`` (arrays or
    ``jax.ShapeDtypeStruct`` leaves; ``None`` restores what was saved as is). Missing items come back as None."""
    if step is None:
        step = manager.latest_step()
        if step is None:
            raise StoreError(f"no checkpoint in {manager.directory}")
    if step not in manager.all_steps():
        raise StoreError(f"no checkpoint for step {step} in {manager.directory} (steps: {manager.all_steps()})")
    step_dir = Path(str(manager.directory)) / str(step)
    # The small items first: if the template does not match, nothing has been written at store_path yet.
    items = {}
    if (step_dir / "train_state").exists():
        items["train_state"] = ocp.args.StandardRestore(train_state_template)
    if (step_dir / "meta").exists():
        items["meta"] = ocp.args.JsonRestore()
    small = manager.restore(step, args=ocp.args.Composite(**items)) if items else {}
    store_args = StoreRestore(store_path, tier=tier, shard_paths=shard_paths, overwrite=overwrite, mode=mode,
                              pages_in_flight=pages_in_flight)
    store = manager.restore(step, args=ocp.args.Composite(store=store_args))["store"]
    return store, small.get("train_state"), small.get("meta")


def load_train_state(step_dir: str | os.PathLike) -> Any:
    """The train state saved with a checkpoint step, as plain nested dicts of arrays on this process's first
    device — whatever mesh it was saved from (for sampling, export or inspection on another machine)."""
    import jax

    path = Path(step_dir).absolute() / "train_state"  # orbax takes absolute paths only
    if not path.is_dir():
        raise StoreError(f"{step_dir} holds no train state")
    # The item's own metadata (the step directory, not the item's, holds the checkpoint-level metadata file).
    metadata = ocp.StandardCheckpointHandler().metadata(path)
    tree = getattr(metadata, "item_metadata", metadata)
    checkpointer = ocp.StandardCheckpointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    return checkpointer.restore(path, target)


# ---- export --------------------------------------------------------------------------------------------------

_KEY_TOKEN = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+)\]|\.([A-Za-z_]\w*)")


def _path_keys(path: str) -> list[str]:
    """``"['dense']['kernel']"`` → ``["dense", "kernel"]`` (jax keystr paths; indices become strings)."""
    keys, pos = [], 0
    while pos < len(path):
        m = _KEY_TOKEN.match(path, pos)
        if m is None:
            return [path]  # not a path we can split: keep it whole as one key
        keys.append(str(ast.literal_eval(m.group(1))) if m.group(1) is not None else m.group(2))
        pos = m.end()
    return keys or [path]


def _nest(layout: Layout, flat: np.ndarray) -> dict:
    tree: dict = {}
    for leaf in layout.leaves:
        node = tree
        keys = _path_keys(leaf.path)
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = np.ascontiguousarray(flat[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape))
    return tree


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike) -> dict:
    """Writes a checkpoint that plain orbax reads, without nsp.

    ``checkpoint_dir`` is a checkpoint step directory (``.../<step>`` with a ``store`` item) or a snapshot.
    ``out_dir`` (must not exist) gets::

      out_dir/params/      orbax StandardCheckpointer pytree: fp32 master params, original shapes, nested dicts
                           keyed by the parameter paths (sequence indices become string keys "0", "1", ...)
      out_dir/opt_state/   orbax StandardCheckpointer pytree {"mu": tree, "nu": tree} (the moments the
                           optimizer keeps; absent for plain SGD)
      out_dir/train_state/ the step's train_state item (hard links/copies of orbax's own files), if any
      out_dir/export.json  version, optimizer, leaves (path, shape, original dtype), the step's meta

    Restore with ``ocp.StandardCheckpointer().restore(out_dir / "params")``.
    """
    src = Path(checkpoint_dir).absolute()
    out = Path(out_dir).absolute()
    if out.exists():
        raise StoreError(f"export directory {out} already exists")
    if not out.parent.exists():
        raise StoreError(f"cannot create {out}: directory {out.parent} does not exist")
    snap = src / "store" if (src / "store" / SNAPSHOT).exists() or (src / "store").is_dir() else src
    info = load_snapshot_info(snap)
    meta = _read_json(snap / METADATA, "snapshot store metadata")
    layout = Layout.from_json(meta["layout"])
    out.mkdir()
    try:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(out / "params", _nest(layout, read_snapshot(snap, "param")))
        moments = {s: _nest(layout, read_snapshot(snap, s)) for s in ("mu", "nu") if s in info["states"]}
        if moments:
            ckptr.save(out / "opt_state", moments)
        ckptr.wait_until_finished()
        ckptr.close()
        step_meta = None
        if snap != src:
            if (src / "train_state").is_dir():
                shutil.copytree(src / "train_state", out / "train_state", copy_function=_link_or_copy)
            if (src / "meta").is_dir():
                try:
                    step_meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(src / "meta")
                except Exception:  # noqa: BLE001  (a meta item orbax cannot read is left out, not fatal)
                    step_meta = None
        record = {
            "format": "nsp-export",
            "version": info["version"],
            "optimizer": meta["optimizer"],
            "leaves": [{"path": leaf.path, "keys": _path_keys(leaf.path), "shape": list(leaf.shape),
                        "dtype": leaf.dtype} for leaf in layout.leaves],
            "params": "params", "opt_state": "opt_state" if moments else None,
            "meta": step_meta,
        }
        _atomic_write_json(out / "export.json", record)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return record


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst
