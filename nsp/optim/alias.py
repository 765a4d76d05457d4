"""Optimizers with their state in a store, optionally with Top-K compression fused into the update pass.

``nsp.optim.adamw(1e-3, store=store, compression=nsp.optim.TopK(0.01))`` is
``optax.chain(topk_compress(0.01, ...), scale_by_storage_adamw(store, 1e-3))``: the kernel decompresses the kept
entries block by block while it updates, so no dense gradient is ever rebuilt. With ``TopK(..., lazy=True)`` the
update is lazy: only the entries sent this step move (see ``nsp.optim.compress``). ``staleness=1`` lets the update
stream in the background while the next step's forward/backward runs on params one step old. ``float32_updates=True``
lands bf16 params exactly on the store's master rounded to bf16, and ``stage_gradients=True`` makes the leanest
step, which never holds the whole gradient (both: ``nsp.optim.scale_by_storage``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from nsp.optim.compress import TopK, topk_compress
from nsp.optim.storage import (
    scale_by_storage_adagrad,
    scale_by_storage_adam,
    scale_by_storage_adamw,
    scale_by_storage_sgd,
)
from nsp.storage import StateStore


def _lazy(compression: TopK | None) -> bool:
    """Whether the store's update is lazy: with Top-K compression as ``TopK.lazy`` says, never without."""
    if compression is None:
        return False
    if not isinstance(compression, TopK):
        raise TypeError(f"compression must be None or nsp.optim.TopK(ratio), got {compression!r}")
    return bool(compression.lazy)


def _compose(scale_by_storage_kind, store: StateStore, compression: TopK | None, mesh, axis_name, staleness,
             options: dict, *hyper) -> optax.GradientTransformationExtraArgs:
    """``scale_by_storage_kind(store, *hyper, ...)``, lazy as ``compression`` says, after Top-K compression when
    there is any: the one body of the four aliases, composed as optax composes its aliases. ``options``: the
    storage transform's ``float32_updates``, ``stage_gradients`` and ``clip_norm``."""
    if compression is not None and options.get("stage_gradients"):
        raise ValueError("stage_gradients=True takes the dense gradient leaf by leaf; it does not combine with "
                         "Top-K compression (whose compressed gradient is already small)")
    tx = scale_by_storage_kind(store, *hyper, mesh=mesh, axis_name=axis_name, staleness=staleness,
                               lazy=_lazy(compression), **options)
    if compression is None:
        return tx
    compress = topk_compress(compression.ratio, error_feedback=compression.error_feedback,
                             residual_decay=compression.residual_decay, method=compression.method,
                             num_shards=store.num_shards, mesh=mesh, axis_name=axis_name)
    return optax.chain(compress, tx)


def _unsupported(name: str, value, default, why: str) -> None:
    """Raises ``NotImplementedError`` for an optax argument nsp accepts (so that signatures match optax's) but
    cannot honour; a traced value (``optax.inject_hyperparams``) cannot be inspected and is left to the store's
    own hyperparameters, as every static hyperparameter is."""
    if isinstance(value, jax.core.Tracer):
        return
    same = value is default if default is None or isinstance(default, bool) else float(value) == float(default)
    if not same:
        raise NotImplementedError(f"{name}={value!r} is not supported by nsp's optimizers: {why}")


def _moment_dtype(name: str, value) -> None:
    if value is not None and jnp.dtype(value) != jnp.dtype(jnp.float32):
        raise NotImplementedError(f"{name}={value!r} is not supported: nsp keeps the optimizer's state in float32 "
                                  "in the store (its memory is the store's, not the accelerator's)")


def adam(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype=None, *, nesterov: bool = False, store: StateStore,
         compression: TopK | None = None, weight_decay: float = 0.0, mesh: Mesh | None = None,
         axis_name: str | None = None, staleness: int = 0,
         float32_updates: bool = False, stage_gradients: bool = False,
        clip_norm: float | None = None) -> optax.GradientTransformationExtraArgs:
    """Adam with its state in ``store``: ``optax.adam``'s arguments, in its order, plus nsp's keyword-only ones.

    ``eps_root`` other than 0, ``mu_dtype`` other than None or float32 (the store keeps float32 moments) and
    ``nesterov=True`` raise ``NotImplementedError``. ``weight_decay`` (nsp's) adds L2 decay to the gradient.

    Example::

      store = nsp.storage.open("/nvme/run/store", tier="file")
      tx = nsp.optim.adam(1e-3, store=store, compression=nsp.optim.TopK(0.01))
    """
    _unsupported("eps_root", eps_root, 0.0, "the update kernel adds eps outside the square root only")
    _moment_dtype("mu_dtype", mu_dtype)
    _unsupported("nesterov", nesterov, False, "Nesterov Adam (NAdam) is not in the update kernel")
    return _compose(scale_by_storage_adam, store, compression, mesh, axis_name, staleness,
                    dict(float32_updates=float32_updates, stage_gradients=stage_gradients, clip_norm=clip_norm),
                    learning_rate, b1, b2, eps, weight_decay)


def adamw(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype=None, weight_decay: float = 1e-4, mask=None, *, nesterov: bool = False,
          store: StateStore, compression: TopK | None = None, mesh: Mesh | None = None,
          axis_name: str | None = None, staleness: int = 0,
          float32_updates: bool = False, stage_gradients: bool = False,
        clip_norm: float | None = None) -> optax.GradientTransformationExtraArgs:
    """AdamW with its state in ``store``: ``optax.adamw``'s arguments, in its order, plus nsp's keyword-only ones.

    ``eps_root`` other than 0, ``mu_dtype`` other than None or float32, a ``mask`` and ``nesterov=True`` raise
    ``NotImplementedError`` (to keep some leaves from weight decay, give them their own optimizer with
    ``optax.partition``, each with its own store)."""
    _unsupported("eps_root", eps_root, 0.0, "the update kernel adds eps outside the square root only")
    _moment_dtype("mu_dtype", mu_dtype)
    if mask is not None:
        raise NotImplementedError("mask is not supported by nsp.optim.adamw: the store decays every param; to keep "
                                  "some from weight decay, give them their own optimizer (weight_decay=0) with "
                                  "optax.partition, each with its own store")
    _unsupported("nesterov", nesterov, False, "Nesterov Adam (NAdam) is not in the update kernel")
    return _compose(scale_by_storage_adamw, store, compression, mesh, axis_name, staleness,
                    dict(float32_updates=float32_updates, stage_gradients=stage_gradients, clip_norm=clip_norm),
                    learning_rate, b1, b2, eps, weight_decay)


def sgd(learning_rate: optax.ScalarOrSchedule, momentum: float | None = None, nesterov: bool = False,
        accumulator_dtype=None, *, store: StateStore, compression: TopK | None = None, weight_decay: float = 0.0,
        mesh: Mesh | None = None, axis_name: str | None = None,
        staleness: int = 0, float32_updates: bool = False,
        stage_gradients: bool = False,
        clip_norm: float | None = None) -> optax.GradientTransformationExtraArgs:
    """SGD (optionally with momentum) with its state in ``store``: ``optax.sgd``'s arguments, in its order, plus
    nsp's keyword-only ones. ``accumulator_dtype`` other than None or float32 raises ``NotImplementedError``."""
    _moment_dtype("accumulator_dtype", accumulator_dtype)
    return _compose(scale_by_storage_sgd, store, compression, mesh, axis_name, staleness,
                    dict(float32_updates=float32_updates, stage_gradients=stage_gradients, clip_norm=clip_norm),
                    learning_rate, momentum, nesterov, weight_decay)


def adagrad(learning_rate: optax.ScalarOrSchedule, initial_accumulator_value: float = 0.1, eps: float = 1e-7, *,
            store: StateStore, compression: TopK | None = None, mesh: Mesh | None = None,
            axis_name: str | None = None, staleness: int = 0,
            float32_updates: bool = False, stage_gradients: bool = False,
        clip_norm: float | None = None) -> optax.GradientTransformationExtraArgs:
    """AdaGrad with its state in ``store``: ``optax.adagrad``'s arguments, plus nsp's keyword-only ones."""
    return _compose(scale_by_storage_adagrad, store, compression, mesh, axis_name, staleness,
                    dict(float32_updates=float32_updates, stage_gradients=stage_gradients, clip_norm=clip_norm),
                    learning_rate, initial_accumulator_value, eps)
