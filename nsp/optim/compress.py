"""Top-K gradient compression as an optax transform, with error feedback.

``topk_compress`` flattens the incoming updates (the layout order of ``nsp.storage.Layout``), cuts the flat
vector into the store's equal shards, and keeps the ``ratio`` largest-magnitude entries of each shard. What it
emits is a ``Compressed`` update (values and shard-local sorted indices, ``k`` per shard), which the storage
transforms decompress inside the update kernel. With error feedback the entries it drops are kept in the state
and added to the next step's gradient, so nothing is lost, only delayed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from nsp.optim._shards import map_shards, shard_flat
from nsp.primitives.topk import METHODS, kept_count, topk_compress as _topk


class TopK(NamedTuple):
    """Top-K compression settings for the ``nsp.optim`` aliases.

    Attributes:
      ratio: fraction of each shard's entries kept (0 < ratio <= 1).
      error_feedback: carry the dropped remainder into the next step.
      method: ``"auto"``, ``"exact"``, ``"approx"`` or ``"threshold"`` (see ``nsp.primitives.topk_compress``).
    """

    ratio: float
    error_feedback: bool = True
    method: str = "auto"


class Compressed(NamedTuple):
    """A Top-K compressed update of a whole parameter tree.

    Attributes:
      values: ``num_shards * k`` kept values (fp32), shard by shard.
      indices: matching int32 positions, local to each shard and sorted ascending within it.
    """

    values: jax.Array
    indices: jax.Array


class TopKState(NamedTuple):
    """State of ``topk_compress``.

    Attributes:
      residual: the flat, padded fp32 remainder not yet sent (error feedback), or an empty array without it.
    """

    residual: jax.Array


def flat_size(tree: Any, num_shards: int) -> tuple[int, int]:
    """(real, padded) length of the flattened tree cut into ``num_shards`` equal shards."""
    total = sum(int(x.size) for x in jax.tree_util.tree_leaves(tree))
    shard = max(1, -(-total // num_shards))
    return total, shard * num_shards


def flatten_padded(tree: Any, num_shards: int, dtype=jnp.float32) -> jax.Array:
    """The tree's leaves raveled in pytree order, concatenated and zero-padded to equal shards."""
    total, padded = flat_size(tree, num_shards)
    parts = [jnp.ravel(x).astype(dtype) for x in jax.tree_util.tree_leaves(tree)]
    if padded > total:
        parts.append(jnp.zeros((padded - total,), dtype))
    return jnp.concatenate(parts)


def topk_compress(
    ratio: float,
    *,
    error_feedback: bool = True,
    method: str = "auto",
    num_shards: int = 1,
    mesh: Mesh | None = None,
    axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Keeps the ``ratio`` largest-magnitude entries of each store shard of the updates.

    Args:
      ratio: fraction kept per shard (``0 < ratio <= 1``).
      error_feedback: add the entries dropped so far to the next update (recommended; needs one fp32 copy of
        the flattened params in the state).
      method: selection method of ``nsp.primitives.topk_compress``.
      num_shards: shards of the store that consumes the result (``store.num_shards``).
      mesh, axis_name: when the store is sharded over a mesh axis: each device compresses its own shard.

    Returns:
      An optax transform whose updates are a ``Compressed``; chain it right before an ``nsp.optim`` storage
      transform.

    Example::

      tx = optax.chain(
          optax.clip_by_global_norm(1.0),
          nsp.optim.topk_compress(0.01, num_shards=store.num_shards),
          nsp.optim.scale_by_storage_adam(store, learning_rate=1e-3),
      )
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    kept_count(1000, ratio=ratio)  # validates ratio with a clear message
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")

    def init_fn(params):
        _, padded = flat_size(params, num_shards)
        return TopKState(jnp.zeros((padded,) if error_feedback else (0,), jnp.float32))

    def update_fn(updates, state, params=None):
        del params
        if isinstance(updates, Compressed):
            raise ValueError("the updates are compressed already (topk_compress appears twice in the chain)")
        flat = shard_flat(flatten_padded(updates, num_shards), mesh, axis_name)
        if error_feedback:
            if state.residual.shape != flat.shape:
                raise ValueError(f"the updates flatten to {flat.shape[0]} entries; this state was made for "
                                 f"{state.residual.shape[0]}")
            flat = flat + state.residual
        k = kept_count(flat.shape[0] // num_shards, ratio=ratio)

        def compress_shard(shard):
            values, indices = _topk(shard, k=k, method=method)
            rest = shard.at[indices].set(0.0) if error_feedback else jnp.zeros((0,), shard.dtype)
            return values, indices, rest

        values, indices, residual = map_shards(compress_shard, num_shards, mesh, axis_name, flat)
        return Compressed(values, indices), TopKState(residual)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
