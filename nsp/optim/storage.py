"""Optax transforms whose optimizer state lives in an ``nsp.storage`` store and is updated near it.

The optax state holds only small things (the step count and the store version it refers to); the fp32 master
params and moments stay in the store. The learning rate is traced (schedules and ``optax.inject_hyperparams``
change it without recompiling); the other hyperparameters are fixed when the store is initialized. ``update`` hands the (possibly compressed) gradient to the store through
``nsp.primitives.store_update`` — one side-effecting XLA FFI call per device shard, inside your jitted step — and
returns updates such that ``optax.apply_updates(params, updates)`` gives the store's new params in the params'
own dtype. Calling ``update`` twice with the same state gives the same result (the store replays the version);
a state older than that is a clear error.

With one device and one store shard, and gradient and params leaves of one dtype, the update takes the gradient
leaves as they are and writes each leaf's new params over its gradient (``store_update_leaves``): the optimizer
adds no memory to the step. Keep the params in bf16 on the accelerator (cast them after ``init``, which writes
the fp32 master into the store) and the step holds 2 bytes of params and 2 of gradient per parameter.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from nsp.optim._shards import shard_flat
from nsp.optim.compress import Compressed
from nsp.primitives.store_update import store_update, store_update_leaves
from nsp.storage import OptimizerSpec, StateStore


class StorageState(NamedTuple):
    """State of the storage transforms.

    Attributes:
      count: updates applied so far (int32); the next update is step ``count + 1``.
      version: the store version this state refers to (int32).
    """

    count: jax.Array
    version: jax.Array


def _static(name: str, value: Any) -> float | None:
    """Hyperparameters other than the learning rate are compile-time constants of the update kernel, fixed when
    the store is initialized. Under ``optax.inject_hyperparams`` they arrive traced inside ``update``: then
    None, and the update uses the values the store was initialized with."""
    if isinstance(value, jax.core.Tracer):
        return None
    return float(np.asarray(value))


def _spec(kind: str, lazy: bool, **hyper) -> OptimizerSpec | None:
    if any(v is None for v in hyper.values()):
        return None
    return OptimizerSpec(kind, lazy=lazy, **hyper)


def scale_by_storage(
    store: StateStore,
    optimizer: OptimizerSpec | None,
    learning_rate: optax.ScalarOrSchedule,
    *,
    mesh: Mesh | None = None,
    axis_name: str | None = None,
    staleness: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """The general storage transform: ``optimizer``'s update of ``store``, at ``learning_rate``.

    The learning rate is applied inside the kernel, so this transform is the whole optimizer: do not chain
    ``optax.scale_by_learning_rate`` after it. Transforms that rescale gradients (clipping, ``optax.masked``,
    ``topk_compress``) go before it.

    Args:
      store: an opened ``nsp.storage`` store; ``init`` writes the params into it (or checks that the store
        already holds this layout and optimizer, when resuming).
      optimizer: which update and its static hyperparameters (None inside a traced ``update`` when they were
        injected: the store's own are used; only the learning rate can change after init).
      learning_rate: a scalar or an optax schedule of the step count (traced: changing it never recompiles).
      mesh, axis_name: the mesh axis the store's shards are spread over (one shard per device).
      staleness: 0 = exact; 1 = the update streams in the background while the next step's forward/backward
        runs, which therefore sees params one step old (Angel-PTM's bounded staleness). Not replayable. On a
        CPU-only machine, give the update CPUs of its own with ``NSP_ENGINE_CPUS`` (README), or it competes with
        the forward/backward for cores.

    Returns:
      An optax transform; its ``update`` needs ``params``.
    """

    if isinstance(staleness, jax.core.Tracer):
        # optax.inject_hyperparams traces every numeric argument; staleness is fixed when init runs.
        staleness = getattr(store, "staleness", 0)
    elif staleness not in (0, 1):
        raise ValueError(f"staleness must be 0 or 1, got {staleness}")

    def init_fn(params):
        if optimizer is None:
            raise TypeError("the optimizer's hyperparameters must be concrete numbers at init")
        leaves = jax.tree_util.tree_leaves(params)
        traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
        if not leaves or not (traced or all(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves)):
            # A tree with no arrays (every leaf masked out), or placeholders (optax.tree.map_params), or an
            # abstract one (jax.ShapeDtypeStruct): the state's structure, as optax's own transforms give it. The
            # store is written by the first init on real arrays.
            return StorageState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
        if traced:
            # Under jax.jit the params reach the store through a host callback (once, at init; never on the
            # step's path); under jax.eval_shape nothing runs and nothing is written.
            version = jax.experimental.io_callback(
                lambda p: np.int32(_initialize(p)), jax.ShapeDtypeStruct((), jnp.int32), params, ordered=True)
            return StorageState(version, version)
        version = _initialize(params)
        return StorageState(jnp.asarray(version, jnp.int32), jnp.asarray(version, jnp.int32))

    def _initialize(params) -> int:
        store.staleness = int(staleness)
        return store.initialize(params, optimizer)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args  # the store's update needs none; accepted so that chains passing e.g. value= work
        if params is None:
            raise ValueError("nsp storage transforms need params: call tx.update(grads, state, params)")
        layout = store.layout
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        if isinstance(updates, Compressed):
            if updates.values.shape[0] % layout.num_shards:
                raise ValueError(f"{updates.values.shape[0]} compressed entries do not split over the store's "
                                 f"{layout.num_shards} shards (topk_compress(num_shards=...) must match)")
            out = store_update(store, values=updates.values.astype(jnp.float32), indices=updates.indices,
                               version=state.version, lr=lr, step=state.count + 1, mesh=mesh, axis_name=axis_name,
                               staleness=staleness)
            new_params, version = layout.unflatten(out.params, params, dtype=jnp.float32), out.version
        elif _leaves_path(layout, updates, params, mesh):
            # One store shard, gradient and params of one dtype: the update reads the gradient leaves where they
            # are and writes the new params over them (no flat copies: the leanest step in memory).
            new_leaves, version = store_update_leaves(
                store, jax.tree_util.tree_leaves(updates), version=state.version, lr=lr, step=state.count + 1,
                staleness=staleness)
            new_params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), new_leaves)
        else:
            leaves = jax.tree_util.tree_leaves(updates)
            # bf16 gradients travel as bf16 (half the bytes); anything else as fp32.
            dtype = jnp.bfloat16 if leaves and all(x.dtype == jnp.bfloat16 for x in leaves) else jnp.float32
            flat = shard_flat(layout.flatten(updates, dtype=dtype), mesh, axis_name)
            out = store_update(store, flat, version=state.version, lr=lr, step=state.count + 1, mesh=mesh,
                               axis_name=axis_name, staleness=staleness)
            new_params, version = layout.unflatten(out.params, params, dtype=jnp.float32), out.version
        new_updates = jax.tree_util.tree_map(_update_in_params_dtype, new_params, params)
        # A skipped step (non-finite gradient) leaves the version, and so the step count, where they were.
        applied = (version - state.version).astype(state.count.dtype)
        return new_updates, StorageState(state.count + applied, version)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update_in_params_dtype(new: jax.Array, param: jax.Array) -> jax.Array:
    """The update, in the params' dtype (optax's rule), that ``optax.apply_updates`` turns into the store's new
    fp32 master rounded to that dtype (``t``): ``p + (t - p)`` is exactly ``t`` whenever the difference is exact
    in that dtype (Sterbenz: ``t`` and ``p`` within a factor of 2 of each other). A step larger than that (a
    param near zero, or crossing it) needs a ``u`` finer than the dtype holds at ``u``'s size: ``p + u`` then
    lands within an ulp of ``t``, as ``p + (t - p)`` does in optax's own arithmetic."""
    target = new.astype(param.dtype)
    wide = jnp.promote_types(param.dtype, jnp.float32)
    return (target.astype(wide) - param.astype(wide)).astype(param.dtype)


def _leaves_path(layout, updates, params, mesh) -> bool:
    """Whether the update can take the gradient as leaves (``store_update_leaves``): one device and one store
    shard, and gradient and params leaves all of one dtype (float32 or bfloat16) with the layout's shapes."""
    if mesh is not None or layout.num_shards != 1:
        return False
    grads, ps = jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(params)
    if not grads or len(grads) != len(ps) or len(grads) != len(layout.leaves):
        return False
    dtype = grads[0].dtype
    return dtype in (jnp.float32, jnp.bfloat16) and all(
        g.dtype == dtype and p.dtype == dtype and tuple(g.shape) == spec.shape
        for g, p, spec in zip(grads, ps, layout.leaves))


def _check_lr(learning_rate):
    if not callable(learning_rate) and not isinstance(learning_rate, (numbers.Real, jax.Array, np.ndarray)):
        raise TypeError(f"learning_rate must be a number or a schedule, got {learning_rate!r}")


def scale_by_storage_adam(
    store: StateStore,
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    mesh: Mesh | None = None,
    axis_name: str | None = None,
    staleness: int = 0,
    lazy: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Adam on state kept in ``store`` (``weight_decay`` as L2 on the gradient, like
    ``optax.chain(optax.add_decayed_weights(wd), optax.adam(...))``).

    ``lazy=True`` (all four factories): an entry whose gradient is exactly zero keeps its param and state -- no
    momentum step, no decay, no weight decay (LazyAdam). After ``topk_compress`` only the sent entries move
    (``nsp.optim.compress`` compares the two updates). The ``nsp.optim`` aliases with ``compression=TopK(...)``
    use ``TopK.lazy``.

    Example::

      store = nsp.storage.open(tier="memory")
      tx = nsp.optim.scale_by_storage_adam(store, learning_rate=1e-3)
      state = tx.init(params)
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    """
    _check_lr(learning_rate)
    spec = _spec("adam", b1=_static("b1", b1), b2=_static("b2", b2), eps=_static("eps", eps),
                 weight_decay=_static("weight_decay", weight_decay), lazy=bool(lazy))
    return scale_by_storage(store, spec, learning_rate, mesh=mesh, axis_name=axis_name, staleness=staleness)


def scale_by_storage_adamw(
    store: StateStore,
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    *,
    mesh: Mesh | None = None,
    axis_name: str | None = None,
    staleness: int = 0,
    lazy: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """AdamW (decoupled weight decay, optax's default 1e-4) on state kept in ``store``."""
    _check_lr(learning_rate)
    spec = _spec("adamw", b1=_static("b1", b1), b2=_static("b2", b2), eps=_static("eps", eps),
                 weight_decay=_static("weight_decay", weight_decay), lazy=bool(lazy))
    return scale_by_storage(store, spec, learning_rate, mesh=mesh, axis_name=axis_name, staleness=staleness)


def scale_by_storage_sgd(
    store: StateStore,
    learning_rate: optax.ScalarOrSchedule,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    mesh: Mesh | None = None,
    axis_name: str | None = None,
    staleness: int = 0,
    lazy: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """SGD, optionally with (Nesterov) momentum, on state kept in ``store`` (like ``optax.sgd``)."""
    _check_lr(learning_rate)
    spec = _spec("sgd", momentum=_static("momentum", 0.0 if momentum is None else momentum),
                 nesterov=bool(nesterov), weight_decay=_static("weight_decay", weight_decay), lazy=bool(lazy))
    return scale_by_storage(store, spec, learning_rate, mesh=mesh, axis_name=axis_name, staleness=staleness)


def scale_by_storage_adagrad(
    store: StateStore,
    learning_rate: optax.ScalarOrSchedule,
    initial_accumulator_value: float = 0.1,
    eps: float = 1e-7,
    *,
    mesh: Mesh | None = None,
    axis_name: str | None = None,
    staleness: int = 0,
    lazy: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """AdaGrad on state kept in ``store`` (like ``optax.adagrad``)."""
    _check_lr(learning_rate)
    spec = _spec("adagrad", eps=_static("eps", eps),
                 initial_nu=_static("initial_accumulator_value", initial_accumulator_value), lazy=bool(lazy))
    return scale_by_storage(store, spec, learning_rate, mesh=mesh, axis_name=axis_name, staleness=staleness)
