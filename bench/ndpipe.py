"""Near-data fine-tuning (NDPipe) against fine-tuning where the data is moved to the trainer.

    python bench/ndpipe.py                 # the record in bench/results/ndpipe.json
    python bench/ndpipe.py --quick         # fewer steps, N = 1 and 2: a smoke run
    python bench/ndpipe.py --cores split --json bench/results/ndpipe_split.json   # roles on their own cores
    python bench/ndpipe.py --plot-only bench/results/ndpipe.json bench/results/ndpipe_split.json \
        --png bench/results/ndpipe.png       # the plot of both records

A GPT is pretrained once as a language model (``--pretrain-steps``), then fine-tuned for ``--steps`` steps on the
same batches, for two tasks: ``classify`` (NDPipe's own kind: which top-level package of the standard library a
chunk of source comes from, a classifier on the pooled features, every block frozen in the frozen schedules, so
an extractor sends one vector per sequence; accuracy reported) and ``lm`` (language modelling, the first
``--freeze-layers`` blocks frozen, per-token features). Each task by:

  full         ``nsp train --init-from PRE``: every param trains, the trainer reads the tokens (all the data
               goes to the trainer)
  frozen       ``nsp train --init-from PRE --freeze-layers K``: the backbone frozen, computed by the trainer
  ndpipe       ``nsp launch -n N -- nsp features ... --features-runs R`` (N extractor processes, "beside the
               data") and ``nsp train --features`` (the Tuner) started beside them: the pipelined schedule
  ndpipe-serial  the same, the Tuner started once extraction has finished

each timed end to end (from the first process started to the last one finished: start-up, compilation and data
loading included, as a user waits for them), for N = 1, 2, 4 extractors. Bytes moved: what crosses from where the
data is to the trainer (the tokens, one byte each, for full and frozen; the features and tokens or labels for
ndpipe, as ``features.json`` counts them). For the pipelined schedule the record also gives the overlap: how long
extraction and the Tuner ran side by side (from the Tuner's start to the end of extraction or of the Tuner,
whichever came first).

Where the processes run (``--cores``):

  shared  (the default) every process on all of this machine's cores: the extractors and the Tuner compete for
          them, as they would not on separate storage servers.
  split   a software model of NDPipe's separate servers on one machine: the trainer's processes (full, frozen and
          the Tuner) are pinned to the first half of the usable cores, the extractors (the "PipeStores") to the
          other half (``sched_setaffinity``). Every schedule gets the same trainer cores, as every schedule in
          NDPipe gets the same Tuner server; what NDPipe adds is the stores' own compute beside the data. All N
          extractors share the stores' half here: N models more stores' processes, not more stores' cores.

Beside the times: the held-out loss (and accuracy, for ``classify``) each schedule ends with, and, for the
frozen schedule, the size of the checkpoint delta (``nsp ckpt delta``) from its first checkpoint (step 0) to its
last against the last checkpoint's full size: what a store holding the starting version is sent.

Targets (the issue's): ndpipe >= 1.5x faster than full at N = 4; the pipelined schedule >= 1.3x faster than
the serial one; the delta after a frozen-backbone fine-tune <= 10% of a full checkpoint. The record goes to
``bench/results/ndpipe.json`` (or ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, print_table, write_json  # noqa: E402

NSP = [sys.executable, "-m", "nsp.cli"]


def _env() -> dict:
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1")


# The CPUs each role may run on (``--cores``): None leaves a process on all of them.
ROLE_CPUS: dict[str, set[int] | None] = {"trainer": None, "extractors": None}


def split_cores(usable: set[int]) -> dict[str, set[int]]:
    """The trainer's and the extractors' CPUs for ``--cores split``: the first half and the rest."""
    cpus = sorted(usable)
    if len(cpus) < 2:
        raise SystemExit(f"--cores split needs at least 2 usable CPUs; this process may use {cpus}")
    half = len(cpus) // 2
    return {"trainer": set(cpus[:half]), "extractors": set(cpus[half:])}


def _pin(role: str):
    """A ``preexec_fn`` that pins the child (and whatever it starts) to ``role``'s CPUs, or None."""
    cpus = ROLE_CPUS[role]
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def _run(args: list[str], timeout: float, role: str | None = "trainer") -> float:
    """Runs ``nsp ARGS`` on ``role``'s CPUs (None: on every CPU); returns its wall time."""
    t0 = time.perf_counter()
    done = subprocess.run(NSP + args, env=_env(), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_pin(role) if role else None)
    if done.returncode != 0:
        raise RuntimeError(f"nsp {' '.join(args[:1])} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return time.perf_counter() - t0


def _ndpipe(common: list[str], fine: list[str], n: int, runs: int, out: Path, pipelined: bool,
            timeout: float) -> dict:
    """N extractors and a Tuner (its run directory: ``out / "tuner"``), timed: ``seconds`` end to end,
    ``extract_s`` (the extractors' own wall time), ``tune_s`` (the Tuner's), ``overlap_s`` (both running),
    ``tuner_waited_s`` (the Tuner's wait for features, as it printed it) and ``meta`` (features.json)."""
    feats = out / "features"
    t0 = time.perf_counter()
    extractors = subprocess.Popen(NSP + ["launch", "-n", str(n), "--", *NSP, "features", *common, *fine,
                                         "--features-out", str(feats), "--features-runs", str(runs)],
                                  env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  preexec_fn=_pin("extractors"))
    # The extractors' output is drained, and their end time taken, on a thread of its own: the Tuner runs
    # meanwhile, and a full pipe would stall them.
    ended: dict[str, float | str] = {}

    def drain() -> None:
        ended["output"] = extractors.communicate()[0]
        ended["at"] = time.perf_counter()

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    if pipelined:
        while not (feats / "features.json").exists():
            if extractors.poll() is not None:
                drainer.join()
                raise RuntimeError(f"the extractors failed:\n{str(ended['output'])[-3000:]}")
            time.sleep(0.05)
    else:
        drainer.join(timeout=timeout)
        if extractors.returncode != 0:
            raise RuntimeError(f"the extractors failed:\n{str(ended.get('output', ''))[-3000:]}")
    tuner_start = time.perf_counter()
    tuner = subprocess.run(NSP + ["train", *common, *fine, "--features", str(feats), "--run-dir",
                                  str(out / "tuner")], env=_env(), capture_output=True, text=True, timeout=timeout,
                           preexec_fn=_pin("trainer"))
    tuner_end = time.perf_counter()
    drainer.join(timeout=timeout)
    if extractors.returncode != 0 or tuner.returncode != 0:
        raise RuntimeError(f"ndpipe failed:\n{str(ended.get('output', ''))[-2000:]}\n{tuner.stdout[-2000:]}"
                           f"{tuner.stderr[-2000:]}")
    extract_end = float(ended["at"])
    waited = next((float(line.split("waited ")[1].split(" s")[0]) for line in tuner.stdout.splitlines()
                   if line.startswith("features: waited")), float("nan"))
    return {"seconds": max(extract_end, tuner_end) - t0, "extract_s": extract_end - t0,
            "tune_s": tuner_end - tuner_start, "overlap_s": max(0.0, min(extract_end, tuner_end) - tuner_start),
            "tuner_waited_s": waited, "meta": json.loads((feats / "features.json").read_text())}


def _final_eval(run_dir: Path) -> dict:
    """The last held-out metrics a run logged (``eval_loss``, and ``eval_accuracy`` for a classifier)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in rows if "eval_loss" in r][-1]
    return {k: last[k] for k in ("eval_loss", "eval_accuracy") if k in last}


def _delta(run_dir: Path, work: Path, timeout: float) -> dict:
    """``nsp ckpt delta`` from a run's first checkpoint to its last: the manifest's sizes."""
    steps = sorted(int(p.name) for p in (run_dir / "ckpt").iterdir() if p.name.isdigit())
    out = work / "delta"
    shutil.rmtree(out, ignore_errors=True)
    _run(["ckpt", "delta", str(run_dir / "ckpt" / str(steps[0])), str(run_dir / "ckpt" / str(steps[-1])), str(out)],
         timeout)
    stats = json.loads((out / "DELTA.json").read_text())["stats"]
    shutil.rmtree(out, ignore_errors=True)
    return {"delta_from_step": steps[0], "delta_to_step": steps[-1], "delta_bytes": stats["delta_bytes"],
            "checkpoint_bytes": stats["full_bytes"], "delta_ratio": stats["ratio"]}


def fine_tune(task: str, args, common: list[str], pre: Path, base: Path) -> list[dict]:
    """Every schedule of one task: its rows."""
    task_args = ["--task", task, "--eval-batches", str(args.eval_batches)] if task == "classify" else []
    blocks = args.classify_freeze_layers if task == "classify" else args.freeze_layers
    fine = [*task_args, "--init-from", str(pre), "--steps", str(args.steps), "--seed", "11"]
    frozen = [*fine, "--freeze-layers", str(blocks)]
    token_bytes = args.steps * args.batch * (args.seq + (0 if task == "classify" else 1))
    rows = []
    for name, extra in (("full", fine), ("frozen", frozen)):
        run_dir = base / f"{task}-{name}"
        seconds = _run(["train", *common, *extra, "--run-dir", str(run_dir)], args.timeout)
        row = {"task": task, "schedule": name, "extractors": 0, "seconds": seconds, "bytes_moved": token_bytes,
               **_final_eval(run_dir)}
        if name == "frozen":
            row.update(_delta(run_dir, base, args.timeout))
        rows.append(row)
        print(f"  {task:8s} {name:14s} {seconds:7.1f} s", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    for n in [int(x) for x in args.extractors.split(",")]:
        for pipelined in (True, False):
            name = "ndpipe" if pipelined else "ndpipe-serial"
            out = base / f"{task}-{name}-{n}"
            timed = _ndpipe(common, frozen, n, args.runs, out, pipelined, args.timeout)
            meta = timed.pop("meta")
            rows.append({"task": task, "schedule": name, "extractors": n, **timed,
                         "bytes_moved": meta["bytes_features"] + meta["bytes_tokens"],
                         "bytes_features": meta["bytes_features"], "pooled": meta.get("pooled", False),
                         **_final_eval(out / "tuner")})
            print(f"  {task:8s} {name:14s} N={n} {timed['seconds']:7.1f} s (extraction {timed['extract_s']:.1f} s, "
                  f"the Tuner {timed['tune_s']:.1f} s, side by side {timed['overlap_s']:.1f} s, the Tuner waited "
                  f"{timed['tuner_waited_s']:.1f} s)", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    return rows


def add_speedups(rows: list[dict]) -> list[dict]:
    """Each row's speed-up over its task's full fine-tuning, and each pipelined row's over its serial one."""
    for r in rows:
        task = [t for t in rows if t["task"] == r["task"]]
        r["speedup_vs_full"] = next(t["seconds"] for t in task if t["schedule"] == "full") / r["seconds"]
        serial = next((t["seconds"] for t in task if t["schedule"] == "ndpipe-serial"
                       and t["extractors"] == r["extractors"]), None)
        if r["schedule"] == "ndpipe" and serial:
            r["speedup_vs_serial"] = serial / r["seconds"]
    return rows


TIMES = ("seconds", "extract_s", "tune_s", "overlap_s", "tuner_waited_s")


def merge_repeats(repeats: list[list[dict]]) -> list[dict]:
    """One row per (task, schedule, N) from ``--repeats`` passes: each time the median over passes (every pass's
    in ``<time>_runs``), the speed-ups those medians give, and each pass's own speed-ups in ``<speedup>_runs``
    (each pass ran every schedule once, in the same order, so a slow spell lands on a whole pass)."""
    for rows in repeats:
        add_speedups(rows)
    merged = []
    for i, first in enumerate(repeats[0]):
        same = [rows[i] for rows in repeats]
        row = dict(first)
        for key in TIMES + ("speedup_vs_full", "speedup_vs_serial"):
            if key in first:
                row[f"{key}_runs"] = [r[key] for r in same]
                if key in TIMES:
                    row[key] = median(row[f"{key}_runs"])
        merged.append(row)
    return add_speedups(merged)


def plot(records: list[dict], png: str | os.PathLike) -> None:
    """One panel per (task, ``--cores``) of the ``records``: each schedule's end-to-end seconds as a bar (NDPipe's
    for N = 1, 2, 4 extractors, pipelined beside serial), its speed-up over full fine-tuning above it, and the
    bytes each moved to the trainer in the panel's legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(r, task) for r in records for task in r["tasks"]]
    cols = min(2, len(panels))
    rows_of_panels = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(6.2 * cols, 4.2 * rows_of_panels), squeeze=False)
    colours = {"full": "#888888", "frozen": "#4c72b0", "ndpipe-serial": "#dd8452", "ndpipe": "#55a868"}
    for ax, (record, task) in zip(axes.flat, panels):
        rows = [r for r in record["rows"] if r["task"] == task]
        labels, heights, colors = [], [], []
        for r in rows:
            n = f"\nN={r['extractors']}" if r["extractors"] else ""
            labels.append({"full": "full", "frozen": "frozen", "ndpipe": "pipelined",
                           "ndpipe-serial": "serial"}[r["schedule"]] + n)
            heights.append(r["seconds"])
            colors.append(colours[r["schedule"]])
        bars = ax.bar(range(len(rows)), heights, color=colors)
        for bar, r in zip(bars, rows):
            ax.annotate(f"{r['speedup_vs_full']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("end to end (s)")
        moved = {r["schedule"]: r["bytes_moved"] for r in rows}
        ax.set_title(f"{task}, cores {record.get('cores', 'shared')}: {record['steps']} steps\n"
                     f"to the trainer: tokens {moved['full'] / 1e6:.2f} MB, features "
                     f"{moved.get('ndpipe', 0) / 1e6:.2f} MB", fontsize=9)
    fig.suptitle("NDPipe: features beside the data against fine-tuning where the data is moved (above each bar: "
                 "speed-up over full)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    # 150 steps: at 48 (the first record's) each process's start-up (~8 s for a trainer) was a third of the
    # full fine-tune's time, and more extractors measured mostly more start-ups.
    parser.add_argument("--steps", type=int, default=150, help="fine-tuning steps")
    parser.add_argument("--pretrain-steps", type=int, default=20)
    parser.add_argument("--tasks", default="classify,lm")
    parser.add_argument("--freeze-layers", type=int, default=3, help="blocks frozen for the lm task")
    parser.add_argument("--classify-freeze-layers", type=int, default=4,
                        help="blocks frozen for the classify task (all of them: pooled features)")
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches of the classify task")
    parser.add_argument("--runs", type=int, default=4, help="sub-datasets of the pipelined schedule")
    parser.add_argument("--extractors", default="1,2,4")
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes over every schedule; the record keeps each pass and the medians")
    parser.add_argument("--cores", choices=("shared", "split"), default="shared",
                        help="every process on every core, or the trainer and the extractors on halves of them")
    parser.add_argument("--quick", action="store_true", help="16 steps, N = 1 and 2")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None, help="also draw the record(s) to this file")
    parser.add_argument("--plot-only", nargs="+", metavar="JSON", default=None,
                        help="run nothing: draw these records (e.g. the shared and split ones) to --png")
    args = parser.parse_args()
    if args.plot_only:
        if not args.png:
            parser.error("--plot-only needs --png (where the plot goes)")
        plot([json.loads(Path(f).read_text()) for f in args.plot_only], args.png)
        print(f"ndpipe: {', '.join(args.plot_only)} drawn to {args.png}")
        return
    if args.quick:
        args.steps, args.extractors, args.pretrain_steps = 16, "1,2", 4
    usable = os.sched_getaffinity(0)
    if args.cores == "split":
        ROLE_CPUS.update(split_cores(usable))
        print(f"ndpipe: the trainer on CPUs {sorted(ROLE_CPUS['trainer'])}, the extractors on "
              f"{sorted(ROLE_CPUS['extractors'])}", flush=True)
    base = Path(tempfile.mkdtemp(prefix="nsp-ndpipe-", dir=args.dir))
    common = ["--model", args.model, "--seq", str(args.seq), "--batch", str(args.batch), "--tier", "file",
              "--eval-every", "0", "--log-every", "10", "--ckpt-every", "0"]
    try:
        pre = base / "pre"
        print(f"ndpipe: pretraining {args.model} for {args.pretrain_steps} steps", flush=True)
        _run(["train", *common, "--run-dir", str(pre), "--steps", str(args.pretrain_steps)], args.timeout, role=None)
        passes = []
        for k in range(args.repeats):
            if args.repeats > 1:
                print(f"ndpipe: pass {k + 1} of {args.repeats}", flush=True)
            passes.append([row for task in args.tasks.split(",") for row in fine_tune(task, args, common, pre, base)])
        rows = merge_repeats(passes)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    passes_note = f", median of {args.repeats} passes" if args.repeats > 1 else ""
    print_table(f"fine-tuning {args.model} for {args.steps} steps ({args.batch} x {args.seq} tokens), end to end"
                f"{passes_note}",
                rows, [("task", "task", ""), ("schedule", "schedule", ""), ("extractors", "N", "d"),
                       ("seconds", "seconds", ".1f"), ("speedup_vs_full", "vs full", ".2f"),
                       ("speedup_vs_serial", "vs serial", ".2f"), ("overlap_s", "side by side (s)", ".1f"),
                       ("tuner_waited_s", "Tuner waited (s)", ".1f"),
                       ("bytes_moved", "bytes moved", ",d"), ("eval_loss", "held-out loss", ".4f"),
                       ("eval_accuracy", "accuracy", ".3f"), ("delta_ratio", "delta/ckpt", ".3f")])
    record = {"model": args.model, "seq": args.seq, "batch": args.batch, "steps": args.steps,
              "pretrain_steps": args.pretrain_steps, "freeze_layers": args.freeze_layers,
              "classify_freeze_layers": args.classify_freeze_layers, "tasks": args.tasks.split(","),
              "runs": args.runs, "repeats": args.repeats, "quick": args.quick, "cores": args.cores,
              "role_cpus": {k: sorted(v if v is not None else usable) for k, v in ROLE_CPUS.items()}, "rows": rows}
    written = write_json("ndpipe", record, args.json)
    if args.png:
        plot([json.loads(Path(written).read_text())], args.png)


if __name__ == "__main__":
    main()
