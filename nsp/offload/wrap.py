"""``offload(fn, area)``: ``fn`` whose residuals for the backward pass wait on disk instead of in memory.

Reverse-mode autodiff keeps, from the forward pass of each layer, the tensors its backward will need (its
residuals). For a deep model and a big batch they are most of the step's memory. FlashNeuron sends them to an SSD
as the forward pass produces them and reads them back as the backward pass reaches their layer; this is that, for
any JAX function:

- forward: ``jax.vjp(fn, *args)`` gives the outputs and the residuals (the leaves of the VJP function). Those that
  are not ``fn``'s own inputs (those stay alive anyway: the params, the layer input) are pushed to the spill area
  by one side-effecting FFI call (``nsp.primitives.spill.spill_save``); the step then holds none of them.
- backward: one FFI call pops them back (``spill_load``). It takes the cotangent arriving at this layer as an
  operand, so XLA cannot hoist the read before the backward gets there; the kernel reads the next layers'
  entries ahead meanwhile (``SpillArea(read_ahead=...)``). The VJP function is rebuilt from the residuals and
  applied: the gradients are those of ``fn`` without offload, bit for bit (nothing is recomputed).

The target is a ``SpillArea`` (a directory on disk, through the engine's page files) or ``HostMemory`` (the
devices' ``pinned_host`` memory through JAX's memory kinds: XLA copies the residuals out and back on its own
streams; on a GPU this frees device memory, on a CPU it moves nothing).

Lossless by default. ``sparse=True`` stores each residual in FlashNeuron's bit-vector sparse format where that
is smaller (lossless: post-ReLU activations, about half zeros). ``compress=jnp.bfloat16`` stores float32
residuals as bf16 (half the bytes; lossy: the gradients then differ from the exact ones, by what
``tests/test_offload.py`` measures). Call sites are told
apart at trace time, and each keeps a stack, so a function offloaded inside ``jax.lax.scan``/``nnx.scan`` over
layers needs nothing more: the backward scan pops in the reverse order of the forward's pushes.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from nsp.offload.area import SpillArea
from nsp.offload.host import HostMemory
from nsp.primitives.spill import spill_load, spill_save

_CALL_SITES = itertools.count()

#: Residuals smaller than this stay in memory (a few scalars are not worth a file's bytes).
MIN_SPILL_BYTES = 4096


def offload(fn: Callable[..., Any], area: SpillArea | HostMemory, *, compress: Any = None, sparse: bool = False,
            min_bytes: int = MIN_SPILL_BYTES) -> Callable[..., Any]:
    """``fn`` with its backward-pass residuals spilled to ``area`` in the forward pass and read back in the
    backward pass.

    Args:
      fn: a function of arrays (pytrees of them) to arrays, e.g. one transformer block applied to its params
        and input. Differentiated as usual; called without differentiation, nothing is spilled.
      area: where the residuals go: ``nsp.offload.SpillArea`` (disk) or ``nsp.offload.HostMemory``.
      compress: None (lossless), or ``jnp.bfloat16``/``jnp.float16``: float32 residuals are stored in that dtype
        (lossy).
      sparse: store each residual in FlashNeuron's bit-vector sparse format where that is smaller (lossless; a
        pass over it to count its zeros): for models with ReLU, whose activations are about half zeros.
      min_bytes: residuals smaller than this stay in memory.

    Returns:
      A function with ``fn``'s signature and values.

    Example::

      with nsp.offload.SpillArea("/nvme/spill") as area:
          block = nsp.offload.offload(lambda p, x: model_block(p, x), area)
          loss, grads = jax.value_and_grad(lambda p: loss_of(block, p))(params)
    """
    if compress is not None and jnp.dtype(compress) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"compress must be None, jnp.bfloat16 or jnp.float16, got {compress}")
    if not isinstance(area, (SpillArea, HostMemory)):
        raise TypeError(f"offload needs a SpillArea or a HostMemory to send residuals to, got {area!r}")
    if sparse and isinstance(area, HostMemory):
        raise ValueError("the sparse format is the spill area's (its files): HostMemory keeps arrays as they are")
    to_host = isinstance(area, HostMemory)

    def wrapped(*args):
        slot = next(_CALL_SITES)  # one per call at trace time: each layer of a Python loop has its own stack
        plan: dict[str, Any] = {}  # what the forward spilled, for the backward (static: set while tracing)

        @jax.custom_vjp
        def run(*args):
            return fn(*args)

        def forward(*args):
            out, vjp_fn = jax.vjp(fn, *args)
            leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
            spill = _to_spill(leaves, args, min_bytes)
            plan.update(treedef=treedef, spill=spill, like=[jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype)
                                                            for i in spill])
            stored = [_encode(leaves[i], compress) for i in spill]
            if to_host:  # the residuals themselves travel, in host memory
                token = area.save(stored)
            else:
                token = spill_save(area.id, slot, stored, sparse=sparse) if spill else jnp.zeros((), jnp.int32)
            spilled = set(spill)
            kept = [None if i in spilled else x for i, x in enumerate(leaves)]
            return out, (token, kept)

        def backward(residuals, cotangent):
            token, kept = residuals
            leaves = list(kept)
            if plan["spill"]:
                after = jax.tree_util.tree_leaves(cotangent)[0]
                stored_like = [jax.ShapeDtypeStruct(x.shape, _stored_dtype(x.dtype, compress)) for x in plan["like"]]
                loaded = (area.load(token, after) if to_host
                          else spill_load(area.id, slot, token, after, stored_like))
                for i, x, like in zip(plan["spill"], loaded, plan["like"]):
                    leaves[i] = x.astype(like.dtype)
            vjp_fn = jax.tree_util.tree_unflatten(plan["treedef"], leaves)
            return vjp_fn(cotangent)

        run.defvjp(forward, backward)
        return run(*args)

    return wrapped


def spilled_bytes(fn: Callable[..., Any], *args: Any, compress: Any = None,
                  min_bytes: int = MIN_SPILL_BYTES) -> int:
    """The bytes ``offload(fn, ...)`` spills per call on ``args`` (arrays or ``jax.ShapeDtypeStruct``), before the
    sparse format: what its forward pass keeps for the backward pass besides ``fn``'s inputs. Traced abstractly
    (``jax.eval_shape``): nothing runs. For sizing a spill directory before the first step."""
    total = 0

    def residuals(*args):
        nonlocal total
        _, vjp_fn = jax.vjp(fn, *args)
        leaves = jax.tree_util.tree_leaves(vjp_fn)
        total = sum(_nbytes(leaves[i], _stored_dtype(leaves[i].dtype, compress))
                    for i in _to_spill(leaves, args, min_bytes))
        return 0

    jax.eval_shape(residuals, *args)
    return int(total)


def _to_spill(leaves: list[Any], args: tuple, min_bytes: int) -> list[int]:
    """Which of the VJP's residual ``leaves`` go to the spill area: arrays of at least ``min_bytes`` that are not
    the function's own inputs (those stay alive anyway)."""
    inputs = {id(x) for x in jax.tree_util.tree_leaves(args)}
    return [i for i, x in enumerate(leaves)
            if isinstance(x, jax.Array) and id(x) not in inputs and _nbytes(x) >= min_bytes]


def _nbytes(x: jax.Array, dtype: Any = None) -> int:
    """Bytes of ``x`` (as ``dtype``, when given)."""
    return int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(dtype or x.dtype).itemsize


def _stored_dtype(dtype: Any, compress: Any) -> Any:
    return jnp.dtype(compress) if compress is not None and jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype)


def _encode(x: jax.Array, compress: Any) -> jax.Array:
    return x.astype(_stored_dtype(x.dtype, compress))
