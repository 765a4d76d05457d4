"""State stores: optimizer state in a storage tier (host memory, files), sharded, paged and versioned.

One module per concern: ``format`` (the on-disk format: file names, JSON files, zarr arrays, the writer lock),
``metadata`` (checks of what is read from disk), ``layout`` (pytree to shards and pages), ``store`` (the
``StateStore``: lifecycle, reading, statistics), ``creation`` (its first version: initialize, restart, attach),
``update`` (the update path: the checks every update passes, eager or jitted, and the eager update), ``space``
(the disk a store needs, checked before it writes), ``progress`` (watching long updates), ``handle`` (what the
update primitives get of a store), ``opening`` (``open``: create, check and recover store directories),
``identity`` (copy and re-identify stores), and checkpoints: ``snapshot``, ``restore`` (whole stores, or one
process's shards), ``placement`` (links/copies of page files), ``orbax_handler``, ``export`` and ``delta``
(checkpoint deltas; ``checkpoint`` gathers their public names). The package sits on ``nsp.engine`` (the compiled
engine), ``nsp.spec`` and ``nsp.csd`` (the emulated device's options), and below the rest of nsp.
"""

from nsp.storage.format import StoreError
from nsp.storage.handle import StoreHandle
from nsp.storage.layout import PAGE_BYTES_DEFAULT, PAGES_IN_FLIGHT_DEFAULT, Layout, Leaf
from nsp.storage.opening import ExternalShardsWarning, open
from nsp.storage.progress import UpdateWatcher
from nsp.storage.space import FileSystemNeed, check_free_space, required_bytes
from nsp.storage.store import OptimizerSpec, StateStore

__all__ = ["PAGE_BYTES_DEFAULT", "PAGES_IN_FLIGHT_DEFAULT", "Layout", "Leaf", "ExternalShardsWarning", "FileSystemNeed",
           "OptimizerSpec", "StateStore", "StoreError", "StoreHandle", "UpdateWatcher", "check_free_space", "open",
           "required_bytes"]
