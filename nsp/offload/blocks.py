"""Offloading the blocks of an ``nnx`` model: ``offload_blocks(area)`` is a ``block_call`` for ``GPT.__call__``."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable

import jax
from flax import nnx

from nsp.offload.area import SpillArea
from nsp.offload.host import HostMemory
from nsp.offload.wrap import offload


def offload_blocks(area: SpillArea | HostMemory, *, compress: Any = None, sparse: bool = False,
                   layers: Iterable[int] | None = None,
                   num_layers: int | None = None) -> Callable[[nnx.Module, jax.Array], jax.Array]:
    """``block_call(block, x)``: applies an ``nnx`` block (deterministic: no dropout) to ``x`` with its residuals
    spilled to ``area`` (a ``SpillArea`` or ``HostMemory``; ``nsp.offload.offload``, with ``compress`` and
    ``sparse`` as there). Pass it as ``GPT(...)(tokens, block_call=...)``.

    ``layers``: offload only these blocks (indices; None: all), the others run as usual; the index is the order of
    the calls, counted modulo ``num_layers`` (needed with ``layers``: the model's block count), so every trace of
    the forward pass sees blocks ``0 .. num_layers - 1`` (what ``nsp.offload.planner`` chooses).

    The block runs as a pure function of its state and input (``nnx.split``/``nnx.merge``); a block that
    changes its own state while it runs (dropout's RNG counters, batch statistics) is refused.
    """
    chosen = None if layers is None else frozenset(int(i) for i in layers)
    if chosen is not None and (num_layers is None or num_layers < 1):
        raise ValueError("offload_blocks(layers=...) needs num_layers, the model's block count")
    calls = itertools.count()

    def call(block: nnx.Module, x: jax.Array) -> jax.Array:
        index = next(calls) % num_layers if chosen is not None else None
        if chosen is not None and index not in chosen:
            return block(x, deterministic=True)
        apply, state = block_function(block)
        return offload(apply, area, compress=compress, sparse=sparse)(state, x)

    return call


def block_function(block: nnx.Module) -> tuple[Callable[[Any, jax.Array], jax.Array], Any]:
    """``(apply, state)``: the deterministic ``block`` as a pure function ``apply(state, x)`` of its state."""
    graphdef, state = nnx.split(block)

    def apply(state, x):
        module = nnx.merge(graphdef, state)
        y = module(x, deterministic=True)
        _, after = nnx.split(module)
        if jax.tree_util.tree_structure(after) != jax.tree_util.tree_structure(state) or any(
                a is not b for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(state))):
            raise ValueError("offload_blocks: the block changed its own state while it ran (dropout RNGs, "
                             "batch statistics); offload needs a block that is a pure function of its input")
        return y

    return apply, state
