"""A store's identity on purpose: copy a store under a new identity, or re-identify one that was copied or moved.

Every shard names its store (``SHARD.json``) and every manifest names it too, so a store opens only its own
shards. ``copy_store`` makes an independent store (its own id, every shard inside it); ``reidentify`` gives a
store directory a new id after a plain ``cp -a``, or makes a moved store the owner of its shards outside it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from nsp.storage.format import (LOCK, MANIFEST, METADATA, RESTARTS, SHARD_ID, StoreError, atomic_write_json,
                                fsync_file, inside, lock_store, read_json, release_locks, shard_dir, write_shard_id)
from nsp.storage.metadata import check_metadata
from nsp.storage.opening import open as open_store


def copy_store(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copies the store at ``src`` (its committed state, and shards kept outside it) into the new directory
    ``dst``, under a new identity, every shard inside ``dst``. ``src`` is opened (locked) while it is copied.

    Returns the new store's directory. ``nsp store copy SRC DST`` does the same.
    """
    dst = Path(dst).absolute()
    if dst.exists() and any(dst.iterdir()):
        raise StoreError(f"cannot copy into {dst}: it exists and is not empty")
    with open_store(src) as store:
        store.barrier()
        store_id = uuid.uuid4().hex
        dst.mkdir(parents=True, exist_ok=True)
        try:
            shards = []
            for i, shard in enumerate(store.shard_paths):
                target = shard_dir(dst, i)
                shutil.copytree(shard, target, ignore=shutil.ignore_patterns(LOCK, SHARD_ID, "*.tmp", "*.nsp-tmp"))
                _rename_identity(target, store_id, i, dst)
                shards.append(target)
            if (store.root / RESTARTS).exists():  # where each optimizer run began (StateStore.base_version)
                shutil.copy2(store.root / RESTARTS, dst / RESTARTS)
            for path in dst.rglob("*"):
                if path.is_file():
                    fsync_file(path)
            meta = read_json(store.root / METADATA, "store metadata")
            meta.update(store_id=store_id, shard_paths=[str(s.relative_to(dst)) for s in shards])
            atomic_write_json(dst / METADATA, meta)  # last: from here on it is a store
        except BaseException:
            shutil.rmtree(dst, ignore_errors=True)
            raise
    return dst


def reidentify(path: str | os.PathLike) -> str:
    """Gives the store at ``path`` a new identity and makes it the owner of all its shards; returns the new id.

    For a store copied with ``cp -a`` (the copy and the original then share an id) or moved with shards kept
    outside it. A shard outside the store that another existing store directory still names is refused: that is
    a copy sharing the original's shard, and ``copy_store`` is the way to copy it.
    """
    root = Path(path).absolute()
    meta = check_metadata(read_json(root / METADATA, "store metadata"), str(root / METADATA))
    shards = [root / p for p in meta["shard_paths"]]
    for shard in shards:
        owner = read_json(shard / SHARD_ID, "shard identity")
        if owner.get("store") != meta["store_id"]:
            raise StoreError(f"shard {shard} belongs to store {owner.get('store')} at {owner.get('root')}, not to "
                             f"{root} ({meta['store_id']}): refusing to take it")
        old_root = Path(str(owner.get("root")))
        if old_root != root and not inside(shard, root) and (old_root / METADATA).exists():
            raise StoreError(f"shard {shard} is still named by the store at {old_root}: {root} is a copy that "
                             f"shares it; copy stores with `nsp store copy`")
    store_id = uuid.uuid4().hex
    locks = lock_store(root, shards)  # no writer may hold it meanwhile
    try:
        for i, shard in enumerate(shards):
            _rename_identity(shard, store_id, i, root)
        atomic_write_json(root / METADATA, dict(meta, layout=meta["layout"].to_json(), store_id=store_id))
    finally:
        release_locks(locks)
    return store_id


def _rename_identity(shard: Path, store_id: str, index: int, root: Path) -> None:
    write_shard_id(shard, store_id, index, root)
    manifest = shard / MANIFEST
    if manifest.exists():
        data = read_json(manifest, "shard manifest")
        atomic_write_json(manifest, dict(data, store=store_id, shard=index))
