"""Training a Flax GPT with its optimizer state in a storage tier: ``train_and_evaluate(config)``, the loop.

One jitted step: forward/backward on the accelerator, then the optax chain (clipping, optional Top-K
compression, the nsp storage optimizer) whose update runs in the store's C++ engine through the XLA FFI. The
store holds the fp32 master params and moments; the model's params come back from it every step. Checkpoints
are snapshots of the store (hard links) plus the small train state, through an orbax CheckpointManager.

One process of several (``nsp.distributed``: ``--coordinator``/``--num-processes``/``--process-id`` or what JAX
detects) builds the same mesh over every process's devices, holds only the store shards of its own devices (in
``STORE_DIR/process-NNNNN``), reads only its rows of each global batch, and checkpoints its shards into its part of
each step; the processes agree on the committed version before every checkpoint.

This file holds the loop (``train_and_evaluate``: steps, metrics, evaluation, checkpoints, Ctrl-C); the pieces a
run is built from live beside it, by job:

- ``nsp.train.setup``: ``load_data`` (the batches), ``model_config`` and ``init_model`` (graphdef and params),
  ``init_store_layerwise`` (a model too big for fp32, written into the store part by part), and the run's
  set-up and resume (``build``: fresh, from a checkpoint, from the store);
- ``nsp.train.optimizer``: ``make_optimizer`` (the optax chain on a store), ``learning_rate_schedule``;
- ``nsp.train.step``: ``make_train_step`` (the jitted train and eval steps), ``loss_fn``, ``put_batch``,
  ``local_rows``;
- ``nsp.train.freeze``: ``--freeze``/``--freeze-layers`` (the leaves kept out of the store and the backward pass)
  and ``--init-from`` (another run's params as the starting point);
- ``nsp.train.metrics``: the metrics rows and log lines, the step watch (``--progress-s``);
- ``nsp.train.process``: ``lean_malloc``, joining the processes of a multi-process run;
- ``nsp.train.failure``: what a run says when it stops partway (a full disk, an I/O error, a failed step): the
  error's line, what was kept, how to go on (``RunStopped``).

They are public, so that other loops (the benchmarks, a user's own) step exactly as ``nsp train`` does; this
module re-exports them (``from nsp.train.trainer import make_train_step, ...``), and ``TrainError``
(``nsp.train.config``), what a run raises when it cannot start or continue as configured.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

import nsp.distributed
import nsp.storage
from nsp.storage import checkpoint as ckpt
from nsp.train import activations, ckpt_local, failure, features, process, store_resume
from nsp.train.config import TrainConfig, TrainError
from nsp.train.layerwise import fmt_gib, peak_rss_bytes
from nsp.train.metrics import MetricsWriter, StepMeter, StepWatch, step_line
from nsp.train.optimizer import learning_rate_schedule, make_optimizer
from nsp.train.process import lean_malloc
from nsp.train.setup import (Run, TrainData, beside_earlier_default_runs, build, init_model, init_store_layerwise,
                             load_data, model_config)
from nsp.train.step import local_rows, loss_fn, make_train_step, put_batch

__all__ = ["TrainData", "TrainError", "init_model", "init_store_layerwise", "lean_malloc", "learning_rate_schedule",
           "load_data", "local_rows", "loss_fn", "make_optimizer", "make_train_step", "model_config", "put_batch",
           "train_and_evaluate"]


def train_and_evaluate(config: TrainConfig, *, log: Callable[[str], None] = print) -> dict:
    """Trains ``config.model`` for ``config.steps`` steps; returns the final metrics.

    Writes ``metrics.jsonl``, ``tb/`` (TensorBoard), ``config.json`` and ``ckpt/`` into ``config.run_dir``.
    Ctrl-C finishes the step in flight, checkpoints, and leaves a run that ``resume=True`` continues.
    """
    process.join(config)
    config = beside_earlier_default_runs(config.resolved(), log)
    run = build(config, log)
    if config.features:  # the Tuner: batches of a frozen backbone's features (nsp.train.features)
        try:
            meta, run.train_batches = features.open_for(config)
            features.check_backbone(config, meta, run.params, run.freeze)
        except BaseException:
            run.store.close()
            raise
        log(f"features: training blocks {meta.blocks}.. from {config.features} ({meta.dtype}, {meta.processes} "
            f"extractor process{'es' if meta.processes > 1 else ''}, backbone from {meta.source})")
        per_device = config.batch // (run.mesh.size if run.mesh is not None else 1)
        if per_device != meta.rows_per_device:
            log(f"features: computed {meta.rows_per_device} rows per device, this run's devices take {per_device}: "
                "the features equal the run's own up to rounding (the same split makes them equal bit for bit)")
    try:
        block_call, spill = activations.spill_setup(config, run.graphdef, run.params, log,
                                                    batch=(run.train_batches.batch(run.step)
                                                           if config.offload_activations != "none" else None),
                                                    mesh=run.mesh,
                                                    store=run.store)
    except BaseException:
        run.store.close()
        raise
    train_step, eval_step = make_train_step(run.graphdef, run.tx, run.mesh, block_call, run.freeze,
                                            features_from=config.freeze_layers if config.features else 0)
    local = ckpt_local.active(config)  # each process's own checkpoints: old steps go once every process agrees
    manager = ckpt.make_checkpoint_manager(Path(config.run_dir) / "ckpt", local=local,
                                           max_to_keep=None if local else config.keep_checkpoints)
    metrics = MetricsWriter(Path(config.run_dir), jax.process_index())
    schedule = learning_rate_schedule(config)
    interrupted, finished = [], []
    doing = ["setting up"]  # what the run is at, for the message of a failure
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
            doing[0] = f"the checkpoint of step {run.step}"
            with failure.checkpoint_save():
                _save_checkpoint(run, manager)

    watch = None
    summary: dict = {}
    signal.signal(signal.SIGINT, on_sigint)
    try:  # a failure from here on (the first checkpoint included) ends in one message: the except below
        if not config.checkpoints:
            log("checkpoints off (--no-checkpoints): " + (
                f"--resume continues from the store's committed version ({store_resume.RECORD} records each step's)"
                if record_steps else
                f"nothing is saved and the run cannot be resumed ({store_resume.why_not(config)})"))
        if run.step == 0:
            save()  # a run killed before its first checkpoint can still be resumed
            if record_steps:  # nor need one killed in its first step be set up again
                store_resume.write_record(Path(config.run_dir), run.store.version, 0)
        if config.bf16_params and run.step < config.steps:
            train_step = _compile_ahead(run, train_step, log)
        run_t0 = time.perf_counter()
        losses: list[float] = []
        watch = StepWatch(run.store, config.progress_s, log) if config.progress_s else None
        meter = StepMeter(run.store, run.step, run.tokens_per_step, config.staleness)
        if run.step >= config.steps:
            log(f"the run already has {run.step} of {config.steps} steps")
        end = min(config.steps, config.stop_after or config.steps)
        rows = local_rows(config.batch, run.mesh)
        multiprocess = jax.process_count() > 1
        while run.step < end and not (interrupted and not multiprocess):
            if multiprocess and run.step % config.log_every == 0 and process.any_process(bool(interrupted)):
                interrupted.append(True)  # every process stops at the same step (Ctrl-C reaches each)
                break
            tokens = put_batch(run.train_batches.batch(run.step, rows), run.mesh, global_rows=config.batch)
            doing[0] = f"step {run.step + 1}"
            nsp.distributed.CLOCK.sample()  # a step of the wall clock, should a wait time out (failure.stopped)
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
                row = meter.row(run.step, loss, float(schedule(run.step - 1)), run.agree_s, jax.process_index())
                if config.eval_every and (run.step % config.eval_every == 0 or final) or final:
                    row.update(_evaluate(run, eval_step))
                metrics.write(row)
                log(step_line(row, config))
                meter.restart(run.step)
                summary = row
            elif config.eval_every and run.step % config.eval_every == 0:
                metrics.write({"step": run.step, **_evaluate(run, eval_step)})
            if config.ckpt_every and run.step % config.ckpt_every == 0 and not final:
                save()
        save()
        if losses:
            log(f"done: {len(losses)} logged step(s) in {time.perf_counter() - run_t0:.1f} s, loss "
                + " -> ".join(f"{x:.4f}" for x in losses)
                + (f", eval {summary['eval_loss']:.4f}" if "eval_loss" in summary else "")
                + (f", accuracy {summary['eval_accuracy']:.1%}" if "eval_accuracy" in summary else "")
                + f" | peak RSS {fmt_gib(peak_rss_bytes())}")
        if config.features:
            log(f"features: waited {run.train_batches.waited_s:.1f} s for extractors over "
                f"{time.perf_counter() - run_t0:.1f} s of training")
        if interrupted or run.step < config.steps:
            log(f"stopped at step {run.step} of {config.steps}; "
                + ("continue with the same command and --resume" if resumable else
                   "no checkpoints were saved (--no-checkpoints): the run cannot be resumed"))
            summary["interrupted"] = bool(interrupted)
        summary["step"] = run.step
        summary["params"] = run.params
        finished.append(True)
        return summary
    except Exception as e:
        # A full disk or an I/O error under the store, the checkpoints or the spill directory, or a step that
        # raised: one message (what failed, what was kept, how to go on) instead of the tracebacks. In a
        # multi-process run a collective that failed because a peer went away leaves as before (the command
        # tells a lost peer, or a peer that stopped the run, from it); this process's own failure is reported
        # here, and the command then tells the other processes (nsp.distributed.stop).
        cause = failure.storage_error(e)
        if cause is None or not failure.is_own(cause):
            raise
        nsp.distributed.stop.begin()
        process.forget_failed_steps()
        raise failure.stopped(cause, config=config, doing=doing[0], store=run.store,
                              manager=manager if config.checkpoints else None, spill=spill) from None
    finally:
        # After a failure every part is still closed, and what closing raises (the same full disk, say) is
        # dropped: the failure itself is what the run reports.
        closing = [lambda: signal.signal(signal.SIGINT, previous_handler), manager.wait_until_finished,
                   manager.close, metrics.close, run.store.close, lambda: activations.close(spill)]
        if watch is not None:
            closing.insert(0, watch.close)
        _close_all(closing, quiet=not finished)
        if finished:  # a process that failed leaves without waiting: its peers' watchdogs end them
            nsp.distributed.finish()


def _close_all(closing: list[Callable[[], object]], *, quiet: bool) -> None:
    """Calls each of ``closing`` in turn, whatever the earlier ones raised; then raises the first error, unless
    ``quiet`` (the run is already failing: that failure is the one to report)."""
    first = None
    for close in closing:
        try:
            close()
        except Exception as e:  # noqa: BLE001  (raised below, once the rest is closed)
            first = first or e
    if first is not None and not quiet:
        raise first


def _compile_ahead(run: Run, train_step, log: Callable[[str], None]):
    """The train step compiled ahead of the first step, so that the steps' times are the steps' own (a big
    model's step takes XLA a minute or more to compile on a CPU)."""
    log("compiling the train step ...")
    t0 = time.perf_counter()
    first = put_batch(run.train_batches.batch(run.step, local_rows(run.config.batch, run.mesh)), run.mesh,
                      global_rows=run.config.batch)
    compiled = train_step.lower(run.params, run.opt_state, first).compile()
    log(f"compiled the train step in {time.perf_counter() - t0:.1f} s | peak RSS {fmt_gib(peak_rss_bytes())}")
    return compiled


def _evaluate(run: Run, eval_step) -> dict[str, float]:
    """The held-out metrics averaged over the run's eval batches, named as the metrics rows name them:
    ``eval_loss`` (and ``eval_accuracy`` with ``--task classify``)."""
    each = [eval_step(run.params, put_batch(b, run.mesh)) for b in run.eval_batches]
    return {f"eval_{name}": float(np.mean([float(m[name]) for m in each])) for name in each[0]}


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
    train_state = {"params": run.params, "opt_state": run.opt_state}
    try:  # every process stops here, saying which lacks the room (the run's message: what was kept, how to go on)
        process.together("checking the room for the checkpoint", lambda: failure.check_checkpoint_room(
            Path(str(manager.directory)), train_state, run.store))
    except TrainError as e:
        raise nsp.storage.StoreError(str(e)) from None
    local = ckpt.is_local(manager)
    ckpt.save_checkpoint(manager, run.step, run.store, train_state,
                         {"step": run.step, "config": dataclasses.asdict(run.config),
                          "process_count": jax.process_count(), "num_shards": n,
                          **({"ckpt_local": True} if local else {})})
    if local:  # every process holds the step: each removes its own steps beyond --keep-checkpoints
        ckpt_local.after_save(manager, run.step, run.config.keep_checkpoints)
