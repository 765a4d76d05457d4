"""The train state of a run resumed on another shard count: its flat vectors cut again.

Everything in a run's train state is independent of the shard count (params, step counts, fingerprints,
accumulated gradients) except Top-K's error-feedback residual (``nsp.optim.TopKState``): a flat fp32 vector as
long as the store layout's padded total, ``ceil(total / num_shards) * num_shards``. Its first ``total`` elements
are the real ones, in layout order, whatever the shard count; the padding is zeros (no gradient reaches it). So a
residual re-cut for another shard count is its real elements followed by the new layout's padding of zeros, and
the residual every element carries into the next step is unchanged.

A resume on another process count also finds the store directories of the earlier layout where its own go
(``STORE_DIR`` for one process, ``STORE_DIR/process-NNNNN`` for several): ``clear_stale_stores`` removes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from nsp.optim import TopKState
from nsp.storage.format import METADATA
from nsp.storage.restore import RESTORING, remove_existing_store


def padded_total(total: int, num_shards: int) -> int:
    """``Layout.padded_total`` of ``total`` elements over ``num_shards`` shards."""
    return max(1, -(-total // num_shards)) * num_shards


class FlatRecut:
    """Re-cuts the flat vectors of an optax state saved with ``saved_shards`` shards for ``num_shards``."""

    def __init__(self, total: int, saved_shards: int, num_shards: int):
        self.total = int(total)
        self.saved = padded_total(self.total, saved_shards)
        self.new = padded_total(self.total, num_shards)

    def _is_flat(self, x: Any, length: int) -> bool:
        return tuple(getattr(x, "shape", ())) == (length,) and length > 0

    def saved_like(self, template: Any) -> Any:
        """``template`` (an optax state for this run) with each residual shaped as saved: what to restore into."""
        if self.saved == self.new:
            return template

        def like(state):
            if isinstance(state, TopKState) and self._is_flat(state.residual, self.new):
                return TopKState(jax.ShapeDtypeStruct((self.saved,), state.residual.dtype))
            return state

        return jax.tree_util.tree_map(like, template, is_leaf=lambda x: isinstance(x, TopKState))

    def __call__(self, opt_state: Any) -> Any:
        """``opt_state`` as restored (``saved_like``'s shapes) with each residual re-cut for this run."""
        if self.saved == self.new:
            return opt_state

        def recut(state):
            if isinstance(state, TopKState) and self._is_flat(state.residual, self.saved):
                return TopKState(self.vector(state.residual))
            return state

        return jax.tree_util.tree_map(recut, opt_state, is_leaf=lambda x: isinstance(x, TopKState))

    def vector(self, flat: jax.Array) -> jax.Array:
        """One flat vector of the saved length re-cut (the real elements, then zeros), on the same devices."""
        total, new = self.total, self.new

        def cut(x):
            return jnp.concatenate([x[:total], jnp.zeros((new - total,), x.dtype)])

        sharding = getattr(flat, "sharding", None)
        # jit: the restored array may span several processes' devices (replicated), where eager slicing is refused.
        return jax.jit(cut, out_shardings=sharding)(flat) if sharding is not None else cut(jnp.asarray(flat))


def stale_stores(store_root: Path, multiprocess: bool) -> list[Path]:
    """The stores a run on another process count left under ``store_root`` (``--store-dir``), which this run's
    would overlap: one process's store at ``store_root`` itself, or several processes' ``process-NNNNN`` in it."""
    if multiprocess:
        return [store_root] if (store_root / METADATA).exists() or (store_root / RESTORING).exists() else []
    return sorted(p for p in store_root.glob("process-*") if (p / METADATA).exists() or (p / RESTORING).exists())


def clear_stale_stores(store_root: Path, item_dir: Path, log) -> None:
    """Removes ``stale_stores`` before a resharded restore (their state is the checkpoint's, or newer steps that
    the resume redoes). Processes take turns: on a store directory that hosts share, one removes what the others
    then no longer find. A directory that is not an nsp store is never deleted (``remove_existing_store``)."""
    import nsp.distributed

    me = jax.process_index()
    for turn in range(jax.process_count()):
        if turn == me:
            for stale in stale_stores(store_root, jax.process_count() > 1):
                log(f"removing {stale}: the store of the run's earlier process layout (the checkpoint holds its state)")
                remove_existing_store(stale, item_dir, overwrite=True)
        nsp.distributed.barrier(f"nsp-reshard-clear-{turn}")
    store_root.mkdir(parents=True, exist_ok=True)
