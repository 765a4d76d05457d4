"""The staged step (``stage_gradients=True``) beside nsp's default step: time and peak memory, same model.

    python bench/staged_step.py                      # GPT 24 x 1024 (303M params), batch 1 x 64, 3 pairs
    python bench/staged_step.py --layers 12 --pairs 5

Each attempt is ``bench/max_model.py``'s nsp-file child in a subprocess of its own (file tier, bf16 params set up
with ``nsp.optim.init_from``, ``nsp train``'s step, two steps; the second one timed), with and without
``--stage-gradients``, alternating so that the machine's drift falls on both alike. The table gives each one's
median step time and peak RSS over the pairs and the staged step's ratios; both must give the same losses (the
staged step is the same update, bit for bit). The record goes to ``bench/results/staged_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402


def attempt(staged: bool, args, workdir: Path) -> dict:
    store = workdir / "store"
    shutil.rmtree(store, ignore_errors=True)
    cmd = [sys.executable, str(Path(__file__).parent / "max_model.py"), "--child", "nsp-file", "--layers",
           str(args.layers), "--width", str(args.width), "--seq", str(args.seq), "--store", str(store),
           "--f32-accum", "--stage-gradients" if staged else "--no-stage-gradients"]
    env = dict(os.environ, MALLOC_ARENA_MAX="2", MALLOC_MMAP_THRESHOLD_="131072")  # as max_model.py's attempts
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    shutil.rmtree(store, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"attempt failed (staged={staged}):\n{proc.stderr[-2000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory here)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="nsp-staged-", dir=args.dir or os.getcwd()))
    results = {True: [], False: []}
    try:
        for i in range(args.pairs):
            for staged in (True, False):
                r = attempt(staged, args, workdir)
                results[staged].append(r)
                print(f"  pair {i + 1}: {'staged ' if staged else 'default'} step {r['step_s']:.2f} s, peak RSS "
                      f"{r['peak_rss'] / 2**30:.2f} GiB", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    losses = {tuple(r["losses"]) for rs in results.values() for r in rs}
    rows = []
    for staged in (False, True):
        rs = results[staged]
        rows.append({"step": "staged (stage_gradients)" if staged else "default (leaves update)",
                     "step_s": statistics.median(r["step_s"] for r in rs),
                     "peak_rss_gib": statistics.median(r["peak_rss"] for r in rs) / 2**30,
                     "step_s_all": [r["step_s"] for r in rs], "peak_rss_all": [r["peak_rss"] for r in rs]})
    rows[1]["time_vs_default"] = rows[1]["step_s"] / rows[0]["step_s"]
    rows[1]["rss_vs_default"] = rows[1]["peak_rss_gib"] / rows[0]["peak_rss_gib"]
    params = results[True][0]["params"]
    print_table(f"nsp file tier, GPT {args.layers} x {args.width} ({params / 1e6:.0f}M params), batch 1 x {args.seq}, "
                f"median of {args.pairs} pairs", rows,
                [("step", "step", "s"), ("step_s", "step (s)", ".2f"), ("peak_rss_gib", "peak RSS (GiB)", ".2f"),
                 ("time_vs_default", "time vs default", ".3f"), ("rss_vs_default", "RSS vs default", ".3f")])
    print(f"same losses in every attempt: {'yes' if len(losses) == 1 else 'NO'}")
    write_json("staged_step", {"layers": args.layers, "width": args.width, "seq": args.seq, "params": params,
                               "pairs": args.pairs, "same_losses": len(losses) == 1, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
