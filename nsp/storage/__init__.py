"""State stores: optimizer state in a storage tier (host memory, files), sharded, paged and versioned."""

from nsp.storage.layout import PAGE_BYTES_DEFAULT, PAGES_IN_FLIGHT_DEFAULT, Layout, Leaf
from nsp.storage.store import ExternalShardsWarning, OptimizerSpec, StateStore, StoreError, open

__all__ = ["PAGE_BYTES_DEFAULT", "PAGES_IN_FLIGHT_DEFAULT", "Layout", "Leaf", "ExternalShardsWarning", "OptimizerSpec", "StateStore", "StoreError",
           "open"]
