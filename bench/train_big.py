"""One `nsp train` run of a big model, kept as a record: its output, every step's metrics, and its peak memory.

    python bench/train_big.py                      # the README's 2.7B command (about 10 minutes, ~61 GB of disk)
    python bench/train_big.py --resume-check       # that run whole, then killed inside step 2's update and resumed
    python bench/train_big.py --name gpt3_760m -- --model gpt3-760m --steps 5 --batch 1 --seq 128 --bf16 \\
        --f32-accum --bf16-params --no-checkpoints --log-every 1 --eval-every 1 --eval-batches 2

Runs ``nsp train ARGS --run-dir DIR`` in a child process (its output shown as it comes), then writes
``bench/results/train_<name>.json``: the command, git commit, machine and versions (as every benchmark record),
the child's output lines, each step's row of ``metrics.jsonl`` (loss, held-out loss, step, forward/backward and
update seconds, bytes moved, peak RSS) and the child's peak resident memory as the kernel counted it
(``wait4``'s ``ru_maxrss``, the figure ``/usr/bin/time -v`` prints). The run directory (its store: 12 bytes per
parameter per version slot) is deleted afterwards unless ``--keep``.

``--resume-check`` runs the command twice, one store on the disk at a time: whole, then SIGKILLed halfway through
the update of step ``--kill-in-step`` (``NSP_DEBUG_KILL_AFTER_WRITES``: each shard's file backend counts its page
writes) and continued with ``--resume`` (from the store: the run saves no checkpoints, ``nsp.train.store_resume``).
The record (``train_gpt3_2p7b_resume.json`` by default) holds all three children and a SHA-256 of each final
state (param, mu, nu); it exits 0 only when they are bit-identical.
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


def run_child(train_args: list[str], run_dir: Path, env: dict | None = None,
              stop_when: str | None = None) -> dict:
    """Runs ``nsp train ARGS --run-dir RUN_DIR`` as a child (its output shown as it comes); SIGKILLs it once a line
    starts with ``stop_when`` (when given). Returns its exit code, wall time, peak RSS (wait4), output and steps."""
    cmd = [sys.executable, "-m", "nsp.cli", "train", *train_args, "--run-dir", str(run_dir)]
    print("running:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in child.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
        if stop_when is not None and line.startswith(stop_when):
            child.kill()
    _, status, usage = os.wait4(child.pid, 0)
    try:
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        metrics = []
    return {"returncode": os.waitstatus_to_exitcode(status), "wall_s": time.perf_counter() - t0,
            "peak_rss_bytes": usage.ru_maxrss * 1024,  # KiB on Linux
            "steps": [m for m in metrics if "loss" in m], "output": lines}


def store_digest(store_dir: Path) -> dict:
    """The store's committed version and a SHA-256 of each state (param, mu, nu), read a leaf at a time."""
    import hashlib

    import nsp.storage

    store = nsp.storage.open(store_dir)
    try:
        out = {"version": store.version}
        for state in ("param", "mu", "nu"):
            digest = hashlib.sha256()
            for _, values in store.read_leaves(state):
                digest.update(values.tobytes())
            out[state] = digest.hexdigest()
        return out
    finally:
        store.close()


def resume_check(args, train_args: list[str]) -> int:
    """The README run twice: once whole, once SIGKILLed inside step ``--kill-in-step``'s update and resumed with
    ``--resume`` (from its store: the run saves no checkpoints). Compares the two stores' final state bit for bit."""
    import nsp.storage

    record: dict = {"nsp_train_args": train_args, "kill_in_step": args.kill_in_step}
    whole_dir = Path(args.dir) / f"nsp-train-{args.name}-whole"
    cut_dir = Path(args.dir) / f"nsp-train-{args.name}-cut"
    for d in (whole_dir, cut_dir):
        if d.exists():
            raise SystemExit(f"{d} exists: remove it or give another --name")
    try:
        record["whole"] = run_child(train_args, whole_dir)
        if record["whole"]["returncode"] != 0:
            raise SystemExit("the uninterrupted run failed")
        record["whole"]["digest"] = store_digest(whole_dir / "store")
        store = nsp.storage.open(whole_dir / "store")
        pages = store.layout.pages_per_shard
        shards = store.num_shards
        store.close()
        shutil.rmtree(whole_dir)  # one store on the disk at a time
        # Each shard's file backend counts its own page writes: its 3 states' pages at set-up and in every update.
        # The kill lands halfway through the update of step kill_in_step.
        per_update = 3 * pages
        kill_after = per_update * args.kill_in_step + per_update // 2
        record.update(pages_per_state=pages, shards=shards, kill_after_page_writes=kill_after)
        env = {**os.environ, "NSP_DEBUG_KILL_AFTER_WRITES": str(kill_after)}
        record["killed"] = run_child(train_args, cut_dir, env=env)
        record["killed"]["record_after_kill"] = json.loads((cut_dir / "store_step.json").read_text())
        record["resumed"] = run_child([*train_args, "--resume"], cut_dir)
        record["resumed"]["digest"] = store_digest(cut_dir / "store")
    finally:
        if not args.keep:
            shutil.rmtree(whole_dir, ignore_errors=True)
            shutil.rmtree(cut_dir, ignore_errors=True)
    a, b = record["whole"]["digest"], record["resumed"]["digest"]
    record["killed_by_sigkill"] = record["killed"]["returncode"] == -9
    record["bit_identical"] = a == b
    out = write_json(f"train_{args.name}", record)
    print(f"\nwhole run: rc {record['whole']['returncode']}, peak RSS {record['whole']['peak_rss_bytes'] / 2**30:.2f} "
          f"GiB; killed after {kill_after} page writes (rc {record['killed']['returncode']}, store record "
          f"{record['killed']['record_after_kill']}); resumed: rc {record['resumed']['returncode']}, peak RSS "
          f"{record['resumed']['peak_rss_bytes'] / 2**30:.2f} GiB\nfinal store, whole vs resumed: version "
          f"{a['version']} vs {b['version']}; bit-identical (param, mu, nu): {record['bit_identical']}\nwrote {out}")
    return 0 if record["bit_identical"] and record["killed_by_sigkill"] else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default=None, help="the record's name: bench/results/train_<name>.json "
                        "(default gpt3_2p7b, or gpt3_2p7b_resume with --resume-check)")
    parser.add_argument("--dir", default="/var/tmp", help="where the run directory goes (needs the store's disk)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument("--resume-check", action="store_true",
                        help="run it whole, then again killed (SIGKILL) inside an update and resumed with --resume; "
                             "compare the final stores bit for bit")
    parser.add_argument("--kill-in-step", type=int, default=2, help="--resume-check: the step whose update is killed")
    parser.add_argument("args", nargs="*", help="nsp train's arguments after -- (default: the README's 2.7B run)")
    args = parser.parse_args()
    train_args = args.args or README_2P7B
    args.name = args.name or ("gpt3_2p7b_resume" if args.resume_check else "gpt3_2p7b")
    if args.resume_check:
        sys.exit(resume_check(args, train_args))
    run_dir = Path(args.dir) / f"nsp-train-{args.name}"
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: remove it or give another --name")
    result = run_child(train_args, run_dir)
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    returncode, wall_s, peak, steps = (result[k] for k in ("returncode", "wall_s", "peak_rss_bytes", "steps"))
    record = {"nsp_train_args": train_args, **result}
    out = write_json(f"train_{args.name}", record)
    print(f"\nrc {returncode}, {wall_s:.0f} s, peak RSS {peak / 2**30:.2f} GiB (wait4), "
          f"losses {[round(s['loss'], 4) for s in steps]}, held-out "
          f"{[round(s['eval_loss'], 4) for s in steps if 'eval_loss' in s]}\nwrote {out}")
    sys.exit(returncode)


if __name__ == "__main__":
    main()
