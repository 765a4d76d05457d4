"""Configuration of a training run: one dataclass, every field overridable from the command line; and
``TrainError``, what a run raises when it cannot start or continue as configured."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from nsp.spec import KINDS

DEFAULT_SEQ = 128  # tokens per sequence when --seq is not given (and the model allows it)
DEFAULT_LR = 3e-3  # peak learning rate of a model without a published recipe (the toy sizes, GPT-2)
DEFAULT_WARMUP_STEPS = 20  # warm-up steps of a model without one


class TrainError(RuntimeError):
    """The run cannot start or continue as configured (the message says why; nothing was overwritten)."""


class RunStopped(TrainError):
    """The run stopped partway on a failure of its storage (a full disk, an I/O error) or of a step. The message
    says what failed, what was kept (the store's committed version, the last checkpoint) and how to go on; the
    failed step committed nothing."""


@dataclasses.dataclass
class TrainConfig:
    # Model config name from nsp.models.CONFIGS (tiny, small, gpt2-124m, ...); vocab comes from the data.
    model: str = "small"
    # Directory for metrics (metrics.jsonl, tb/), checkpoints (ckpt/) and, by default, the store.
    run_dir: str = "runs/default"
    # Training text: a text file, a directory of text files, or a token file; empty = the Python stdlib sources.
    data: str = ""
    # What the model learns: "lm" (next-token prediction) or "classify" (which top-level package a chunk of source
    # comes from: a head on the GPT's pooled features, accuracy reported; nsp.train.labels). With classify, --data
    # is a directory of source trees (empty = the Python stdlib), each file labelled by its top-level directory.
    task: str = "lm"
    # With --task classify: the classes, the top-level packages holding the most bytes of source.
    classes: int = 8
    # Where the optimizer state lives: "file" (disk), "memory" (host RAM) or "csd".
    tier: str = "file"
    # Directory of the state store; empty = RUN_DIR/store.
    store_dir: str = ""
    # Version slots of a new file-tier store: 2 (an update writes t+1 beside t) or 1 (one copy of the state on
    # disk, half the disk, and a redo journal so that a kill still leaves t or t+1 whole: nsp.storage.open).
    slots: int = 2
    # Store page size in MiB (also the zarr chunk size on disk).
    page_mib: float = 4.0
    # Optimizer whose state the store keeps: adamw, adam, sgd or adagrad.
    optimizer: str = "adamw"
    # Peak learning rate (linear warmup, then cosine decay to lr * min_lr_ratio). 0 = the model's published recipe
    # (nsp.train.recipes: GPT-3's Table 2.1 for the gpt3-* sizes, scaled by the square root of the batch ratio for
    # smaller batches), else 3e-3.
    lr: float = 0.0
    # Warmup steps of the learning-rate schedule. -1 = the model's recipe (its warm-up tokens in steps of this
    # batch, or the whole run when that is shorter; nsp.train.recipes), else 20.
    warmup_steps: int = -1
    # Final learning rate as a fraction of the peak.
    min_lr_ratio: float = 0.1
    # Decoupled weight decay (AdamW) or L2 (others).
    weight_decay: float = 0.01
    # Adam first-moment decay (or SGD momentum). With --topk, 0.5 trained better (nsp.optim.TOPK_ADAM_BETAS).
    b1: float = 0.9
    # Adam second-moment decay.
    b2: float = 0.99
    # Global gradient-norm clipping threshold (0 = off).
    clip: float = 1.0
    # Top-K gradient compression ratio (0 = dense gradients).
    topk: float = 0.0
    # Keep what Top-K drops for the next step (error feedback).
    error_feedback: bool = True
    # Factor on the kept remainder each step it stays unsent (1 = classic error feedback, nothing dropped).
    topk_residual_decay: float = 1.0
    # With Top-K: the store updates only the entries sent each step (lazy), not all of them on a mostly-zero gradient.
    topk_lazy: bool = False
    # 1: each update streams in the background while the next forward/backward runs on params one step old.
    staleness: int = 0
    # Training steps (the total, also when resuming).
    steps: int = 200
    # Sequences per step (split over the devices).
    batch: int = 8
    # Tokens per sequence, at most the model's block size (0 = the block size or 128, whichever is smaller).
    seq: int = 0
    # Seed of the model init and of the data stream (batches are a function of seed and step).
    seed: int = 0
    # Compute in bfloat16 (the store keeps fp32 master params either way).
    bf16: bool = False
    # With --bf16: the Linear matmuls as bf16 x bf16 -> fp32 dots (GPTConfig.f32_accum): XLA:CPU then keeps no fp32
    # copy of the weights through the step (about 2.5 bytes per parameter less).
    f32_accum: bool = False
    # With --bf16: the step holds the params in bfloat16 (the store keeps the fp32 master), and set-up builds the
    # model part by part straight into the store, never whole in fp32. For models near the machine's memory.
    bf16_params: bool = False
    # Stage each gradient leaf on the store's disk as the backward pass produces it, and read the new params back
    # leaf by leaf (nsp.optim stage_gradients=True, with --clip applied inside the store): the step never holds the
    # whole gradient. One device, the file or csd tier, dense gradients, staleness 0.
    stage_gradients: bool = False
    # The MLP's nonlinearity: gelu (GPT-2) or relu (OPT; about half of its activations are zeros, which
    # --offload-activations stores in FlashNeuron's sparse format).
    activation: str = "gelu"
    # The blocks' backward-pass activations (nsp.offload): "none" keeps them in memory; "all" sends every block's
    # to --spill-dir in the forward pass and reads them back in the backward pass (lossless; in the sparse format
    # where it shrinks them with --activation relu); a budget ("6GiB") or "auto" (what the machine has free):
    # FlashNeuron's planner profiles the blocks and offloads as few as keep the step's peak within it.
    offload_activations: str = "none"
    # Train from the features of a frozen backbone that nsp features wrote (DIR): each step reads its batch's
    # features and runs only the blocks after --freeze-layers and the head (nsp.train.features). Needs
    # --init-from and --freeze-layers as the features were made.
    features: str = ""
    # Where offloaded activations go (scratch, removed at the end); empty = RUN_DIR/spill.
    spill_dir: str = ""
    # What --offload-activations sends them to: "disk" (--spill-dir) or "host" (the accelerator's pinned host
    # memory, through JAX's memory kinds: nsp.offload.HostMemory; on a CPU that moves nothing).
    offload_to: str = "disk"
    # Print and log metrics every this many steps.
    log_every: int = 10
    # Print where a step in flight is (its forward/backward, or the update's pages done of total) every this many
    # seconds; 0 = off. For steps that take minutes.
    progress_s: float = 0.0
    # Held-out loss every this many steps (0 = only at the end).
    eval_every: int = 50
    # Held-out batches averaged per evaluation.
    eval_batches: int = 4
    # Checkpoint every this many steps (0 = only at the end).
    ckpt_every: int = 100
    # Checkpoints kept (older ones are deleted).
    keep_checkpoints: int = 3
    # Save checkpoints. --no-checkpoints: none, for a store that fills most of its disk (a checkpoint's hard links
    # keep its version's pages, so the store's next writes of them take new space); --resume then continues from
    # the store's committed version where the optimizer keeps everything there (nsp.train.store_resume).
    checkpoints: bool = True
    # Continue the run in RUN_DIR from its latest checkpoint (or, without checkpoints, from its store).
    resume: bool = False
    # Multi-process runs (nsp.distributed): process 0's coordination service as host:port (empty = the
    # JAX_COORDINATOR_ADDRESS variable or what JAX detects: SLURM, Open MPI, Kubernetes; none = one process).
    coordinator: str = ""
    # Processes of a multi-process run (0 = from the environment).
    num_processes: int = 0
    # Multi-process runs on hosts that share no file system: each process keeps its own complete checkpoints in
    # its RUN_DIR/ckpt (its part of the store, its copy of the train state), and --resume takes the newest step
    # every process holds (nsp.train.ckpt_local). Refused when the processes do see each other's RUN_DIR/ckpt.
    ckpt_local: bool = False
    # This process's index in a multi-process run (-1 = from the environment).
    process_id: int = -1
    # Multi-process runs: a process whose heartbeats stop this many seconds counts as dead, and every other process
    # stops within about this bound saying which (JAX's own default is 100 s). Raise it where a process may stall
    # that long alive (a machine loaded beyond its cores, a long swap-in).
    heartbeat_timeout: int = 10
    # Stop early, checkpointed and resumable, after this many steps (0 = run to --steps; the schedule still
    # spans --steps).
    stop_after: int = 0
    # Fine-tuning: start from the params of another run's checkpoint (its RUN_DIR for the latest checkpoint, or a
    # checkpoint directory RUN_DIR/ckpt/STEP) instead of a fresh model: a new store, step 0, new optimizer state.
    # The model config must match (same leaves and shapes).
    init_from: str = ""
    # Freeze the params whose name matches this regex (re.search on names such as h/0/attn/c_attn/kernel or
    # wte/embedding): they stay out of the store and out of the backward pass, and come back unchanged, bit for bit
    # (nsp.train.freeze).
    freeze: str = ""
    # Freeze the token and position embeddings (wte, which is also the tied output projection, and wpe) and the first
    # N blocks (h/0 .. h/N-1); with --freeze, the leaves either names.
    freeze_layers: int = 0

    def __post_init__(self):
        checks = [
            (self.steps >= 1, "steps must be >= 1"),
            (self.batch >= 1, "batch must be >= 1"),
            (self.seq >= 0, "seq must be >= 1 (or 0: the model's block size or 128, whichever is smaller)"),
            (self.lr >= 0, "lr must be > 0 (or 0: the model's recipe)"),
            (self.warmup_steps >= -1, "warmup_steps must be >= 0 (or -1: the model's recipe)"),
            (0 <= self.topk < 1, "topk must be in [0, 1) (0 = dense)"),
            (0 <= self.topk_residual_decay <= 1, "topk_residual_decay must be in [0, 1]"),
            (self.page_mib > 0, "page_mib must be > 0"),
            (self.log_every >= 1, "log_every must be >= 1"),
            (self.progress_s >= 0, "progress_s must be >= 0 (0 = off)"),
            (self.eval_every >= 0 and self.ckpt_every >= 0, "eval_every and ckpt_every must be >= 0"),
            (self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1"),
            (self.stop_after >= 0, "stop_after must be >= 0"),
            (self.heartbeat_timeout >= 2, "heartbeat_timeout must be >= 2 (seconds)"),
            (self.staleness in (0, 1), "staleness must be 0 or 1"),
            (self.optimizer in KINDS, f"unknown optimizer {self.optimizer!r} ({', '.join(sorted(KINDS))})"),
            (self.tier in ("file", "memory", "csd"), f"unknown tier {self.tier!r} (file, memory, csd)"),
            (self.slots in (1, 2), "slots must be 1 or 2"),
            (self.slots == 2 or self.tier == "file", "slots 1 (a redo journal) needs the file tier"),
            (self.activation in ("gelu", "relu"), f"unknown activation {self.activation!r} (gelu, relu)"),
            (self.task in ("lm", "classify"), f"unknown task {self.task!r} (lm, classify)"),
            (self.classes >= 2, "classes must be >= 2"),
            (self.task == "lm" or not (self.stage_gradients or self.bf16_params),
             "task classify: not with --stage-gradients or --bf16-params (made for language models too big to "
             "hold)"),
            (_offload_choice(self.offload_activations),
             f"unknown offload_activations {self.offload_activations!r} (none, all, auto, or a memory budget "
             "such as 6GiB)"),
            (not self.features or (self.init_from and self.freeze_layers > 0 and not self.freeze),
             "features needs --init-from and --freeze-layers as nsp features used (and no --freeze REGEX)"),
            (not self.features or (self.offload_activations == "none" and not self.stage_gradients),
             "features: the step runs only the top blocks (no --offload-activations, no --stage-gradients)"),
            (self.offload_to in ("disk", "host"), f"unknown offload_to {self.offload_to!r} (disk, host)"),
            (self.offload_to == "disk" or self.offload_activations in ("none", "all"),
             "offload_to host takes --offload-activations all (the planner plans a spill directory's disk)"),
            (not self.stage_gradients or (self.tier != "memory" and not self.topk and self.staleness == 0),
             "stage_gradients needs the file or csd tier, dense gradients (no --topk) and staleness 0"),
            (self.bf16 or not (self.bf16_params or self.f32_accum),
             "bf16_params and f32_accum need bf16 compute (--bf16)"),
            (self.freeze_layers >= 0, "freeze_layers must be >= 0"),
            (_regex_ok(self.freeze), f"freeze: {self.freeze!r} is not a valid regular expression"),
            (not self.bf16_params or not (self.freeze or self.freeze_layers or self.init_from),
             "freeze, freeze_layers and init_from start from whole fp32 params: not with bf16_params (which "
             "builds the model part by part into the store)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def resolved(self) -> TrainConfig:
        """This config with its defaults that depend on the model filled in: ``seq``, and ``lr`` and
        ``warmup_steps`` from the model's recipe (``nsp.train.recipes``) or the generic defaults."""
        from nsp.train.recipes import RECIPES

        recipe = RECIPES.get(self.model)
        filled = {}
        if not self.seq:
            from nsp.models import get_config

            filled["seq"] = min(DEFAULT_SEQ, get_config(self.model).block_size)
        batch_tokens = self.batch * filled.get("seq", self.seq)
        if not self.lr:
            filled["lr"] = recipe.lr_for(batch_tokens) if recipe else DEFAULT_LR
        if self.warmup_steps < 0:
            filled["warmup_steps"] = recipe.warmup_steps(self.steps, batch_tokens) if recipe else DEFAULT_WARMUP_STEPS
        return dataclasses.replace(self, **filled) if filled else self

    @property
    def store_path(self) -> Path:
        return Path(self.store_dir) if self.store_dir else Path(self.run_dir) / "store"

    @property
    def page_bytes(self) -> int:
        return max(4096, int(self.page_mib * 2**20) // 4096 * 4096)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def fields_help(cls) -> dict[str, str]:
        """Each field's comment from the source, for --help."""
        import inspect

        help_text, pending = {}, []
        for line in inspect.getsource(cls).splitlines():
            stripped = line.strip()
            if stripped.startswith("# "):
                pending.append(stripped[2:])
            elif ":" in stripped and pending and not stripped.startswith(("def", "@", "class")):
                help_text[stripped.split(":")[0]] = " ".join(pending)
                pending = []
            else:
                pending = []
        return help_text


def _regex_ok(value: str) -> bool:
    import re

    try:
        re.compile(value)
    except re.error:
        return False
    return True


def _offload_choice(value: str) -> bool:
    """Whether ``value`` is an ``--offload-activations`` choice: none, all, auto, or a memory budget."""
    if value in ("none", "all", "auto"):
        return True
    from nsp.offload.planner import parse_budget

    try:
        parse_budget(value)
    except ValueError:
        return False
    return True
