"""Section 2 of the report, loss vs compression ratio (Smart-Infinity Table IV / Fig. 16): the training sweep and
its table.

Every contender is ``nsp train``'s run at the report's model, steps, batch and seed (``train_config``), built from
the trainer's own pieces (nsp.train.trainer: ``load_data``, ``init_model``, ``make_optimizer``,
``make_train_step``): the nsp runs differ only in their optimizer settings (Top-K ratio, error feedback, store
update, betas, peak learning rate); the reference is optax.adamw in RAM behind the same clipping and schedule.
``run_training`` steps them all in lockstep (interleaved, so that drift in the machine's speed hits all of them
alike) on the same batches and compares the dense nsp run with optax every step.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from common import START_GIT, build_info, median
from report_traffic import RATIOS

import nsp.optim
import nsp.storage
from nsp.train.config import TrainConfig
from nsp.train.trainer import (init_model, learning_rate_schedule, load_data, make_optimizer, make_train_step,
                               put_batch)


def tree_copy(tree: Any) -> Any:
    """A fresh copy of every leaf (the train steps donate their params)."""
    return jax.tree_util.tree_map(jnp.copy, tree)


def rel_err(a: Any, b: Any) -> jax.Array:
    """||a - b|| / ||b|| over a whole tree (tests/test_optim.py's measure: rounding differences amplified by training
    make an element-wise relative error meaningless for params near zero)."""
    pairs = list(zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    diff = sum(jnp.sum((x - y) ** 2) for x, y in pairs)
    norm = sum(jnp.sum(y ** 2) for _, y in pairs)
    return jnp.sqrt(diff / jnp.maximum(norm, 1e-30))


# ---- the sweep ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # "optax" or "nsp"
    ratio: float | None = None
    error_feedback: bool | None = None
    residual_decay: float | None = None  # with error feedback: nsp.optim.TopK's residual_decay
    lazy: bool | None = None  # with Top-K: nsp.optim.TopK's lazy (only the sent entries move)
    betas: tuple[float, float] | None = None  # AdamW's (b1, b2) when not the config's
    lr: float | None = None  # peak learning rate when not the config's


# Top-K near 1% with the moment decays recommended for it and a higher peak learning rate (nsp.optim.compress).
TOPK_TUNED_LR = 5e-3


def contenders() -> list[Contender]:
    runs = [Contender("optax.adamw (RAM)", "optax"), Contender("nsp adamw, memory tier, dense", "nsp")]
    defaults = nsp.optim.TopK(1.0)
    decay, lazy = defaults.residual_decay, defaults.lazy
    for c in RATIOS:
        runs.append(Contender(f"nsp Top-K {c:.0%} + error feedback", "nsp", c, True, decay, lazy))
        runs.append(Contender(f"nsp Top-K {c:.0%}, no error feedback", "nsp", c, False, None, lazy))
    # At the smallest ratio, for comparison: the other store update (the default is the dense update on the
    # decompressed gradient, as Smart-Infinity's updater runs it; lazy moves only the entries sent that step).
    runs.append(Contender(f"nsp Top-K {RATIOS[-1]:.0%} + error feedback, {'dense' if lazy else 'lazy'} update", "nsp",
                          RATIOS[-1], True, decay, not lazy))
    b1, b2 = nsp.optim.TOPK_ADAM_BETAS
    runs.append(Contender(f"nsp Top-K {RATIOS[-1]:.0%} + error feedback, b1 {b1:g}, b2 {b2:g}, peak {TOPK_TUNED_LR:g}",
                          "nsp", RATIOS[-1], True, decay, lazy, (b1, b2), TOPK_TUNED_LR))
    return runs


def train_config(args) -> TrainConfig:
    """``nsp train``'s defaults (learning rate, warm-up, cosine decay, AdamW betas, weight decay, clipping), at this
    report's model, steps, batch and seed."""
    return TrainConfig(model=args.model, tier="memory", steps=args.steps, batch=args.batch, seq=args.seq,
                       seed=args.seed, eval_batches=args.eval_batches).resolved()


def make_tx(contender: Contender, config: TrainConfig, store) -> optax.GradientTransformation:
    """An nsp contender's optimizer is ``nsp train``'s (``make_optimizer``) at its settings; optax's is
    optax.adamw in RAM behind the same clipping and learning-rate schedule."""
    b1, b2 = contender.betas or (config.b1, config.b2)
    config = dataclasses.replace(
        config, topk=contender.ratio or 0.0, error_feedback=bool(contender.error_feedback),
        topk_residual_decay=1.0 if contender.residual_decay is None else contender.residual_decay,
        topk_lazy=bool(contender.lazy), b1=b1, b2=b2, lr=contender.lr or config.lr)
    if contender.kind == "nsp":
        return make_optimizer(config, store, None)
    opt = optax.adamw(learning_rate_schedule(config), config.b1, config.b2, weight_decay=config.weight_decay)
    return optax.chain(optax.clip_by_global_norm(config.clip), opt)


class TrainRun:
    """One contender's params, optimizer and store, advanced a step at a time by ``nsp train``'s jitted step."""

    def __init__(self, contender: Contender, config: TrainConfig, graphdef, params0):
        self.contender = contender
        self.store = nsp.storage.open(tier="memory") if contender.kind == "nsp" else None
        tx = make_tx(contender, config, self.store)
        self.params = tree_copy(params0)
        self.opt_state = tx.init(self.params)
        self._step, self.evaluate = make_train_step(graphdef, tx)
        self.losses: list[float] = []
        self.step_s: list[float] = []

    def step(self, tokens: jax.Array) -> None:
        t0 = time.perf_counter()
        self.params, self.opt_state, loss = self._step(self.params, self.opt_state, tokens)
        jax.block_until_ready(self.params)  # the store's update is done when the params are
        self.step_s.append(time.perf_counter() - t0)
        self.losses.append(float(loss))

    def update_ms(self) -> float | None:
        if self.store is None:
            return None
        s = self.store.stats()
        return s["update_ns"] / max(s["updates"], 1) / 1e6

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def mean_held_out_loss(evaluate, params: Any, batches: list[Any]) -> float:
    """The held-out loss of ``params``: the mean over ``batches`` of the ``"loss"`` that ``evaluate`` (the metrics
    function ``make_train_step`` returns beside the step, a dict per batch) gives."""
    return float(np.mean([float(evaluate(params, b)["loss"]) for b in batches]))


def run_training(args, command: str) -> dict:
    """Section 2: every contender stepped in lockstep on the same batches; the dense pair compared every step.
    ``command`` is the command line the record names."""
    config = train_config(args)
    data = load_data(config)  # the batches nsp train draws
    graphdef, params0 = init_model(config, data.tokens.vocab_size)
    runs = [TrainRun(c, config, graphdef, params0) for c in contenders()]
    ref, dense = runs[0], runs[1]
    eval_batches = [put_batch(b) for b in data.eval_batches]

    def held_out_loss(p) -> float:
        return mean_held_out_loss(ref.evaluate, p, eval_batches)

    start_loss = held_out_loss(params0)
    compare = jax.jit(rel_err)
    dense_err: list[float] = []
    t0 = time.perf_counter()
    try:
        for i in range(config.steps):
            tokens = put_batch(data.train_batches.batch(i))
            for run in runs:
                run.step(tokens)
            dense_err.append(float(compare(dense.params, ref.params)))
            if (i + 1) % max(1, config.steps // 10) == 0 or i + 1 == config.steps:
                print(f"  step {i + 1}/{config.steps}: " + ", ".join(
                    f"{r.contender.name.replace('nsp ', '')} {r.losses[-1]:.3f}" for r in runs[:4]) + ", ...",
                    flush=True)
        wall_s = time.perf_counter() - t0
        results = []
        for run in runs:
            c = run.contender
            results.append({
                "name": c.name, "kind": c.kind, "ratio": c.ratio, "error_feedback": c.error_feedback,
                "residual_decay": c.residual_decay, "lazy": c.lazy, "betas": c.betas, "lr": c.lr,
                "held_out_loss": held_out_loss(run.params), "final_train_loss": run.losses[-1],
                # The first step compiles; the median of the others is the step time.
                "step_ms": median(run.step_s[1:]) * 1e3 if len(run.step_s) > 1 else None,
                "compile_s": run.step_s[0], "update_ms": run.update_ms(), "losses": run.losses,
            })
    finally:
        for run in runs:
            run.close()
    tokens = data.tokens
    data_info = {"source": tokens.source, "tokens": int(tokens.num_tokens),
                 "train_tokens": int(data.train_tokens.shape[0]),
                 "held_out_tokens": int(data.held_out_tokens.shape[0]), "files": tokens.info.get("file_count")}
    return {
        "config": dataclasses.asdict(config),
        "model_params": int(sum(x.size for x in jax.tree_util.tree_leaves(params0))),
        "data": data_info, "start_held_out_loss": start_loss, "dense_rel_err": dense_err,
        "dense_rel_err_max": max(dense_err), "dense_rel_err_final": dense_err[-1], "runs": results,
        "wall_s": wall_s, "quick": args.quick, "command": command,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "git": START_GIT, "build": build_info(),
    }


# ---- its table ---------------------------------------------------------------------------------------------------

def _ef_label(r: dict) -> str:
    if r["error_feedback"] is None:
        return "-"
    if not r["error_feedback"]:
        return "no"
    decay = r.get("residual_decay")  # absent from reports made before residual_decay existed
    return "yes" if decay is None else f"yes, remainder x{decay:g}/step"


def _variant(r: dict) -> tuple:
    # Reports made before these fields existed lack them (those runs used a decay of 1, the dense update and the
    # config's betas and learning rate).
    return r.get("residual_decay"), r.get("lazy"), tuple(r.get("betas") or ()), r.get("lr")


def extra_ef_run(r: dict, runs: list[dict]) -> bool:
    """An error-feedback run whose residual_decay or update differs from that of most error-feedback runs (the
    one comparison run at the smallest ratio)."""
    variants = collections.Counter(_variant(x) for x in runs if x["error_feedback"])
    return bool(r["error_feedback"]) and _variant(r) != variants.most_common(1)[0][0]


def _update_label(r: dict) -> str:
    if r["ratio"] is None:
        return "-"
    return "lazy" if r.get("lazy") else "dense"


def train_rows(train: dict) -> list[dict]:
    dense = next(r for r in train["runs"] if r["name"].startswith("nsp adamw"))
    rows = []
    for r in train["runs"]:
        rows.append({
            "name": r["name"], "ratio": "100%" if r["ratio"] is None else f"{r['ratio']:.0%}",
            "ef": _ef_label(r), "update": _update_label(r),
            "held_out": r["held_out_loss"], "vs_dense": r["held_out_loss"] / dense["held_out_loss"] - 1,
            "train": r["final_train_loss"], "step_ms": r["step_ms"], "update_ms": r["update_ms"],
        })
    return rows


TRAIN_COLUMNS = [("name", "run", ""), ("ratio", "kept", ""), ("ef", "error feedback", ""),
                 ("update", "store update", ""),
                 ("held_out", "held-out loss", ".4f"), ("vs_dense", "vs nsp dense", "+.2%"),
                 ("train", "last train loss", ".4f"), ("step_ms", "step ms (median)", ".1f"),
                 ("update_ms", "store update ms", ".2f")]
