"""Fault campaign: kill `nsp train` at random and at targeted moments, resume, and compare with a clean run.

    python bench/fault_campaign.py --trials 100        # the full campaign
    python bench/fault_campaign.py --trials 4 --steps 8 # a quick one

Each trial runs `nsp train` (tiny GPT, file tier; Top-K on in odd trials) as a subprocess and kills it with
SIGKILL: after a random delay, or at a targeted point its variable names — inside an update (after N page
writes: NSP_DEBUG_KILL_AFTER_WRITES), just before a commit renames a shard's manifest (NSP_DEBUG_KILL_AT_COMMIT),
or just before a checkpoint's snapshot becomes valid (NSP_DEBUG_KILL_AT_SNAPSHOT). The first two are read once,
as each shard's engine is made, and wrap its file backend in a fault-injecting one (ffi/backends/fault_backend.cc); a
normal run has none. Then it checks every page of the store's committed version (`nsp store verify`),
resumes with `--resume`, and compares the final params with an uninterrupted run of the same seed, bit for bit.
`--train-args` adds options to every run (`--offload-activations all`: activations spilled in each step).
`--stage-gradients` runs every trial with `--stage-gradients --bf16 --bf16-params` (the gradient staged on the store's
disk leaf by leaf; on a one-slot store the stage file is the redo journal's gradient): one device and one shard
(the staged step's), dense gradients only (no Top-K trials).

`--slots 1` runs every trial on a one-slot store (one copy of the state and a redo journal): every kill point
above, plus halfway through a shard's journal write (NSP_DEBUG_KILL_IN_JOURNAL), between a window's journal record
and its page renames (NSP_DEBUG_KILL_AT_SWITCH), and inside recovery (mode `recovery`: the run is killed inside an
update, then the store's recovery, which `nsp store verify`'s open runs, is killed after N of its own page writes,
and the store is verified and resumed after that).
Lost steps = steps the killed run had finished minus the step it resumed from. The last line reads
`bit-identical: K/N, corrupt: C`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODES = ("random", "update", "commit", "snapshot")
#: The kill points only a one-slot store has (--slots 1 cycles through MODES and these).
ONE_SLOT_MODES = ("journal", "switch", "recovery")


#: Extra `nsp train` options of every run (--train-args), e.g. activation offload.
EXTRA_ARGS: list[str] = []


def train_cmd(run_dir: Path, corpus: Path, steps: int, topk: bool, resume: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "nsp.cli", "train", "--model", "tiny", "--run-dir", str(run_dir), "--data",
           str(corpus), "--steps", str(steps), "--seq", "32", "--batch", "4", "--log-every", "1", "--ckpt-every",
           "2", "--eval-every", "0", "--eval-batches", "1", "--tier", "file"]
    if topk:
        cmd += ["--topk", "0.05"]
    if resume:
        cmd.append("--resume")
    cmd += EXTRA_ARGS
    return cmd


def final_params(run_dir: Path) -> list[np.ndarray]:
    import jax

    from nsp.storage import checkpoint as ckpt

    steps = [int(p.name) for p in (run_dir / "ckpt").iterdir() if p.name.isdigit()]
    state = ckpt.load_train_state(run_dir / "ckpt" / str(max(steps)))
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state["params"])]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def run_trial(i: int, mode: str, args, corpus: Path, workdir: Path, rng: random.Random, env: dict) -> dict:
    topk = bool(i % 2) and not args.stage_gradients  # the staged step takes dense gradients only
    run_dir = workdir / f"trial{i:03d}"
    trial_env = dict(env)
    # Targeted points: a random occurrence of the point within the run. Each shard's backend counts its own
    # page writes (3 per step for the tiny model: one page per state), the commit counter is the process's
    # (every shard commits each step: 4, or 1 with --stage-gradients), and a checkpoint snapshots every 2 steps.
    # A one-slot store's shards each write one journal and switch one window (its one page) in per step.
    shards = 1 if args.stage_gradients else 4
    if mode in ("update", "recovery"):
        trial_env["NSP_DEBUG_KILL_AFTER_WRITES"] = str(rng.randrange(4, 3 * args.steps + 3))
    elif mode == "journal":
        trial_env["NSP_DEBUG_KILL_IN_JOURNAL"] = str(rng.randrange(1, shards * args.steps))
    elif mode == "switch":
        trial_env["NSP_DEBUG_KILL_AT_SWITCH"] = str(rng.randrange(1, shards * args.steps))
    elif mode == "commit":
        trial_env["NSP_DEBUG_KILL_AT_COMMIT"] = str(rng.randrange(shards + 1, shards * args.steps))
    elif mode == "snapshot":
        trial_env["NSP_DEBUG_KILL_AT_SNAPSHOT"] = str(rng.randrange(1, args.steps // 2 + 1))
    started = time.perf_counter()
    proc = subprocess.Popen(train_cmd(run_dir, corpus, args.steps, topk), env=trial_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if mode == "random":
        deadline = started + rng.uniform(0.5, args.random_window or args.reference_seconds)
        while proc.poll() is None and time.perf_counter() < deadline:
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
        elif not args.random_window:
            # The run ended before its kill: runs are shorter than the window (a warmer cache, a quieter
            # machine), so later random kills aim within the length this one took.
            args.reference_seconds = min(args.reference_seconds, time.perf_counter() - started)
    try:
        _, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    killed = proc.returncode == -9
    done = steps_done(run_dir)
    store = run_dir / "store"
    recovery_killed = None
    if mode == "recovery" and (store / "nsp_store.json").exists():
        # Open the store (recovery runs there) with a kill after N of recovery's page writes.
        kill_env = dict(env, NSP_DEBUG_KILL_AFTER_WRITES=str(rng.randrange(0, 3)))
        check = subprocess.run([sys.executable, "-m", "nsp.cli", "store", "verify", str(store)], env=kill_env,
                               capture_output=True, text=True)
        recovery_killed = check.returncode == -9
    corrupt, verify_said = False, None
    if (store / "nsp_store.json").exists():
        check = subprocess.run([sys.executable, "-m", "nsp.cli", "store", "verify", str(store)], env=env,
                               capture_output=True, text=True)
        corrupt = check.returncode != 0
        if corrupt:  # what verify found, for the record (the store itself is gone once the trial resumes)
            verify_said = (check.stdout + check.stderr).strip().splitlines()[-5:]
    resumed_from = None
    if not (run_dir / "config.json").exists():
        shutil.rmtree(run_dir, ignore_errors=True)  # killed before the run was set up: start it again
        resume = subprocess.run(train_cmd(run_dir, corpus, args.steps, topk), env=env, capture_output=True,
                                text=True)
        resumed_from = 0
    else:
        resume = subprocess.run(train_cmd(run_dir, corpus, args.steps, topk, resume=True), env=env,
                                capture_output=True, text=True)
        for line in resume.stdout.splitlines():
            if line.startswith("resumed ") and " at step " in line:
                resumed_from = int(line.split(" at step ")[1].split()[0])
            elif "starting the run afresh" in line:
                resumed_from = 0
    identical = False
    if resume.returncode == 0:
        ours, ref = final_params(run_dir), args.reference[topk]
        identical = len(ours) == len(ref) and all(np.array_equal(a, b) for a, b in zip(ours, ref))
    result = {"trial": i, "mode": mode, "topk": topk, "killed": killed, "steps_done": done,
              "resumed_from": resumed_from, "lost_steps": None if resumed_from is None else done - resumed_from,
              "corrupt": corrupt, "bit_identical": identical, "resume_rc": resume.returncode}
    if recovery_killed is not None:
        result["recovery_killed"] = recovery_killed
    if verify_said is not None:
        result["verify_said"] = verify_said
    if resume.returncode != 0:
        result["error"] = (resume.stderr or "").strip().splitlines()[-1:] or [err[-200:]]
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def make_corpus(path: Path) -> None:
    import collections
    import json as json_module

    path.write_text(inspect.getsource(collections) + inspect.getsource(json_module.decoder))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10, help="training steps of each run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random-window", type=float, default=0.0,
                        help="random kills land within this many seconds of the start (default: the length of "
                             "an uninterrupted run)")
    parser.add_argument("--modes", default=None,
                        help=f"kill modes to cycle through, comma-separated (default: {','.join(MODES)}; with "
                             f"--slots 1 also {','.join(ONE_SLOT_MODES)})")
    parser.add_argument("--slots", type=int, choices=(1, 2), default=2,
                        help="version slots of every run's store (1: one slot and a redo journal)")
    parser.add_argument("--stage-gradients", action="store_true",
                        help="every run with nsp train --stage-gradients --bf16 --bf16-params (one device; no Top-K)")
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir here)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--train-args", default="",
                        help="extra nsp train options of every run, e.g. '--offload-activations all --activation relu' "
                        "(activations spilled to disk in each step: scratch, never state)")
    args = parser.parse_args()
    allowed = MODES + (ONE_SLOT_MODES if args.slots == 1 else ())
    args.modes = [m.strip() for m in (args.modes or ",".join(allowed)).split(",") if m.strip()]
    if not args.modes or any(m not in allowed for m in args.modes):
        parser.error(f"--modes must name some of {', '.join(allowed)}"
                     + ("" if args.slots == 1 else f" ({', '.join(ONE_SLOT_MODES)} need --slots 1)"))
    EXTRA_ARGS[:] = (args.train_args.split() + (["--slots", "1"] if args.slots == 1 else [])
                     + (["--stage-gradients", "--bf16", "--bf16-params"] if args.stage_gradients else []))
    devices = 1 if args.stage_gradients else 4  # the staged step runs on one device
    rng = random.Random(args.seed)
    Path(args.dir or os.getcwd()).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="nsp-faults-", dir=args.dir or os.getcwd()))
    # A persistent compilation cache: every run compiles the same step, and a cached executable is the same
    # code (so the same bits); it saves each subprocess its compile time.
    env = {**os.environ, "NSP_CACHE_DIR": str(workdir / "cache"), "XLA_FLAGS":
           f"--xla_force_host_platform_device_count={devices}", "JAX_COMPILATION_CACHE_DIR": str(workdir / "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    results = []
    try:
        corpus = workdir / "corpus.txt"
        make_corpus(corpus)
        args.reference = {}
        for topk in (False, False) if args.stage_gradients else (False, True, False):  # uninterrupted runs
            ref_dir = workdir / f"reference-{'topk' if topk else 'dense'}"
            shutil.rmtree(ref_dir, ignore_errors=True)
            t0 = time.perf_counter()
            subprocess.run(train_cmd(ref_dir, corpus, args.steps, topk), env=env, check=True,
                           capture_output=True)
            # Random kills land within a run's length; the last reference runs with a warm cache, as trials do.
            args.reference_seconds = time.perf_counter() - t0
            args.reference[topk] = final_params(ref_dir)
        print(f"{args.trials} trials of `nsp train` (tiny, file tier, {args.slots} version slot"
              f"{'s' if args.slots == 2 else ' and a redo journal'}, {devices} shard{'s' if devices > 1 else ''}"
              f"{', staged bf16 gradients' if args.stage_gradients else ''}, {args.steps} steps, checkpoint "
              f"every 2), killed with SIGKILL, resumed, compared with an uninterrupted run")
        for i in range(args.trials):
            mode = args.modes[i % len(args.modes)]
            r = run_trial(i, mode, args, corpus, workdir, rng, env)
            results.append(r)
            print(f"  trial {i:3d} {mode:8s} topk={int(r['topk'])} killed={int(r['killed'])} "
                  f"done={r['steps_done']:2d} resumed_from={r['resumed_from']} lost={r['lost_steps']} "
                  f"corrupt={int(r['corrupt'])} identical={int(r['bit_identical'])}"
                  + (f" error={r['error']}" if "error" in r else ""), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    n = len(results)
    identical = sum(r["bit_identical"] for r in results)
    corrupt = sum(r["corrupt"] for r in results)
    lost = [r["lost_steps"] for r in results if r["lost_steps"] is not None]
    print("\nmode      trials  killed  bit-identical  corrupt  lost steps (max)")
    for mode in dict.fromkeys(args.modes):
        rs = [r for r in results if r["mode"] == mode]
        if rs:
            ls = [r["lost_steps"] for r in rs if r["lost_steps"] is not None]
            print(f"{mode:8s}  {len(rs):6d}  {sum(r['killed'] for r in rs):6d}  "
                  f"{sum(r['bit_identical'] for r in rs):13d}  {sum(r['corrupt'] for r in rs):7d}  "
                  f"{max(ls, default=0):4d}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write_json

    path = write_json("fault_campaign", {"trials": results, "steps": args.steps, "seed": args.seed,
                                         "slots": args.slots, "modes": args.modes,
                                         "stage_gradients": args.stage_gradients}, args.json)
    print(f"\nlost steps: max {max(lost, default=0)}, mean {np.mean(lost) if lost else 0:.1f} "
          f"(checkpoints every 2 steps)\nwrote {path}")
    print(f"bit-identical: {identical}/{n}, corrupt: {corrupt}")
    return 0 if identical == n and corrupt == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
