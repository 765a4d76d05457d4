"""What the storage transforms do to behave like optax although their state lives in a store.

An optax optimizer keeps its whole state in the pytree ``init`` returns and ``update`` threads through; nsp keeps
the fp32 master and the moments in a store and the optax state holds only a step count, a store version and a
fingerprint. Each part below makes up for one difference that would otherwise show (``nsp.optim.storage`` puts
them together in ``scale_by_storage``):

- **Adopting changed params** (``adopt_operands``). optax steps from the params it is given; the store steps
  from its master. They agree while the params are the ones the previous update led to. When they are not (a
  transform chained after the nsp optimizer changed its updates, ``optax.contrib.reduce_on_plateau`` or
  ``optax.scale``, or code edited the params), the store adopts the given params as its master for that step.
- **The params fingerprint** (``updates_and_expected``; ``init`` takes ``nsp.optim.fingerprint.init_fingerprint``,
  where the hashes are). Telling the two cases apart without a host round trip: the state carries a hash
  of the params the update led to, and the next update compares, on the accelerator, before touching the store.
  After ``init`` it also knows the params' roundings to bf16/f16 (casting them after ``init`` is no change).
- **``float32_updates``** (``updates_and_expected``). optax returns updates in the params' dtype; for bf16 or
  f16 params float32 updates instead land ``optax.apply_updates`` on the master's rounding, so the params depend
  on the master alone and a run can continue from its store (but for params stepping onto or across zero from
  far above it, which land beside it: ``nsp.optim.fingerprint.update_in_params_dtype``).
- **The learning-rate scale** (``LR_SCALE_ARG``, ``lr_scale_consumers``, ``mark_lr_scaled``, ``scaled_lr``).
  ``optax.contrib.reduce_on_plateau`` scales updates after the optimizer, which would make every step adopt
  changed params; ``nsp.optim.reduce_on_plateau`` passes its scale as an extra argument instead, the storage
  transforms multiply their learning rate by it (the store applies the scaled step), and say so, so that a
  wrapper around an optimizer without a storage transform scales the updates as optax does.
- **Resuming** (``resuming``, ``resume_requested``). optax's ``init`` means a fresh state; a store outlives the
  process, so ``init`` inside ``resuming()`` continues the state the store holds instead of restarting it.
- **Injected hyperparameters** (``static_hyper``). Under ``optax.inject_hyperparams`` every hyperparameter
  arrives traced; only the learning rate is traced into the kernel, the others are the store's own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nsp.optim import fingerprint as fp

# ---- resuming -------------------------------------------------------------------------------------------------

_RESUMING = threading.local()
_RESUMING.depth = 0


@contextlib.contextmanager
def resuming():
    """Inside it, ``tx.init(params)`` of a storage transform resumes: on a store that holds a state it checks
    that state against the params' layout and the optimizer and returns an optax state naming the store's
    committed version (its moments, master and version carry on), writing nothing.

    Outside it ``init`` means what it means in optax: a fresh state from the params given, also on a store that
    holds one (``StateStore.restart``: the next version holds the params and zeroed moments; an optax state made
    before it fails its next update with a clear error).

    Example::

      store = nsp.storage.open("/nvme/run/store", tier="file")   # a store a previous run left
      tx = nsp.optim.adamw(1e-3, store=store)
      with nsp.optim.resuming():
          state = tx.init(params)                                 # continues the previous run's state
    """
    if not hasattr(_RESUMING, "depth"):
        _RESUMING.depth = 0
    _RESUMING.depth += 1
    try:
        yield
    finally:
        _RESUMING.depth -= 1


def resume_requested() -> bool:
    """Whether this thread is inside ``resuming()`` (read when ``init`` is called, or traced under jax.jit)."""
    return bool(getattr(_RESUMING, "depth", 0))


# ---- the learning-rate scale ----------------------------------------------------------------------------------

#: The extra argument through which ``nsp.optim.reduce_on_plateau`` (or any caller) scales the learning rate of
#: the storage transforms inside an ``update`` call: the store then applies the scaled step itself.
LR_SCALE_ARG = "nsp_learning_rate_scale"

_LR_SCALE_USERS = threading.local()


@contextlib.contextmanager
def lr_scale_consumers():
    """Counts the storage transforms that apply ``LR_SCALE_ARG`` while tracing the ``update`` calls inside.

    Yields a list that gets one entry per storage transform that scaled its learning rate (``mark_lr_scaled``).
    """
    stack = getattr(_LR_SCALE_USERS, "stack", None)
    if stack is None:
        stack = _LR_SCALE_USERS.stack = []
    seen: list[bool] = []
    stack.append(seen)
    try:
        yield seen
    finally:
        stack.pop()


def mark_lr_scaled() -> None:
    """Tells every enclosing ``lr_scale_consumers()`` that the scale was applied (by a storage transform, or by a
    wrapper that scaled the updates itself)."""
    for seen in getattr(_LR_SCALE_USERS, "stack", ()):
        seen.append(True)


def scaled_lr(lr: Any, extra_args: dict) -> Any:
    """The learning rate of this step: ``lr`` times the ``LR_SCALE_ARG`` extra argument when one is given (and
    then marked as applied), else ``lr`` as it is."""
    lr_scale = extra_args.get(LR_SCALE_ARG)
    if lr_scale is None:
        return lr
    mark_lr_scaled()
    return jnp.asarray(lr, jnp.float32) * jnp.asarray(lr_scale).astype(jnp.float32)


# ---- adopting changed params, the fingerprint, float32 updates -----------------------------------------------

def adopt_operands(fingerprint: jax.Array, params: Any) -> tuple[jax.Array, list[jax.Array]]:
    """``(adopt, params_leaves)`` for the store update: whether the params differ from the ones the previous
    update led to (``fingerprint``, checked on the accelerator), and the leaves the store adopts if so."""
    return fp.params_changed(fingerprint, params), jax.tree_util.tree_leaves(params)


def updates_and_expected(params: Any, *, new_params: Any = None, new_flat: jax.Array | None = None,
                         layout=None, float32_updates: bool = False) -> tuple[Any, jax.Array]:
    """The updates that take ``params`` to the store's new params (a tree ``new_params``, or the store's flat
    vector ``new_flat`` of ``layout``), in the params' dtype or, with ``float32_updates``, float32; and the
    fingerprint of where they lead (what the next update expects)."""
    if new_flat is None:
        return fp.updates_and_expected(params, new_params, float32_updates)
    return fp.updates_and_expected_flat(params, new_flat, [spec.offset for spec in layout.leaves], float32_updates)


# ---- injected hyperparameters ----------------------------------------------------------------------------------


def static_hyper(value: Any) -> float | None:
    """Hyperparameters other than the learning rate are compile-time constants of the update kernel, fixed when
    the store is initialized. Under ``optax.inject_hyperparams`` they arrive traced inside ``update``: then
    None, and the update uses the values the store was initialized with."""
    if isinstance(value, jax.core.Tracer):
        return None
    return float(np.asarray(value))
