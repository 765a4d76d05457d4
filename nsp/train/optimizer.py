"""The optimizer of a run: its learning-rate schedule (``learning_rate_schedule``) and the optax chain on a store
(``make_optimizer``: clipping, optional Top-K compression, the nsp storage optimizer)."""

from __future__ import annotations

import optax

import nsp.optim
from nsp.train.config import TrainConfig


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warm-up from 0 to the peak, then cosine decay to ``lr * min_lr_ratio`` at ``steps`` (the model's
    recipe fills an unset peak and warm-up: ``TrainConfig.resolved``)."""
    config = config.resolved()
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.lr, warmup_steps=min(config.warmup_steps, config.steps),
        decay_steps=max(config.steps, config.warmup_steps + 1), end_value=config.lr * config.min_lr_ratio)


def make_optimizer(config: TrainConfig, store, mesh) -> optax.GradientTransformation:
    """``nsp train``'s optax chain on ``store``: global-norm clipping (``config.clip``; inside the store's update
    with ``config.stage_gradients``), then ``config.optimizer`` on the store (Top-K compressed with ``config.topk``), on the schedule of ``learning_rate_schedule``. ``mesh``:
    the run's devices (axis ``"data"``), None for one device."""
    schedule = learning_rate_schedule(config)
    # float32_updates: bf16 params land exactly on the store's master rounded to bf16, so they depend on the master
    # alone and a run without checkpoints can continue from its store (store_resume).
    kw = dict(store=store, mesh=mesh, axis_name="data" if mesh is not None else None, staleness=config.staleness,
              float32_updates=True)
    clip_inside = config.stage_gradients and config.clip > 0
    if config.stage_gradients:
        # The staged update clips as it reads the gradient from the store's disk: a clip transform chained in
        # front would need the whole gradient at once for its norm.
        kw["stage_gradients"] = True
        if clip_inside:
            kw["clip_norm"] = config.clip
    if config.topk:
        kw["compression"] = nsp.optim.TopK(config.topk, error_feedback=config.error_feedback,
                                           residual_decay=config.topk_residual_decay, lazy=config.topk_lazy)
    if config.optimizer == "adamw":
        tx = nsp.optim.adamw(schedule, config.b1, config.b2, weight_decay=config.weight_decay, **kw)
    elif config.optimizer == "adam":
        tx = nsp.optim.adam(schedule, config.b1, config.b2, weight_decay=config.weight_decay, **kw)
    elif config.optimizer == "sgd":
        tx = nsp.optim.sgd(schedule, momentum=config.b1, weight_decay=config.weight_decay, **kw)
    else:
        tx = nsp.optim.adagrad(schedule, **kw)
    return optax.chain(optax.clip_by_global_norm(config.clip), tx) if config.clip and not clip_inside else tx
