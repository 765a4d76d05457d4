"""orbax glue: a store as one item of an ``ocp.CheckpointManager`` step, beside a train state and JSON metadata.

``StoreCheckpointHandler`` with ``StoreSave`` / ``StoreRestore`` args saves the ``store`` item by snapshot
(``snapshot.py``: hard links into the step directory) and restores it by ``restore.py``. Keep-N deletes old step
directories, i.e. only their links; the live store's files are untouched. ``make_checkpoint_manager``,
``save_checkpoint`` and ``restore_checkpoint`` put the three items together.

In a multi-process run (``nsp.distributed``) every process saves the shards it holds into its own part of the
item, ``store/process-NNNNN``, and orbax ties the parts into one step: it finalises the step only once every
process has saved, and writes the small items (train state, meta) from the primary process, as it does for any
multi-process checkpoint. Each process restores its own part; with ``StoreRestore(num_shards=...)`` a step written
on another layout (shard or process count) is resharded instead (``reshard.py``).

``make_checkpoint_manager(..., local=True)`` is the same step kept by each process alone, for hosts that share no
file system (``nsp train --ckpt-local``): the manager runs over this process only (orbax's ``active_processes``,
this process its primary host), so it writes the meta and its own replica of the (replicated) train state itself,
beside its part of the store, and finalises the step without waiting for the others. Which step every process
holds is then the caller's to agree on (``nsp.train.ckpt_local``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from nsp.storage.format import StoreError
from nsp.storage.layout import PAGES_IN_FLIGHT_DEFAULT
from nsp.storage.reshard import restore_resharded
from nsp.storage.restore import restore_store, snapshot_shards
from nsp.storage.snapshot import SNAPSHOT, load_snapshot_info, snapshot_store
from nsp.storage.store import StateStore

ITEM_NAMES = ("store", "train_state", "meta")


def _not_ocdbt_merge_notice(record: logging.LogRecord) -> bool:
    # orbax warns at every save that it found no OCDBT files to merge: the train state is written without OCDBT on
    # purpose (make_checkpoint_manager), so the warning says nothing.
    return "Skipping merge of OCDBT checkpoints" not in str(record.msg)


logging.getLogger("absl").addFilter(_not_ocdbt_merge_notice)  # orbax logs through absl's logger


class StoreCheckpointHandler(ocp.CheckpointHandler):
    """orbax handler for a ``StateStore`` item: ``save`` snapshots the store into the item directory (hard
    links), ``restore`` rebuilds a store from it. Saving is synchronous: when ``CheckpointManager.save`` returns,
    the snapshot is complete and the store may be updated again."""

    def __init__(self):
        self.last_info: dict | None = None

    @classmethod
    def typestr(cls) -> str:
        # orbax records this name for the item in each step's metadata: the module the handler lived in before the
        # checkpoint code was split, so that checkpoints are written as before and older ones resolve by name.
        return "nsp.storage.checkpoint.StoreCheckpointHandler"

    def save(self, directory, args: StoreSave) -> None:
        dest = process_part(Path(str(directory)))
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.last_info = snapshot_store(args.store, dest, mode=args.mode)

    def restore(self, directory, args: StoreRestore | None = None) -> StateStore:
        if args is None:
            raise StoreError("restoring a store item needs StoreRestore(store_path=...): where to rebuild it")
        snap = process_part(Path(str(directory)))
        if args.num_shards is not None and _needs_reshard(snap, args.num_shards, args.shards):
            # Written on another layout (shard count, or process count): this process's new shards are re-cut
            # from whichever parts hold their ranges (``reshard.py``).
            return restore_resharded(directory, args.store_path, args.num_shards, shards=args.shards,
                                     tier=args.tier, overwrite=args.overwrite, pages_in_flight=args.pages_in_flight)
        if args.shards is not None and not snap.exists():
            raise StoreError(f"{directory} holds no part for this process ({snap.name}): the checkpoint was "
                             "written by a run with another process count (StoreRestore(num_shards=...) reshards "
                             "it)")
        # One process of several restores its own shards; on the memory tier store_path is then ignored.
        return restore_store(snap, args.store_path, tier=args.tier, shard_paths=args.shard_paths,
                             overwrite=args.overwrite, mode=args.mode, pages_in_flight=args.pages_in_flight,
                             shards=args.shards)

    def metadata(self, directory) -> dict | None:
        try:
            info = load_snapshot_info(process_part(Path(str(directory))), check_files=False)
        except StoreError:
            return None
        info.pop("files", None)
        return info


def _needs_reshard(snap: Path, num_shards: int, shards: list[int] | None) -> bool:
    """Whether this process's part ``snap`` of a store item is not exactly the ``shards`` of ``num_shards`` it
    restores (absent, or another cut)."""
    if not (snap / SNAPSHOT).exists():
        return True
    info = load_snapshot_info(snap, check_files=False)
    wanted = list(range(num_shards)) if shards is None else sorted(shards)
    return info["layout"]["num_shards"] != num_shards or snapshot_shards(info) != wanted


def process_part(item_dir: Path) -> Path:
    """Where this process's snapshot lives in a store item: the item itself for a lone process,
    ``process-NNNNN`` inside it for one process of several."""
    import jax

    return item_dir if jax.process_count() == 1 else item_dir / f"process-{jax.process_index():05d}"


def load_store_item_info(item_dir: str | os.PathLike, *, check_files: bool = False) -> dict:
    """What a checkpoint step's store item holds, whoever wrote it: ``load_snapshot_info`` of a lone process's
    snapshot, or, for a multi-process step (``process-NNNNN`` parts), the parts together: ``version`` (the one
    every part holds), ``processes`` (each part's process, shards, files and bytes), ``local_shards`` and
    ``files`` over all parts, and the rest (layout, optimizer, page size) from part 0. Raises ``StoreError`` when a
    part is missing or unfinished, or the parts disagree on the version or the layout."""
    item = Path(item_dir)
    parts = sorted(p for p in item.glob("process-*") if p.is_dir()) if item.is_dir() else []
    if not parts or (item / SNAPSHOT).exists():
        return load_snapshot_info(item, check_files=check_files)
    infos = [load_snapshot_info(part, check_files=check_files) for part in parts]
    first = infos[0]
    for part, info in zip(parts, infos):
        for key in ("version", "layout", "optimizer", "page_bytes"):
            if info.get(key) != first.get(key):
                raise StoreError(f"checkpoint store item {item} is inconsistent: {part.name} holds {key} "
                                 f"{info.get(key)!r}, {parts[0].name} {first.get(key)!r}")
    shards = sorted(s for info in infos for s in info.get("local_shards") or [])
    expected = list(range(first["layout"]["num_shards"]))
    if shards != expected:
        raise StoreError(f"checkpoint store item {item} holds shards {shards} over its {len(parts)} parts; the "
                         f"layout has {expected}: a part is missing")
    combined = {k: v for k, v in first.items() if k not in ("source", "files", "local_shards", "path")}
    for key, value in first.items():  # the parts' counts add up (files and bytes linked, copied, ...)
        if isinstance(value, int) and not isinstance(value, bool) and (key.endswith(("_files", "_bytes"))):
            combined[key] = sum(info.get(key) or 0 for info in infos)
    combined["method"] = "/".join(sorted({str(info.get("method")) for info in infos}))
    combined["created"] = max(str(info.get("created")) for info in infos)
    combined.update(path=str(item.absolute()), local_shards=shards,
                    files=[{**f, "path": f"{part.name}/{f['path']}"} for part, info in zip(parts, infos)
                           for f in info["files"]],
                    processes=[{"process": int(part.name.split("-")[1]), "path": str(part),
                                "shards": info.get("local_shards"), "files": len(info["files"]),
                                "bytes": sum(f["bytes"] for f in info["files"])} for part, info in zip(parts, infos)])
    return combined


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
    # The shards this process restores (one process of several: those of its devices); None = a whole snapshot.
    shards: list[int] | None = None
    # The shard count to restore as: an item written with another (or by another process count) is resharded
    # (``reshard.py``). None: restore as written, and refuse another process's part.
    num_shards: int | None = None


class LocalCheckpointManager(ocp.CheckpointManager):
    """A checkpoint manager of this process alone (``make_checkpoint_manager(..., local=True)``)."""

    local = True


def is_local(manager: ocp.CheckpointManager) -> bool:
    """Whether ``manager`` keeps this process's own complete checkpoints (``local=True``)."""
    return bool(getattr(manager, "local", False))


def make_checkpoint_manager(directory: str | os.PathLike, max_to_keep: int | None = 3, *,
                            enable_async_checkpointing: bool = True, local: bool = False,
                            **options: Any) -> ocp.CheckpointManager:
    """An ``ocp.CheckpointManager`` with items ``store`` (tier snapshot), ``train_state`` (pytree), ``meta``
    (JSON). Put ``directory`` on the store's file system, or pages get copied instead of linked. Extra keyword
    arguments go to ``ocp.CheckpointManagerOptions``.

    ``local``: in a multi-process run, a manager of this process alone over its own ``directory`` (a file system
    the other processes need not see): it writes every item of a step itself (its part of the store, its replica
    of the train state, the meta) and finalises the step on its own. Its train state is saved and restored with
    ``train_state_save_args`` / ``train_state_restore_args``. With one process it is the ordinary manager."""
    import jax

    directory = Path(directory).absolute()
    # The train state is written a leaf per directory (zarr), not packed into OCDBT's shared data files: a leaf
    # that did not change between two steps (a frozen backbone's) is then the same bytes at the same path in both,
    # and a checkpoint delta (nsp.storage.delta) leaves it out. Either format restores.
    if not local or jax.process_count() == 1:
        opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                            enable_async_checkpointing=enable_async_checkpointing, **options)
        handlers = {"store": StoreCheckpointHandler(),
                    "train_state": ocp.StandardCheckpointHandler(use_ocdbt=False), "meta": ocp.JsonCheckpointHandler()}
        return ocp.CheckpointManager(directory, options=opts, item_names=ITEM_NAMES, item_handlers=handlers)
    me = jax.process_index()
    # This process is the only one orbax waits for (its barriers are keyed by the prefix) and its primary host.
    mp = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                            barrier_sync_key_prefix=f"nsp-local-{me:05d}")
    # Each process writes its own replica of a replicated array (replica_id None: the replica of its first
    # shard), not only the replica that lives on process 0.
    arrays = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=me, replica_id=None, use_replica_parallel=False)))
    directory.mkdir(parents=True, exist_ok=True)  # orbax creates no directory for a subset of processes
    # A step's directories are made before its items are written, not in the background: orbax tells its writers
    # that they exist through keys of the coordination service named by an operation count, the same on every
    # process, so another process's directories would count as this one's.
    opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=False,
                                        enable_async_checkpointing=enable_async_checkpointing,
                                        multiprocessing_options=mp,
                                        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
                                        **options)
    handlers = {"store": StoreCheckpointHandler(),
                "train_state": ocp.PyTreeCheckpointHandler(use_ocdbt=False, multiprocessing_options=mp,
                                                           type_handler_registry=arrays),
                "meta": ocp.JsonCheckpointHandler(multiprocessing_options=mp)}
    return LocalCheckpointManager(directory, options=opts, item_names=ITEM_NAMES, item_handlers=handlers)


def train_state_save_args(manager: ocp.CheckpointManager, train_state: Any) -> ocp.args.CheckpointArgs:
    """The save args of the ``train_state`` item for ``manager``'s handler (a local manager's is a pytree
    handler of its own: args of another handler's kind would make orbax pick a default handler instead)."""
    return ocp.args.PyTreeSave(train_state) if is_local(manager) else ocp.args.StandardSave(train_state)


def train_state_restore_args(manager: ocp.CheckpointManager, template: Any) -> ocp.args.CheckpointArgs:
    """The restore args of the ``train_state`` item for ``manager``'s handler (``template``: arrays or
    ``jax.ShapeDtypeStruct`` leaves, with the shardings to restore onto; ``None``: as saved)."""
    if not is_local(manager):
        return ocp.args.StandardRestore(template)
    if template is None:
        return ocp.args.PyTreeRestore()
    return ocp.args.PyTreeRestore(template, restore_args=ocp.checkpoint_utils.construct_restore_args(template))


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
        items["train_state"] = train_state_save_args(manager, train_state)
    if meta is not None:
        items["meta"] = ocp.args.JsonSave(meta)
    version = store.version
    saved = manager.save(step, args=ocp.args.Composite(**items))
    if wait:
        manager.wait_until_finished()
    out = {"step": step, "saved": bool(saved), "version": version, "snapshot": None}
    if saved:
        snap = process_part(Path(str(manager.directory)) / str(step) / "store")
        if (snap / SNAPSHOT).exists():
            info = load_snapshot_info(snap, check_files=False)
            info.pop("files", None)
            out["snapshot"] = info
    return out


def restore_checkpoint(manager: ocp.CheckpointManager, step: int | None, store_path: str | os.PathLike | None,
                       train_state_template: Any = None, *, tier: str = "file",
                       shard_paths: list[str | os.PathLike] | None = None, overwrite: bool = False,
                       mode: str = "auto", pages_in_flight: int = PAGES_IN_FLIGHT_DEFAULT,
                       shards: list[int] | None = None, num_shards: int | None = None,
                       ) -> tuple[StateStore, Any, dict | None]:
    """Restores ``(store, train_state, meta)`` of ``step`` (``None``: the latest). The store is rebuilt at
    ``store_path`` (see ``restore_store``); ``train_state`` follows ``train_state_template`` (arrays or
    ``jax.ShapeDtypeStruct`` leaves; ``None`` restores what was saved as is). Missing items come back as None.
    ``shards``: the shards this process restores, one process of several (its part of the step's store item).
    ``num_shards``: restore the store as that many shards, resharding a step written on another layout."""
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
        items["train_state"] = train_state_restore_args(manager, train_state_template)
    if (step_dir / "meta").exists():
        items["meta"] = ocp.args.JsonRestore()
    small = manager.restore(step, args=ocp.args.Composite(**items)) if items else {}
    store_args = StoreRestore(store_path, tier=tier, shard_paths=shard_paths, overwrite=overwrite, mode=mode,
                              pages_in_flight=pages_in_flight, shards=shards, num_shards=num_shards)
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

