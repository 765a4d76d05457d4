"""Training a Flax GPT with its optimizer state in a storage tier: ``train_and_evaluate(config)``.

One jitted step: forward/backward on the accelerator, then the optax chain (clipping, optional Top-K
compression, the nsp storage optimizer) whose update runs in the store's C++ engine through the XLA FFI. The
store holds the fp32 master params and moments; the model's params come back from it every step. Checkpoints
are snapshots of the store (hard links) plus the small train state, through an orbax CheckpointManager.

One process of several (``nsp.distributed``: ``--coordinator``/``--num-processes``/``--process-id`` or what JAX
detects) builds the same mesh over every process's devices, holds only the store shards of its own devices (in
``STORE_DIR/process-NNNNN``), reads only its rows of each global batch, and checkpoints its shards into its part of
each step; the processes agree on the committed version before every checkpoint.

The pieces a run is built from are public, so that other loops (the benchmarks, a user's own) step exactly as
``nsp train`` does: ``load_data`` (the batches), ``init_model`` (graphdef and params), ``make_optimizer`` (the
optax chain on a store), ``make_train_step`` (the jitted train and eval steps), ``put_batch`` and ``loss_fn``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import nsp.distributed
import nsp.optim
import nsp.storage
from nsp.models import GPT, cross_entropy_loss, get_config
from nsp.storage import checkpoint as ckpt
from nsp.train import data as data_lib
from nsp.train import store_resume
from nsp.train.config import TrainConfig
from nsp.train.layerwise import LayerwiseInit, SetupProgress, fmt_gib, peak_rss_bytes


def lean_malloc() -> None:
    """glibc's malloc as ``bench/max_model.py`` runs its attempts: blocks from 128 KiB up mmapped (and unmapped
    when freed; glibc's default raises that threshold to the size of the blocks freed, which then stay in the
    heap), two arenas. For ``bf16_params`` runs near the machine's memory; a no-op elsewhere than glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD (also turns glibc's dynamic threshold off)
        libc.mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


class TrainError(RuntimeError):
    """The run cannot start or continue as configured (the message says why; nothing was overwritten)."""


@dataclasses.dataclass
class Run:
    """Everything a training run holds while it runs."""

    config: TrainConfig
    graphdef: Any
    params: Any
    opt_state: Any
    store: nsp.storage.StateStore
    tx: optax.GradientTransformation
    train_batches: data_lib.Batcher
    eval_batches: list[np.ndarray]
    mesh: Any
    step: int
    tokens_per_step: int
    agree_s: float = 0.0  # time spent agreeing on the committed version (multi-process), in total


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warm-up from 0 to the peak, then cosine decay to ``lr * min_lr_ratio`` at ``steps`` (the model's
    recipe fills an unset peak and warm-up: ``TrainConfig.resolved``)."""
    config = config.resolved()
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.lr, warmup_steps=min(config.warmup_steps, config.steps),
        decay_steps=max(config.steps, config.warmup_steps + 1), end_value=config.lr * config.min_lr_ratio)


def make_optimizer(config: TrainConfig, store, mesh) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(config)
    # float32_updates: bf16 params land exactly on the store's master rounded to bf16, so they depend on the master
    # alone and a run without checkpoints can continue from its store (store_resume).
    kw = dict(store=store, mesh=mesh, axis_name="data" if mesh is not None else None, staleness=config.staleness,
              float32_updates=True)
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
    return optax.chain(optax.clip_by_global_norm(config.clip), tx) if config.clip else tx


def loss_fn(graphdef, params, tokens):
    """Mean next-token cross-entropy of the GPT ``(graphdef, params)`` on ``tokens`` ``[batch, seq + 1]``: it reads
    ``tokens[:, :-1]`` and predicts ``tokens[:, 1:]``."""
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return cross_entropy_loss(logits, tokens[:, 1:])


@dataclasses.dataclass
class TrainData:
    """The tokens of a run and the batches drawn from them (``load_data``)."""

    tokens: data_lib.TokenData
    train_tokens: np.ndarray  # the first 95%
    held_out_tokens: np.ndarray  # the last 5%, contiguous
    train_batches: data_lib.Batcher  # batch(step) is a function of (seed, step)
    eval_batches: list[np.ndarray]  # config.eval_batches fixed batches of the held-out tokens (seed + 1)


def load_data(config: TrainConfig) -> TrainData:
    """``config.data`` (the Python stdlib sources when empty) in windows of ``config.seq + 1`` tokens, 5% held out;
    training batches seeded by ``config.seed``, held-out ones by ``config.seed + 1``. Raises
    ``nsp.train.data.DataError`` when the data cannot serve that (too few tokens, an unreadable file)."""
    tokens = data_lib.load_tokens(config.data or None, seq_len=config.seq)
    train_tokens, held_out = data_lib.split(tokens, held_out_fraction=0.05, seq_len=config.seq)
    eval_batcher = data_lib.Batcher(held_out, config.batch, config.seq, seed=config.seed + 1)
    return TrainData(tokens, train_tokens, held_out,
                     data_lib.Batcher(train_tokens, config.batch, config.seq, seed=config.seed),
                     [eval_batcher.batch(i) for i in range(config.eval_batches)])


def model_config(config: TrainConfig, vocab_size: int):
    """The ``GPTConfig`` of a run: ``config.model`` with ``vocab_size`` tokens, bfloat16 compute with
    ``config.bf16``, bf16 x bf16 -> fp32 dots with ``config.f32_accum``."""
    return get_config(config.model, vocab_size=vocab_size, dtype=jnp.bfloat16 if config.bf16 else jnp.float32,
                      f32_accum=config.f32_accum)


def init_model(config: TrainConfig, vocab_size: int) -> tuple[Any, Any]:
    """``(graphdef, params)`` of a fresh GPT ``config.model`` with ``vocab_size`` tokens, initialised from
    ``config.seed`` (bfloat16 compute with ``config.bf16``)."""
    return nnx.split(GPT(model_config(config, vocab_size), rngs=nnx.Rngs(config.seed)), nnx.Param)


def init_store_layerwise(config: TrainConfig, layerwise: LayerwiseInit, store, tx: optax.GradientTransformation,
                         mesh=None, log: Callable[[str], None] = print) -> tuple[Any, Any]:
    """Writes a fresh model into ``store`` part by part and returns ``(bf16 params, opt_state)``.

    The fp32 values go straight from ``layerwise`` (one part of the model at a time) into the store's version 0
    through ``StateStore.initialize_from``; the step keeps only a bf16 copy of each leaf. ``tx.init`` on those
    finds the store initialized (it checks layout and optimizer and takes the committed version): casting the
    params to bf16 after the fp32 master was written is what the storage transform's fingerprint expects
    (``nsp.optim.storage``). Progress (MB and pages written, MB/s, ETA) and the peak RSS go to ``log``.

    Raises:
      TrainError: the store cannot take the state (not enough free space: nothing was written).
    """
    total = layerwise.num_params
    cast = jnp.bfloat16 if config.bf16_params else jnp.float32
    log(f"set-up: {config.model} ({total / 1e6:,.1f}M params) built part by part: fp32 master and moments into the "
        f"store{'' if store.root is None else ' at ' + str(store.root)}, a {jnp.dtype(cast).name} copy of the "
        "params for the step")
    try:
        # Without checkpoints no update follows one: the disk needs no room for a snapshot's pages.
        return nsp.optim.init_from(tx, layerwise.abstract, layerwise, dtype=cast,
                                   progress=SetupProgress(log, store.page_bytes),
                                   checkpoint_margin=1 if config.checkpoints else 0)
    except nsp.storage.StoreError as e:
        raise TrainError(str(e)) from None
    finally:
        layerwise.close()


def _beside_earlier_default_runs(config: TrainConfig, log: Callable[[str], None]) -> TrainConfig:
    """``nsp train`` run again with the default run directory starts a new run beside the earlier ones
    (``runs/default-2``, ...) instead of refusing; a run directory given on purpose is never switched."""
    default = TrainConfig.run_dir
    chosen = config.resume or config.store_dir or config.run_dir != default
    if chosen or jax.process_count() > 1 or not _holds_files(Path(default)):
        return config
    n = 2
    while _holds_files(Path(f"{default}-{n}")):
        n += 1
    log(f"{default} holds an earlier run: this one goes to {default}-{n} (--run-dir chooses, --resume continues)")
    return dataclasses.replace(config, run_dir=f"{default}-{n}")


def _holds_files(d: Path) -> bool:
    return d.is_dir() and any(d.iterdir())


def _has_complete_checkpoint(ckpt_dir: Path) -> bool:
    """Whether ``ckpt_dir`` holds a finished checkpoint (orbax finalises a step by renaming it into place; an
    interrupted save leaves only a temporary directory)."""
    if not ckpt_dir.is_dir():
        return False
    manager = ckpt.make_checkpoint_manager(ckpt_dir, max_to_keep=None)
    try:
        return bool(manager.all_steps())
    finally:
        manager.close()


def _store_path(config: TrainConfig) -> Path:
    """This process's store directory: ``config.store_path``, or its ``process-NNNNN`` in a multi-process run."""
    if jax.process_count() == 1:
        return config.store_path
    return config.store_path / f"process-{jax.process_index():05d}"


def _together(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every process; when it fails on any, every process raises ``TrainError`` naming which and why
    (a lone process raises its own error as before)."""
    if jax.process_count() == 1:
        return fn()
    result, error = None, None
    try:
        result = fn()
    except (nsp.storage.StoreError, TrainError, OSError, ValueError) as e:
        error = e
    try:
        nsp.distributed.all_succeed(what, error)
    except nsp.distributed.DistributedError as e:
        if result is not None and hasattr(result, "close"):
            result.close()
        nsp.distributed.finish()  # every process knows: leave in order (process 0, the service's host, last)
        raise TrainError(str(e)) from None
    return result


def _build(config: TrainConfig, log: Callable[[str], None]) -> Run:
    run_dir = Path(config.run_dir)
    store_path = _store_path(config)
    primary = jax.process_index() == 0
    ckpt_dir = run_dir / "ckpt"
    has_checkpoints = _has_complete_checkpoint(ckpt_dir)
    resume = config.resume
    # A run without checkpoints continues from its store's committed version (store_resume), where it can.
    from_store = resume and not has_checkpoints and not config.checkpoints and (run_dir / store_resume.RECORD).exists()
    if from_store and (why := store_resume.why_not(config)):
        raise TrainError(f"--resume: {run_dir} saved no checkpoints (--no-checkpoints) and cannot continue from its "
                         f"store: {why}")
    if resume and not has_checkpoints and not from_store:
        if not (run_dir / "config.json").exists():
            raise TrainError(f"--resume: {run_dir} holds no run to resume (no config.json, no checkpoint)")
        # The run stopped before its first checkpoint completed: nothing was saved, so start it afresh (its
        # store holds no checkpointed state; it is rebuilt).
        log(f"{run_dir} has no complete checkpoint: starting the run afresh")
        if config.tier != "memory" and store_path.exists():
            shutil.rmtree(store_path)
        nsp.distributed.barrier("nsp-fresh-start")  # every process has looked before the directory goes
        if ckpt_dir.exists() and primary:
            shutil.rmtree(ckpt_dir)
        nsp.distributed.barrier("nsp-fresh-start-done")
        resume = False
    elif not resume and (has_checkpoints or (ckpt_dir.exists() and any(ckpt_dir.iterdir()))):
        raise TrainError(f"{run_dir} already holds a run (checkpoints in {ckpt_dir}); pass --resume to continue "
                         "it or choose another --run-dir")
    def check_no_store():
        if not resume and config.tier != "memory" and (store_path / nsp.storage.store.METADATA).exists():
            raise TrainError(f"{store_path} already holds a store; pass --resume or choose another --store-dir")

    _together("checking the store directory", check_no_store)

    block_size = get_config(config.model).block_size  # checks the model name before any data work
    if config.seq > block_size:
        raise TrainError(f"--seq {config.seq} exceeds the block size {block_size} of model {config.model!r}")
    try:
        data = load_data(config)
    except data_lib.DataError as e:
        raise TrainError(str(e)) from None
    tokens = data.tokens

    # Every process's devices, each process's contiguous: store shard i lives on the process of device i.
    devices = nsp.distributed.global_devices()
    mesh = None
    if len(devices) > 1:
        if config.batch % len(devices):
            raise TrainError(f"--batch {config.batch} must be a multiple of the {len(devices)} devices")
        mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    num_shards = len(devices)
    shards = list(nsp.distributed.local_shards(num_shards, devices)) if jax.process_count() > 1 else None

    setup_t0 = time.perf_counter()
    if config.bf16_params:
        # Built part by part into the store at set-up: the whole model is never held in fp32.
        layerwise = LayerwiseInit(model_config(config, tokens.vocab_size), config.seed)
        graphdef, params = layerwise.graphdef, None
    else:
        graphdef, params = init_model(config, tokens.vocab_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    if shards is not None:
        store_path.parent.mkdir(parents=True, exist_ok=True)
    store_kw = dict(tier=config.tier, num_shards=num_shards, page_bytes=config.page_bytes, shards=shards)
    step = 0
    if from_store:
        store = _together("opening this process's store shards", lambda: nsp.storage.open(store_path, **store_kw))
        try:
            saved = json.loads((run_dir / "config.json").read_text())
            if saved.get("model") != config.model:
                raise TrainError(f"{run_dir} is a run of model {saved.get('model')!r}, not {config.model!r}")
            step = store_resume.step_to_resume(run_dir, store.version)
            tx = make_optimizer(config, store, mesh)
            if params is None:  # bf16 params: cast from the store's fp32 master, leaf by leaf
                params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),
                                                layerwise.abstract)
            _check_layout(store, params)
            params = store_resume.params_from_store(store, params)
            with nsp.optim.resuming():  # the store holds the state: init checks it and takes its version
                opt_state = tx.init(params)
        except ValueError as e:
            store.close()
            raise TrainError(f"--resume: {e}") from None
        except BaseException:
            store.close()
            raise
        log(f"resumed {run_dir} at step {step} from its store (version {store.version}; no checkpoints)")
    elif resume:
        manager = ckpt.make_checkpoint_manager(ckpt_dir, max_to_keep=config.keep_checkpoints)
        # orbax finalises a multi-process step only once every process saved its part: the latest step is the
        # newest version every process holds.
        step = manager.latest_step()
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if meta.get("config", {}).get("model") != config.model:
            raise TrainError(f"the checkpoint is of model {meta.get('config', {}).get('model')!r}, "
                             f"not {config.model!r}")
        saved_processes = meta.get("process_count", 1)
        if saved_processes != jax.process_count() or meta.get("num_shards", num_shards) != num_shards:
            raise TrainError(f"the checkpoint at step {step} was written by {saved_processes} process(es) with "
                             f"{meta.get('num_shards', '?')} store shards; this run has {jax.process_count()} "
                             f"with {num_shards}: resume with the same process and device counts (each process "
                             "restores only its own shards)")
        # The store goes back to the checkpoint's version (steps after it are redone, bit for bit).
        store, _, _ = _together("restoring this process's store shards", lambda: ckpt.restore_checkpoint(
            manager, step, None if config.tier == "memory" else store_path, tier=config.tier, overwrite=True,
            shards=shards))
        tx = make_optimizer(config, store, mesh)
        if params is None:  # bf16 params: restored from the checkpoint, never built
            params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), layerwise.abstract)
            _check_layout(store, params)
        with nsp.optim.resuming():  # checks the layout; writes nothing
            template = {"params": params, "opt_state": tx.init(params)}
        if mesh is not None and jax.process_count() > 1:  # restored straight onto the mesh, replicated
            replicated = NamedSharding(mesh, P())
            template = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), template)
        state = manager.restore(step, args=ocp.args.Composite(train_state=ocp.args.StandardRestore(template)))
        params, opt_state = state["train_state"]["params"], state["train_state"]["opt_state"]
        manager.close()
        log(f"resumed {run_dir} at step {step} (store version {store.version})")
    else:
        store = _together("opening this process's store shards", lambda: nsp.storage.open(
            None if config.tier == "memory" else store_path, **store_kw))
        tx = make_optimizer(config, store, mesh)
        try:
            if params is None:
                params, opt_state = _together("writing the initial state into the store shards", lambda: (
                    init_store_layerwise(config, layerwise, store, tx, mesh, log)))
            else:
                opt_state = _together("writing the initial state into the store shards", lambda: tx.init(params))
        except BaseException:
            store.close()
            raise
        if primary:
            (run_dir / "config.json").write_text(config.to_json())

    if mesh is not None:  # the step keeps params and optax state replicated over the mesh
        params, opt_state = _replicate((params, opt_state), mesh)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    log(f"model {config.model}: {n_params / 1e6:.2f}M params, vocab {tokens.vocab_size}; data: {tokens.source} "
        f"({tokens.num_tokens / 1e6:.2f}M tokens); store: {config.tier} tier"
        f"{'' if config.tier == 'memory' else ' at ' + str(store_path)}, {num_shards} shard(s)"
        + (f" ({len(shards)} of them on process {jax.process_index()} of {jax.process_count()})" if shards else "")
        + (f", Top-K {config.topk:.1%}" if config.topk else ""))
    log(f"set-up: {time.perf_counter() - setup_t0:.1f} s (data, model, store), peak RSS "
        f"{fmt_gib(peak_rss_bytes())}" + (", params bf16 (fp32 master in the store)" if config.bf16_params else ""))
    b1, b2 = nsp.optim.TOPK_ADAM_BETAS
    if config.topk and config.optimizer in ("adam", "adamw") and config.b1 > b1:
        log(f"note: with Top-K, --b1 {b1:g} (b2 {b2:g}) trained better than b1 {config.b1:g} in what was measured: "
            "nsp.optim.TOPK_ADAM_BETAS")
    return Run(config, graphdef, params, opt_state, store, tx, data.train_batches, data.eval_batches, mesh, step,
               config.batch * config.seq)


def _check_layout(store, params) -> None:
    """Raises ``TrainError`` when ``store`` holds another layout than ``params`` (arrays or abstract leaves)."""
    layout = nsp.storage.Layout.from_tree(params, num_shards=store.num_shards, page_bytes=store.page_bytes)
    diff = store.layout.describe_difference(layout)
    if diff:
        raise TrainError(f"the checkpoint's store holds another model's layout: {diff}")


def make_train_step(graphdef, tx: optax.GradientTransformation, mesh=None):
    """``(train_step, eval_step)``, both jitted.

    ``train_step(params, opt_state, tokens) -> (params, opt_state, loss)``: forward/backward of ``loss_fn``, then
    ``tx``; it donates ``params`` and ``opt_state`` (do not use them after the call). ``eval_step(params, tokens)
    -> loss``. With a ``mesh`` (axis ``"data"``), params and optax state are replicated and the batch is split
    over the devices (``put_batch`` places it so).
    """
    loss = functools.partial(loss_fn, graphdef)

    def train_step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    if mesh is None:
        return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(loss)

    def data_parallel_step(params, opt_state, tokens):
        value, grads = _mean_over_devices(jax.value_and_grad(loss), mesh)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    # Data parallel: params and the small optax state replicated, the batch split over the devices. Fixing the
    # shardings (rather than letting XLA pick them) keeps the compiled step, and so its float rounding, the same
    # in a fresh and in a resumed run: resume stays bit-exact.
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    step = jax.jit(data_parallel_step, donate_argnums=(0, 1), in_shardings=(replicated, replicated, batch),
                   out_shardings=(replicated, replicated, replicated))
    return step, jax.jit(loss, in_shardings=(replicated, batch))


def _mean_over_devices(value_and_grad, mesh):
    """``value_and_grad(params, tokens)`` on each device's rows of ``tokens``, averaged over the ``"data"`` axis in
    an order that does not depend on where the devices are.

    An all-reduce adds the devices' gradients in whatever order its implementation picks, and the one between
    processes picks another than the one inside a process: 2 processes x 2 devices would then round differently
    from 1 x 4. Here every device sends each other device that one's slice of its gradient (all_to_all: bytes
    moved, nothing added), adds the slices it receives in device order, and the sums are gathered back (again
    nothing added): the same bits whatever the process layout, for the same traffic as a ring all-reduce.
    """
    n = mesh.shape["data"]

    def local(params, tokens):
        value, grads = value_and_grad(params, tokens)
        flat, unravel = jax.flatten_util.ravel_pytree(grads)
        size = flat.size
        pieces = jnp.pad(flat, (0, -size % n)).reshape(n, -1)  # piece j: the slice device j sums
        received = jax.lax.all_to_all(pieces, "data", split_axis=0, concat_axis=0)  # [n, size / n], by sender
        mine = functools.reduce(jnp.add, [received[i] for i in range(n)]) / n  # in device order
        total = jax.lax.all_gather(mine, "data", tiled=True)[:size]
        values = jax.lax.all_gather(value, "data")
        return functools.reduce(jnp.add, [values[i] for i in range(n)]) / n, unravel(total)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False)


def _replicate(tree, mesh):
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
    if mesh is None:
        return jnp.asarray(batch)
    sharding = NamedSharding(mesh, P("data"))
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    if global_rows is None:
        global_rows = batch.shape[0]
        batch = batch[local_rows(global_rows, mesh)]
    return jax.make_array_from_process_local_data(sharding, batch, (global_rows,) + batch.shape[1:])


def _evaluate(run: Run, eval_step) -> float:
    return float(np.mean([float(eval_step(run.params, put_batch(b, run.mesh))) for b in run.eval_batches]))


class _MetricsWriter:
    def __init__(self, run_dir: Path, process: int = 0):
        # Process 0 writes the run's metrics; another process of a multi-process run writes its own (its shards'
        # traffic) beside them, and no TensorBoard log.
        self.jsonl = open(run_dir / ("metrics.jsonl" if process == 0 else f"metrics-process-{process}.jsonl"), "a")
        self.tb = None
        if process:
            return
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        except ImportError:  # tensorboardX is a dependency; tolerate its absence in odd installs
            self.tb = None

    def write(self, row: dict) -> None:
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


class _StepWatch:
    """Logs, every ``every_s`` seconds while a step runs, where it is: its forward/backward (until the store's
    update begins), then the update's pages done of total, rate and time left (``StateStore.progress``, which the
    engines keep as they go). For steps that take minutes (``--progress-s``)."""

    def __init__(self, store, every_s: float, log: Callable[[str], None]):
        self.store, self.every_s, self.log = store, every_s, log
        self.step: int | None = None
        self.t0 = 0.0
        self.begun = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nsp-step-watch", daemon=True)
        self._thread.start()

    def begin(self, step: int) -> None:
        """Step ``step`` is about to be dispatched."""
        self.begun = self.store.progress()["updates_begun"]
        self.t0 = time.perf_counter()
        self.step = step

    def end(self) -> None:
        """The step's result was read."""
        self.step = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            step = self.step
            if step is None:
                continue
            try:
                p = self.store.progress()
            except nsp.storage.StoreError:  # closed under us: the run is ending
                return
            elapsed = time.perf_counter() - self.t0
            if p["running"] and p["pages_total"] and p["pages_done"] >= p["pages_total"]:
                self.log(f"  step {step}: update making its pages durable ({elapsed:.0f} s into the step)")
            elif p["running"] and p["pages_total"]:
                rate = p["bytes_done"] / max(p["elapsed_s"], 1e-9)
                left = p["elapsed_s"] * (p["pages_total"] - p["pages_done"]) / max(p["pages_done"], 1)
                self.log(f"  step {step}: update page {p['pages_done']} of {p['pages_total']} "
                         f"({100 * p['pages_done'] / p['pages_total']:.0f}%), {rate / 1e6:.0f} MB/s, "
                         f"ETA {left:.0f} s ({elapsed:.0f} s into the step)")
            elif p["updates_begun"] == self.begun:
                self.log(f"  step {step}: forward/backward, {elapsed:.0f} s so far")
            else:
                self.log(f"  step {step}: update done in {p['elapsed_s']:.0f} s, applying it ({elapsed:.0f} s into "
                         "the step)")


def _bar(step: int, total: int, width: int = 20) -> str:
    done = int(width * step / total)
    return "[" + "=" * done + ">" * (done < width) + " " * (width - done - (done < width)) + "]"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _save_checkpoint(run: Run, manager) -> None:
    jax.block_until_ready(run.params)
    run.store.barrier()  # a background update (staleness 1) commits first
    t0 = time.perf_counter()
    try:  # a step counts only once every process committed its shards
        nsp.distributed.agree_committed(run.store.version)
    except nsp.distributed.DistributedError as e:
        raise TrainError(str(e)) from None
    run.agree_s += time.perf_counter() - t0
    n = run.mesh.devices.size if run.mesh is not None else 1
    ckpt.save_checkpoint(manager, run.step, run.store, {"params": run.params, "opt_state": run.opt_state},
                         {"step": run.step, "config": dataclasses.asdict(run.config),
                          "process_count": jax.process_count(), "num_shards": n})


def train_and_evaluate(config: TrainConfig, *, log: Callable[[str], None] = print) -> dict:
    """Trains ``config.model`` for ``config.steps`` steps; returns the final metrics.

    Writes ``metrics.jsonl``, ``tb/`` (TensorBoard), ``config.json`` and ``ckpt/`` into ``config.run_dir``.
    Ctrl-C finishes the step in flight, checkpoints, and leaves a run that ``resume=True`` continues.
    """
    try:
        nsp.distributed.initialize(config.coordinator or None, config.num_processes or None,
                                   config.process_id if config.process_id >= 0 else None)
    except nsp.distributed.DistributedError as e:
        raise TrainError(str(e)) from None
    config = _beside_earlier_default_runs(config.resolved(), log)
    run = _build(config, log)
    train_step, eval_step = make_train_step(run.graphdef, run.tx, run.mesh)
    manager = ckpt.make_checkpoint_manager(Path(config.run_dir) / "ckpt", max_to_keep=config.keep_checkpoints)
    metrics = _MetricsWriter(Path(config.run_dir), jax.process_index())
    schedule = learning_rate_schedule(config)
    interrupted, finished = [], []
    previous_handler = signal.getsignal(signal.SIGINT)
    # Without checkpoints, a run that can continue from its store records each step's store version for it.
    record_steps = not config.checkpoints and store_resume.why_not(config) is None
    resumable = config.checkpoints or record_steps

    def on_sigint(signum, frame):  # finish the step in flight, then stop cleanly
        if interrupted:
            previous_handler(signum, frame) if callable(previous_handler) else None
        interrupted.append(True)
        log("\ninterrupt: finishing the step in flight, then " + ("checkpointing" if config.checkpoints else
            "stopping" + ("" if resumable else " (no checkpoints: the run cannot be resumed)"))
            + " (Ctrl-C again to abort)")

    def save():
        if config.checkpoints:
            _save_checkpoint(run, manager)

    signal.signal(signal.SIGINT, on_sigint)
    if not config.checkpoints:
        log("checkpoints off (--no-checkpoints): " + (
            f"--resume continues from the store's committed version ({store_resume.RECORD} records each step's)"
            if record_steps else f"nothing is saved and the run cannot be resumed ({store_resume.why_not(config)})"))
    if run.step == 0:
        save()  # a run killed before its first checkpoint can still be resumed
        if record_steps:  # nor need one killed in its first step be set up again
            store_resume.write_record(Path(config.run_dir), run.store.version, 0)
    if config.bf16_params and run.step < config.steps:
        # Compiled ahead of the first step, so that the steps' times are the steps' own (a big model's step takes
        # XLA a minute or more to compile on a CPU).
        log("compiling the train step ...")
        t0 = time.perf_counter()
        first = put_batch(run.train_batches.batch(run.step, local_rows(config.batch, run.mesh)), run.mesh,
                          global_rows=config.batch)
        train_step = train_step.lower(run.params, run.opt_state, first).compile()
        log(f"compiled the train step in {time.perf_counter() - t0:.1f} s | peak RSS {fmt_gib(peak_rss_bytes())}")
    run_t0 = time.perf_counter()
    losses: list[float] = []
    watch = _StepWatch(run.store, config.progress_s, log) if config.progress_s else None
    last = {"time": time.perf_counter(), "step": run.step, "stats": run.store.stats()}
    summary: dict = {}
    try:
        if run.step >= config.steps:
            log(f"the run already has {run.step} of {config.steps} steps")
        end = min(config.steps, config.stop_after or config.steps)
        rows = local_rows(config.batch, run.mesh)
        multiprocess = jax.process_count() > 1
        while run.step < end and not (interrupted and not multiprocess):
            if multiprocess and run.step % config.log_every == 0 and _any_process(bool(interrupted)):
                interrupted.append(True)  # every process stops at the same step (Ctrl-C reaches each)
                break
            tokens = put_batch(run.train_batches.batch(run.step, rows), run.mesh, global_rows=config.batch)
            if watch is not None:
                watch.begin(run.step + 1)
            run.params, run.opt_state, loss = train_step(run.params, run.opt_state, tokens)
            run.step += 1
            if record_steps:  # once the step's update committed (or was skipped)
                jax.block_until_ready(loss)
                store_resume.write_record(Path(config.run_dir), run.store.version, run.step)
            final = run.step == end
            if run.step % config.log_every == 0 or final:
                loss = float(loss)  # waits for the step
                losses.append(loss)
                if watch is not None:
                    watch.end()
                now, stats = time.perf_counter(), run.store.stats()
                steps = run.step - last["step"]
                delta = {k: (stats[k] - last["stats"].get(k, 0)) / steps for k in stats if k != "buffer_bytes"}
                step_s = (now - last["time"]) / steps
                update_s = delta.get("update_ns", 0) / 1e9
                # With staleness 1 the update runs beside the next step: only the time a step waited for it (the
                # previous update's tail, the copies) is the step's own.
                wait_s = delta.get("wait_ns", 0) / 1e9
                held_s = wait_s if config.staleness else update_s
                row = {
                    "step": run.step, "loss": loss, "lr": float(schedule(run.step - 1)),
                    "tokens_per_s": run.tokens_per_step / step_s, "step_s": step_s,
                    "update_s": update_s, "update_wait_s": wait_s, "fwd_bwd_s": max(step_s - held_s, 0.0),
                    "shared_in_bytes": delta["shared_in_bytes"], "shared_out_bytes": delta["shared_out_bytes"],
                    "internal_read_bytes": delta["internal_read_bytes"],
                    "internal_write_bytes": delta["internal_write_bytes"],
                    "skipped_steps": stats.get("skipped", 0),
                    "agree_s": run.agree_s, "process": jax.process_index(),
                    "peak_rss_bytes": peak_rss_bytes(),
                }
                if config.eval_every and (run.step % config.eval_every == 0 or final) or final:
                    row["eval_loss"] = _evaluate(run, eval_step)
                metrics.write(row)
                log(f"step {run.step:>5}/{config.steps} {_bar(run.step, config.steps)} loss {loss:.4f}"
                    + (f" eval {row['eval_loss']:.4f}" if "eval_loss" in row else "")
                    + (f" | {row['tokens_per_s'] / 1e3:.1f}k tok/s" if row["tokens_per_s"] >= 100 else
                       f" | {row['tokens_per_s']:.2f} tok/s")
                    + f" | step {step_s * 1e3:.0f} ms (fwd/bwd "
                    f"{row['fwd_bwd_s'] * 1e3:.0f}, update {update_s * 1e3:.0f}"
                    + (f" beside the next step, {wait_s * 1e3:.0f} waited" if config.staleness else "")
                    + ") | link in "
                    f"{_fmt_bytes(row['shared_in_bytes'])} out {_fmt_bytes(row['shared_out_bytes'])} | store r "
                    f"{_fmt_bytes(row['internal_read_bytes'])} w {_fmt_bytes(row['internal_write_bytes'])}"
                    f" | lr {row['lr']:.2e} | peak RSS {fmt_gib(row['peak_rss_bytes'])}")
                last = {"time": time.perf_counter(), "step": run.step, "stats": stats}
                summary = row
            elif config.eval_every and run.step % config.eval_every == 0:
                metrics.write({"step": run.step, "eval_loss": _evaluate(run, eval_step)})
            if config.ckpt_every and run.step % config.ckpt_every == 0 and not final:
                save()
        save()
        if losses:
            log(f"done: {len(losses)} logged step(s) in {time.perf_counter() - run_t0:.1f} s, loss "
                + " -> ".join(f"{x:.4f}" for x in losses)
                + (f", eval {summary['eval_loss']:.4f}" if "eval_loss" in summary else "")
                + f" | peak RSS {fmt_gib(peak_rss_bytes())}")
        if interrupted or run.step < config.steps:
            log(f"stopped at step {run.step} of {config.steps}; "
                + ("continue with the same command and --resume" if resumable else
                   "no checkpoints were saved (--no-checkpoints): the run cannot be resumed"))
            summary["interrupted"] = bool(interrupted)
        summary["step"] = run.step
        summary["params"] = run.params
        finished.append(True)
        return summary
    finally:
        if watch is not None:
            watch.close()
        signal.signal(signal.SIGINT, previous_handler)
        manager.wait_until_finished()
        manager.close()
        metrics.close()
        run.store.close()
        if finished:  # a process that failed leaves without waiting: its peers' watchdogs end them
            nsp.distributed.finish()


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` is set on any process (one small all-gather)."""
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())
