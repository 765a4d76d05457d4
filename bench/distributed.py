"""One process with 4 CPU devices against 2 processes with 2 each (``nsp launch``), same run, this machine.

Both run ``nsp train`` with the same flags; the 2-process run holds two store shards per process. Reported per
layout: the steady step time (steps after the first logged window: no compilation), each process's traffic per
step from ``store.stats()`` (shared link in/out, internal reads/writes of its own shards), and the time the
processes spent agreeing on the committed version before checkpoints (one jitted all-gather each), per
checkpoint. Layouts alternate over ``--reps`` repetitions; medians are printed. Both layouts share this machine's
cores, so the ratio says what the runtime costs, not what a second host would bring.

    python bench/distributed.py [--model tiny] [--steps 20] [--reps 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, print_table, write_json  # noqa: E402

NSP = [sys.executable, "-m", "nsp.cli"]
KEYS = ("shared_in_bytes", "shared_out_bytes", "internal_read_bytes", "internal_write_bytes")


def _train_args(a, run_dir: Path) -> list[str]:
    return ["train", "--model", a.model, "--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq),
            "--log-every", str(a.steps // 2), "--eval-every", "0", "--eval-batches", "1", "--ckpt-every",
            str(a.steps // 2), "--run-dir", str(run_dir), "--data", a.data]


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _run(layout: str, a, run_dir: Path) -> dict:
    if layout == "1x4":
        cmd, env = NSP + _train_args(a, run_dir), _env(4)
    else:
        launch = NSP + ["launch", "-n", "2", "--devices-per-process", "2", "--"]
        cmd, env = launch + NSP + _train_args(a, run_dir), _env(2)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{layout} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = {}
    for f in sorted(run_dir.glob("metrics*.jsonl")):
        last = [json.loads(line) for line in f.read_text().splitlines() if "step_s" in line][-1]
        rows[last.get("process", 0)] = last
    checkpoints = 1 + 2  # step 0, the middle one, the end
    return {"layout": layout, "step_s": rows[0]["step_s"], "agree_ms_per_ckpt": 1e3 * rows[0]["agree_s"] / checkpoints,
            "processes": {p: {k: r[k] for k in KEYS} for p, r in rows.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "nsp"))
    parser.add_argument("--json", default=None, help="where the record goes (default bench/results/distributed.json)")
    a = parser.parse_args()
    results: dict[str, list[dict]] = {"1x4": [], "2x2": []}
    with tempfile.TemporaryDirectory(prefix="nsp-dist-bench-") as tmp:
        for rep in range(a.reps):
            for layout in results:
                results[layout].append(_run(layout, a, Path(tmp) / f"{layout}-{rep}"))
    rows = []
    for layout, runs in results.items():
        for p in sorted(runs[0]["processes"]):
            rows.append({"layout": layout, "process": p,
                         "step_ms": 1e3 * median([r["step_s"] for r in runs]),
                         "agree_ms": median([r["agree_ms_per_ckpt"] for r in runs]),
                         **{k: median([r["processes"][p][k] for r in runs]) / 1e3 for k in KEYS}})
    base = rows[0]["step_ms"]
    for r in rows:
        r["vs_1x4"] = r["step_ms"] / base
    print_table(f"nsp train --model {a.model}, batch {a.batch} x seq {a.seq}, {a.steps} steps, median of {a.reps}",
                rows, [("layout", "layout", "s"), ("process", "proc", "d"), ("step_ms", "step ms", ".1f"),
                       ("vs_1x4", "x 1x4", ".2f"), ("agree_ms", "agree ms/ckpt", ".2f"),
                       ("shared_in_bytes", "link in KB/step", ".1f"), ("shared_out_bytes", "link out KB/step", ".1f"),
                       ("internal_read_bytes", "store r KB/step", ".1f"),
                       ("internal_write_bytes", "store w KB/step", ".1f")])
    out = write_json("distributed", {"config": vars(a), "rows": rows, "runs": results}, a.json)
    print(f"\nrecord: {out}")


if __name__ == "__main__":
    main()
