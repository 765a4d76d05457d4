"""A store's on-disk format, in one place: the store, its snapshots, restores and identity changes all write it.

A ``file``-tier store is a directory of JSON descriptions and zarr v3 arrays that plain ``tensorstore.open``
reads: one chunk per page, raw little-endian fp32 plus a CRC-32C trailer::

    ROOT/nsp_store.json                   store id, layout, optimizer, tier, backend, shard paths (written once,
                                          atomically)
    ROOT/LOCK, SHARD/LOCK                 held by the single writer (every shard is locked, wherever it lives)
    SHARD/SHARD.json                      {"store": id, "shard": i, "root": ROOT}: whose shard this is
    SHARD/MANIFEST.json                   {"store", "shard", "version": t, "checksums": each page's CRC-32C per slot}
    SHARD/slot{0,1}/{param,mu,nu}/        zarr v3 arrays (zarr.json + c/<page>); a one-slot store (metadata
                                          "slots": 1) has slot0 only, and while an update runs, its new pages
                                          beside the old (c/<page>.next) and SHARD/redo.journal

The ``csd`` tier, and any backend library a ``file`` or ``csd`` store names, keeps exactly these files too: its
devices read and write the page files of their shard's directory.

SHARD is ``ROOT/shards/00000`` (recorded relative to ROOT, so a copied or moved store opens its own shards) or a
directory given as ``shard_paths[i]`` outside ROOT (recorded absolute). The C++ engine writes the pages and, on
every commit, the manifest, in the same format. What is read back from disk is checked in ``metadata.py``.

Every JSON file is replaced atomically (``atomic_write_json``), so a crash leaves the old file or the new one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any

from nsp.spec import STATES

FORMAT_VERSION = 2
METADATA = "nsp_store.json"
#: The versions at which the optimizer was started afresh on the store (``StateStore.restart``).
RESTARTS = "restarts.json"
MANIFEST = "MANIFEST.json"
SHARD_ID = "SHARD.json"
LOCK = "LOCK"
TIERS = ("memory", "file", "csd")
# The backend each tier runs unless the store names another (a backend library, libnsp_backend_<name>.so: see
# docs/backends.md). memory and file are built in; csd is the emulated device shipped in nsp/backends/.
TIER_BACKENDS = {"memory": "memory", "file": "file", "csd": "csd"}


class StoreError(RuntimeError):
    """A store cannot do what was asked (wrong layout, missing version, locked, corrupt...)."""


# ---- durable files -----------------------------------------------------------------------------------------------


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, data: dict) -> None:
    """Write-to-temp, fsync, rename, fsync the directory: readers see the old or the new file, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_json(path: Path, what: str) -> Any:
    """The parsed file; a missing or unparsable one is a ``StoreError`` naming ``what`` it should have been."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise StoreError(f"{what} {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{what} {path} is corrupt or truncated ({e})") from None


# ---- paths -------------------------------------------------------------------------------------------------------


def shard_dir(root: Path, index: int) -> Path:
    """Where shard ``index`` lives by default (a store's, and a snapshot's copy of it)."""
    return root / "shards" / f"{index:05d}"


def array_dir(shard: Path, slot: int, state: str) -> Path:
    """The zarr array of one state in one version slot of a shard."""
    return shard / f"slot{slot}" / state


def inside(path: Path, root: Path) -> bool:
    """Whether ``path`` is ``root`` or lies under it, by name (no symlink is followed)."""
    return path == root or root in path.parents


def recorded_path(shard: Path, root: Path) -> str:
    """How nsp_store.json records a shard: relative to the root when it lives under it (so a copied or moved store
    opens its own shards), absolute otherwise (a directory the user placed on purpose)."""
    return str(shard.relative_to(root)) if inside(shard, root) else str(shard)


# ---- the JSON files ----------------------------------------------------------------------------------------------


def store_metadata(*, store_id: str, tier: str, page_bytes: int, checksum: bool, shard_paths: list[str],
                   layout: dict, optimizer: dict, backend: str | None = None, slots: int = 2) -> dict:
    """The content of ``nsp_store.json`` (``layout``: ``Layout.to_json()``, ``optimizer``: the spec's fields;
    ``backend``: what runs its shards, by default the tier's own, ``TIER_BACKENDS``; ``slots``: version slots,
    recorded only for a one-slot store, so a two-slot store's file is what it always was)."""
    extra = {"slots": 1} if slots == 1 else {}
    return {
        "format": "nsp-store",
        "format_version": FORMAT_VERSION,
        "store_id": store_id,
        "tier": tier,
        "backend": backend or TIER_BACKENDS[tier],
        "page_bytes": page_bytes,
        "checksum": checksum,
        "shard_paths": shard_paths,
        "layout": layout,
        "optimizer": optimizer,
        **extra,
    }


def store_slots(meta: dict) -> int:
    """The version slots a store (or a snapshot of one) keeps, from its metadata: 2 unless it records 1."""
    return int(meta.get("slots", 2))


def slot_of(slots: int, version: int) -> int:
    """The slot that holds ``version``: ``version % 2`` with two slots; slot 0 always with one (a one-slot
    store's updates switch each page in over the old one, ``ffi/engine/redo_journal.h``)."""
    return 0 if slots == 1 else version % 2


def store_backend(tier: str, recorded: str | None) -> str:
    """The backend a store of ``tier`` runs, given the one its metadata records (None: none recorded, as in stores
    written before backends were recorded). A tier's own backend (``TIER_BACKENDS``) runs only that tier, so it
    follows the tier: a restore into another tier keeps the snapshot's metadata but changes its tier. Any other
    name (a backend library) stays."""
    if recorded is None or recorded in TIER_BACKENDS.values():
        return TIER_BACKENDS[tier]
    return recorded


def backend_options_string(options: dict | None) -> str:
    """``{"key": value}`` as the ``key=value;key=value`` string a backend library is opened with.

    Raises:
      ValueError: a key that is empty or holds ``=``, ``;`` or whitespace, or a value that holds ``;``.
    """
    items = []
    for key, value in (options or {}).items():
        key, text = str(key), str(value)
        if not key or any(c in key for c in "=; \t\n"):
            raise ValueError(f"backend option name {key!r} must be non-empty with no '=', ';' or whitespace")
        if ";" in text or "\n" in text:
            raise ValueError(f"backend option {key}={text!r}: a value must not hold ';' or a newline")
        items.append(f"{key}={text}")
    return ";".join(items)


def write_shard_id(shard: Path, store_id: str, index: int, root: Path) -> None:
    atomic_write_json(shard / SHARD_ID, {"store": store_id, "shard": index, "root": str(root)})


def write_manifest(shard: Path, store_id: str, index: int, version: int, checksums: dict) -> None:
    """A shard's manifest, as the engine writes it on commit (``checksums``: ``{"slot": {"version": held,
    state: [crc per page]}}``)."""
    atomic_write_json(shard / MANIFEST, {"store": store_id, "shard": index, "version": version,
                                         "checksums": checksums})


# ---- zarr arrays -------------------------------------------------------------------------------------------------


def zarr_spec(path: Path, shard_size: int, page_elems: int, checksum: bool, state: str, slot: int, *,
              sync: bool = True) -> dict:
    """The tensorstore spec of a slot's state array: one chunk per page, a CRC-32C trailer when ``checksum``.
    ``sync=False`` leaves durability to the caller (who fsyncs once, after writing everything)."""
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if checksum:
        codecs.append({"name": "crc32c"})
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
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
    if not sync:
        spec["context"] = {"file_io_sync": False}
    return spec


def page_files(array: Path) -> list[tuple[str, int]]:
    """(name, bytes) of the page files of a zarr array (``c/<page>``), in page order; temporaries skipped."""
    try:
        entries = [(e.name, e.stat().st_size) for e in os.scandir(array / "c") if e.name.isdigit() and e.is_file()]
    except FileNotFoundError:
        return []
    return sorted(entries, key=lambda x: int(x[0]))


def trailer_checksums(array: Path) -> list[int]:
    """The CRC-32C trailer (the zarr crc32c codec's last 4 bytes, little-endian) of each page file, in page order."""
    crcs = []
    for name, size in page_files(array):
        with open(array / "c" / name, "rb") as f:
            f.seek(size - 4)
            crcs.append(int.from_bytes(f.read(4), "little"))
    return crcs


# ---- the writer lock ---------------------------------------------------------------------------------------------


def lock_store(root: Path, shards: list[Path]) -> list[int]:
    """Locks the store and every shard it will write, wherever the shard lives: a second writer on any of them is
    refused, whichever store directory it came through. Returns the descriptors (closing one drops its lock);
    on failure none is left held."""
    fds: list[int] = []
    try:
        for directory in [root, *shards]:
            what = f"store {root}" if directory == root else f"shard {directory} (of store {root})"
            fds.append(_lock(directory / LOCK, what))
    except BaseException:
        release_locks(fds)
        raise
    return fds


def release_locks(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)  # closing the descriptor drops the flock


def _lock(path: Path, what: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StoreError(f"cannot open the writer lock {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            holder = path.read_text().strip() or "another process"
            raise StoreError(f"{what} is already open for writing by {holder}") from None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}".encode())
    return fd


def lock_holder(directory: Path) -> str | None:
    """Who holds ``directory``'s writer lock (what its LOCK file says), or None when nobody does. The probe takes
    the lock and drops it at once."""
    lock = directory / LOCK
    if not lock.exists():
        return None
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return lock.read_text().strip() or "another process"
    finally:
        os.close(fd)  # drops the lock again
    return None
