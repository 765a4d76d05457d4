"""Checkpoints straight from the storage tier: one import for the public names of ``snapshot`` (hard-link
snapshots), ``restore`` (rebuilding a store from one), ``orbax_handler`` (a store as an orbax checkpoint item),
``export`` (a checkpoint plain orbax reads) and ``delta`` (a checkpoint sent as what changed since another). Each of
those modules says how it works."""

# Names outside __all__ are public too (``ckpt.load_train_state``, ``ckpt.read_snapshot``...), as they were when
# all of this lived here.
from nsp.storage.delta import apply_delta, make_delta
from nsp.storage.export import export_checkpoint
from nsp.storage.orbax_handler import (ITEM_NAMES, StoreCheckpointHandler, StoreRestore, StoreSave,  # noqa: F401
                                       is_local, load_store_item_info, load_train_state, make_checkpoint_manager,
                                       restore_checkpoint, save_checkpoint, train_state_restore_args,
                                       train_state_save_args)
from nsp.storage.placement import MODES  # noqa: F401
from nsp.storage.restore import RESTORING, restore_store  # noqa: F401
from nsp.storage.snapshot import (CHECKSUMS, SNAPSHOT, SNAPSHOT_FORMAT, SNAPSHOT_FORMAT_VERSION,  # noqa: F401
                                  load_snapshot_info, read_snapshot, snapshot_store)

__all__ = [
    "SNAPSHOT", "StoreCheckpointHandler", "StoreRestore", "StoreSave", "apply_delta", "export_checkpoint",
    "is_local", "load_snapshot_info", "load_store_item_info", "make_checkpoint_manager", "make_delta",
    "restore_checkpoint", "restore_store", "save_checkpoint", "snapshot_store", "train_state_restore_args",
    "train_state_save_args",
]
