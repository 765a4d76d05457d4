"""Rebuilding one process's shards of a store from its part of a multi-process checkpoint.

Each process of a run snapshots only its own shards (``snapshot_store`` of a store opened with ``shards=``), so
its part of a checkpoint holds those shards and the store's metadata. ``restore_local`` is
``nsp.storage.restore_store`` of those shards (``shards=``): the one restore, with its format and checks (the
snapshot's version in its slot, a new store id, the metadata written last), opening the store with the same
shards. A snapshot of other shards (the run had another process count or device count) is refused here;
``nsp.storage.reshard.restore_resharded`` re-cuts one (what ``nsp train --resume`` does on another layout).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from nsp.storage import StateStore
from nsp.storage.layout import PAGES_IN_FLIGHT_DEFAULT
from nsp.storage.restore import restore_store, snapshot_shards

__all__ = ["restore_local", "snapshot_shards"]


def restore_local(snapshot_dir: str | os.PathLike, store_path: str | os.PathLike | None, shards: Sequence[int], *,
                  tier: str = "file", overwrite: bool = False, mode: str = "auto",
                  pages_in_flight: int = PAGES_IN_FLIGHT_DEFAULT) -> StateStore:
    """Restores shards ``shards`` of a store from ``snapshot_dir`` (which must hold exactly those) at
    ``store_path`` (``None`` for the memory tier) and opens them (``nsp.storage.open(..., shards=shards)``)."""
    return restore_store(snapshot_dir, store_path, tier=tier, overwrite=overwrite, mode=mode,
                         pages_in_flight=pages_in_flight, shards=shards)
