"""Optimizers with their state in a store, optionally with Top-K compression fused into the update pass.

``nsp.optim.adamw(1e-3, store=store, compression=nsp.optim.TopK(0.01))`` is
``optax.chain(topk_compress(0.01, ...), scale_by_storage_adamw(store, 1e-3))``: the kernel decompresses the kept
entries block by block while it updates, so no dense gradient is ever rebuilt. With ``TopK(..., lazy=True)`` the
update is lazy: only the entries sent this step move (see ``nsp.optim.compress``). ``staleness=1`` lets the update
stream in the background while the next step's forward/backward runs on params one step old. ``float32_updates=True``
lands bf16 params exactly on the store's master rounded to bf16 (``nsp.optim.scale_by_storage``).
"""

from __future__ import annotations

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
             float32_updates, *hyper) -> optax.GradientTransformationExtraArgs:
    """``scale_by_storage_kind(store, *hyper, ...)``, lazy as ``compression`` says, after Top-K compression when
    there is any: the one body of the four aliases, composed as optax composes its aliases."""
    tx = scale_by_storage_kind(store, *hyper, mesh=mesh, axis_name=axis_name, staleness=staleness,
                               lazy=_lazy(compression), float32_updates=float32_updates)
    if compression is None:
        return tx
    compress = topk_compress(compression.ratio, error_feedback=compression.error_feedback,
                             residual_decay=compression.residual_decay, method=compression.method,
                             num_shards=store.num_shards, mesh=mesh, axis_name=axis_name)
    return optax.chain(compress, tx)


def adam(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
         store: StateStore, compression: TopK | None = None, weight_decay: float = 0.0,
         mesh: Mesh | None = None, axis_name: str | None = None,
         staleness: int = 0, float32_updates: bool = False) -> optax.GradientTransformationExtraArgs:
    """Adam with its state in ``store`` (see ``optax.adam``).

    Example::

      store = nsp.storage.open("/nvme/run/store", tier="file")
      tx = nsp.optim.adam(1e-3, store=store, compression=nsp.optim.TopK(0.01))
    """
    return _compose(scale_by_storage_adam, store, compression, mesh, axis_name, staleness, float32_updates,
                    learning_rate, b1, b2, eps, weight_decay)


def adamw(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-4, *, store: StateStore, compression: TopK | None = None,
          mesh: Mesh | None = None, axis_name: str | None = None,
          staleness: int = 0, float32_updates: bool = False) -> optax.GradientTransformationExtraArgs:
    """AdamW with its state in ``store`` (see ``optax.adamw``)."""
    return _compose(scale_by_storage_adamw, store, compression, mesh, axis_name, staleness, float32_updates,
                    learning_rate, b1, b2, eps, weight_decay)


def sgd(learning_rate: optax.ScalarOrSchedule, momentum: float | None = None, nesterov: bool = False, *,
        store: StateStore, compression: TopK | None = None, weight_decay: float = 0.0,
        mesh: Mesh | None = None, axis_name: str | None = None,
        staleness: int = 0, float32_updates: bool = False) -> optax.GradientTransformationExtraArgs:
    """SGD (optionally with momentum) with its state in ``store`` (see ``optax.sgd``)."""
    return _compose(scale_by_storage_sgd, store, compression, mesh, axis_name, staleness, float32_updates,
                    learning_rate, momentum, nesterov, weight_decay)


def adagrad(learning_rate: optax.ScalarOrSchedule, initial_accumulator_value: float = 0.1, eps: float = 1e-7, *,
            store: StateStore, compression: TopK | None = None, mesh: Mesh | None = None,
            axis_name: str | None = None, staleness: int = 0,
            float32_updates: bool = False) -> optax.GradientTransformationExtraArgs:
    """AdaGrad with its state in ``store`` (see ``optax.adagrad``)."""
    return _compose(scale_by_storage_adagrad, store, compression, mesh, axis_name, staleness, float32_updates,
                    learning_rate, initial_accumulator_value, eps)
