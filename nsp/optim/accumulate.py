"""Gradient accumulation that runs the optimizer once per ``k`` micro-steps: one store update, not ``k``.

``optax.MultiSteps`` calls its inner optimizer at every micro-step and keeps the result only at the ``k``-th
(``jnp.where`` over the inner state). Around an nsp optimizer that works, and gives the same params (each
discarded update is replayed from the version the state still names), but every micro-step runs a full store
update. ``multi_steps`` calls the inner update under ``lax.cond``, so the store is updated once per ``k``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class MultiStepsState(NamedTuple):
    """State of ``multi_steps``.

    Attributes:
      mini_step: micro-steps accumulated since the last update (int32).
      acc_grads: the running mean (or sum) of the micro-steps' gradients.
      inner_opt_state: the inner optimizer's state.
    """

    mini_step: jax.Array
    acc_grads: Any
    inner_opt_state: Any


def multi_steps(opt: optax.GradientTransformation, every_k: int, *,
                use_grad_mean: bool = True) -> optax.GradientTransformationExtraArgs:
    """Accumulates ``every_k`` gradients, then applies ``opt`` once to their mean (or sum).

    Same results as ``optax.MultiSteps(opt, every_k_schedule=every_k, use_grad_mean=use_grad_mean)``: zero
    updates on the first ``every_k - 1`` micro-steps, ``opt``'s update of the accumulated gradient on the last.

    Args:
      opt: the optimizer, e.g. ``nsp.optim.adam(1e-3, store=store)``.
      every_k: micro-steps per update (a positive int).
      use_grad_mean: accumulate the mean of the gradients (else their sum).

    Example::

      tx = nsp.optim.multi_steps(nsp.optim.adam(1e-3, store=store), every_k=4)
      state = tx.init(params)
      updates, state = tx.update(grads, state, params)  # the store is updated every 4th call
    """
    if not isinstance(every_k, int) or every_k < 1:
        raise ValueError(f"every_k must be a positive int, got {every_k!r}")
    opt = optax.with_extra_args_support(opt)

    def init_fn(params):
        acc = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return MultiStepsState(jnp.zeros((), jnp.int32), acc, opt.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        n = state.mini_step
        if use_grad_mean:
            acc = jax.tree_util.tree_map(lambda g, a: a + (g.astype(jnp.float32) - a) / (n + 1), updates,
                                         state.acc_grads)
        else:
            acc = jax.tree_util.tree_map(lambda g, a: a + g.astype(jnp.float32), updates, state.acc_grads)
        grads = jax.tree_util.tree_map(lambda a, g: a.astype(g.dtype), acc, updates)

        def apply(grads, inner):
            return opt.update(grads, inner, params, **extra_args)

        def wait(grads, inner):
            shapes, _ = jax.eval_shape(apply, grads, inner)
            return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), inner

        emit = n == every_k - 1
        new_updates, inner = jax.lax.cond(emit, apply, wait, grads, state.inner_opt_state)
        acc = jax.tree_util.tree_map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc)
        return new_updates, MultiStepsState(jnp.where(emit, 0, n + 1).astype(jnp.int32), acc, inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
