"""Setting a run up: its data, its model, its store and optimizer state, fresh or resumed (``build``).

A run starts in one of three ways (``start_mode`` picks which, from the run directory and ``--resume``):

- ``start_fresh``: a new store, written from a fresh model (part by part with ``--bf16-params``:
  ``init_store_layerwise``), or from another run's checkpointed params (``--init-from``, fine-tuning);
- ``resume_from_checkpoint``: the store and the train state back at the latest orbax checkpoint (steps after it
  are redone, bit for bit), resharded when the checkpoint was written by another process or device count
  (``nsp.storage.reshard``, ``nsp.train.reshard``);
- ``resume_from_store``: a run without checkpoints (``--no-checkpoints``) continues from its store's committed
  version (``nsp.train.store_resume``).

Each takes the same ``Base`` (config, data, mesh, model, directories: ``prepare``) and returns the store, the
optax chain, params and optax state, and the step; ``build`` replicates those over the mesh and logs the run's
shape. With ``--freeze``/``--freeze-layers`` (``nsp.train.freeze``) the store and the optax state hold the
trainable leaves only; the params (and so the checkpoints) are the whole tree. In a multi-process run each process does the same, on its own store shards, and every step that could
fail on one process alone goes through ``nsp.train.process.together``.

Public pieces other loops build from: ``load_data`` (``TrainData``), ``model_config``, ``init_model``,
``init_store_layerwise``; ``Run`` is what ``build`` returns.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import nsp.distributed
import nsp.optim
import nsp.storage
from nsp.models import GPT, get_config
from nsp.storage import checkpoint as ckpt
from nsp.storage.restore import remove_tree
from nsp.train import data as data_lib
from nsp.train import freeze as freeze_lib
from nsp.train import ckpt_local, labels, process, store_resume
from nsp.train.config import TrainConfig, TrainError
from nsp.train.layerwise import LayerwiseInit, SetupProgress, fmt_gib, peak_rss_bytes
from nsp.train.optimizer import make_optimizer
from nsp.train.reshard import FlatRecut, clear_stale_stores
from nsp.train.step import replicate

FRESH, FROM_CHECKPOINT, FROM_STORE = "fresh", "checkpoint", "store"


@dataclasses.dataclass
class Run:
    """Everything a training run holds while it runs."""

    config: TrainConfig
    graphdef: Any
    params: Any
    opt_state: Any
    store: nsp.storage.StateStore
    tx: optax.GradientTransformation
    train_batches: data_lib.Batcher  # or, with --features, nsp.train.features.FeatureBatches
    eval_batches: list[np.ndarray]
    mesh: Any
    step: int
    tokens_per_step: int
    freeze: freeze_lib.Freeze = freeze_lib.Freeze()  # the leaves kept out of the store and the backward pass
    agree_s: float = 0.0  # time spent agreeing on the committed version (multi-process), in total


@dataclasses.dataclass
class TrainData:
    """The tokens of a run and the batches drawn from them (``load_data``)."""

    tokens: data_lib.TokenData  # or, with --task classify, the labelled source (nsp.train.labels.LabelledSource)
    train_tokens: np.ndarray | None  # the first 95% (None with --task classify: held out by file)
    held_out_tokens: np.ndarray | None  # the last 5%, contiguous
    train_batches: data_lib.Batcher  # batch(step) is a function of (seed, step); labels.ClassBatcher for classify
    eval_batches: list  # config.eval_batches fixed batches of the held-out tokens (seed + 1)


def load_data(config: TrainConfig) -> TrainData:
    """``config.data`` (the Python stdlib sources when empty) in windows of ``config.seq + 1`` tokens, 5% held out;
    training batches seeded by ``config.seed``, held-out ones by ``config.seed + 1``. With ``--task classify``, the
    labelled source tree ``config.data`` (``nsp.train.labels``: held out by file, batches of ``{"tokens",
    "labels"}``). Raises ``nsp.train.data.DataError`` when the data cannot serve that (too few tokens, an
    unreadable file, too few classes)."""
    if config.task == "classify":  # labelled chunks of source, classes balanced (nsp.train.labels)
        source = labels.load_source(config.data, config.classes, config.seq)
        return TrainData(source, None, None, labels.ClassBatcher(source.train, config.batch, config.seq, config.seed),
                         [labels.ClassBatcher(source.held_out, config.batch, config.seq, config.seed + 1).batch(i)
                          for i in range(config.eval_batches)])
    tokens = data_lib.load_tokens(config.data or None, seq_len=config.seq)
    train_tokens, held_out = data_lib.split(tokens, held_out_fraction=0.05, seq_len=config.seq)
    eval_batcher = data_lib.Batcher(held_out, config.batch, config.seq, seed=config.seed + 1)
    return TrainData(tokens, train_tokens, held_out,
                     data_lib.Batcher(train_tokens, config.batch, config.seq, seed=config.seed),
                     [eval_batcher.batch(i) for i in range(config.eval_batches)])


def model_config(config: TrainConfig, vocab_size: int):
    """The ``GPTConfig`` of a run: ``config.model`` with ``vocab_size`` tokens, bfloat16 compute with
    ``config.bf16``, bf16 x bf16 -> fp32 dots with ``config.f32_accum``, the MLP's ``config.activation``, and a
    classifier of ``config.classes`` classes with ``--task classify``."""
    return get_config(config.model, vocab_size=vocab_size, dtype=jnp.bfloat16 if config.bf16 else jnp.float32,
                      f32_accum=config.f32_accum, activation=config.activation,
                      num_classes=config.classes if config.task == "classify" else 0)


def init_model(config: TrainConfig, vocab_size: int) -> tuple[Any, Any]:
    """``(graphdef, params)`` of a fresh GPT ``config.model`` with ``vocab_size`` tokens, initialised from
    ``config.seed`` (bfloat16 compute with ``config.bf16``)."""
    return nnx.split(GPT(model_config(config, vocab_size), rngs=nnx.Rngs(config.seed)), nnx.Param)


def abstract_model(config: TrainConfig, vocab_size: int) -> tuple[Any, Any]:
    """``(graphdef, params)`` of ``init_model``'s GPT with every param a ``jax.ShapeDtypeStruct``: its shape
    without its values. For a process whose params all come from a checkpoint (an extractor): building the
    fresh model's random values costs about as much as the rest of its start-up."""
    return nnx.split(nnx.eval_shape(lambda: GPT(model_config(config, vocab_size), rngs=nnx.Rngs(config.seed))),
                     nnx.Param)


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


def beside_earlier_default_runs(config: TrainConfig, log: Callable[[str], None]) -> TrainConfig:
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


# ---- which start, and what every start starts from -------------------------------------------------------------------


def build(config: TrainConfig, log: Callable[[str], None]) -> Run:
    """The run of ``config`` (resolved), set up and ready for its next step. Raises ``TrainError`` when it cannot
    start as configured."""
    mode = start_mode(config, log)
    store_path = process.store_path(config)

    def check_no_store():
        if mode == FRESH and config.tier != "memory" and (store_path / nsp.storage.store.METADATA).exists():
            raise TrainError(f"{store_path} already holds a store; pass --resume or choose another --store-dir")

    process.together("checking the store directory", check_no_store)
    base = prepare(config)
    start = {FRESH: start_fresh, FROM_CHECKPOINT: resume_from_checkpoint, FROM_STORE: resume_from_store}[mode]
    store, tx, params, opt_state, step = start(base, log)
    if base.mesh is not None:  # the step keeps params and optax state replicated over the mesh
        params, opt_state = replicate((params, opt_state), base.mesh)
    _log_shape(base, params, log)
    return Run(config, base.graphdef, params, opt_state, store, tx, base.data.train_batches, base.data.eval_batches,
               base.mesh, step, config.batch * config.seq, base.freeze)


def start_mode(config: TrainConfig, log: Callable[[str], None]) -> str:
    """How the run in ``config.run_dir`` starts: ``FRESH``, ``FROM_CHECKPOINT`` (``--resume``, a complete
    checkpoint) or ``FROM_STORE`` (``--resume`` of a run without checkpoints that can continue from its store).
    A ``--resume`` of a run that stopped before its first checkpoint completed starts it afresh (its unfinished
    store and checkpoint directory removed). Raises ``TrainError`` where the directory does not allow the start
    asked for."""
    run_dir = Path(config.run_dir)
    ckpt_dir = run_dir / "ckpt"
    local = ckpt_local.active(config)  # each process's own checkpoint directory: every look is agreed on
    if local:
        has_checkpoints = ckpt_local.common_step(ckpt_dir) is not None
    else:
        has_checkpoints = _has_complete_checkpoint(ckpt_dir)
    if local:
        ckpt_local.check_not_shared(ckpt_dir)
    if not config.resume:
        held = has_checkpoints or (ckpt_dir.exists() and any(not ckpt_local.is_marker(p) for p in ckpt_dir.iterdir()))
        if local and process.any_process(held):
            raise TrainError(f"{run_dir} already holds a run on some process (checkpoints in {ckpt_dir}); pass "
                             "--resume to continue it or choose another --run-dir")
        if held:
            raise TrainError(f"{run_dir} already holds a run (checkpoints in {ckpt_dir}); pass --resume to continue "
                             "it or choose another --run-dir")
        return FRESH
    if has_checkpoints:
        return FROM_CHECKPOINT
    # A run without checkpoints continues from its store's committed version (store_resume), where it can.
    if not config.checkpoints and (run_dir / store_resume.RECORD).exists():
        if why := store_resume.why_not(config):
            raise TrainError(f"--resume: {run_dir} saved no checkpoints (--no-checkpoints) and cannot continue from "
                             f"its store: {why}")
        return FROM_STORE
    no_run = not (run_dir / "config.json").exists()
    if (process.any_process(no_run) if local else no_run):
        raise TrainError(f"--resume: {run_dir} holds no run to resume (no config.json, no checkpoint)"
                         + (" on some process" if local else ""))
    # The run stopped before its first checkpoint completed: nothing was saved, so start it afresh (its store
    # holds no checkpointed state; it is rebuilt).
    log(f"{run_dir} has no complete checkpoint: starting the run afresh")
    store_path = process.store_path(config)
    if config.tier != "memory" and store_path.exists():
        remove_tree(store_path)  # of a mount point (the store on a disk of its own), what it holds
    nsp.distributed.barrier("nsp-fresh-start")  # every process has looked before the directory goes
    if local:  # each process's own
        ckpt_local.start_afresh(ckpt_dir)
    elif ckpt_dir.exists() and jax.process_index() == 0:
        shutil.rmtree(ckpt_dir)
    nsp.distributed.barrier("nsp-fresh-start-done")
    return FRESH


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


@dataclasses.dataclass
class Base:
    """What every start mode starts from (``prepare``)."""

    config: TrainConfig
    run_dir: Path
    store_path: Path  # this process's store directory
    data: TrainData
    mesh: Any  # None on one device
    num_shards: int  # store shards: one a device
    shards: list[int] | None  # this process's shards in a multi-process run, else None
    graphdef: Any
    params: Any  # fp32 params of a fresh model; None with --bf16-params (built part by part: ``layerwise``)
    layerwise: LayerwiseInit | None
    setup_t0: float
    freeze: freeze_lib.Freeze  # the leaves --freeze/--freeze-layers keep out of the store and the backward pass

    def store_kw(self) -> dict:
        # slots: asked for only when 1, so that a resumed store keeps what it was made with either way.
        return dict(tier=self.config.tier, num_shards=self.num_shards, page_bytes=self.config.page_bytes,
                    shards=self.shards, **({"slots": 1} if self.config.slots == 1 else {}))

    def abstract_bf16_params(self) -> Any:
        """With --bf16-params: the params' shapes in bfloat16, for a store's layout and a restore's template."""
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), self.layerwise.abstract)

    def trainable(self, params) -> Any:
        """The part of ``params`` the store and the optax state hold (all of it unless leaves are frozen)."""
        return self.freeze.split(params)[0]


def prepare(config: TrainConfig) -> Base:
    """The data, the device mesh and the model (whole, or only abstract with ``--bf16-params``) of a run, and its
    directories made."""
    block_size = get_config(config.model).block_size  # checks the model name before any data work
    if config.seq > block_size:
        raise TrainError(f"--seq {config.seq} exceeds the block size {block_size} of model {config.model!r}")
    try:
        data = load_data(config)
    except data_lib.DataError as e:
        raise TrainError(str(e)) from None

    # Every process's devices, each process's contiguous: store shard i lives on the process of device i.
    devices = nsp.distributed.global_devices()
    mesh = None
    if len(devices) > 1:
        if config.batch % len(devices):
            raise TrainError(f"--batch {config.batch} must be a multiple of the {len(devices)} devices")
        mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    if config.stage_gradients and mesh is not None:
        raise TrainError(f"--stage-gradients runs on one device; this run has {len(devices)} (give the process one "
                         "device, e.g. without XLA_FLAGS=--xla_force_host_platform_device_count)")
    shards = list(nsp.distributed.local_shards(len(devices), devices)) if jax.process_count() > 1 else None

    setup_t0 = time.perf_counter()
    layerwise = None
    if config.bf16_params:
        # Built part by part into the store at set-up: the whole model is never held in fp32.
        layerwise = LayerwiseInit(model_config(config, data.tokens.vocab_size), config.seed)
        graphdef, params = layerwise.graphdef, None
    else:
        graphdef, params = init_model(config, data.tokens.vocab_size)
    run_dir, store_path = Path(config.run_dir), process.store_path(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    if shards is not None:
        store_path.parent.mkdir(parents=True, exist_ok=True)
    freeze = freeze_lib.resolve(config, params if params is not None else layerwise.abstract)
    return Base(config, run_dir, store_path, data, mesh, len(devices), shards, graphdef, params, layerwise,
                setup_t0, freeze)


# ---- the three starts: each returns (store, tx, params, opt_state, step) ---------------------------------------------


def start_fresh(base: Base, log: Callable[[str], None]):
    """A new store, written from the fresh model (part by part with --bf16-params) or from the params of
    ``--init-from``'s checkpoint; the run's config.json."""
    config = base.config
    params = base.params
    if config.init_from:  # before the store exists: a mismatched model leaves nothing behind
        params = freeze_lib.load_params(config.init_from, params)
        log(f"fine-tuning from {freeze_lib.checkpoint_step_dir(config.init_from)}")
    store = process.together("opening this process's store shards", lambda: nsp.storage.open(
        None if config.tier == "memory" else base.store_path, **base.store_kw()))
    tx = make_optimizer(config, store, base.mesh)
    try:
        if base.layerwise is not None:
            params, opt_state = process.together("writing the initial state into the store shards", lambda: (
                init_store_layerwise(config, base.layerwise, store, tx, base.mesh, log)))
        else:
            opt_state = process.together("writing the initial state into the store shards",
                                         lambda: tx.init(base.trainable(params)))
    except BaseException:
        store.close()
        raise
    if jax.process_index() == 0 or ckpt_local.active(config):  # --ckpt-local: each process's own run directory
        (base.run_dir / "config.json").write_text(config.to_json())
    return store, tx, params, opt_state, 0


def resume_from_checkpoint(base: Base, log: Callable[[str], None]):
    """The store and the train state back at the latest checkpoint (the steps after it are redone, bit for bit)."""
    config, params = base.config, base.params
    local = ckpt_local.active(config)
    manager = ckpt.make_checkpoint_manager(base.run_dir / "ckpt", max_to_keep=None if local else
                                           config.keep_checkpoints, local=local)
    if local:  # each process holds its own steps: the newest every process holds (newer ones are redone)
        step = ckpt_local.common_step(base.run_dir / "ckpt", log)
        ckpt_local.discard_newer(manager, step, log)
    else:
        # orbax finalises a multi-process step only once every process saved its part: the latest step is the
        # newest version every process holds.
        step = manager.latest_step()
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta.get("config", {}).get("model") != config.model:
        raise TrainError(f"the checkpoint is of model {meta.get('config', {}).get('model')!r}, "
                         f"not {config.model!r}")
    ckpt_local.check_resumable(meta, step, local, jax.process_count(), base.num_shards)
    saved_processes, saved_shards = meta.get("process_count", 1), meta.get("num_shards", base.num_shards)
    resharding = saved_processes != jax.process_count() or saved_shards != base.num_shards
    if resharding:
        # Another layout: each process re-cuts its own new shards from the step's parts (nsp.storage.reshard;
        # every part must be visible: the checkpoint directory is shared, as orbax requires).
        log(f"resharding the checkpoint at step {step}: written by {saved_processes} process(es) with "
            f"{saved_shards} store shards, this run has {jax.process_count()} with {base.num_shards}")
        if config.tier != "memory":
            clear_stale_stores(config.store_path, base.run_dir / "ckpt" / str(step) / "store", log)
    # The store goes back to the checkpoint's version (steps after it are redone, bit for bit).
    store_args = ckpt.StoreRestore(None if config.tier == "memory" else base.store_path, tier=config.tier,
                                   overwrite=True, shards=base.shards, num_shards=base.num_shards)
    store = process.together("restoring this process's store shards", lambda: manager.restore(
        step, args=ocp.args.Composite(store=store_args))["store"])
    tx = make_optimizer(config, store, base.mesh)
    if params is None:  # bf16 params: restored from the checkpoint, never built
        params = base.abstract_bf16_params()
        _check_layout(store, params)
    with nsp.optim.resuming():  # checks the layout; writes nothing
        template = {"params": params, "opt_state": tx.init(base.trainable(params))}
    # Flat vectors of the train state (Top-K's error-feedback residual) are as long as the saved layout's padding.
    recut = FlatRecut(store.layout.total, saved_shards, base.num_shards)
    template = {"params": template["params"], "opt_state": recut.saved_like(template["opt_state"])}
    if (base.mesh is not None and jax.process_count() > 1) or resharding:
        # Restored straight onto this run's devices, replicated: orbax places arrays as saved only on the same
        # topology.
        place = (NamedSharding(base.mesh, P()) if base.mesh is not None
                 else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        template = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place), template)
    state = manager.restore(step, args=ocp.args.Composite(
        train_state=ckpt.train_state_restore_args(manager, template)))
    params, opt_state = state["train_state"]["params"], recut(state["train_state"]["opt_state"])
    manager.close()
    log(f"resumed {base.run_dir} at step {step} (store version {store.version})")
    return store, tx, params, opt_state, step


def resume_from_store(base: Base, log: Callable[[str], None]):
    """A run without checkpoints continued from its store's committed version: the step from the run's record,
    the params read back from the store's fp32 master (``nsp.train.store_resume``)."""
    config = base.config
    store = process.together("opening this process's store shards",
                             lambda: nsp.storage.open(base.store_path, **base.store_kw()))
    try:
        saved = json.loads((base.run_dir / "config.json").read_text())
        if saved.get("model") != config.model:
            raise TrainError(f"{base.run_dir} is a run of model {saved.get('model')!r}, not {config.model!r}")
        step = store_resume.step_to_resume(base.run_dir, store.version)
        tx = make_optimizer(config, store, base.mesh)
        # bf16 params: cast from the store's fp32 master, leaf by leaf
        params = base.params if base.params is not None else base.abstract_bf16_params()
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
    log(f"resumed {base.run_dir} at step {step} from its store (version {store.version}; no checkpoints)")
    return store, tx, params, opt_state, step


def _check_layout(store, params) -> None:
    """Raises ``TrainError`` when ``store`` holds another layout than ``params`` (arrays or abstract leaves)."""
    layout = nsp.storage.Layout.from_tree(params, num_shards=store.num_shards, page_bytes=store.page_bytes)
    diff = store.layout.describe_difference(layout)
    if diff:
        raise TrainError(f"the checkpoint's store holds another model's layout: {diff}")


def _log_shape(base: Base, params, log: Callable[[str], None]) -> None:
    """The run's model, data and store, and the set-up's time and peak memory, in two lines (and a note on
    Top-K's Adam betas where they differ from what trained better)."""
    config, tokens = base.config, base.data.tokens
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    if base.freeze:
        log(f"frozen: {freeze_lib.describe(base.freeze, params)}")
    data = (f"{tokens.source} ({tokens.num_tokens / 1e6:.2f}M tokens)" if config.task == "lm" else
            f"{len(tokens.names)} classes of {tokens.root} ({', '.join(tokens.names)}), chance "
            f"{1 / len(tokens.names):.1%}")
    log(f"model {config.model}: {n_params / 1e6:.2f}M params, vocab {tokens.vocab_size}; data: {data}; store: {config.tier} tier"
        f"{'' if config.tier == 'memory' else ' at ' + str(base.store_path)}, {base.num_shards} shard(s)"
        + (f" ({len(base.shards)} of them on process {jax.process_index()} of {jax.process_count()})"
           if base.shards else "")
        + (f", Top-K {config.topk:.1%}" if config.topk else ""))
    log(f"set-up: {time.perf_counter() - base.setup_t0:.1f} s (data, model, store), peak RSS "
        f"{fmt_gib(peak_rss_bytes())}" + (", params bf16 (fp32 master in the store)" if config.bf16_params else ""))
    b1, b2 = nsp.optim.TOPK_ADAM_BETAS
    if config.topk and config.optimizer in ("adam", "adamw") and config.b1 > b1:
        log(f"note: with Top-K, --b1 {b1:g} (b2 {b2:g}) trained better than b1 {config.b1:g} in what was measured: "
            "nsp.optim.TOPK_ADAM_BETAS")
