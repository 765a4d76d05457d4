"""The jitted step of ``nsp train``: ``loss_fn`` (next-token cross-entropy of the GPT, or the class cross-entropy
of its classifier with ``--task classify``), ``make_train_step`` (the
jitted train and eval steps: forward/backward, then the optax chain, data parallel over a mesh with gradients
averaged in an order that does not depend on the process layout), and placing data on the devices:
``put_batch`` (a host batch), ``local_rows`` (the rows of a global batch this process feeds) and ``replicate``
(params and optax state on every device of the mesh)."""

from __future__ import annotations

import functools

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from nsp.models import cross_entropy_loss


def loss_fn(graphdef, params, tokens, block_call=None):
    """Mean next-token cross-entropy of the GPT ``(graphdef, params)`` on ``tokens`` ``[batch, seq + 1]``: it reads
    ``tokens[:, :-1]`` and predicts ``tokens[:, 1:]``. ``block_call``: how each block is applied (``GPT.__call__``;
    ``nsp.offload.offload_blocks`` spills their activations).

    A labelled batch (``--task classify``: ``{"tokens": [batch, seq], "labels": [batch]}``, ``nsp.train.labels``)
    gives the mean cross-entropy of the model's classifier (``GPT.classify``) instead."""
    if isinstance(tokens, dict):
        return cross_entropy_loss(class_logits(graphdef, params, tokens["tokens"], block_call), tokens["labels"])
    logits = nnx.merge(graphdef, params)(tokens[:, :-1], block_call=block_call)
    return cross_entropy_loss(logits, tokens[:, 1:])


def class_logits(graphdef, params, tokens, block_call=None):
    """Float32 class logits ``[batch, classes]`` of int ``tokens`` ``[batch, seq]``: every block, pooled, then the
    classifier."""
    model = nnx.merge(graphdef, params)
    x = model.blocks(model.embed(tokens), 0, model.config.n_layer, block_call=block_call)
    return model.classify(model.pool(x))


def eval_metrics(graphdef, params, batch):
    """The held-out metrics of one batch: the loss (``loss_fn``), and with a labelled batch also the accuracy,
    as ``{"loss": ..., "accuracy": ...}``."""
    if not isinstance(batch, dict):
        return {"loss": loss_fn(graphdef, params, batch)}
    logits = class_logits(graphdef, params, batch["tokens"])
    return {"loss": cross_entropy_loss(logits, batch["labels"]),
            "accuracy": jnp.mean((jnp.argmax(logits, axis=-1) == batch["labels"]).astype(jnp.float32))}


def loss_from_features(graphdef, params, batch, first_block: int):
    """``loss_fn`` from a frozen backbone's features (``nsp.train.features``): blocks ``first_block ..`` and the
    head on ``batch["x"]`` (cast to the residual stream's dtype, the params'), scored on ``batch["tokens"]``.
    A classification batch (``batch["labels"]``) holds per-token features (``[batch, seq, width]``: blocks
    ``first_block ..``, pooling and the classifier run) or, when every block is frozen, pooled ones (``[batch,
    width]``: only the classifier runs)."""
    model = nnx.merge(graphdef, params)
    x = batch["x"].astype(model.wte.embedding[...].dtype)
    if "labels" in batch:
        if x.ndim == 3:
            x = model.pool(model.blocks(x, first_block, model.config.n_layer))
        return cross_entropy_loss(model.classify(x), batch["labels"])
    logits = model.head(model.blocks(x, first_block, model.config.n_layer))
    return cross_entropy_loss(logits, batch["tokens"][:, 1:])


def make_train_step(graphdef, tx: optax.GradientTransformation, mesh=None, block_call=None, freeze=None,
                    features_from: int = 0):
    """``(train_step, eval_step)``, both jitted.

    ``train_step(params, opt_state, tokens) -> (params, opt_state, loss)``: forward/backward of ``loss_fn``, then
    ``tx``; it donates ``params`` and ``opt_state`` (do not use them after the call). ``eval_step(params, tokens)
    -> {"loss": ...}`` (and ``"accuracy"`` for a labelled batch: ``eval_metrics``). With a ``mesh`` (axis ``"data"``), params and optax state are replicated and the batch is split
    over the devices (``put_batch`` places it so). ``block_call`` as for ``loss_fn`` (the train step's only: the
    eval step has no backward pass whose activations to keep).

    ``freeze`` (an ``nsp.train.freeze.Freeze``): the leaves it names are differentiated not at all and pass
    through the step unchanged; ``tx`` and its state see only the trainable tree (``Freeze.split``).

    ``features_from`` (> 0): the train step's batch is a frozen backbone's features (``nsp.train.features``:
    ``{"x", "tokens"}``) and only blocks ``features_from ..`` and the head run; the eval step still takes tokens.
    """
    from nsp.train.freeze import Freeze

    freeze = freeze or Freeze()

    def loss(trainable, frozen, tokens):
        if features_from:
            return loss_from_features(graphdef, Freeze.merge(trainable, frozen), tokens, features_from)
        return loss_fn(graphdef, Freeze.merge(trainable, frozen), tokens, block_call=block_call)

    def update(value_and_grad, params, opt_state, tokens):
        # Only the trainable tree is differentiated: JAX then builds no gradient of a frozen leaf, nor the backward
        # pass of what lies below the lowest trainable leaf.
        trainable, frozen = freeze.split(params)
        value, grads = value_and_grad(trainable, frozen, tokens)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return Freeze.merge(optax.apply_updates(trainable, updates), frozen), opt_state, value

    evaluate = functools.partial(eval_metrics, graphdef)
    if mesh is None:
        train_step = functools.partial(update, jax.value_and_grad(loss))
        return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(evaluate)

    data_parallel_step = functools.partial(update, _mean_over_devices(jax.value_and_grad(loss), mesh))
    # Data parallel: params and the small optax state replicated, the batch split over the devices. Fixing the
    # shardings (rather than letting XLA pick them) keeps the compiled step, and so its float rounding, the same
    # in a fresh and in a resumed run: resume stays bit-exact.
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    step = jax.jit(data_parallel_step, donate_argnums=(0, 1), in_shardings=(replicated, replicated, batch),
                   out_shardings=(replicated, replicated, replicated))
    return step, jax.jit(evaluate, in_shardings=(replicated, batch))


def _mean_over_devices(value_and_grad, mesh):
    """``value_and_grad(trainable, frozen, tokens)`` on each device's rows of ``tokens``, averaged over the
    ``"data"`` axis in an order that does not depend on where the devices are.

    An all-reduce adds the devices' gradients in whatever order its implementation picks, and the one between
    processes picks another than the one inside a process: 2 processes x 2 devices would then round differently
    from 1 x 4. Here every device sends each other device that one's slice of its gradient (all_to_all: bytes
    moved, nothing added), adds the slices it receives in device order, and the sums are gathered back (again
    nothing added): the same bits whatever the process layout, for the same traffic as a ring all-reduce.
    """
    n = mesh.shape["data"]

    def local(trainable, frozen, tokens):
        value, grads = value_and_grad(trainable, frozen, tokens)
        flat, unravel = jax.flatten_util.ravel_pytree(grads)
        size = flat.size
        pieces = jnp.pad(flat, (0, -size % n)).reshape(n, -1)  # piece j: the slice device j sums
        received = jax.lax.all_to_all(pieces, "data", split_axis=0, concat_axis=0)  # [n, size / n], by sender
        mine = functools.reduce(jnp.add, [received[i] for i in range(n)]) / n  # in device order
        total = jax.lax.all_gather(mine, "data", tiled=True)[:size]
        values = jax.lax.all_gather(value, "data")
        return functools.reduce(jnp.add, [values[i] for i in range(n)]) / n, unravel(total)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()), check_vma=False)


def replicate(tree, mesh):
    """``tree`` (the same values on every process) replicated over every device of ``mesh``."""
    sharding = NamedSharding(mesh, P())
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx, x=np.asarray(x): x[idx]), tree)


def local_rows(batch_size: int, mesh=None) -> slice:
    """The rows of a global batch this process feeds: those of its devices' positions on ``mesh`` (all rows for a
    lone process)."""
    if mesh is None or jax.process_count() == 1:
        return slice(0, batch_size)
    devices = list(mesh.devices.flat)
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    per = batch_size // len(devices)
    return slice(mine[0] * per, (mine[-1] + 1) * per)


def put_batch(batch: np.ndarray, mesh=None, *, global_rows: int | None = None) -> jax.Array:
    """A host batch on the device(s) as ``make_train_step``'s steps take it: split over ``mesh``'s ``"data"`` axis
    when there is a mesh. One process of several passes either the whole global batch (its rows are taken) or
    only its rows (``local_rows``) with ``global_rows``, the global batch's row count."""
    if isinstance(batch, dict):  # a features batch (nsp.train.features): each of its arrays alike
        return {k: put_batch(v, mesh, global_rows=global_rows) for k, v in batch.items()}
    if mesh is None:
        return jnp.asarray(batch)
    sharding = NamedSharding(mesh, P("data"))
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    if global_rows is None:
        global_rows = batch.shape[0]
        batch = batch[local_rows(global_rows, mesh)]
    return jax.make_array_from_process_local_data(sharding, batch, (global_rows,) + batch.shape[1:])
