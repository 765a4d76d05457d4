"""One `nsp train` run of a big model, kept as a record: its output, every step's metrics, and its peak memory.

    python bench/train_big.py                      # the README's 2.7B command (about 10 minutes, ~61 GB of disk)
    python bench/train_big.py --name gpt3_760m -- --model gpt3-760m --steps 5 --batch 1 --seq 128 --bf16 \\
        --f32-accum --bf16-params --no-checkpoints --log-every 1 --eval-every 1 --eval-batches 2

Runs ``nsp train ARGS --run-dir DIR`` in a child process (its output shown as it comes), then writes
``bench/results/train_<name>.json``: the command, git commit, machine and versions (as every benchmark record),
the child's output lines, each step's row of ``metrics.jsonl`` (loss, held-out loss, step, forward/backward and
update seconds, bytes moved, peak RSS) and the child's peak resident memory as the kernel counted it
(``wait4``'s ``ru_maxrss``, the figure ``/usr/bin/time -v`` prints). The run directory (its store: 12 bytes per
parameter per version slot) is deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402

README_2P7B = ["--model", "gpt3-2.7b", "--steps", "3", "--batch", "1", "--seq", "128", "--bf16", "--f32-accum",
               "--bf16-params", "--no-checkpoints", "--log-every", "1", "--eval-every", "1", "--eval-batches", "2",
               "--progress-s", "30"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="gpt3_2p7b", help="the record's name: bench/results/train_<name>.json")
    parser.add_argument("--dir", default="/var/tmp", help="where the run directory goes (needs the store's disk)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument("args", nargs="*", help="nsp train's arguments after -- (default: the README's 2.7B run)")
    args = parser.parse_args()
    train_args = args.args or README_2P7B
    run_dir = Path(args.dir) / f"nsp-train-{args.name}"
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: remove it or give another --name")
    cmd = [sys.executable, "-m", "nsp.cli", "train", *train_args, "--run-dir", str(run_dir)]
    print("running:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in child.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    _, status, usage = os.wait4(child.pid, 0)
    wall_s = time.perf_counter() - t0
    returncode = os.waitstatus_to_exitcode(status)
    try:
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        metrics = []
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    steps = [m for m in metrics if "loss" in m]
    peak = usage.ru_maxrss * 1024  # KiB on Linux
    record = {"nsp_train_args": train_args, "returncode": returncode, "wall_s": wall_s, "peak_rss_bytes": peak,
              "steps": steps, "output": lines}
    out = write_json(f"train_{args.name}", record)
    print(f"\nrc {returncode}, {wall_s:.0f} s, peak RSS {peak / 2**30:.2f} GiB (wait4), "
          f"losses {[round(s['loss'], 4) for s in steps]}, held-out {[round(s['eval_loss'], 4) for s in steps if 'eval_loss' in s]}"
          f"\nwrote {out}")
    sys.exit(returncode)


if __name__ == "__main__":
    main()
