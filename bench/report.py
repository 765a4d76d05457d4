"""The results report: regenerates docs/results/REPORT.md and its plots from measurements made here and from the
JSON records the benchmarks leave in bench/results/.

    python bench/report.py                  # traffic + a 1000-step training sweep of the tiny GPT (~7-10 min)
    python bench/report.py --quick          # smoke run: 30 training steps, 4 held-out batches (~2-3 min)
    python bench/report.py --run-benches    # first rerun the quick benchmark variants (kernel, store, Top-K)
    python bench/report.py --skip-train     # remeasure traffic, keep the training section of the last report
    python bench/report.py --reuse          # measure nothing: re-render from docs/results/report.json
    python bench/report.py --reuse --allow-stale   # ... and render stale parts too, marked STALE

Records and commits. Each benchmark writes its latest record to bench/results/<name>.json, which git tracks (small
JSON). A record names the commit the tree was at when the benchmark started and which tracked files differed from
it, the machine (CPU model, SIMD flags, the kernel ISA nsp picked, cores, RAM, the disk where it wrote), the library
versions, when nsp's C++ extension was built, and its command line (bench/common.py: write_json). The report
renders a record only when it is
  - committed: tracked by git and unchanged from HEAD (report.json keeps the git blob id of each record it rendered,
    so `git show <blob>` gives back exactly what was rendered), and
  - fresh: the code the benchmark measures (MEASURES below: its script, bench/common.py, and the parts of nsp and
    ffi/ it runs) is the same at HEAD as at the record's commit (`git diff --quiet <commit> HEAD -- <paths>`), had
    no uncommitted changes when it ran, has none in the working tree now, and the C++ extension it ran was not
    older than the ffi/ sources.
A record that is not both is left out and the report says why and how to refresh it; `--allow-stale` renders it
instead, marked STALE. Sections 1 and 2 are measured by this script at the commit it runs at (report.json keeps
that commit, and the reused sections of --reuse / --skip-train are judged like the records); it refuses to measure
on a tree with uncommitted changes to that code unless given --allow-stale. Each rendered part names its record
(file, the commit it was measured at and its date, the machine).

Re-rendering from fresh runs at a final commit (a quiet machine: `uptime` load below 1):
    git status                                   # no uncommitted changes to ffi/, nsp/, models/, bench/
    pip install -e .                             # the C++ extension built from this commit's ffi/
    python bench/update_kernel.py; python bench/store_update.py; python bench/topk.py
    python bench/store_update.py --quick --slow-disk 0.47,0.67 --json bench/results/store_update_slow_disk.json
    python bench/train_step.py; python bench/train_step.py --engine-cpus 1; python bench/checkpoint.py
    python bench/max_model.py; python bench/fault_campaign.py; python bench/csd_scaling.py --calibrate
    python bench/fault_campaign.py --slots 1 --trials 100 --steps 8 --json bench/results/fault_campaign_oneslot.json
    git add bench/results/*.json && git commit -m "bench/results: records at <commit>"
    python bench/report.py                       # sections 1 and 2 measured now, section 3 from those records
    git add docs/results && git commit -m "docs/results: re-rendered at <commit>"
`python bench/report.py --reuse` afterwards checks the result: every section renders, none is left out as stale.

Sections:
  1. Traffic per optimizer step (Smart-Infinity Table I): bytes on the shared link (host <-> store) and on the
     store's internal link, next to the formula values: the baseline is DeepSpeed's own optimizer swap
     (bench/deepspeed_swap.py: ZeRO-Infinity's serial PartitionedOptimizerSwapper arrangement, its aio handle
     swapping p, m, v in and out, DeepSpeedCPUAdam in between; once with the gradient in host memory, once with the
     gradient swapped out to its files and read back as ZeRO-Infinity's NVMe gradient offload does), measured on a
     real step; nsp near-storage dense and Top-K 10/5/2/1% on real file-tier stores.
     The OS's own count of the bytes (/proc/self/io) is shown beside the counters: for nsp the bytes its read and
     write system calls moved, for DeepSpeed (whose aio bypasses those calls) the bytes sent to the block layer.
  2. Loss vs compression ratio (Smart-Infinity Table IV / Fig. 16): the tiny GPT on the Python stdlib sources,
     optax.adamw in RAM, nsp adamw dense and Top-K with and without error feedback, all stepped in lockstep
     (interleaved, so that drift in the machine's speed hits all of them alike) on the same batches.
  3. Kernel and tier throughput: charts and tables from bench/results/*.json, each with its own timestamp.
  4. Scaling from the CSD emulator: not produced (the report says why; section 3 holds the model clock's
     scaling, bench/csd_scaling.py).

The measurements of sections 1 and 2 are written to docs/results/report.json, so that --reuse and --skip-train
can render them again; every number in the report comes from that file or from a benchmark's JSON.

Where each part lives: this file holds the command line, the freshness rules (MEASURES, Provenance) and
--run-benches; bench/report_traffic.py section 1's measurement, bench/report_train.py section 2's training sweep,
bench/report_render.py the markdown and charts of sections 1, 2 and 4, bench/report_benches.py section 3.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (REPO, RESULTS_DIR, START_GIT, build_info, git_info, git_output, library_versions,  # noqa: E402
                    machine_info, print_table, write_json)
from report_benches import read_records, render_benches  # noqa: E402
from report_render import render_report  # noqa: E402
from report_traffic import (BASELINE_COLUMNS, INTERNAL_COLUMNS, SHARED_COLUMNS, baseline_rows,  # noqa: E402
                            run_traffic, traffic_rows)
from report_train import TRAIN_COLUMNS, contenders, run_training, train_rows  # noqa: E402

from nsp.models import get_config  # noqa: E402
from nsp.primitives import get_num_threads, kernel_isa  # noqa: E402

OUT_DIR = REPO / "docs" / "results"

# What each measurement depends on besides the machine: the paths whose change makes its record stale. Sections 1
# and 2 are measured by this script ("traffic", "train"); the others are the benchmarks of section 3. Top-K is plain
# JAX (no kernel of ffi/). bench/common.py holds the timing protocol and the record's fields; nsp/spec.py the
# optimizer contract every kernel and store reads its hyperparameters from.
BUILD = ("ffi/", "CMakeLists.txt")
PROTOCOL = ("bench/common.py",)
SPEC = ("nsp/spec.py",)
MEASURES = {
    "traffic": BUILD + ("nsp/", "bench/report.py", "bench/report_traffic.py", "bench/deepspeed_swap.py") + PROTOCOL,
    "train": BUILD + ("nsp/", "models/", "bench/report.py", "bench/report_train.py", "bench/report_traffic.py")
    + PROTOCOL,
    "update_kernel": BUILD + SPEC + ("nsp/primitives/", "bench/update_kernel.py", "bench/adam_steps.py",
                                     "bench/wait_policy.py", "bench/page_backing.py") + PROTOCOL,
    "store_update": BUILD + SPEC + ("nsp/primitives/", "nsp/storage/", "bench/store_update.py",
                                    "bench/store_update_record.py", "bench/store_contenders.py",
                                    "bench/adam_steps.py", "bench/deepspeed_swap.py", "bench/wait_policy.py",
                                    "bench/page_backing.py") + PROTOCOL,
    "store_update_slow_disk": BUILD + SPEC + ("nsp/primitives/", "nsp/storage/", "bench/store_update.py",
                                              "bench/store_update_record.py", "bench/store_contenders.py",
                                              "bench/adam_steps.py", "bench/deepspeed_swap.py",
                                              "bench/wait_policy.py", "bench/slow_disk.py", "bench/page_backing.py",
                                              "bench/slow_disk/") + PROTOCOL,
    "topk": ("nsp/primitives/topk.py", "bench/topk.py") + PROTOCOL,
    "topk_gpu_67108864": ("nsp/primitives/topk.py", "bench/topk.py") + PROTOCOL,  # on a GPU machine
    "smartcomp_topk": ("bench/smartcomp_topk.py",) + PROTOCOL,  # on a GPU machine
    "train_step": BUILD + ("nsp/", "models/", "bench/train_step.py") + PROTOCOL,
    "train_step_split": BUILD + ("nsp/", "models/", "bench/train_step.py") + PROTOCOL,
    "checkpoint": BUILD + SPEC + ("nsp/primitives/", "nsp/storage/", "bench/checkpoint.py") + PROTOCOL,
    "max_model": BUILD + ("nsp/", "models/", "bench/max_model.py") + PROTOCOL,
    "fault_campaign": BUILD + ("nsp/", "models/", "bench/fault_campaign.py") + PROTOCOL,
    "fault_campaign_oneslot": BUILD + ("nsp/", "models/", "bench/fault_campaign.py") + PROTOCOL,
    "csd_scaling": BUILD + SPEC + ("nsp/csd/", "nsp/primitives/", "nsp/storage/", "bench/csd_scaling.py",
                                   "bench/csd_calibration.py", "bench/store_contenders.py", "bench/adam_steps.py",
                                   "bench/deepspeed_swap.py") + PROTOCOL,
}


def versions() -> dict[str, str]:
    """Versions of the libraries the numbers depend on (the benchmarks' records name the same), and matplotlib."""
    out = {k: v or "not installed" for k, v in library_versions().items() if k != "python"}
    try:
        out["matplotlib"] = importlib.metadata.version("matplotlib")
    except importlib.metadata.PackageNotFoundError:
        out["matplotlib"] = "not installed"
    return out


# ---- provenance: which commit a measurement came from, and whether it still describes the code -------------------

def _under(path: str, paths: tuple[str, ...]) -> bool:
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in paths)


class Provenance:
    """Judges measurements against the repository: committed (a record file) and fresh (see the module docstring).
    One ``git status`` for the working tree, then a few git calls per measurement."""

    def __init__(self):
        self.tree = git_info(max_paths=10**6)  # the working tree now (HEAD and its uncommitted changes)
        self.head = self.tree.get("commit")

    def describe_commit(self, commit: str) -> str | None:
        """'<short> (<date>)' of a commit this repository knows, else None."""
        out = git_output("log", "-1", "--format=%h (%cs)", f"{commit}^{{commit}}", "--")
        return out.strip() if out else None

    def staleness(self, git: dict | None, build: dict | None, paths: tuple[str, ...]) -> list[str]:
        """Why a measurement made at ``git`` (a record's "git") no longer describes the code at ``paths``; [] when
        it is fresh."""
        if self.head is None:
            return ["this is not a git checkout: nothing can be checked"]
        if not git or not git.get("commit"):
            return ["it names no commit (it was made before records carried one)"]
        commit = git["commit"]
        reasons = []
        if self.describe_commit(commit) is None:
            return [f"its commit {commit[:12]} is not in this repository"]
        if git_output("diff", "--quiet", commit, self.head, "--", *paths) is None:
            last = (git_output("log", "-1", "--format=%h %cs %s", f"{commit}..{self.head}", "--", *paths) or "").strip()
            reasons.append("the code it measures changed after its commit"
                           + (f", last in {last.split(' ', 2)[0]} ({last.split(' ', 2)[1]}: "
                              f"\"{last.split(' ', 2)[2]}\")" if last.count(" ") >= 2 else ""))
        dirty = [d for d in git.get("dirty_paths", []) if _under(d, paths)]
        if dirty:
            reasons.append("it ran with uncommitted changes to " + ", ".join(f"`{d}`" for d in dirty))
        elif git.get("dirty_count", 0) > len(git.get("dirty_paths", [])):
            reasons.append(f"it ran with {git['dirty_count']} uncommitted changes, not all of them recorded")
        newer = [f for f in (build or {}).get("sources_newer_than_build", []) if _under(f, paths)]
        if newer:
            reasons.append("nsp's C++ extension it ran was built before the last change to "
                           + ", ".join(f"`{f}`" for f in newer))
        now = [d for d in self.tree.get("dirty_paths", []) if _under(d, paths)]
        if now:
            reasons.append("the working tree has uncommitted changes to " + ", ".join(f"`{d}`" for d in now))
        return reasons

    def record_file(self, path: Path) -> dict:
        """Whether a record file is committed (tracked, unchanged from HEAD): its blob id and last commit."""
        if not path.is_relative_to(REPO):
            return {"committed": False, "why": f"{path} is outside the repository"}
        rel = str(path.relative_to(REPO))
        if git_output("ls-files", "--error-unmatch", "--", rel) is None:
            return {"committed": False, "why": f"`{rel}` is not committed (git does not track it)"}
        if rel in self.tree.get("dirty_paths", []):
            return {"committed": False, "why": f"`{rel}` has uncommitted changes"}
        blob = (git_output("rev-parse", f"{self.head}:{rel}") or "").strip() or None
        last = (git_output("log", "-1", "--format=%h %cs", "--", rel) or "").split()
        return {"committed": True, "blob": blob, "in_commit": last[0] if last else None,
                "in_commit_date": last[1] if len(last) > 1 else None}

    def judge(self, name: str, record: dict, path: Path | None = None) -> dict:
        """The verdict on one measurement: ``fresh`` (rendered as is) and the reasons it is not."""
        git = record.get("git")
        commit = (git or {}).get("commit")
        commit_time = (git or {}).get("commit_time")
        if commit and not commit_time:  # a record made on a copied tree (NSP_SOURCE_COMMIT): ask the repository
            commit_time = (git_output("log", "-1", "--format=%cI", commit) or "").strip() or None
        verdict = {"paths": list(MEASURES[name]), "commit": commit, "commit_time": commit_time, "reasons": []}
        if path is not None:
            verdict["file"] = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
            filed = self.record_file(path)
            verdict.update({k: v for k, v in filed.items() if k != "why"})
            if not filed["committed"]:
                verdict["reasons"].append(filed["why"])
        verdict["reasons"] += self.staleness(git, record.get("build"), MEASURES[name])
        verdict["fresh"] = not verdict["reasons"]
        return verdict


# ---- the command line --------------------------------------------------------------------------------------------

def command_line() -> str:
    return "python bench/report.py" + "".join(" " + shlex.quote(a) for a in sys.argv[1:])


# The quick variants --run-benches runs (a few minutes together on 2 cores).
QUICK_BENCHES = {
    "update_kernel": ["bench/update_kernel.py", "--size", "16M", "--repeats", "5"],
    "store_update": ["bench/store_update.py", "--quick"],
    "topk": ["bench/topk.py", "--size", "4194304", "--repeats", "5"],
}


def run_benches(results_dir: Path) -> dict[str, dict]:
    """Runs the quick benchmark variants as subprocesses, each writing its JSON into ``results_dir``; returns the
    exact commands, keyed by benchmark, with the timestamp of the JSON each one wrote."""
    ran = {}
    for name, argv in QUICK_BENCHES.items():
        argv = list(argv)
        if results_dir != RESULTS_DIR:
            argv += ["--json", str(results_dir / f"{name}.json")]
        print(f"\n$ python {' '.join(argv)}", flush=True)
        subprocess.run([sys.executable, *argv], cwd=REPO, check=True)
        record = json.loads((results_dir / f"{name}.json").read_text())
        ran[name] = {"command": "python " + " ".join(shlex.quote(a) for a in argv), "time": record.get("time")}
    return ran


def environment() -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("NSP_", "XLA_", "JAX_")))


def print_sections(measurements: dict) -> None:
    shared, internal = traffic_rows(measurements["traffic"])
    print_table("Shared link, bytes per step", shared, SHARED_COLUMNS)
    baseline = baseline_rows(measurements["traffic"])
    if baseline:
        print_table("Baseline (DeepSpeed's optimizer swap): its counters against the OS's", baseline,
                    BASELINE_COLUMNS)
    print_table("Store internal link, bytes per step", internal, INTERNAL_COLUMNS)
    train = measurements["train"]
    print_table(f"Training ({train['config']['steps']} steps; nsp dense vs optax max rel. param diff "
                f"{train['dense_rel_err_max']:.3g})", train_rows(train), TRAIN_COLUMNS)


def load_previous(path: Path, needed: bool) -> dict:
    """The measurements of the last run (``{}`` when there is none and none is needed)."""
    if not path.exists():
        if needed:
            raise SystemExit(f"{path} does not exist: run the report once without --reuse / --skip-train")
        return {}
    return json.loads(path.read_text())


SETUP_KEYS = ("machine", "versions", "isa", "threads", "devices", "env")


def describe_setup() -> dict:
    """What the measurements of this run depend on besides the code: machine, libraries, kernel, devices."""
    return {"machine": machine_info(), "versions": versions(), "isa": kernel_isa(), "threads": get_num_threads(),
            "devices": ", ".join(str(d) for d in jax.devices()), "env": environment()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30 training steps and 4 held-out batches")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 1000, 30 --quick)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per training step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (<= the model's block size)")
    parser.add_argument("--model", default="tiny", help="GPT config of the training section (nsp.models.CONFIGS)")
    parser.add_argument("--eval-batches", type=int, default=None, help="held-out batches (default 16, 4 --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of params, gradients, model init and batches")
    parser.add_argument("--run-benches", action="store_true",
                        help="first run the quick benchmark variants (update_kernel, store_update, topk)")
    parser.add_argument("--skip-train", action="store_true",
                        help="keep the training section of the previous report.json (remeasure the traffic)")
    parser.add_argument("--reuse", action="store_true",
                        help="measure nothing: re-render sections 1 and 2 from the previous report.json")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR), help="where the benchmarks' JSON records are")
    parser.add_argument("--out", default=str(OUT_DIR), help="where REPORT.md, the PNGs and report.json go")
    parser.add_argument("--dir", default=None, help="where the traffic section's temporary stores go "
                        "(default: the system's temporary directory)")
    parser.add_argument("--allow-stale", action="store_true",
                        help="render stale or uncommitted records (and reused sections) marked STALE instead of "
                             "leaving them out, and measure sections 1 and 2 on a tree with uncommitted changes")
    args = parser.parse_args()
    args.steps = args.steps or (30 if args.quick else 1000)
    args.eval_batches = args.eval_batches or (4 if args.quick else 16)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step compiles and is not timed)")
    if args.seq > get_config(args.model).block_size:
        parser.error(f"--seq {args.seq} exceeds the block size of {args.model!r}")
    out, results_dir = Path(args.out).absolute(), Path(args.results_dir).absolute()
    json_path = out / "report.json"

    measured_now = [k for k, now in (("traffic", not args.reuse), ("train", not (args.reuse or args.skip_train)))
                    if now]
    if measured_now and not args.allow_stale:  # do not spend minutes on numbers that would be stale at once
        here = Provenance()
        reasons = {k: here.staleness(START_GIT, build_info(), MEASURES[k]) for k in measured_now}
        reasons = {k: r for k, r in reasons.items() if r}
        if reasons:
            raise SystemExit("refusing to measure: the results would be stale at once ("
                             + "; ".join(f"{k}: {', '.join(r)}" for k, r in reasons.items())
                             + "). Commit (and rebuild: pip install -e .) first, or pass --allow-stale.")

    t0 = time.perf_counter()
    previous = load_previous(json_path, needed=args.reuse or args.skip_train)
    # Commands of earlier --run-benches runs stay known: a record whose timestamp matches was written by them.
    ran = {**previous.get("ran_benches", {}), **(run_benches(results_dir) if args.run_benches else {})}
    if args.reuse:
        traffic = previous["traffic"]
    else:
        print("section 1: traffic per optimizer step", flush=True)
        traffic = run_traffic(args, command_line())
    if args.reuse or args.skip_train:
        train = previous["train"]
    else:
        print(f"section 2: training {args.model} for {args.steps} steps, {len(contenders())} runs in lockstep",
              flush=True)
        train = run_training(args, command_line())
    # Re-rendered measurements keep the description of the machine and libraries they were made with.
    setup = {k: previous[k] for k in SETUP_KEYS} if args.reuse else describe_setup()
    if args.reuse:  # the measurements keep the date and command that made them; the rendering is noted apart
        made = {k: previous[k] for k in ("generated", "command", "elapsed_s")}
        made["rerendered"] = f"{time.strftime('%Y-%m-%d %H:%M:%S')} by `{command_line()}`"
    else:
        made = {"generated": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command_line(),
                "elapsed_s": time.perf_counter() - t0}
    # Judged now, at the end: a record committed while sections 1 and 2 ran counts as committed.
    prov = Provenance()
    verdicts = {"traffic": prov.judge("traffic", traffic), "train": prov.judge("train", train)}
    verdicts.update({name: prov.judge(name, record, results_dir / f"{name}.json")
                     for name, record in read_records(results_dir).items()})
    rendered_at = {k: prov.tree.get(k) for k in ("commit", "commit_time", "describe", "dirty", "dirty_count")}
    rendered_at["dirty_paths"] = prov.tree.get("dirty_paths", [])[:40]
    measurements = {**made, **setup, "traffic": traffic, "train": train, "ran_benches": ran,
                    "provenance": verdicts, "rendered_at": rendered_at, "allow_stale": args.allow_stale}
    print_sections(measurements)
    write_json("report", measurements, json_path)
    benches = render_benches(results_dir, out, ran, verdicts, args.allow_stale)
    path = render_report(measurements, benches, out)
    stale = {k: v for k, v in verdicts.items() if not v["fresh"]}
    print(f"\n{len(verdicts) - len(stale)} of {len(verdicts)} parts fresh"
          + (f"; stale ({'rendered, marked STALE' if args.allow_stale else 'left out'}):" if stale else "."))
    for k, v in stale.items():
        print(f"  {k}{' (' + v['file'] + ')' if v.get('file') else ''}: {'; '.join(v['reasons'])}")
    if args.run_benches and not args.allow_stale:
        print("the records --run-benches wrote are not committed yet: commit bench/results/ and rerun with --reuse")
    print(f"\nwrote {path} and {json_path} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
