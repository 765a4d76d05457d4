"""What the update primitives need of a store, handed to them explicitly (``StateStore.handle()``).

``nsp.primitives.store_update`` runs inside jitted code and needs four things of a store: the handles that name
its shard engines there, how the params tree maps onto its shards, which update it runs, and whether the update
streams in the background. The store gives them as one value, so the primitives never reach into the store
object, and the optimizer never leaves notes on it.
"""

from __future__ import annotations

from typing import NamedTuple

from nsp.spec import OptimizerSpec
from nsp.storage.layout import Layout


class StoreHandle(NamedTuple):
    """An initialized store, as the update primitives see it.

    Attributes:
      engines: one handle per shard, naming that shard's C++ engine inside jitted code (valid while the store is
        open; a closed store's handles are refused by the FFI call with a clear error).
      layout: how the params tree flattens into the store's shards and pages.
      spec: the optimizer the store was initialized for (kind and static hyperparameters).
      staleness: 0 (each update returns its own params) or 1 (the update streams in the background and returns
        the previous step's params), as the store was initialized.
    """

    engines: tuple[int, ...]
    layout: Layout
    spec: OptimizerSpec
    staleness: int
