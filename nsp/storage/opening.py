"""Opening a store directory: creating a new store there, or checking and recovering an existing one.

Everything read from disk is checked (``metadata.py``) before anything is opened for writing: the metadata, each
shard's identity (a shard of another store is refused), each manifest. Shards commit one by one, so a crash
between their commits leaves some a version ahead: they are rolled back here, and the store's engines attach to
the committed version (``StateStore.attach``). Only the store's public API is used.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nsp import engine as native
from nsp.storage.format import (LOCK, MANIFEST, METADATA, SHARD_ID, STATES, TIER_BACKENDS, TIERS, StoreError,
                                array_dir, backend_options_string, inside, read_json, shard_dir, store_backend,
                                store_slots, write_manifest, write_shard_id)
from nsp.storage.layout import PAGE_BYTES_DEFAULT, PAGES_IN_FLIGHT_DEFAULT, Layout, check_page_bytes
from nsp.storage.metadata import check_manifest, check_metadata, check_shard_id
from nsp.storage.store import OptimizerSpec, StateStore


def open(  # noqa: A001  (mirrors tensorstore.open / builtins.open on purpose)
    path: str | os.PathLike | None = None,
    *,
    tier: str | None = None,
    num_shards: int | None = None,
    page_bytes: int | None = None,
    shard_paths: list[str | os.PathLike] | None = None,
    pages_in_flight: int = PAGES_IN_FLIGHT_DEFAULT,
    checksum: bool = True,
    in_place: bool = False,
    backend: str | None = None,
    backend_options: Mapping[str, Any] | None = None,
    shards: Sequence[int] | None = None,
    slots: int | None = None,
    redo_window: int = 16,
) -> StateStore:
    """Opens the store at ``path``, or creates an empty one there.

    Args:
      path: the store's directory (``file``/``csd`` tiers); ``None`` for the ``memory`` tier.
      tier: ``"memory"`` (host RAM), ``"file"`` (NVMe/SSD) or ``"csd"`` (one emulated computational-storage
        device per shard: the ``csd`` backend, shipped with nsp, keeps the shard's pages as the file tier does
        and runs the real update kernel on a worker of its own, so results are the file tier's bit for bit,
        while a model clock charges every transfer to the device's links; see ``nsp.csd.device``). Default:
        ``"file"`` with a path, ``"memory"`` without (``"csd"`` when ``backend="csd"``).
      backend: what runs each shard, when not the tier's own: the name of a backend library
        (``libnsp_backend_<name>.so``, looked for in ``NSP_BACKEND_PATH``, then in nsp's ``backends/``
        directory; ``docs/backends.md`` describes its C ABI). Its devices keep the file tier's page files in
        their shard's directory, so the store needs a path (tier ``"file"``, or ``"csd"`` for a device that
        computes). The store records it; reopening uses it. When it cannot be loaded or opened, ``StoreError``
        ``"backend <name> not available: <why>"``.
      backend_options: settings handed to every device as ``key=value;...``. For ``csd``: overrides of
        ``nsp.csd.LinkFigures`` (its model clock's figures, in GB/s; the defaults fill the rest) and faults for
        tests (``fail_kernel_at``, ``fail_read_at``, ``fail_write_at``: the k-th such operation of each device
        fails once). Given at each open, never recorded.
      shards: the shards this process opens, locks, updates and snapshots (default: all). One process of several
        (``nsp.distributed``) holds those of its own devices; the other processes hold the rest, and nothing
        here reads or checks their directories.
      num_shards: equal shards the flattened state is cut into (one per mesh device / storage device);
        default 1 for a new store.
      page_bytes: page (and zarr chunk) size; 4 MiB by default for a new store.
      For an existing store, ``None`` accepts what it was created with; a value must match it.
      shard_paths: one directory per shard (each on its own disk, say); default ``path/shards/NNNNN``.
      pages_in_flight: buffers the file tier streams through per shard (peak extra memory is
        ``pages_in_flight x 3 x page_bytes`` per shard; 8 by default).
      checksum: CRC-32C per page (zarr v3 ``crc32c`` codec), verified on every read.
      in_place: ``memory`` tier only. ``False`` (default) keeps two version slots: an update reads version
        ``t`` and writes ``t+1`` beside it, so the step can be replayed from ``t``. ``True`` keeps one copy of
        the state and updates it in place: half the RAM (12 instead of 24 B/param for Adam) and the kernel's
        speed (no second copy to write), but a step cannot be replayed; updating from the version before the
        committed one is then an error like any stale version.
      slots: ``file`` tier only: the version slots a new store keeps (recorded; ``None`` accepts an existing
        store's). 2 (default): an update writes ``t+1`` beside ``t`` (24 bytes of disk per Adam parameter). 1: one
        copy of the state (12 bytes per parameter) and a redo journal: each update first makes its gradient and
        hyperparameters durable, then writes ``redo_window`` pages at a time beside the old ones and switches them
        in by rename, a journal record per window; opening the store finishes an update a kill interrupted, so
        a kill still leaves version ``t`` or ``t+1`` whole, bit for bit (``ffi/engine/redo_journal.h``). A
        one-slot store cannot replay a step, adopt the caller's params or ``restart``, and all its shards are
        held by one process.
      redo_window: a one-slot store's pages switched in at a time per shard (their scratch is on disk at once).

    Returns:
      A ``StateStore``. An existing store is checked against the arguments; a new one holds no state until
      ``initialize``.

    Example::

      store = nsp.storage.open("/nvme/run1/store", tier="file", num_shards=2)
      store.initialize(params, nsp.storage.OptimizerSpec("adamw", weight_decay=0.1))
    """
    asked_tier = tier
    if tier is None:
        tier = "csd" if backend == "csd" else "file" if path is not None or backend else "memory"
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
    _check_backend_for_tier(tier, backend, backend_options)
    if page_bytes is not None:
        check_page_bytes(page_bytes)
    if num_shards is not None and num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if pages_in_flight < 2:
        raise ValueError(f"pages_in_flight must be >= 2, got {pages_in_flight}")
    if slots is not None and slots not in (1, 2):
        raise ValueError(f"slots must be 1 or 2, got {slots!r}")
    if redo_window < 1:
        raise ValueError(f"redo_window must be >= 1, got {redo_window}")
    if slots == 1 and (tier != "file" or (backend or "file") != "file"):
        raise ValueError(f"slots=1 is the file tier's (its own backend renames each page in); not the {tier} tier"
                         + (f" on backend {backend!r}" if backend else ""))
    if slots == 1 and shards is not None and len(set(shards)) != (num_shards or 1):
        raise ValueError("a one-slot store is stepped by one process holding all its shards (none may switch a page "
                         "in before every shard's redo journal is durable); open all its shards here")
    if in_place and tier != "memory":
        raise ValueError(f"in_place=True is for the memory tier; the {tier} tier keeps two version slots so "
                         "that a crash leaves a whole committed version")
    if tier == "memory":
        if path is not None or shard_paths:
            raise ValueError("the memory tier keeps its state in RAM: pass no path or shard_paths")
        if backend_options:
            raise ValueError("the memory backend takes no backend_options")
        return StateStore(None, tier, num_shards or 1, page_bytes or PAGE_BYTES_DEFAULT, [], pages_in_flight,
                          checksum, in_place, local_shards=shards)
    if path is None:
        raise ValueError(f"the {tier} tier needs a directory path")
    root = Path(path).absolute()
    if root.exists() and not root.is_dir():
        raise StoreError(f"store path {root} exists and is not a directory")
    parent = root.parent
    if not parent.exists():
        raise StoreError(f"cannot create store {root}: directory {parent} does not exist")
    try:
        root.mkdir(exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot create store directory {root}: {e.strerror}") from None
    if not os.access(root, os.W_OK):
        raise StoreError(f"store directory {root} is not writable")
    meta_path = root / METADATA
    if meta_path.exists():
        return _open_existing(root, asked_tier, num_shards, page_bytes, shard_paths, pages_in_flight, backend,
                              backend_options, shards, slots, redo_window)
    backend = backend or TIER_BACKENDS[tier]
    options = _options_string(backend, backend_options)
    _find_backend(backend)  # said now, not at the first initialize
    num_shards = num_shards or 1
    page_bytes = page_bytes or PAGE_BYTES_DEFAULT
    if shard_paths is not None:
        if len(shard_paths) != num_shards:
            raise ValueError(f"got {len(shard_paths)} shard_paths for {num_shards} shards")
        shard_list = [Path(p).absolute() for p in shard_paths]
        if len(set(shard_list)) != len(shard_list):
            raise ValueError(f"shard_paths names one directory twice: {[str(p) for p in shard_list]}")
    else:
        shard_list = [shard_dir(root, i) for i in range(num_shards)]
    store = StateStore(root, tier, num_shards, page_bytes, shard_list, pages_in_flight, checksum, backend=backend,
                       backend_options=options, local_shards=shards, slots=slots or 2, redo_window=redo_window)
    for i in store.local_shards:
        _claim_shard(store, i, shard_list[i])
    try:
        store.acquire_locks()
        for i in store.local_shards:
            write_shard_id(shard_list[i], store.store_id, i, root)
    except BaseException:
        store.close()
        raise
    _say_external(store)
    return store


def _check_backend_for_tier(tier: str, backend: str | None, options: Mapping[str, Any] | None) -> None:
    """The built-in backends run only their own tier; a backend library runs a store on disk."""
    if backend is None:
        return
    if backend in TIER_BACKENDS.values() and backend != TIER_BACKENDS[tier]:
        raise ValueError(f"backend {backend!r} is the {backend} tier's own; it cannot run a {tier} store")
    if tier == "memory" and backend != "memory":
        raise ValueError(f"backend {backend!r} keeps its pages in each shard's directory: open the store with a "
                         "path (tier 'file', or 'csd' for a device that computes)")
    if options and backend in ("memory", "file"):
        raise ValueError(f"the {backend} backend takes no backend_options")


def _options_string(backend: str, options: Mapping[str, Any] | None) -> str:
    """The options string each device of ``backend`` is opened with: for csd, every figure (``nsp.csd.device``)."""
    if backend == "csd":
        from nsp.csd.device import store_device_options

        return store_device_options(options)
    if options and backend in ("memory", "file"):
        raise ValueError(f"the {backend} backend takes no backend_options")
    return backend_options_string(dict(options or {}))


def _find_backend(backend: str) -> None:
    """Loads a backend library (no device is opened yet): one that cannot be had fails the open, not a later
    initialize."""
    if backend in ("memory", "file"):
        return
    try:
        native.find_backend(backend)
    except RuntimeError as e:
        raise StoreError(str(e)) from None


def _say_external(store: StateStore) -> None:
    if store.external_shards:
        warnings.warn(f"store {store.root} keeps shards outside its directory: "
                      f"{[str(p) for p in store.external_shards]}; a copy of {store.root} does not include them "
                      "(nsp store copy does)", ExternalShardsWarning, stacklevel=3)


class ExternalShardsWarning(UserWarning):
    """A store keeps some shards outside its directory (said at open, since a copy of the directory lacks them)."""


def _claim_shard(store: StateStore, index: int, shard: Path) -> None:
    """A new store's shard directory: created, or empty, or a leftover of an unfinished creation of this same
    store directory. A shard of another store is refused before anything is written into it."""
    try:
        shard.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot create shard directory {shard}: {e.strerror}") from None
    ident = shard / SHARD_ID
    if ident.exists():
        owner = read_json(ident, "shard identity")
        if not (isinstance(owner, dict) and owner.get("root") == str(store.root)):
            raise StoreError(f"cannot create store {store.root}: shard directory {shard} belongs to the store at "
                             f"{owner.get('root') if isinstance(owner, dict) else '?'} (id "
                             f"{owner.get('store') if isinstance(owner, dict) else '?'}); pick another directory")
    elif any(p.name != LOCK for p in shard.iterdir()):
        raise StoreError(f"cannot create store {store.root}: shard directory {shard} is not empty")


def _open_existing(root: Path, tier, num_shards, page_bytes, shard_paths, pages_in_flight, backend,
                   backend_options, local_shards, slots=None, redo_window=16) -> StateStore:
    # Everything read from disk is checked before anything is opened for writing.
    meta = check_metadata(read_json(root / METADATA, "store metadata"), str(root / METADATA))
    layout = meta["layout"]
    tier = meta["tier"] if tier is None else tier
    held_backend = store_backend(meta["tier"], meta.get("backend"))
    if backend is not None and backend != held_backend:
        raise StoreError(f"store {root} runs on backend {held_backend!r}, opened with backend={backend!r}")
    options = _options_string(held_backend, backend_options)
    num_shards = layout.num_shards if num_shards is None else num_shards
    page_bytes = meta["page_bytes"] if page_bytes is None else page_bytes
    if page_bytes > meta["page_bytes"] and layout.shard_size <= meta["page_bytes"] // 4:
        page_bytes = meta["page_bytes"]  # the page asked for, shrunk to the store's small shards when created
    held_slots = store_slots(meta)
    slots = held_slots if slots is None else slots
    for name, asked, held in (("tier", tier, meta["tier"]), ("num_shards", num_shards, layout.num_shards),
                              ("page_bytes", page_bytes, meta["page_bytes"]), ("slots", slots, held_slots)):
        if asked != held:
            raise StoreError(f"store {root} was created with {name}={held!r}, opened with {name}={asked!r}")
    try:
        optimizer = OptimizerSpec(**meta["optimizer"])
    except (TypeError, ValueError) as e:
        raise StoreError(f"{root / METADATA}: field 'optimizer' is invalid: {e}") from None
    shards = [root / p for p in meta["shard_paths"]]  # an absolute path stays as it is
    if shard_paths is not None and [Path(p).absolute() for p in shard_paths] != shards:
        raise StoreError(f"store {root} keeps its shards at {[str(s) for s in shards]}")
    store_id = meta["store_id"]
    local = range(num_shards) if local_shards is None else local_shards
    for i in local:
        shard = shards[i]
        ident = shard / SHARD_ID
        if not ident.is_file():
            raise StoreError(f"{root / METADATA}: field 'shard_paths' names {shard} as shard {i}, but it holds no "
                             f"shard ({ident} is missing)")
        check_shard_id(read_json(ident, "shard identity"), str(ident), store_id, i, root,
                       external=not inside(shard, root))
    if held_slots == 1 and local_shards is not None and len(set(local_shards)) != num_shards:
        raise StoreError(f"store {root} keeps one version slot: one process holds all its shards")
    store = StateStore(root, tier, num_shards, page_bytes, shards, pages_in_flight, meta["checksum"],
                       store_id=store_id, backend=held_backend, backend_options=options, local_shards=local_shards,
                       slots=held_slots, redo_window=redo_window)
    try:
        store.acquire_locks()
        if held_slots == 1:
            _open_one_slot(store, layout, optimizer)
        else:
            version, checksums = _recover_version(store, layout, optimizer)
            _check_pages_present(store, layout, optimizer, version)
            _check_checksums_recorded(store, optimizer, version, checksums)
            store.attach(layout, optimizer, version, checksums)
    except BaseException:
        store.close()
        raise
    _say_external(store)
    return store


def _open_one_slot(store: StateStore, layout: Layout, optimizer: OptimizerSpec) -> None:
    """Attaches a one-slot store, finishing from its redo journals an update a kill interrupted. A shard cannot
    roll back once a page of its update is in (it keeps one copy), but none switched a page in before every
    shard's journal was durable (``JournalBarrier``). So when any shard went forward (a version ahead, or a
    window recorded), every shard behind holds the journal that brings it level, and all go forward; when none
    did and some shard holds no journal (a kill while journals were written), the others drop theirs and the
    store stays at its version."""
    used = optimizer.states_used()
    manifests = []
    for i, shard in zip(store.local_shards, store.local_shard_paths):
        path = shard / MANIFEST
        manifests.append(check_manifest(read_json(path, "shard manifest"), str(path), store.store_id, i,
                                        layout.pages_per_shard, used, slots=1))
    versions = [m["version"] for m in manifests]
    if max(versions) - min(versions) > 1:
        raise StoreError(f"shard versions {versions} differ by more than one step: the store is inconsistent")
    for m in manifests:
        _check_pages_present(store, layout, optimizer, m["version"])
    for shard, m in zip(store.local_shard_paths, manifests):
        _check_checksums_recorded(store, optimizer, m["version"], [m["checksums"]], [shard])
    store.attach(layout, optimizer, min(versions), [m["checksums"] for m in manifests])
    for engine, i, shard, m in zip(store._engines, store.local_shards, store.local_shard_paths, manifests):
        if m["version"] != min(versions):
            engine.set_manifest(str(shard / MANIFEST), m["version"], store.store_id, i)
    try:
        _drop_journals_not_in_force(store, versions)
        after = list(store._pool.map(lambda engine: engine.recover(), store._engines))
    except RuntimeError as e:
        raise StoreError(f"cannot recover store {store.root} from its redo journals: {e}") from None
    if len(set(after)) != 1:
        raise StoreError(f"store {store.root}: after recovery its shards hold versions {after} (a shard a version "
                         "behind has no redo journal to go forward by): the store is inconsistent")


def _drop_journals_not_in_force(store: StateStore, versions: list[int]) -> None:
    """Drops the redo journals of an update that never began: every shard at one version, none with a window
    recorded, and some shard without a journal of that version (a kill came while the shards wrote theirs, before
    the barrier let any switch a page in). Redone, those journals would take some shards a version ahead of the
    rest."""
    if len(set(versions)) != 1:
        return  # a shard is ahead: the update was in force, and every shard behind redoes it
    journals = [engine.journal_state() for engine in store._engines]  # (version it starts from, windows recorded)
    pending = [v == versions[0] for v, _ in journals]
    if all(pending):
        return  # every shard can redo it: the store goes forward as one
    recorded = [i for i, p, (_, windows) in zip(store.local_shards, pending, journals) if p and windows]
    if recorded:
        missing = [i for i, p in zip(store.local_shards, pending) if not p]
        raise StoreError(f"store {store.root}: shard(s) {recorded} switched in pages of version {versions[0] + 1} "
                         f"(their redo journals recorded windows), but shard(s) {missing} hold no journal to redo "
                         "that update by: the store is damaged")
    for engine, p in zip(store._engines, pending):
        if p:
            engine.drop_journal()


def _check_pages_present(store: StateStore, layout: Layout, optimizer: OptimizerSpec, version: int) -> None:
    """Every page of the committed version must exist (a version is committed only once all its pages are
    durable): a manifest naming a version whose slot lacks pages is a damaged store, said at open."""
    pages = layout.pages_per_shard
    for shard in store.local_shard_paths:
        for state, used in zip(STATES, optimizer.states_used()):
            if not used:
                continue
            chunks = array_dir(shard, store.slot_of(version), state) / "c"
            present = sum(1 for p in chunks.iterdir() if p.name.isdigit()) if chunks.is_dir() else 0
            if present < pages:
                raise StoreError(f"store {store.root}: its manifest names version {version}, but "
                                 f"{chunks} holds {present} of its {pages} pages: the store is damaged")


def _check_checksums_recorded(store: StateStore, optimizer: OptimizerSpec, version: int,
                              checksums: list[dict], shards: list | None = None) -> None:
    """Each manifest records the checksum of every page of the committed version, for the version its slot
    holds (a manifest naming a version its slot does not hold is damage)."""
    used = optimizer.states_used()
    for shard, tables in zip(shards or store.local_shard_paths, checksums):
        recorded = tables.get(store.slot_of(version), {})
        missing = [s for s, u in zip(STATES, used) if u and s not in recorded]
        if store.checksum and missing:
            raise StoreError(f"{shard / MANIFEST} records no page checksums of {missing} for version {version}: "
                             "the store is damaged")
        if recorded and recorded["version"] != version:
            raise StoreError(f"{shard / MANIFEST}: field 'version' names version {version}, but the slot it lives "
                             f"in holds version {recorded['version']}: the store is damaged")


def _recover_version(store: StateStore, layout: Layout, optimizer: OptimizerSpec) -> tuple[int, list[dict]]:
    """The committed version, and each shard's page checksums. Every shard commits on its own, so a crash
    between shard commits leaves some one version ahead. Those never started another update (the next one needs
    every shard's commit first), so their other slot still holds the older version whole: they roll back to it."""
    used = optimizer.states_used()
    manifests = []
    for i, shard in zip(store.local_shards, store.local_shard_paths):
        path = shard / MANIFEST
        manifests.append(check_manifest(read_json(path, "shard manifest"), str(path), store.store_id, i,
                                        layout.pages_per_shard, used))
    versions = [m["version"] for m in manifests]
    low, high = min(versions), max(versions)
    if high - low > 1:
        raise StoreError(f"shard versions {versions} differ by more than one step: the store is inconsistent")
    for shard, m in zip(store.local_shard_paths, manifests):
        if m["version"] != low:
            tables = {str(slot): states for slot, states in m["checksums"].items()}
            write_manifest(shard, store.store_id, store.shard_paths.index(shard), low, tables)
    return low, [m["checksums"] for m in manifests]
