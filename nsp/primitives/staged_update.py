"""The store update for a step that never holds its whole gradient: each gradient leaf is staged to the store's
disk as the backward pass produces it, and the new params come back a leaf at a time.

``store_update_staged`` is ``store_update_leaves`` (one device, one store shard, gradient leaves of the params'
one dtype) reorganised around the store's stage file (``ffi/engine/gradient_stage.h``), three kinds of FFI call:

1. ``nsp_gradient_stage``, one per gradient leaf: writes the leaf into the stage file at its place in the shard
   and returns whether it is finite. It depends on that leaf alone, so XLA's scheduler runs it as soon as the
   backward pass has produced the leaf, and the leaf's buffer is free from then on: the step holds a few layers'
   gradient at a time instead of all of it (Smart-Infinity's flow: the gradient goes down to the storage that
   holds the optimizer state, and the update runs there).
2. ``nsp_store_update_staged``: the store's usual versioned step, reading the gradient a page at a time from the
   stage file and writing each page's new params over it there. Its ``apply`` operand is the AND of the
   stage calls' results (a NaN or Inf anywhere skips the step), so it runs after every leaf is staged.
3. ``nsp_gradient_stage_load``, one per leaf: reads that leaf's new params back. Each waits for the previous
   leaf's next params (``consume``), so the step's ``optax.apply_updates`` takes each leaf before the next is
   read, and no whole second copy of the params exists.

Costs: the gradient's bytes written to the stage file and read back by the update, and the new params' bytes
written there and read back: with bf16 params 4 bytes per parameter written and 4 read (the page cache serves
the reads while it holds them), beside the update's own 24 of state I/O. The stage file is
``<store>/<shard>/gradient.stage`` (params-sized).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from nsp.primitives import _ffi  # noqa: F401  (registers the FFI targets)
from nsp.primitives.store_update import (_attrs, _context_mesh, _handle, _platform, _step_device,
                                         check_gradient_leaves)


def check_staged(store: Any, grads: list[jax.Array]) -> None:
    """Raises a clear error when ``grads`` cannot take the staged update of ``store`` (a store without a disk,
    the memory tier, is refused by the first stage call: the staged gradient would take the same host memory)."""
    handle = _handle(store)
    layout = handle.layout
    if layout.num_shards != 1:
        raise ValueError(f"the staged update needs a single-shard store; this one has {layout.num_shards} shards")
    if handle.staleness != 0:
        raise ValueError("the staged update needs staleness 0 (a background step would read the stage file while "
                         "the next step writes it)")
    check_gradient_leaves(layout, grads)
    if _context_mesh() is not None:
        raise ValueError("the staged update runs on one device: trace the step without a multi-device mesh")


def _check_cpu() -> None:
    """The staged update's handlers are registered for the CPU only (a CUDA device would stage its leaves
    through host memory first: not written yet)."""
    device = _step_device()
    if _platform(device) != "cpu":
        raise NotImplementedError(f"stage_gradients runs on CPU devices only for now (the step runs on {device}); "
                                  "on an accelerator use the default update (stage_gradients=False)")


def store_update_staged(
    store: Any,
    grads: list[jax.Array],
    *,
    version: jax.typing.ArrayLike,
    lr: jax.typing.ArrayLike,
    step: jax.typing.ArrayLike,
    params: list[jax.Array],
    adopt: jax.typing.ArrayLike = False,
    consume: Callable[[int, jax.Array], tuple[Any, jax.Array]] | None = None,
    clip_norm: float | None = None,
) -> tuple[list[Any], jax.Array]:
    """``store_update_leaves`` with the gradient staged on the store's disk leaf by leaf (module docstring).

    Args:
      store: an initialized single-shard store on disk (file or device tier), staleness 0: its ``StoreHandle``,
        or the store.
      grads: the gradient's leaves in the store layout's order, all float32 or all bfloat16.
      version, lr, step: as for ``store_update``.
      params: the params leaves, of the gradient's dtype (they give the leaves' sizes; read when ``adopt``).
      adopt: start this step from ``params`` instead of from the store's master (``store_update``).
      consume: ``consume(i, new_leaf) -> (result, follow)``: what to make of leaf ``i``'s new params, and an array
        the next leaf's read must wait for. Give the params the step keeps of that leaf (``p + update``, as the
        step's own ``optax.apply_updates`` computes it: XLA merges the two), and the step holds one leaf's new
        params at a time: XLA's scheduler, left to itself, reads every leaf back before it applies any.
      clip_norm: clip the gradient to this global norm (``optax.clip_by_global_norm``'s rule) as the update reads
        it: the stage calls also sum each leaf's squares, and the factor is applied in float32 (rounded back to
        bf16 for a bf16 gradient; optax's bf16 arithmetic rounds twice, so the two may differ in the last bit).
        A clip transform chained before the update would need the whole gradient at once to take its norm.

    Returns:
      ``(results, version)``: per leaf, its new params in the gradient's dtype (or what ``consume`` made of
      them), and the version the store committed. A gradient with NaN or Inf skips the step (the committed
      params come back, ``version`` is unchanged).
    """
    handle = _handle(store)
    check_staged(handle, grads)
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be positive, got {clip_norm}")
    if len(params) != len(grads) or any(p.dtype != g.dtype or p.shape != g.shape for p, g in zip(params, grads)):
        raise TypeError("the staged update needs params leaves of the gradient's dtypes and shapes")
    _check_cpu()
    engine = np.int64(handle.engines[0])
    offsets = [np.int64(spec.offset) for spec in handle.layout.leaves]

    stage = jax.ffi.ffi_call("nsp_gradient_stage", (jax.ShapeDtypeStruct((), jnp.int32),
                                                    jax.ShapeDtypeStruct((), jnp.float32)), has_side_effect=True)
    staged = [stage(g, handle=engine, offset=off, norm=clip_norm is not None) for g, off in zip(grads, offsets)]
    apply = jnp.min(jnp.stack([finite for finite, _ in staged]))  # 1: every leaf finite; 0: skip the step
    scale = jnp.float32(1)
    if clip_norm is not None:  # optax.clip_by_global_norm's rule, the norm from the leaves' sums of squares
        norm = jnp.sqrt(jnp.sum(jnp.stack([squares for _, squares in staged])))
        scale = jnp.where(norm < clip_norm, jnp.float32(1), jnp.float32(clip_norm) / norm)

    adopt = jnp.asarray(adopt).astype(jnp.int32)
    scalars = [jnp.asarray(lr, jnp.float32), jnp.asarray(step, jnp.int32), jnp.asarray(version, jnp.int32),
               jnp.int32(0), apply, adopt]
    update = jax.ffi.ffi_call("nsp_store_update_staged", jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True)
    new_version = update(*scalars, scale, *params, **_attrs(handle))

    results, follow = [], []
    for i, (p, off) in enumerate(zip(params, offsets)):
        load = jax.ffi.ffi_call("nsp_gradient_stage_load", jax.ShapeDtypeStruct(p.shape, p.dtype),
                                has_side_effect=True)
        leaf = load(new_version, *follow, handle=engine, offset=off)
        if consume is None:
            results.append(leaf)
        else:
            result, after = consume(i, leaf)
            results.append(result)
            follow = [after]
    return results, new_version
