"""Top-K gradient compression as an optax transform, with error feedback.

``topk_compress`` flattens the incoming updates and cuts the flat vector into the store's equal shards, asking
the store's ``nsp.storage.Layout`` for both (``flat_layout``), and keeps the ``ratio`` largest-magnitude entries
of each shard. What it emits is a ``Compressed`` update (values and shard-local sorted indices, ``k`` per
shard), which the storage transforms decompress inside the update kernel. With error feedback the entries it
drops are kept in the state and added to the next step's gradient; ``residual_decay`` scales that remainder down
each step it stays unsent.

The store runs the dense update on the decompressed gradient by default (Smart-Infinity's updater): every
moment decays and every param keeps moving on its momentum, sent this step or not. ``TopK(..., lazy=True)``
(``lazy=True`` on the storage transforms) makes it lazy instead: only the entries sent this step move, with
their own moments, and the others keep param and state, as in LazyAdam.

**Adam's moment decays.** At 1% a coordinate's gradient reaches the store a few times in a hundred steps, each
time as the remainder error feedback gathered meanwhile: the moments see few, large samples. Dense Adam's
memories (b1 0.9, b2 0.999) then hold a burst for tens and hundreds of sends, far longer in steps than they
would with a dense gradient; shorter ones, ``TOPK_ADAM_BETAS`` = (0.5, 0.99), keep them about as current as
dense Adam's. Measured on the tiny GPT, Top-K 1% with error feedback against dense Adam at its best setting:

- 200 seeded steps of Adam at a constant learning rate from scratch (tests/test_optim.py; dense 2.377 at 3e-3,
  its best of 1e-3 to 5e-3): at dense Adam's settings, dense update 2.754 (+15.9%), lazy 2.676 (+12.6%); at
  (0.5, 0.99) and 5e-3, dense update 2.433 (+2.4%), lazy 2.420 (+1.8%). Around that point, in a pure-JAX
  model of the lazy update: b1 0.7 gave 2.457 at 5e-3 and 2.425 at 1e-2; at b1 0.5 and 1e-2, b2 0.95, 0.99 and
  0.999 gave 2.419, 2.434 and 2.561; b1 0.9 with b2 0.99 at 5e-3, 2.619. Two more seeds (model and data): lazy
  at (0.5, 0.99) and 5e-3 gave 2.477 and 2.400 where dense gave 2.880 and 2.576.
- 1000 steps of ``nsp train``'s recipe (AdamW, b2 0.99, warm-up + cosine, clipping; batch 16 x 64): dense 1.968
  at a peak of 3e-3, 1.927 at 5e-3. Top-K 1% at b1 0.9 and 3e-3: 2.376 (+20.7% on 1.968); at b1 0.5 and 3e-3:
  2.119; at b1 0.5 and 5e-3: 2.040 (+5.9% on 1.927, +3.7% on 1.968), lazy 2.144; at b1 0.5 and 8e-3: 2.121.
  Dense itself at b1 0.5 and 5e-3: 2.284, and at b1 0.9 and 8e-3: 2.259 -- the short memory suits sparse sends
  only. At b1 0.9 and 3e-3 the lazy update gave 2.556 (+29.8%): over the longer run the momentum that keeps
  every param moving pays off, hence the dense update is the default.
- Top-K 10%, same recipe: b1 0.9 gave 2.055 at 3e-3 and 2.412 at 5e-3; b1 0.5 gave 1.951 at 3e-3 (below dense
  at 3e-3) and 2.247 at 5e-3; b1 0.7 at 5e-3, 2.242. The shorter memory helps there too; the higher learning
  rate only at 1%.
- Tried and dropped (200 steps, same model, dense Adam's decays): a second moment fed the sent value squared
  over its age (+24.8%), selecting by |value| / sqrt(nu) (+31% to +54%), RMS-preconditioning on the
  accelerator before the selection (+16% to +18%), and with the lazy update a remainder decay of 0.5 (no
  change).

``residual_decay`` scales the unsent remainder each step it stays unsent; 1 (classic error feedback) is the
default. With the dense update at dense Adam's decays, 0.5 won at 200 steps (2.643 against 2.754) but lost over
1000 steps of ``nsp train``'s recipe (2.511 against 2.376), where the remainder classic error feedback keeps
pays off.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from nsp.optim._shards import map_shards, shard_flat
from nsp.primitives.topk import METHODS, kept_count, resolve_method, topk_feedback, topk_compress as _topk
from nsp.storage.layout import Layout

#: Default factor applied to the unsent remainder each step (see the module docstring for the measurements).
DEFAULT_RESIDUAL_DECAY = 1.0

#: Adam/AdamW moment decays (b1, b2) for Top-K compressed gradients: each coordinate is sent only now and then,
#: so shorter memories than dense Adam's (0.9, 0.999) keep its moments current (measured at 1% and 10%: module
#: docstring).
TOPK_ADAM_BETAS = (0.5, 0.99)


class TopK(NamedTuple):
    """Top-K compression settings for the ``nsp.optim`` aliases.

    Attributes:
      ratio: fraction of each shard's entries kept (0 < ratio <= 1).
      error_feedback: carry the dropped remainder into the next step.
      method: ``"auto"``, ``"exact"``, ``"approx"`` or ``"threshold"`` (see ``nsp.primitives.topk_compress``).
      residual_decay: factor in ``[0, 1]`` applied to the remainder each step it stays unsent (with error
        feedback only); 1 is classic error feedback, where nothing is lost.
      lazy: the store updates only the entries sent this step (their param and state; the others stay as they
        are) instead of running the dense update on a gradient that is zero almost everywhere. Better over short
        runs, worse over long ones in what was measured (module docstring), so off by default.

    With Adam or AdamW, pass ``b1, b2 = nsp.optim.TOPK_ADAM_BETAS`` to the optimizer: at 1%, dense Adam's
    decays cost several times more loss (module docstring).

    Example::

      b1, b2 = nsp.optim.TOPK_ADAM_BETAS
      tx = nsp.optim.adamw(5e-3, b1, b2, store=store, compression=nsp.optim.TopK(0.01))
    """

    ratio: float
    error_feedback: bool = True
    method: str = "auto"
    residual_decay: float = DEFAULT_RESIDUAL_DECAY
    lazy: bool = False


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
      residual: the flat, padded fp32 remainder not yet sent (error feedback; already scaled by
        ``residual_decay``), or an empty array without it.
    """

    residual: jax.Array


def flat_layout(tree: Any, num_shards: int) -> Layout:
    """The store layout of ``tree`` over ``num_shards`` shards: Top-K cuts its flat vector exactly as the store
    that consumes the result does, by asking the layout (``Layout.flatten``, ``Layout.padded_total``)."""
    return Layout.from_tree(tree, num_shards=num_shards)


def flat_size(tree: Any, num_shards: int) -> tuple[int, int]:
    """(real, padded) length of the flattened tree cut into ``num_shards`` equal shards."""
    layout = flat_layout(tree, num_shards)
    return layout.total, layout.padded_total


def flatten_padded(tree: Any, num_shards: int, dtype=jnp.float32) -> jax.Array:
    """The tree's leaves raveled in pytree order, concatenated and zero-padded to equal shards (the layout's flat
    vector)."""
    return flat_layout(tree, num_shards).flatten(tree, dtype)


def _add_into(residual: jax.Array, layout: Layout, leaves: list[jax.Array]) -> jax.Array:
    """``residual + layout.flatten(leaves)``, leaf by leaf into the residual's own buffer: a donated residual is
    updated in place, and no flat copy of the gradient is made (each leaf is read once, converted on the fly)."""
    for leaf, spec in zip(leaves, layout.leaves):
        if spec.size:
            part = jax.lax.dynamic_slice(residual, (spec.offset,), (spec.size,)) + jnp.ravel(leaf).astype(jnp.float32)
            residual = jax.lax.dynamic_update_slice(residual, part, (spec.offset,))
    return residual


def _check_residual_decay(residual_decay: float) -> float:
    if (isinstance(residual_decay, bool) or not isinstance(residual_decay, numbers.Real)
            or not 0.0 <= float(residual_decay) <= 1.0):
        raise ValueError(f"residual_decay must be a number in [0, 1], got {residual_decay!r}")
    return float(residual_decay)


def topk_compress(
    ratio: float,
    *,
    error_feedback: bool = True,
    residual_decay: float = DEFAULT_RESIDUAL_DECAY,
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
      residual_decay: with error feedback, the remainder left after each step's selection is multiplied by
        this factor before it is carried on: ``1.0`` is classic error feedback (nothing is lost, only delayed),
        ``0.0`` keeps nothing (like ``error_feedback=False``, but still holding the state). The module
        docstring has what was measured. Ignored without error feedback.
      method: selection method of ``nsp.primitives.topk_compress``.
      num_shards: shards of the store that consumes the result (``store.num_shards``).
      mesh, axis_name: when the store is sharded over a mesh axis: each device compresses its own shard.

    Returns:
      An optax transform whose updates are a ``Compressed``; chain it right before an ``nsp.optim`` storage
      transform (``lazy=True`` there gives the lazy update, like ``TopK(..., lazy=True)`` in the aliases).

    Raises:
      ValueError: for an unknown ``method``, a ``ratio`` outside ``(0, 1]``, a ``residual_decay`` outside
        ``[0, 1]``, or ``num_shards < 1``.

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
    decay = _check_residual_decay(residual_decay)
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")

    def init_fn(params):
        padded = flat_layout(params, num_shards).padded_total
        return TopKState(jnp.zeros((padded,) if error_feedback else (0,), jnp.float32))

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args  # accepted so that chains passing e.g. value= work
        del params
        if isinstance(updates, Compressed):
            raise ValueError("the updates are compressed already (topk_compress appears twice in the chain)")
        leaves = jax.tree_util.tree_leaves(updates)
        layout = flat_layout(updates, num_shards)
        padded = layout.padded_total
        if error_feedback and state.residual.shape != (padded,):
            raise ValueError(f"the updates flatten to {padded} entries; this state was made for "
                             f"{state.residual.shape[0]}")
        k = kept_count(padded // num_shards, ratio=ratio)
        in_place = (error_feedback and mesh is None and leaves
                    and all(x.dtype in (jnp.float32, jnp.bfloat16) for x in leaves)
                    and resolve_method(method, padded // num_shards, k, jnp.float32) == "auto")
        if in_place:
            # On a CPU the whole step -- add the gradient into the residual, select, clear what is sent, decay --
            # is one C++ pass over the residual's own buffer (nsp.primitives.topk.topk_feedback); elsewhere the
            # jnp path below, which XLA fuses on an accelerator.
            values, indices, residual = jax.lax.platform_dependent(
                cpu=lambda: topk_feedback(state.residual, leaves, k=k, shards=num_shards, decay=decay),
                default=lambda: _compress_flat(_add_into(state.residual, layout, leaves), k))
            return Compressed(values, indices), TopKState(residual)
        # Without a residual to add into, the flat vector keeps the gradient's own dtype when the leaves share one
        # (bf16 gradients: half the bytes); the selection reads magnitudes in float32 either way.
        dtypes = {x.dtype for x in leaves}
        dtype = dtypes.pop() if len(dtypes) == 1 and not error_feedback else jnp.float32
        if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize > 4:
            dtype = jnp.float32
        flat = shard_flat(layout.flatten(updates, dtype), mesh, axis_name)
        if error_feedback:
            flat = flat + state.residual
        values, indices, residual = _compress_flat(flat, k)
        return Compressed(values, indices), TopKState(residual)

    def _compress_flat(flat, k):
        def compress_shard(shard):
            values, indices = _topk(shard, k=k, method=method)
            values = values.astype(jnp.float32)
            if not error_feedback:
                return values, indices, jnp.zeros((0,), shard.dtype)
            rest = shard.at[indices].set(0.0)
            if decay != 1.0:
                rest = rest * decay
            return values, indices, rest

        return map_shards(compress_shard, num_shards, mesh, axis_name, flat)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
