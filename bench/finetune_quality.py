"""Fine-tuning quality under Top-K gradient compression, measured the way Smart-Infinity's Table IV does.

    python bench/finetune_quality.py              # the record in bench/results/finetune_quality.json
    python bench/finetune_quality.py --quick      # a smoke run: few steps, one seed, one learning rate

The small GPT is pretrained on one corpus (the Python standard library, ``nsp train``'s default data) and then
fine-tuned on another that shares no file with it: the ``.py`` sources of installed packages (``--packages``,
read from this interpreter's site-packages, concatenated in the order of their paths, at most
``--finetune-mib``). Each fine-tune starts from the same pretrained checkpoint (``nsp train --init-from``) and
ends with the held-out loss of the new corpus (its last 5%, which no training window touches;
``--eval-batches`` fixed batches).

Contenders: dense AdamW, and Top-K at 10, 5, 2 and 1% with error feedback (``--topk R``, with the betas the
project recommends for Top-K, ``nsp.optim.TOPK_ADAM_BETAS``). Each is given its own learning rate: every rate of
``--lrs`` is tried on the first seed, the best (lowest held-out loss) is kept, and the remaining seeds run at it.
The held-out sets differ between seeds (they are drawn with the seed) but not between contenders, so each
contender is compared with dense seed by seed; the record gives every run and, per contender, the mean of its
seeds' held-out losses and its ratio to dense's. Goal (the paper's "comparable accuracy"): every ratio within 2%
of dense, i.e. at most 1.02.

The numbers are losses, not times: other work on the machine slows the runs but does not move them (each run is
deterministic for its seed, bit for bit).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

NSP = [sys.executable, "-m", "nsp.cli"]
TOPK_BETAS = ("0.5", "0.99")  # nsp.optim.TOPK_ADAM_BETAS, kept here so the bench needs no nsp import


def finetune_corpus(packages: list[str], limit_bytes: int, out: Path) -> dict:
    """Writes the ``.py`` sources of ``packages`` (from site-packages) to ``out``, at most ``limit_bytes``;
    returns what was taken."""
    site = Path(sysconfig.get_paths()["purelib"])
    files = []
    for name in packages:
        root = site / name
        if not root.is_dir():
            raise SystemExit(f"finetune_quality: package {name!r} is not installed in {site}")
        files += sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    taken, size = [], 0
    with open(out, "wb") as f:
        for path in files:
            data = path.read_bytes()
            if size + len(data) > limit_bytes:
                break
            f.write(data)
            size += len(data)
            taken.append(str(path.relative_to(site)))
    if size == 0:
        raise SystemExit(f"finetune_quality: no sources found in {packages} under {site}")
    return {"packages": packages, "files": len(taken), "bytes": size, "first": taken[0], "last": taken[-1]}


def run_train(args: list[str], run_dir: Path, timeout: float) -> dict:
    """Runs ``nsp train`` and returns its last metrics row that has an ``eval_loss``, plus its wall time."""
    t0 = time.perf_counter()
    done = subprocess.run(NSP + ["train", *args, "--run-dir", str(run_dir)], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"nsp train {' '.join(args)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval_loss" in r]
    if not evals:
        raise RuntimeError(f"nsp train {' '.join(args)} logged no eval_loss")
    return {"eval_loss": evals[-1]["eval_loss"], "step": evals[-1]["step"],
            "seconds": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument("--steps", type=int, default=150, help="fine-tuning steps")
    parser.add_argument("--ratios", default="0.1,0.05,0.02,0.01", help="Top-K ratios (with error feedback)")
    parser.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="peak learning rates tried on the first seed")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--packages", default="optax,flax,orbax",
                        help="site-packages whose .py sources are the fine-tuning corpus")
    parser.add_argument("--finetune-mib", type=float, default=4.0)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--quick", action="store_true", help="20 pretraining and 10 fine-tuning steps, one seed")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.pretrain_steps, args.steps, args.seeds, args.lrs, args.eval_batches = 20, 10, "0", "1e-3", 4
    seeds = [int(s) for s in args.seeds.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    contenders = [("dense", [])] + [(f"topk {float(r):g}", ["--topk", r, "--b1", TOPK_BETAS[0],
                                                              "--b2", TOPK_BETAS[1]])
                                    for r in args.ratios.split(",")]
    base = Path(tempfile.mkdtemp(prefix="nsp-ftq-", dir=args.dir))
    common = ["--model", args.model, "--seq", str(args.seq), "--batch", str(args.batch), "--tier", "memory",
              "--eval-every", "0", "--eval-batches", str(args.eval_batches), "--log-every", "50"]
    runs = []
    try:
        corpus = finetune_corpus(args.packages.split(","), int(args.finetune_mib * 2**20), base / "finetune.txt")
        print(f"finetune_quality: fine-tuning corpus {corpus['bytes']:,} bytes from {corpus['files']} files of "
              f"{corpus['packages']}", flush=True)
        pre = base / "pre"
        print(f"finetune_quality: pretraining {args.model} on the stdlib for {args.pretrain_steps} steps", flush=True)
        pretrain = run_train([*common, "--steps", str(args.pretrain_steps), "--ckpt-every", "0"], pre, args.timeout)
        print(f"  pretrained: held-out loss {pretrain['eval_loss']:.4f} ({pretrain['seconds']:.0f} s)", flush=True)
        fine = [*common, "--init-from", str(pre), "--data", str(base / "finetune.txt"), "--steps",
                str(args.steps), "--no-checkpoints"]

        def one(name: str, extra: list[str], lr: float, seed: int) -> dict:
            out = base / "run"
            shutil.rmtree(out, ignore_errors=True)
            result = run_train([*fine, *extra, "--lr", repr(lr), "--seed", str(seed)], out, args.timeout)
            row = {"contender": name, "lr": lr, "seed": seed, **result}
            print(f"  {name:10s} lr {lr:<7g} seed {seed}: held-out loss {row['eval_loss']:.4f} "
                  f"({row['seconds']:.0f} s)", flush=True)
            runs.append(row)
            return row

        chosen = {}
        for name, extra in contenders:
            tried = [one(name, extra, lr, seeds[0]) for lr in lrs]
            best = min(tried, key=lambda r: r["eval_loss"])
            chosen[name] = best["lr"]
            for seed in seeds[1:]:
                one(name, extra, best["lr"], seed)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def losses(name: str) -> dict[int, float]:
        return {r["seed"]: r["eval_loss"] for r in runs if r["contender"] == name and r["lr"] == chosen[name]}

    dense = losses("dense")
    rows = []
    for name, _ in contenders:
        mine = losses(name)
        per_seed = [mine[s] / dense[s] for s in seeds]
        rows.append({"contender": name, "lr": chosen[name], "mean_eval_loss": statistics.fmean(mine.values()),
                     "stdev_eval_loss": statistics.stdev(mine.values()) if len(mine) > 1 else 0.0,
                     "ratio_vs_dense": statistics.fmean(mine.values()) / statistics.fmean(dense.values()),
                     "worst_seed_ratio": max(per_seed), "within_2pct": max(per_seed) <= 1.02})
    print_table(f"held-out loss after fine-tuning {args.model} for {args.steps} steps on {corpus['packages']} "
                f"(pretrained {args.pretrain_steps} steps on the stdlib), seeds {seeds}", rows,
                [("contender", "contender", ""), ("lr", "lr", "g"), ("mean_eval_loss", "held-out loss", ".4f"),
                 ("stdev_eval_loss", "stdev", ".4f"), ("ratio_vs_dense", "vs dense", ".4f"),
                 ("worst_seed_ratio", "worst seed", ".4f"), ("within_2pct", "within 2%", "")])
    write_json("finetune_quality", {
        "model": args.model, "seq": args.seq, "batch": args.batch, "pretrain_steps": args.pretrain_steps,
        "steps": args.steps, "seeds": seeds, "lrs": lrs, "eval_batches": args.eval_batches, "corpus": corpus,
        "pretrain_eval_loss": pretrain["eval_loss"], "quick": args.quick, "goal": "every ratio <= 1.02",
        "met": all(r["within_2pct"] for r in rows), "rows": rows, "runs": runs}, args.json)


if __name__ == "__main__":
    main()
