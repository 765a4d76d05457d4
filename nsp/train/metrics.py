"""What a run reports while it runs: the metrics of each logged step (``StepMeter``: time, throughput and the
store's traffic per step; ``step_line``: the step's log line), where they are written (``MetricsWriter``:
``metrics.jsonl`` and TensorBoard), and ``StepWatch``, a thread that logs where a long step is while it runs
(``--progress-s``)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable

import nsp.storage
from nsp.train.config import TrainConfig
from nsp.train.layerwise import fmt_gib, peak_rss_bytes


class StepMeter:
    """The metrics row of a logged step: wall time and the store's counters (``StateStore.stats``) per step since
    the previous logged step, split into forward/backward and the update's share."""

    def __init__(self, store, step: int, tokens_per_step: int, staleness: int):
        self.store, self.tokens_per_step, self.staleness = store, tokens_per_step, staleness
        self.time, self.step, self.stats = time.perf_counter(), step, store.stats()

    def row(self, step: int, loss: float, lr: float, agree_s: float, process: int) -> dict:
        """Step ``step``'s row (its loss and learning rate given); ``restart`` after logging it."""
        now, stats = time.perf_counter(), self.store.stats()
        steps = step - self.step
        delta = {k: (stats[k] - self.stats.get(k, 0)) / steps for k in stats if k != "buffer_bytes"}
        step_s = (now - self.time) / steps
        update_s = delta.get("update_ns", 0) / 1e9
        # With staleness 1 the update runs beside the next step: only the time a step waited for it (the
        # previous update's tail, the copies) is the step's own.
        wait_s = delta.get("wait_ns", 0) / 1e9
        held_s = wait_s if self.staleness else update_s
        self._read = stats
        return {
            "step": step, "loss": loss, "lr": lr,
            "tokens_per_s": self.tokens_per_step / step_s, "step_s": step_s,
            "update_s": update_s, "update_wait_s": wait_s, "fwd_bwd_s": max(step_s - held_s, 0.0),
            "shared_in_bytes": delta["shared_in_bytes"], "shared_out_bytes": delta["shared_out_bytes"],
            "internal_read_bytes": delta["internal_read_bytes"],
            "internal_write_bytes": delta["internal_write_bytes"],
            "skipped_steps": stats.get("skipped", 0),
            "agree_s": agree_s, "process": process,
            "peak_rss_bytes": peak_rss_bytes(),
        }

    def restart(self, step: int) -> None:
        """The next row counts from now and step ``step`` (what the row was logged, evaluated and written in is
        no step's)."""
        self.time, self.step, self.stats = time.perf_counter(), step, self._read


def step_line(row: dict, config: TrainConfig) -> str:
    """The log line of a logged step's metrics ``row``."""
    return (f"step {row['step']:>5}/{config.steps} {_bar(row['step'], config.steps)} loss {row['loss']:.4f}"
            + (f" eval {row['eval_loss']:.4f}" if "eval_loss" in row else "")
            + (f" acc {row['eval_accuracy']:.1%}" if "eval_accuracy" in row else "")
            + (f" | {row['tokens_per_s'] / 1e3:.1f}k tok/s" if row["tokens_per_s"] >= 100 else
               f" | {row['tokens_per_s']:.2f} tok/s")
            + f" | step {row['step_s'] * 1e3:.0f} ms (fwd/bwd "
            f"{row['fwd_bwd_s'] * 1e3:.0f}, update {row['update_s'] * 1e3:.0f}"
            + (f" beside the next step, {row['update_wait_s'] * 1e3:.0f} waited" if config.staleness else "")
            + ") | link in "
            f"{_fmt_bytes(row['shared_in_bytes'])} out {_fmt_bytes(row['shared_out_bytes'])} | store r "
            f"{_fmt_bytes(row['internal_read_bytes'])} w {_fmt_bytes(row['internal_write_bytes'])}"
            f" | lr {row['lr']:.2e} | peak RSS {fmt_gib(row['peak_rss_bytes'])}")


class MetricsWriter:
    """The run's metrics, a row a line: ``metrics.jsonl`` and TensorBoard scalars in ``tb/`` (process 0), or
    ``metrics-process-N.jsonl`` (process N of several)."""


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
        """Closes both logs, the second also when the first fails; raises the first error (a full disk, say)."""
        try:
            self.jsonl.close()
        finally:
            tb, self.tb = self.tb, None
            if tb is not None:
                try:
                    tb.close()
                except OSError:
                    # tensorboardX closes its event files again at exit when this close fails, and fails again
                    # there (the same unwritten events): a traceback after the run's own message. Its writers are
                    # given up here instead.
                    _give_up(tb)
                    raise


def _give_up(tb) -> None:
    """Gives up a tensorboardX writer whose close failed (a full disk): stops its writer threads and marks its event
    files closed. Else tensorboardX closes them again at exit and fails again there (the same unwritten events),
    and a thread still reading its closed queue raises too: tracebacks after the run's own message."""
    for writer in (getattr(tb, "all_writers", None) or {}).values():
        events = getattr(writer, "event_writer", None)
        if events is None or not hasattr(events, "_closed"):
            continue
        worker = getattr(events, "_worker", None)
        if worker is not None:
            try:
                worker.stop()
            except Exception:  # noqa: BLE001  (a worker that died on the full disk already)
                pass
        events._closed = True


class StepWatch:
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
