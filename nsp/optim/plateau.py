"""``optax.contrib.reduce_on_plateau`` for nsp optimizers: the plateau scale goes into the learning rate.

``optax.chain(opt, optax.contrib.reduce_on_plateau(...))`` multiplies ``opt``'s updates by the plateau scale.
After an nsp optimizer that works (the next update sees params that differ from the store's master and steps
from them), but once the scale drops below 1 every step sends the params down the shared link once more and the
master keeps only the params' own precision. ``reduce_on_plateau`` here avoids both: it
runs the same plateau logic first -- its scale depends only on the ``value=`` it is
given and its own state, never on the updates (optax 0.2.8, ``optax/contrib/_reduce_on_plateau.py``) -- and hands
the new scale to the nsp optimizer as a factor on its learning rate, which the store applies inside its update
kernel. The result is the chain's: ``new_scale * (-lr * direction)`` there, ``-(lr * new_scale) * direction`` here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from nsp.optim.compensation import LR_SCALE_ARG, lr_scale_consumers, mark_lr_scaled


class ReduceOnPlateauState(NamedTuple):
    """State of ``reduce_on_plateau``.

    Attributes:
      inner_opt_state: the wrapped optimizer's state.
      plateau_state: ``optax.contrib.ReduceLROnPlateauState`` (``.scale`` is the factor now applied to the
        learning rate; ``.best_value``, ``.plateau_count`` as in optax).
    """

    inner_opt_state: Any
    plateau_state: Any


def reduce_on_plateau(
    opt: optax.GradientTransformation,
    factor: float = 0.1,
    patience: int = 10,
    rtol: float = 1e-4,
    atol: float = 0.0,
    cooldown: int = 0,
    accumulation_size: int = 1,
    min_scale: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    """Scales ``opt``'s learning rate by ``optax.contrib.reduce_on_plateau``'s scale.

    Gives the params of ``optax.chain(opt, optax.contrib.reduce_on_plateau(factor, patience, ...))`` (same
    arguments, same meaning), with ``opt`` an nsp optimizer (``nsp.optim.adam(..., store=store)``, a chain or
    wrapper holding one). Its ``update`` needs ``value=`` (the loss or metric watched), like optax's. The
    storage transforms inside ``opt`` multiply their learning rate (schedules and injected ones included) by the
    scale, so the store applies the scaled step. Around an ``opt`` that holds no nsp storage transform (a plain
    ``optax.adam``), the updates are multiplied by the scale instead, exactly as the optax chain does. An ``opt``
    that mixes both on different leaves (``optax.partition``) gets only its storage transforms scaled: there,
    chain ``optax.contrib.reduce_on_plateau`` after the optax part inside the partition instead.

    Args:
      opt: the optimizer whose learning rate is reduced.
      factor, patience, rtol, atol, cooldown, accumulation_size, min_scale: as in
        ``optax.contrib.reduce_on_plateau``.

    Returns:
      An optax transform with state ``ReduceOnPlateauState``; ``update(grads, state, params, value=loss)``.

    Example::

      store = nsp.storage.open(tier="memory")
      tx = nsp.optim.reduce_on_plateau(nsp.optim.adam(1e-3, store=store), factor=0.5, patience=5)
      state = tx.init(params)
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, state = tx.update(grads, state, params, value=loss)
      params = optax.apply_updates(params, updates)
      state.plateau_state.scale  # the learning rate's factor now
    """
    plateau = optax.contrib.reduce_on_plateau(factor=factor, patience=patience, rtol=rtol, atol=atol,
                                              cooldown=cooldown, accumulation_size=accumulation_size,
                                              min_scale=min_scale)
    opt = optax.with_extra_args_support(opt)

    def init_fn(params):
        return ReduceOnPlateauState(opt.init(params), plateau.init(params))

    def update_fn(updates, state, params=None, *, value, **extra_args):
        # The plateau logic on the value alone (no updates to scale): the scale this step uses.
        _, plateau_state = plateau.update((), state.plateau_state, value=value)
        scale = plateau_state.scale
        outer = extra_args.pop(LR_SCALE_ARG, None)  # a scale from a wrapper around this one
        total = scale if outer is None else scale * outer
        with lr_scale_consumers() as scaled:
            new_updates, inner = opt.update(updates, state.inner_opt_state, params, value=value,
                                            **extra_args, **{LR_SCALE_ARG: total})
        if not scaled:  # no storage transform took the scale: apply it to the updates, as the optax chain does
            new_updates = jax.tree_util.tree_map(lambda u: total * u, new_updates)
            if outer is not None:
                mark_lr_scaled()  # the outer scale is applied too
        return new_updates, ReduceOnPlateauState(inner, plateau_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
