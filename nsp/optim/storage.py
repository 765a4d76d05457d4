"""Optax transforms whose optimizer state lives in an ``nsp.storage`` store and is updated near it.

The optax state holds only small things (the step count, the store version it refers to, a params hash); the fp32 master
params and moments stay in the store. The learning rate is traced (schedules and ``optax.inject_hyperparams``
change it without recompiling); the other hyperparameters are fixed when the store is initialized. ``update`` hands
the (possibly compressed) gradient to the store through
``nsp.primitives.store_update`` — one side-effecting XLA FFI call per device shard, inside your jitted step — and
returns updates such that ``optax.apply_updates(params, updates)`` gives the store's new params in the params'
own dtype (with ``float32_updates=True``, bf16 and f16 params take float32 updates and land on the master's
rounding exactly). Calling ``update`` twice with the same state gives the same result (the store replays the
version); a state older than that is a clear error.

The store's fp32 master is what the next update normally builds on: the params passed to ``update`` are the ones
the previous update led to (``optax.apply_updates(params, updates)`` of the updates it returned), and the master
holds them at full precision. When they are not -- a transform chained *after* the nsp optimizer changed its
updates (``optax.contrib.reduce_on_plateau`` once its scale drops, ``optax.scale``, clipping), or code edited the
params between steps -- the update does what optax does: it steps from the params it is given. The store then
adopts them as its master for that step (m and v stay its own), so such chains match optax. To tell the two
apart the state carries a fingerprint of the params the update led to, checked on the accelerator before the
store is touched (no host round trip). An adopted step costs the params' bytes once more down the shared link
(counted in ``store.stats()["params_adopted"]`` and ``shared_in_bytes``), and the master is then only as precise
as the params given (bf16 params lose the fp32 master's extra bits on such steps): to scale updates, prefer a
schedule, ``optax.inject_hyperparams`` or ``nsp.optim.reduce_on_plateau``, which scale the learning rate inside
the store. Casting the params to another float dtype between ``init`` and the first step (bf16 on the
accelerator) is not a change: the fingerprint knows those roundings. With ``staleness=1`` the params given are
one step old by design, so changed params fail the step with a clear error. Cost of the check: two hash
passes per step -- over the params given, and over the next params (``params + updates``, computed on the fly) --
and no params-sized memory (``nsp.optim.fingerprint``: C++ on a CPU, one fused reduction per leaf elsewhere).

What makes these transforms behave like optax's own -- adopting changed params, the fingerprint, float32
updates, the learning-rate scale, resuming, injected hyperparameters -- is ``nsp.optim.compensation``, each part
with the reason it exists.

With one device and one store shard, and gradient and params leaves of one dtype, the update takes the gradient
leaves as they are and writes each leaf's new params over its gradient (``store_update_leaves``): the optimizer
adds no memory to the step. Keep the params in bf16 on the accelerator (cast them after ``init``, which writes
the fp32 master into the store) and the step holds 2 bytes of params and 2 of gradient per parameter.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from nsp.optim import compensation as comp
from nsp.optim import fingerprint as fp
from nsp.optim._shards import shard_flat
from nsp.optim.compensation import LR_SCALE_ARG, lr_scale_consumers, resuming  # noqa: F401  (their old home)
from nsp.optim.compress import Compressed
from nsp.optim.init_from import producing
from nsp.primitives.staged_update import store_update_staged
from nsp.primitives.store_update import store_update, store_update_leaves
from nsp.storage import OptimizerSpec, StateStore


class StorageState(NamedTuple):
    """State of the storage transforms.

    Attributes:
      count: updates applied so far (int32); the next update is step ``count + 1``.
      version: the store version this state refers to (int32).
      params_fingerprint: uint32 ``[leaves, 4]``: per params leaf, a hash of the params the next ``update``
        expects (``optax.apply_updates`` of the previous update's result). After ``init`` the four columns are
        the init params as given and rounded to float32, bfloat16 and float16 (casting the params after ``init``
        is fine); after an update all four are the same.
    """

    count: jax.Array
    version: jax.Array
    params_fingerprint: jax.Array


def scale_by_storage(
    store: StateStore,
    optimizer: OptimizerSpec | None,
    learning_rate: optax.ScalarOrSchedule,
    *,
    mesh: Mesh | None = None,
    axis_name: str | None = None,
    staleness: int = 0,
    float32_updates: bool = False,
    stage_gradients: bool = False,
    clip_norm: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The general storage transform: ``optimizer``'s update of ``store``, at ``learning_rate``.

    The learning rate is applied inside the kernel, so this transform is the whole optimizer: do not chain
    ``optax.scale_by_learning_rate`` after it. Transforms that rescale gradients (clipping, ``optax.masked``,
    ``topk_compress``) go before it.

    Args:
      store: an opened ``nsp.storage`` store; ``init`` writes the params into it: a fresh state, as in optax,
        also on a store that holds one (``StateStore.restart``). Inside ``nsp.optim.resuming()`` it instead checks
        that the store holds this layout and optimizer and continues the store's state.
      optimizer: which update and its static hyperparameters (None inside a traced ``update`` when they were
        injected: the store's own are used; only the learning rate can change after init).
      learning_rate: a scalar or an optax schedule of the step count (traced: changing it never recompiles).
      mesh, axis_name: the mesh axis the store's shards are spread over (one shard per device).
      staleness: 0 = exact; 1 = the update streams in the background while the next step's forward/backward
        runs, which therefore sees params one step old (Angel-PTM's bounded staleness). Not replayable. On a
        CPU-only machine, give the update CPUs of its own with ``NSP_ENGINE_CPUS`` (README), or it competes with
        the forward/backward for cores.
      float32_updates: for bf16 and f16 params, return float32 updates: ``optax.apply_updates`` then lands the
        params exactly on the store's master rounded to their dtype, so they depend on the master alone and a
        run can continue from its store (``nsp train --no-checkpoints`` does; inside a jitted step XLA fuses the
        float32 update into the sum). Off by default: optax transforms such as ``optax.apply_if_finite`` expect
        updates in the gradients' dtype.
      stage_gradients: the leanest step in memory: each gradient leaf is written to the store's disk as soon as the
        backward pass has produced it, the update reads it from there, and the new params come back a leaf at a
        time (``nsp.primitives.store_update_staged``), so the step holds neither the whole gradient nor a second
        copy of the params, only the params and a few layers' gradient. Costs the gradient's and the new params'
        bytes through the store's stage file each step (for bf16, 4 bytes per parameter written and 4 read, the
        reads mostly from the page cache, beside the update's 24 of state I/O). Needs a single-shard store on disk
        (not the memory tier), one device, staleness 0, gradient and params leaves all float32 or all bfloat16,
        and no Top-K compression; an update that cannot take it raises ``ValueError`` naming why. Global-norm clipping chained before this
        transform (``optax.clip_by_global_norm``) needs the whole gradient at once for its norm: give
        ``clip_norm`` instead.
      clip_norm: with ``stage_gradients``: clip the gradient to this global norm (``optax.clip_by_global_norm``'s
        rule) as the update reads it from the stage file (``store_update_staged``); the norm comes from the stage
        calls, so the step still never holds the whole gradient.

    Returns:
      An optax transform; its ``update`` needs ``params`` (when they are not the ones the previous update led
      to, the step starts from them: module docstring). An ``nsp_learning_rate_scale=`` extra argument
      (``LR_SCALE_ARG``; what ``nsp.optim.reduce_on_plateau`` passes) multiplies the learning rate of that step.
    """

    if isinstance(staleness, jax.core.Tracer):
        # optax.inject_hyperparams traces every numeric argument. Staleness is fixed when init runs, and each
        # update takes it from the store's handle.
        staleness = None
    elif staleness not in (0, 1):
        raise ValueError(f"staleness must be 0 or 1, got {staleness}")
    if clip_norm is not None and not stage_gradients:
        raise ValueError("clip_norm is the staged update's clipping (stage_gradients=True); otherwise chain "
                         "optax.clip_by_global_norm before this transform")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be positive, got {clip_norm}")
    if stage_gradients and staleness:
        raise ValueError("stage_gradients=True needs staleness 0: a background step would read the staged gradient "
                         "while the next step writes it")

    def init_fn(params):
        if optimizer is None:
            raise TypeError("the optimizer's hyperparameters must be concrete numbers at init")
        leaves = jax.tree_util.tree_leaves(params)
        producer = producing()
        if producer is not None and leaves:  # nsp.optim.init_from's abstract pass: its producer writes the store
            _initialize_from(producer, params, leaves)
        traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
        if producer is not None or not leaves or not (
                traced or all(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves)):
            # A tree with no arrays (every leaf masked out), or placeholders (optax.tree.map_params), or an
            # abstract one (jax.ShapeDtypeStruct, init_from's pass): the state's structure, as optax's own
            # transforms give it. The store is written by the first init on real arrays (or by init_from).
            return StorageState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
                                jnp.zeros((len(leaves), fp.WIDTH), jnp.uint32))
        fingerprint = fp.init_fingerprint(params)
        resume = comp.resume_requested()  # taken when init is called (or traced, under jax.jit)
        if traced:
            # Under jax.jit the params reach the store through a host callback (once, at init; never on the
            # step's path); under jax.eval_shape nothing runs and nothing is written.
            def initialize(p):
                version = _initialize(p, resume)
                return np.int32(version - store.base_version(version)), np.int32(version)

            count, version = jax.experimental.io_callback(
                initialize, (jax.ShapeDtypeStruct((), jnp.int32),) * 2, params, ordered=True)
            return StorageState(count, version, fingerprint)
        version = _initialize(params, resume)
        count = version - store.base_version(version)  # updates applied since the optimizer started
        return StorageState(jnp.asarray(count, jnp.int32), jnp.asarray(version, jnp.int32), fingerprint)

    def _initialize(params, resume: bool) -> int:
        if staleness is None:
            raise TypeError("staleness must be a concrete 0 or 1 when init runs")
        if resume:  # nsp.optim.resuming(): the state the store holds, checked against the params' layout
            return store.initialize(params, optimizer, staleness=int(staleness),
                                    stage_itemsize=_stage_itemsize(params))
        return store.restart(params, optimizer, staleness=int(staleness))

    def _stage_itemsize(params) -> int:
        # The stage file holds the gradient in the params' dtype (the staged update needs one for all leaves).
        if not stage_gradients:
            return 0
        return max((jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params)), default=4)

    def _initialize_from(producer, params, leaves) -> None:
        if staleness is None:
            raise TypeError("staleness must be a concrete 0 or 1 when init runs")
        indices = producer.indices_of(leaves)
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)

        def produce(j):
            return producer(indices[j])

        def write():  # run by init_from once the abstract pass is over: produce() may use JAX itself
            if store.initialized:  # a fresh state from the producer as the next version (optax's init)
                store.restart(abstract, optimizer, staleness=int(staleness), produce=produce,
                              progress=producer.progress)
            else:
                store.initialize_from(abstract, produce, optimizer, staleness=int(staleness),
                                      progress=producer.progress, checkpoint_margin=producer.checkpoint_margin,
                                      stage_itemsize=_stage_itemsize(params))

        producer.writes.append(write)

    def update_fn(updates, state, params=None, **extra_args):
        # The store's update needs no extra args (accepted so that chains passing e.g. value= work), except a
        # learning-rate scale from nsp.optim.reduce_on_plateau.
        if params is None:
            raise ValueError("nsp storage transforms need params: call tx.update(grads, state, params). The update "
                             "returns new params - params in the params' dtype (the store keeps only their fp32 "
                             "master), and checks that the params are the ones the last update led to")
        handle = store.handle()
        layout = handle.layout
        lr = comp.scaled_lr(learning_rate(state.count) if callable(learning_rate) else learning_rate, extra_args)
        # Params changed since the update that led to them (a transform after this one scaled its updates, code
        # edited them): the store steps from the params given, as optax would, instead of from its master.
        adopt, params_leaves = comp.adopt_operands(state.params_fingerprint, params)
        new_flat = new_params = None  # the new params as the store's flat vector, or (the leaves path) a tree
        if isinstance(updates, Compressed):
            if stage_gradients:
                raise ValueError("stage_gradients=True takes a dense gradient, not a Top-K compressed one")
            if updates.values.shape[0] % layout.num_shards:
                raise ValueError(f"{updates.values.shape[0]} compressed entries do not split over the store's "
                                 f"{layout.num_shards} shards (topk_compress(num_shards=...) must match)")
            out = store_update(handle, values=updates.values.astype(jnp.float32), indices=updates.indices,
                               version=state.version, lr=lr, step=state.count + 1, mesh=mesh, axis_name=axis_name,
                               params=params_leaves, adopt=adopt, params_dtype=_flat_params_dtype(params_leaves))
            new_flat, version = out.params, out.version
        elif stage_gradients:
            _check_staging(store, layout, updates, params, mesh)
            ps = jax.tree_util.tree_leaves(params)
            # Leaf by leaf, so that each leaf's new params are consumed (optax.apply_updates) as they arrive.
            pieces, version = store_update_staged(
                handle, jax.tree_util.tree_leaves(updates), version=state.version, lr=lr, step=state.count + 1,
                params=ps, adopt=adopt, consume=functools.partial(_consume_staged, ps, float32_updates),
                clip_norm=clip_norm)
            treedef = jax.tree_util.tree_structure(params)
            new_updates = jax.tree_util.tree_unflatten(treedef, [u for u, _ in pieces])
            expected = jnp.concatenate([e for _, e in pieces], axis=0)
            applied = (version - state.version).astype(state.count.dtype)
            return new_updates, StorageState(state.count + applied, version, expected)
        elif _leaves_path(layout, updates, params, mesh):
            # One store shard, gradient and params of one dtype: the update reads the gradient leaves where they
            # are and writes the new params over them (no flat copies: the leanest step in memory).
            new_leaves, version = store_update_leaves(
                handle, jax.tree_util.tree_leaves(updates), version=state.version, lr=lr, step=state.count + 1,
                params=params_leaves, adopt=adopt)
            new_params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), new_leaves)
        else:
            leaves = jax.tree_util.tree_leaves(updates)
            # bf16 gradients travel as bf16 (half the bytes); anything else as fp32.
            dtype = jnp.bfloat16 if leaves and all(x.dtype == jnp.bfloat16 for x in leaves) else jnp.float32
            flat = shard_flat(layout.flatten(updates, dtype=dtype), mesh, axis_name)
            out = store_update(handle, flat, version=state.version, lr=lr, step=state.count + 1, mesh=mesh,
                               axis_name=axis_name, params=params_leaves, adopt=adopt,
                               params_dtype=_flat_params_dtype(params_leaves))
            new_flat, version = out.params, out.version
        # The updates come with the fingerprint of where they lead (on the CPU from one C++ pass that reads the
        # params before anything can write over them: nsp.optim.fingerprint).
        new_updates, expected = comp.updates_and_expected(params, new_params=new_params, new_flat=new_flat,
                                                          layout=layout, float32_updates=float32_updates)
        # A skipped step (non-finite gradient) leaves the version, and so the step count, where they were.
        applied = (version - state.version).astype(state.count.dtype)
        return new_updates, StorageState(state.count + applied, version, expected)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _flat_params_dtype(params_leaves) -> Any:
    """The dtype the store returns its flat params in: bfloat16 for bf16 params (half the bytes up the shared
    link, no float32 copy in the step), else float32."""
    bf16 = params_leaves and all(x.dtype == jnp.bfloat16 for x in params_leaves)
    return jnp.bfloat16 if bf16 else jnp.float32


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


def _consume_staged(ps, float32_updates, i, new):
    """Leaf ``i`` of a staged update: ``((updates, expected fingerprint row), next params)``. The next params are
    what the step's ``optax.apply_updates`` computes of this leaf (XLA merges the two): the next leaf is read only
    after it, so the step never holds more than one leaf's new params (``store_update_staged``)."""
    pair = comp.updates_and_expected(ps[i], new_params=new, float32_updates=float32_updates)
    return pair, optax.apply_updates(ps[i], pair[0])


def _check_staging(store, layout, updates, params, mesh) -> None:
    """Raises ``ValueError`` naming why an update cannot stage its gradient (``stage_gradients=True``)."""
    if store.tier == "memory":
        raise ValueError("stage_gradients=True stages the gradient on the store's disk: the memory tier has none "
                         "(and there the staged gradient would take the same host memory); open the store with "
                         "tier='file' or a device tier")
    if mesh is not None or layout.num_shards != 1:
        raise ValueError("stage_gradients=True needs one device and a single-shard store")
    if not _leaves_path(layout, updates, params, None):
        dtypes = sorted({str(x.dtype) for x in jax.tree_util.tree_leaves((updates, params))})
        raise ValueError("stage_gradients=True needs gradient and params leaves all float32 or all bfloat16, with "
                         f"the store layout's shapes; got dtypes {dtypes}")


def _check_lr(learning_rate):
    if not callable(learning_rate) and not isinstance(learning_rate, (numbers.Real, jax.Array, np.ndarray)):
        raise TypeError(f"learning_rate must be a number or a schedule, got {learning_rate!r}")


def _by_kind(kind: str, store: StateStore, learning_rate, hyper: dict, *, nesterov: bool = False, lazy: bool,
             mesh, axis_name, staleness, float32_updates=False, stage_gradients=False,
             clip_norm=None) -> optax.GradientTransformationExtraArgs:
    """The one body of the factories below: ``kind`` with its static hyperparameters (``hyper``: OptimizerSpec
    field -> the value given) as the store's spec, then ``scale_by_storage``."""
    _check_lr(learning_rate)
    static = {name: comp.static_hyper(value) for name, value in hyper.items()}
    spec = (None if any(v is None for v in static.values())
            else OptimizerSpec(kind, nesterov=bool(nesterov), lazy=bool(lazy), **static))
    return scale_by_storage(store, spec, learning_rate, mesh=mesh, axis_name=axis_name, staleness=staleness,
                            float32_updates=float32_updates, stage_gradients=stage_gradients,
                            clip_norm=clip_norm)


def scale_by_storage_adam(
    store: StateStore, learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
    eps: float = 1e-8, weight_decay: float = 0.0, *, mesh: Mesh | None = None, axis_name: str | None = None,
    staleness: int = 0, lazy: bool = False, float32_updates: bool = False, stage_gradients: bool = False,
    clip_norm: float | None = None,
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
    return _by_kind("adam", store, learning_rate, dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay),
                    lazy=lazy, mesh=mesh, axis_name=axis_name, staleness=staleness,
                    float32_updates=float32_updates, stage_gradients=stage_gradients, clip_norm=clip_norm)


def scale_by_storage_adamw(
    store: StateStore, learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
    eps: float = 1e-8, weight_decay: float = 1e-4, *, mesh: Mesh | None = None, axis_name: str | None = None,
    staleness: int = 0, lazy: bool = False, float32_updates: bool = False, stage_gradients: bool = False,
    clip_norm: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """AdamW (decoupled weight decay, optax's default 1e-4) on state kept in ``store``."""
    return _by_kind("adamw", store, learning_rate, dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay),
                    lazy=lazy, mesh=mesh, axis_name=axis_name, staleness=staleness,
                    float32_updates=float32_updates, stage_gradients=stage_gradients, clip_norm=clip_norm)


def scale_by_storage_sgd(
    store: StateStore, learning_rate: optax.ScalarOrSchedule, momentum: float | None = None,
    nesterov: bool = False, weight_decay: float = 0.0, *, mesh: Mesh | None = None, axis_name: str | None = None,
    staleness: int = 0, lazy: bool = False, float32_updates: bool = False, stage_gradients: bool = False,
    clip_norm: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """SGD, optionally with (Nesterov) momentum, on state kept in ``store`` (like ``optax.sgd``)."""
    hyper = dict(momentum=0.0 if momentum is None else momentum, weight_decay=weight_decay)
    return _by_kind("sgd", store, learning_rate, hyper, nesterov=nesterov, lazy=lazy, mesh=mesh,
                    axis_name=axis_name, staleness=staleness, float32_updates=float32_updates,
                    stage_gradients=stage_gradients, clip_norm=clip_norm)


def scale_by_storage_adagrad(
    store: StateStore, learning_rate: optax.ScalarOrSchedule, initial_accumulator_value: float = 0.1,
    eps: float = 1e-7, *, mesh: Mesh | None = None, axis_name: str | None = None, staleness: int = 0,
    lazy: bool = False, float32_updates: bool = False, stage_gradients: bool = False,
    clip_norm: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """AdaGrad on state kept in ``store`` (like ``optax.adagrad``)."""
    return _by_kind("adagrad", store, learning_rate, dict(eps=eps, initial_nu=initial_accumulator_value),
                    lazy=lazy, mesh=mesh, axis_name=axis_name, staleness=staleness,
                    float32_updates=float32_updates, stage_gradients=stage_gradients, clip_norm=clip_norm)
