"""``tx.init`` without the whole model in fp32: the store is written from the model's init functions, leaf by leaf.

``tx.init(params)`` needs the params: for a model whose fp32 params do not fit beside everything else (or would
only fit by pushing out what the step needs), set-up would be the peak of the run. ``init_from`` takes the
params' shapes (``jax.ShapeDtypeStruct`` leaves: ``nnx.eval_shape``, ``jax.eval_shape``) and a function that
gives one leaf's values at a time. Each storage transform in ``tx`` writes its fp32 master and moments straight
from those leaves into its store (``StateStore.initialize_from``, a few pages at a time), and keeps only the
step's copy of each leaf (bf16, say) once its pages are written. At most a leaf or two are alive in fp32 at a
time.

How: ``tx.init`` runs twice. First abstractly (``jax.eval_shape``) with the producer in scope, which each storage
transform's ``init`` picks up (``producing``): it records the write of its store from the leaves it was given,
which it finds by identity among the abstract params, so ``optax.masked``/``optax.partition`` chains work. The
writes run once that pass is over (outside any trace: ``produce`` may use JAX). Then ``tx.init`` runs for real
on the kept params inside ``nsp.optim.resuming()``: the storage transforms find their stores written and take
the committed version; every other transform in the chain initialises as it always does.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import jax
import numpy as np
import optax

from nsp.optim.compensation import resume_requested, resuming

_PRODUCING = threading.local()


class _Producer:
    """The leaves of one ``init_from`` call: gives each leaf once (to a store, or at the end to nobody), keeps its
    step copy, and lets go of the fp32 values at once."""

    def __init__(self, abstract: Any, produce: Callable[[int], Any], dtype: Any,
                 progress: Callable[[int, int], None] | None, checkpoint_margin: int):
        self.leaves, self.treedef = jax.tree_util.tree_flatten(abstract)
        self.produce = produce
        self.dtype = dtype
        self.progress = progress
        self.checkpoint_margin = checkpoint_margin
        self.kept: list[Any] = [None] * len(self.leaves)
        self.index: dict[int, int] = {}  # id of a traced input leaf -> its index in ``leaves``
        self.writes: list[Callable[[], None]] = []  # each storage transform's store write, in the chain's order

    def __call__(self, i: int) -> Any:
        if self.kept[i] is not None:
            raise ValueError(f"init_from: leaf {i} was asked for twice (two storage transforms over one leaf?)")
        spec = self.leaves[i]
        value = self.produce(i)
        if tuple(np.shape(value)) != tuple(spec.shape):
            raise ValueError(f"init_from: produce({i}) gave shape {tuple(np.shape(value))}, the params' leaf {i} "
                             f"has {tuple(spec.shape)}")
        self.kept[i] = jax.numpy.asarray(value).astype(self.dtype or spec.dtype)
        return value

    def indices_of(self, leaves: list[Any]) -> list[int]:
        """The indices (in the whole params) of the leaves a storage transform's ``init`` was given."""
        try:
            return [self.index[id(x)] for x in leaves]
        except KeyError:
            raise ValueError("init_from: a storage transform was given arrays computed from the params, not the "
                             "params' leaves themselves (a transform before it in the chain maps the params in "
                             "its init): initialise it with tx.init(params) instead") from None

    def params(self) -> Any:
        for i, leaf in enumerate(self.kept):
            if leaf is None:  # in no store: built all the same, for the step and the chain's other transforms
                self(i)
        return jax.tree_util.tree_unflatten(self.treedef, self.kept)


def producing() -> _Producer | None:
    """The ``init_from`` in progress on this thread, if any (what a storage transform's ``init`` asks)."""
    return getattr(_PRODUCING, "producer", None)


@contextlib.contextmanager
def _in_scope(producer: _Producer):
    previous = producing()
    _PRODUCING.producer = producer
    try:
        yield
    finally:
        _PRODUCING.producer = previous


def init_from(
    tx: optax.GradientTransformation,
    abstract_params: Any,
    produce: Callable[[int], Any],
    *,
    dtype: Any = None,
    progress: Callable[[int, int], None] | None = None,
    checkpoint_margin: int = 1,
) -> tuple[Any, optax.OptState]:
    """``(params, tx.init(params))`` for a fresh model, without ever holding the model in fp32.

    Args:
      tx: an optax transform containing nsp storage transforms (``nsp.optim.adamw(..., store=...)``, chained or
        partitioned as you like).
      abstract_params: the params' tree with ``jax.ShapeDtypeStruct`` leaves (or arrays), e.g.
        ``nnx.state(nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0))), nnx.Param)``.
      produce: ``produce(i)`` gives leaf ``i``'s initial values (``jax.tree_util.tree_leaves`` order; numpy or
        JAX, usually float32). Called once per leaf, in increasing order for the leaves of one store; the store
        copies them into its pages and drops them.
      dtype: the dtype of the params returned for the step (``jnp.bfloat16``: the store keeps the fp32 master,
        the step 2 bytes per parameter). None: each leaf's abstract dtype.
      progress: ``progress(done_bytes, total_bytes)`` as each store's pages are written.
      checkpoint_margin: as for ``StateStore.initialize_from`` (0 when no update follows a checkpoint).

    Returns:
      ``(params, opt_state)``: the params in ``dtype`` and the optax state, as ``tx.init`` would give for the
      model (``tx.update`` then steps from the fp32 master, not from the rounded copy).

    Raises:
      ValueError: ``produce`` gave a leaf of another shape; a storage transform gets arrays computed from the
        params rather than their leaves.
      nsp.storage.StoreError: as ``StateStore.initialize_from`` (not enough disk, another layout...).

    Example::

      import jax, jax.numpy as jnp, nsp.optim, nsp.storage

      shapes = {"w": (4096, 4096), "b": (4096,)}
      abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
      keys = jax.random.split(jax.random.key(0), 2)
      init_fns = [lambda: jnp.zeros(4096), lambda: 0.02 * jax.random.normal(keys[1], (4096, 4096))]
      tx = nsp.optim.adamw(1e-3, store=nsp.storage.open("/nvme/run/store", tier="file"))
      params, state = nsp.optim.init_from(tx, abstract, lambda i: init_fns[i](), dtype=jnp.bfloat16)

    For the GPTs of ``nsp.models``, ``nsp.train.layerwise.LayerwiseInit(config, seed)`` is such a ``produce``
    (``.abstract`` its tree): each leaf bit for bit the one ``GPT(config, rngs=nnx.Rngs(seed))`` holds.
    """
    if resume_requested():
        raise ValueError("init_from starts a fresh state from the producer; to continue a store's state, call "
                         "tx.init(params) inside nsp.optim.resuming() with the params read back")
    producer = _Producer(abstract_params, produce, dtype, progress, checkpoint_margin)

    def abstract_init(params):
        producer.index = {id(x): i for i, x in enumerate(jax.tree_util.tree_leaves(params))}
        return tx.init(params)

    with _in_scope(producer):
        jax.eval_shape(abstract_init, jax.tree_util.tree_unflatten(
            producer.treedef, [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in producer.leaves]))
    for write in producer.writes:
        write()
    params = producer.params()
    with resuming():  # the stores hold the state just written: init checks it and takes the committed version
        return params, tx.init(params)
