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
versions, when nsp's C++ extension was built, and its command line (bench/_common.py: write_json). The report
renders a record only when it is
  - committed: tracked by git and unchanged from HEAD (report.json keeps the git blob id of each record it rendered,
    so `git show <blob>` gives back exactly what was rendered), and
  - fresh: the code the benchmark measures (MEASURES below: its script, bench/_common.py, and the parts of nsp and
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
    python bench/train_step.py; python bench/train_step.py --engine-cpus 1; python bench/checkpoint.py
    python bench/max_model.py; python bench/fault_campaign.py
    git add bench/results/*.json && git commit -m "bench/results: records at <commit>"
    python bench/report.py                       # sections 1 and 2 measured now, section 3 from those records
    git add docs/results && git commit -m "docs/results: re-rendered at <commit>"
`python bench/report.py --reuse` afterwards checks the result: every section renders, none is left out as stale.

Sections:
  1. Traffic per optimizer step (Smart-Infinity Table I): bytes on the shared link (host <-> store) and on the
     store's internal link, next to the formula values: the baseline is DeepSpeed's own optimizer swap
     (bench/_deepspeed_swap.py: ZeRO-Infinity's serial PartitionedOptimizerSwapper arrangement, its aio handle
     swapping p, m, v in and out, DeepSpeedCPUAdam in between; once with the gradient in host memory, once with the
     gradient swapped out to its files and read back as ZeRO-Infinity's NVMe gradient offload does), measured on a
     real step; nsp near-storage dense and Top-K 10/5/2/1% on real file-tier stores.
     The OS's own count of the bytes (/proc/self/io) is shown beside the counters: for nsp the bytes its read and
     write system calls moved, for DeepSpeed (whose aio bypasses those calls) the bytes sent to the block layer.
  2. Loss vs compression ratio (Smart-Infinity Table IV / Fig. 16): the tiny GPT on the Python stdlib sources,
     optax.adamw in RAM, nsp adamw dense and Top-K with and without error feedback, all stepped in lockstep
     (interleaved, so that drift in the machine's speed hits all of them alike) on the same batches.
  3. Kernel and tier throughput: charts and tables from bench/results/*.json, each with its own timestamp.
  4. Scaling from the CSD emulator: not produced (the report says why).

The measurements of sections 1 and 2 are written to docs/results/report.json, so that --reuse and --skip-train
can render them again; every number in the report comes from that file or from a benchmark's JSON.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (RESULTS_DIR, START_GIT, build_info, git_info, git_output, library_versions,  # noqa: E402
                     machine_info, median, print_table, write_json)
import _deepspeed_swap  # noqa: E402  (DeepSpeed's optimizer swap: Table I's baseline)

import nsp.optim  # noqa: E402
import nsp.storage  # noqa: E402
from nsp.models import GPT, cross_entropy_loss, get_config  # noqa: E402
from nsp.primitives import get_num_threads, kernel_isa  # noqa: E402
from nsp.train import data as data_lib  # noqa: E402
from nsp.train.config import TrainConfig  # noqa: E402
from nsp.train.trainer import learning_rate_schedule  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "docs" / "results"
RATIOS = (0.10, 0.05, 0.02, 0.01)  # Top-K densities of Smart-Infinity's Table IV

# Section 1: 1,024,000 params makes c x N whole for every ratio (so the formula is a whole number of bytes),
# fills one store shard with no padding, and cuts into 4 whole pages of 256,000 fp32 entries (1,024,000 bytes,
# a multiple of 4096), so that no page file carries zarr padding either; it is also a whole number of DeepSpeed's
# aio alignment (AIO_ALIGNED_BYTES = 1024 bytes = 256 fp32 entries), so its swap files carry no padding.
TRAFFIC_PARAMS = 1_024_000
TRAFFIC_PAGE_BYTES = 1_024_000
TRAFFIC_LR = 1e-3
TRAFFIC_BETAS, TRAFFIC_EPS = (0.9, 0.999), 1e-8  # nsp.optim.adam's defaults, which the nsp rows run

# What each measurement depends on besides the machine: the paths whose change makes its record stale. Sections 1
# and 2 are measured by this script ("traffic", "train"); the others are the benchmarks of section 3. Top-K is plain
# JAX (no kernel of ffi/). bench/_common.py holds the timing protocol and the record's fields.
BUILD = ("ffi/", "CMakeLists.txt")
PROTOCOL = ("bench/_common.py",)
MEASURES = {
    "traffic": BUILD + ("nsp/", "bench/report.py", "bench/_deepspeed_swap.py") + PROTOCOL,
    "train": BUILD + ("nsp/", "models/", "bench/report.py") + PROTOCOL,
    "update_kernel": BUILD + ("nsp/primitives/", "bench/update_kernel.py", "bench/_wait_policy.py") + PROTOCOL,
    "store_update": BUILD + ("nsp/primitives/", "nsp/storage/", "bench/store_update.py", "bench/_deepspeed_swap.py",
                             "bench/_wait_policy.py") + PROTOCOL,
    "topk": ("nsp/primitives/topk.py", "bench/topk.py") + PROTOCOL,
    "train_step": BUILD + ("nsp/", "models/", "bench/train_step.py") + PROTOCOL,
    "train_step_split": BUILD + ("nsp/", "models/", "bench/train_step.py") + PROTOCOL,
    "checkpoint": BUILD + ("nsp/primitives/", "nsp/storage/", "bench/checkpoint.py") + PROTOCOL,
    "max_model": BUILD + ("nsp/", "models/", "bench/max_model.py") + PROTOCOL,
    "fault_campaign": BUILD + ("nsp/", "models/", "bench/fault_campaign.py") + PROTOCOL,
}


# ---- small helpers ---------------------------------------------------------------------------------------------

def tree_copy(tree: Any) -> Any:
    """A fresh copy of every leaf (the train steps donate their params)."""
    return jax.tree_util.tree_map(jnp.copy, tree)


def rel_err(a: Any, b: Any) -> jax.Array:
    """||a - b|| / ||b|| over a whole tree (tests/test_optim.py's measure: rounding differences amplified by training
    make an element-wise relative error meaningless for params near zero)."""
    pairs = list(zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    diff = sum(jnp.sum((x - y) ** 2) for x, y in pairs)
    norm = sum(jnp.sum(y ** 2) for _, y in pairs)
    return jnp.sqrt(diff / jnp.maximum(norm, 1e-30))


def proc_io() -> dict[str, int]:
    """This process's I/O counters: rchar / wchar are the bytes its read / write system calls moved (all threads)."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, value = line.split(":")
                out[key.strip()] = int(value)
    except OSError:
        pass
    return out


class IoDelta:
    """Bytes this process's system calls read and wrote between ``start`` and ``stop``, less what reading
    /proc/self/io itself adds to rchar (measured on an empty interval just before).

    ``stop`` also sets ``storage``: the bytes this process sent to and fetched from the block layer in that interval
    (read_bytes / write_bytes). That is the OS's count for I/O that bypasses read and write system calls, such as
    DeepSpeed's aio (io_submit on O_DIRECT files); a read served from the page cache adds nothing to it."""

    def start(self) -> None:
        a = proc_io()
        self.probe = proc_io().get("rchar", 0) - a.get("rchar", 0)
        self.io0 = proc_io()

    def stop(self) -> tuple[int, int]:
        io1 = proc_io()
        self.storage = (io1.get("read_bytes", 0) - self.io0.get("read_bytes", 0),
                        io1.get("write_bytes", 0) - self.io0.get("write_bytes", 0))
        return (io1.get("rchar", 0) - self.io0.get("rchar", 0) - self.probe,
                io1.get("wchar", 0) - self.io0.get("wchar", 0))


def exact(value: Fraction) -> int | float:
    """A formula value as an int when it is a whole number of bytes."""
    return int(value) if value.denominator == 1 else float(value)


def versions() -> dict[str, str]:
    """Versions of the libraries the numbers depend on (the benchmarks' records name the same), and matplotlib."""
    out = {k: v or "not installed" for k, v in library_versions().items() if k != "python"}
    try:
        out["matplotlib"] = importlib.metadata.version("matplotlib")
    except importlib.metadata.PackageNotFoundError:
        out["matplotlib"] = "not installed"
    return out


# ---- provenance: which commit a measurement came from, and whether it still describes the code -----------------

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
        verdict = {"paths": list(MEASURES[name]), "commit": (git or {}).get("commit"),
                   "commit_time": (git or {}).get("commit_time"), "reasons": []}
        if path is not None:
            verdict["file"] = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
            filed = self.record_file(path)
            verdict.update({k: v for k, v in filed.items() if k != "why"})
            if not filed["committed"]:
                verdict["reasons"].append(filed["why"])
        verdict["reasons"] += self.staleness(git, record.get("build"), MEASURES[name])
        verdict["fresh"] = not verdict["reasons"]
        return verdict


def machine_line(machine: dict) -> str:
    """'<cpu>, <n> cores (<m> usable), <RAM>, kernels <isa>' from a record's machine description."""
    parts = [str(machine.get("cpu", "?"))]
    cores, usable = machine.get("cores"), machine.get("cpus_usable")
    parts.append(f"{cores} cores" + (f" ({usable} usable)" if usable not in (None, cores) else ""))
    if machine.get("ram_bytes"):
        parts.append(f"{machine['ram_bytes'] / 2**30:.1f} GiB RAM")
    if machine.get("kernel_isa"):
        parts.append(f"kernels {machine['kernel_isa']}")
    if machine.get("flags") is not None:
        parts.append("flags " + (" ".join(machine["flags"]) or "none of note"))
    return ", ".join(parts)


def provenance_line(verdict: dict, machine: dict | None, when: str | None) -> str:
    """The line every rendered part starts with: its record, commit, date and machine, and whether it is fresh."""
    what = f"Record `{verdict['file']}`" if verdict.get("file") else "Measured by this script"
    if verdict.get("in_commit"):
        what += f" (committed in `{verdict['in_commit']}`, blob `{(verdict.get('blob') or '?')[:12]}`)"
    commit = verdict.get("commit")
    at = (f"commit `{commit[:12]}` ({(verdict.get('commit_time') or '?')[:10]})" if commit
          else "no recorded commit")
    line = f"{what}: measured {when or '?'} at {at}"
    if machine:
        line += f", on {machine_line(machine)}"
    if verdict["fresh"]:
        return line + ". Fresh: the code it measures is unchanged since."
    return f"**STALE**: {'; '.join(verdict['reasons'])}.\n\n{line}."


def left_out(title: str, verdict: dict, refresh: str) -> str:
    """What stands in the report for a stale part when --allow-stale is not given."""
    where = f"`{verdict['file']}`" if verdict.get("file") else "this measurement"
    commit = verdict.get("commit")
    return (f"{title}\n\n**Left out, stale**: {where}"
            + (f" (measured at commit `{commit[:12]}`)" if commit else "") + f": {'; '.join(verdict['reasons'])}. "
            f"Refresh it with `{refresh}` at the current commit"
            + (", commit the record," if verdict.get("file") else "")
            + " and rerun this report (`--allow-stale` renders it marked instead).\n")


def command_line() -> str:
    return "python bench/report.py" + "".join(" " + shlex.quote(a) for a in sys.argv[1:])


# ---- section 1: traffic ----------------------------------------------------------------------------------------

class CountedAio:
    """One of the aio handles of DeepSpeed's swapper, counting the bytes of every read and write it is handed (the
    tensor given to ``async_pread`` / ``async_pwrite``), split by swap file: a sub-group's gradient file or its
    state files (p, m, v). Everything else is the handle's own."""

    def __init__(self, handle, gradient_paths: list[str]):
        self._handle = handle
        self._gradient_paths = set(gradient_paths)
        self.read = {"state": 0, "gradient": 0}
        self.written = {"state": 0, "gradient": 0}

    def _kind(self, path: str) -> str:
        return "gradient" if path in self._gradient_paths else "state"

    def async_pread(self, buffer, path, *args):
        self.read[self._kind(path)] += buffer.numel() * buffer.element_size()
        return self._handle.async_pread(buffer, path, *args)

    def async_pwrite(self, buffer, path, *args):
        self.written[self._kind(path)] += buffer.numel() * buffer.element_size()
        return self._handle.async_pwrite(buffer, path, *args)

    def __getattr__(self, name: str):
        return getattr(self._handle, name)


def adam_reference(p0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """Adam (no weight decay, bias-corrected, eps outside the root) in float64: what the baseline's params should be
    after ``grads``."""
    p, m, v = p0.astype(np.float64), np.zeros(p0.size), np.zeros(p0.size)
    (b1, b2), eps = TRAFFIC_BETAS, TRAFFIC_EPS
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * np.square(g, dtype=np.float64)
        p = p - TRAFFIC_LR * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return p


def measure_baseline(workdir: str, p0: np.ndarray, grads: list[np.ndarray], swap_gradient: bool,
                     deepspeed: dict) -> dict:
    """One optimizer step of DeepSpeed's optimizer swap (``bench/_deepspeed_swap.py``) in ZeRO's serial arrangement
    (PartitionedOptimizerSwapper: one aio handle; per sub-group p, m, v swapped in, DeepSpeedCPUAdam, swapped out)
    at DeepSpeed's default sub_group_size and aio settings. ``swap_gradient``: the gradient is first swapped out
    to its files and read back with each sub-group's state (ZeRO-Infinity's gradient offload to NVMe); otherwise
    it is copied from host memory. The second step is measured (the first sets up DeepSpeedCPUAdam's state).

    Bytes are counted three ways: the swapper's own counters (``bytes_read`` / ``bytes_written``, added up at each
    of its aio calls), the handle's calls split into state and gradient files (``CountedAio``), and the OS's
    count of what this process sent to and fetched from the block layer (DeepSpeed's aio reads and writes its
    files O_DIRECT through io_submit, which read and write system calls, rchar / wchar, do not see)."""
    path = os.path.join(workdir, "baseline_swap" if swap_gradient else "baseline")
    swap = _deepspeed_swap.DeepSpeedOptimizerSwap(
        path, p0, sub_group_numel=int(deepspeed["sub_group_size_default"]), pipelined=False, lr=TRAFFIC_LR,
        betas=TRAFFIC_BETAS, eps=TRAFFIC_EPS, threads=get_num_threads(), swap_gradient=swap_gradient)
    try:
        handle = CountedAio(swap.read_handle, swap.grad_paths)
        swap.read_handle = swap.write_handle = handle  # the serial arrangement has one handle for both
        swap.step(grads[0])
        read0, written0 = swap.bytes_read, swap.bytes_written
        calls0 = (dict(handle.read), dict(handle.written))
        io = IoDelta()
        io.start()
        swap.step(grads[1])
        os_read, os_written = io.stop()
        storage_read, storage_written = io.storage
        read, written = swap.bytes_read - read0, swap.bytes_written - written0
        calls_read = {k: v - calls0[0][k] for k, v in handle.read.items()}
        calls_written = {k: v - calls0[1][k] for k, v in handle.written.items()}
        # The state the step left in the swap files: its change from p0 against Adam's, relative.
        moved = swap.read_params().astype(np.float64) - p0
        want = adam_reference(p0, grads) - p0
        update_rel_err = float(np.linalg.norm(moved - want) / np.linalg.norm(want))
        return {
            "to_store": written, "from_store": read,
            "state_read": calls_read["state"], "state_written": calls_written["state"],
            "grad_read": calls_read["gradient"], "grad_written": calls_written["gradient"],
            "counters_agree": calls_read["state"] + calls_read["gradient"] == read
                              and calls_written["state"] + calls_written["gradient"] == written,
            "os_read": os_read, "os_written": os_written,
            "os_storage_read": storage_read, "os_storage_written": storage_written,
            "numel": int(p0.size), "swapped_numel": int(sum(g[2] for g in swap.groups)),
            "update_rel_err": update_rel_err, "deepspeed": swap.describe(),
        }
    finally:
        swap.close()


def measure_nsp(workdir: str, p0: np.ndarray, grads: list[np.ndarray], ratio: float | None) -> dict:
    """One step of ``nsp.optim.adam(store=<file tier>)`` (Top-K compressed at ``ratio``), jitted as a user would;
    the second step is measured (the first compiles)."""
    name = "nsp_dense" if ratio is None else f"nsp_topk_{ratio:g}"
    store = nsp.storage.open(os.path.join(workdir, name), tier="file", page_bytes=TRAFFIC_PAGE_BYTES)
    try:
        compression = None if ratio is None else nsp.optim.TopK(ratio)
        tx = nsp.optim.adam(TRAFFIC_LR, store=store, compression=compression)
        params = {"w": jnp.asarray(p0)}
        opt_state = tx.init(params)

        @jax.jit
        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        params, opt_state = jax.block_until_ready(step(params, opt_state, {"w": jnp.asarray(grads[0])}))
        g = {"w": jnp.asarray(grads[1])}  # on the device before the counters start
        store.barrier()
        store.reset_stats()
        io = IoDelta()
        io.start()
        params, opt_state = jax.block_until_ready(step(params, opt_state, g))
        store.barrier()
        os_read, os_written = io.stop()
        s = store.stats()
        return {
            "to_store": s["shared_in_bytes"], "from_store": s["shared_out_bytes"],
            "internal_read": s["internal_read_bytes"], "internal_write": s["internal_write_bytes"],
            "pages_read": s["pages_read"], "pages_written": s["pages_written"], "updates": s["updates"],
            "os_read": os_read, "os_written": os_written,
            "os_storage_read": io.storage[0], "os_storage_written": io.storage[1],
            "total": store.layout.total, "padded_total": store.layout.padded_total,
            "pages_per_state": store.layout.pages_per_shard * store.num_shards,
        }
    finally:
        store.close()


def traffic_formulas(n: int) -> dict[str, dict[str, Fraction | None]]:
    """Smart-Infinity Table I with M = 2 bytes x params (16-bit model size) and fp32 transport (2M per tensor)."""
    M = Fraction(2 * n)
    out = {
        "baseline": {"to_store": 6 * M + 2 * M, "from_store": 6 * M + 2 * M,  # state + grads each way
                     "internal_read": None, "internal_write": None},
        "dense": {"to_store": 2 * M, "from_store": 2 * M, "internal_read": 6 * M, "internal_write": 6 * M},
    }
    for c in RATIOS:
        out[f"topk_{c:g}"] = {"to_store": Fraction(str(c)) * n * (4 + 4), "from_store": 2 * M,
                              "internal_read": 6 * M, "internal_write": 6 * M}
    return out


def run_traffic(args) -> dict:
    """Section 1: measures every configuration's bytes per step on real file-tier stores in a temporary folder."""
    n = TRAFFIC_PARAMS
    rng = np.random.default_rng(args.seed)
    p0 = (rng.standard_normal(n, dtype=np.float32) * np.float32(0.02))
    grads = [rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2) for _ in range(2)]
    print("  DeepSpeed (the baseline): loading its async_io and cpu_adam ops (the first use compiles them, "
          "minutes) ...", flush=True)
    deepspeed = _deepspeed_swap.status()
    if not deepspeed["available"]:
        print(f"  DeepSpeed not available: {deepspeed['reason']} -- the baseline rows are left out", flush=True)
    workdir = tempfile.mkdtemp(prefix=".nsp_report_", dir=args.dir)
    try:
        measured = {}
        for key, swap_gradient in (("baseline", False), ("baseline_swap", True)):
            if not deepspeed["available"]:
                measured[key] = {"unavailable": f"DeepSpeed not available: {deepspeed['reason']}"}
                continue
            try:
                measured[key] = measure_baseline(workdir, p0, grads, swap_gradient, deepspeed)
            except Exception as e:  # noqa: BLE001  (what DeepSpeed raises varies; the row says what it was)
                measured[key] = {"unavailable": f"DeepSpeed not available: its optimizer swap failed here: "
                                                f"{type(e).__name__}: {e}"}
                print(f"  {key}: {measured[key]['unavailable']}", flush=True)
        measured["dense"] = measure_nsp(workdir, p0, grads, None)
        for c in RATIOS:
            measured[f"topk_{c:g}"] = measure_nsp(workdir, p0, grads, c)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"params": n, "page_bytes": TRAFFIC_PAGE_BYTES, "seed": args.seed, "measured": measured,
            "deepspeed": deepspeed, "command": command_line(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "git": START_GIT,
            "build": build_info()}


TRAFFIC_LABELS = {
    "dense": "(b) nsp near-storage update, dense (SmartUpdate)",
    **{f"topk_{c:g}": f"(c) nsp near-storage + Top-K {c:.0%} (SmartComp)" for c in RATIOS},
}
SHORT_LABELS = {"dense": "(b) nsp dense", **{f"topk_{c:g}": f"(c) nsp Top-K {c:.0%}" for c in RATIOS}}
BASELINE_TAGS = {"baseline": "(a)", "baseline_swap": "(a')"}


def deepspeed_name(traffic: dict) -> str | None:
    """'DeepSpeed <version>' of the baseline rows; None for a record made before they ran DeepSpeed's swapper."""
    if "deepspeed" not in traffic:
        return None
    version = traffic["deepspeed"].get("version")  # unknown when DeepSpeed could not be imported
    return f"DeepSpeed {version}" if version else "DeepSpeed"


def traffic_label(key: str, traffic: dict, short: bool = False) -> str:
    """A row's label; the baseline's names the DeepSpeed version whose optimizer swap it ran."""
    if not key.startswith("baseline"):
        return (SHORT_LABELS if short else TRAFFIC_LABELS)[key]
    swapped = key == "baseline_swap"
    tag = BASELINE_TAGS[key]
    ds = deepspeed_name(traffic)
    if ds is None:  # an older record: the baseline was then modelled with nsp's own engine
        return (f"{tag} baseline host updater modelled with nsp's engine (older record), gradient "
                + ("swapped" if swapped else "in host RAM"))
    if short:
        return f"{tag} {ds} swap, grad " + ("swapped" if swapped else "in RAM")
    if swapped:
        return (f"{tag} baseline: {ds}'s optimizer swap, serial, + gradient swapped out to its files and read back "
                "(ZeRO-Infinity's gradient offload to NVMe)")
    return (f"{tag} baseline: {ds}'s optimizer swap, serial (p, m, v swapped in, DeepSpeedCPUAdam, swapped out), "
            "gradient in host RAM")


def traffic_rows(traffic: dict) -> tuple[list[dict], list[dict]]:
    """(shared-link rows, internal-link rows) with the formula value and whether they match to the byte. A baseline
    row that could not be measured (DeepSpeed not available) says why and has no numbers; the baseline has no
    internal link (see ``baseline_rows`` for its OS check)."""
    n = traffic["params"]
    M = 2 * n
    formulas = traffic_formulas(n)
    shared, internal = [], []
    for key, m in traffic["measured"].items():
        label = traffic_label(key, traffic)
        if "unavailable" in m:
            shared.append({"config": f"{BASELINE_TAGS[key]} baseline, {deepspeed_name(traffic)}'s optimizer swap: "
                                     f"{m['unavailable']} (left out)", "key": key, "match": "-"})
            continue
        f = formulas["baseline" if key.startswith("baseline") else key]
        total = m["to_store"] + m["from_store"]
        f_total = f["to_store"] + f["from_store"]
        match = m["to_store"] == f["to_store"] and m["from_store"] == f["from_store"]
        shared.append({
            "config": label, "key": key, "to": m["to_store"], "from": m["from_store"], "total": total,
            "total_m": f"{total / M:.4g} M", "formula_to": exact(f["to_store"]), "formula_from": exact(f["from_store"]),
            "formula_total": exact(f_total), "formula_m": f"{float(f_total) / M:.4g} M",
            "match": "yes" if match else f"no ({(total - float(f_total)) / M:+.4g} M)",
        })
        if "internal_read" in m:
            imatch = m["internal_read"] == f["internal_read"] and m["internal_write"] == f["internal_write"]
            internal.append({
                "config": label, "key": key, "read": m["internal_read"], "write": m["internal_write"],
                "pages": f"{m['pages_read']} / {m['pages_written']}",
                "formula": f"{exact(f['internal_read']):,} / {exact(f['internal_write']):,}",
                "match": "yes" if imatch else "no", "os_read": m["os_read"], "os_written": m["os_written"],
                "os_extra": f"{m['os_read'] - m['internal_read']:+,} / {m['os_written'] - m['internal_write']:+,}",
            })
    return shared, internal


def baseline_rows(traffic: dict) -> list[dict]:
    """The measured baseline rows' byte counts side by side: the swapper's counters, its aio calls by swap file,
    and the OS's counts (system calls; block layer)."""
    rows = []
    for key, m in traffic["measured"].items():
        if not key.startswith("baseline") or "unavailable" in m or "os_storage_read" not in m:
            continue
        r, w = m["os_storage_read"], m["os_storage_written"]
        rows.append({
            "config": traffic_label(key, traffic, short=True), "key": key,
            "swapper": f"{m['from_store']:,} / {m['to_store']:,}",
            "state": f"{m['state_read']:,} / {m['state_written']:,}",
            "grad": f"{m['grad_read']:,} / {m['grad_written']:,}",
            "agree": "yes" if m["counters_agree"] else "no",
            "os_sys": f"{m['os_read']:,} / {m['os_written']:,}", "os_block": f"{r:,} / {w:,}",
            "os_extra": f"{r - m['from_store']:+,} / {w - m['to_store']:+,}",
            "update_err": m["update_rel_err"],
        })
    return rows


SHARED_COLUMNS = [("config", "configuration", ""), ("to", "to store (B)", ",d"), ("from", "from store (B)", ",d"),
                  ("total", "total (B)", ",d"), ("total_m", "total / M", ""),
                  ("formula_total", "formula total (B)", ",.12g"), ("formula_m", "formula / M", ""),
                  ("match", "match", "")]
INTERNAL_COLUMNS = [("config", "configuration", ""), ("read", "read (B)", ",d"), ("write", "written (B)", ",d"),
                    ("pages", "pages r / w", ""), ("formula", "formula r / w (B)", ""), ("match", "match", ""),
                    ("os_read", "OS rchar (B)", ",d"), ("os_written", "OS wchar (B)", ",d"),
                    ("os_extra", "OS - counted r / w (B)", "")]
BASELINE_COLUMNS = [("config", "configuration", ""), ("swapper", "swapper counters r / w (B)", ""),
                    ("state", "aio calls, p m v files r / w (B)", ""),
                    ("grad", "aio calls, gradient files r / w (B)", ""), ("agree", "calls = counters", ""),
                    ("os_sys", "OS rchar / wchar (B)", ""), ("os_block", "OS block layer r / w (B)", ""),
                    ("os_extra", "OS block - counters r / w (B)", ""),
                    ("update_err", "update vs Adam (rel. err)", ".2g")]


# ---- section 2: training ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # "optax" or "nsp"
    ratio: float | None = None
    error_feedback: bool | None = None
    residual_decay: float | None = None  # with error feedback: nsp.optim.TopK's residual_decay
    lazy: bool | None = None  # with Top-K: nsp.optim.TopK's lazy (only the sent entries move)
    betas: tuple[float, float] | None = None  # AdamW's (b1, b2) when not the config's
    lr: float | None = None  # peak learning rate when not the config's


# Top-K near 1% with the moment decays recommended for it and a higher peak learning rate (nsp.optim.compress).
TOPK_TUNED_LR = 5e-3


def contenders() -> list[Contender]:
    runs = [Contender("optax.adamw (RAM)", "optax"), Contender("nsp adamw, memory tier, dense", "nsp")]
    defaults = nsp.optim.TopK(1.0)
    decay, lazy = defaults.residual_decay, defaults.lazy
    for c in RATIOS:
        runs.append(Contender(f"nsp Top-K {c:.0%} + error feedback", "nsp", c, True, decay, lazy))
        runs.append(Contender(f"nsp Top-K {c:.0%}, no error feedback", "nsp", c, False, None, lazy))
    # At the smallest ratio, for comparison: the other store update (the default is the dense update on the
    # decompressed gradient, as Smart-Infinity's updater runs it; lazy moves only the entries sent that step).
    runs.append(Contender(f"nsp Top-K {RATIOS[-1]:.0%} + error feedback, {'dense' if lazy else 'lazy'} update", "nsp",
                          RATIOS[-1], True, decay, not lazy))
    b1, b2 = nsp.optim.TOPK_ADAM_BETAS
    runs.append(Contender(f"nsp Top-K {RATIOS[-1]:.0%} + error feedback, b1 {b1:g}, b2 {b2:g}, peak {TOPK_TUNED_LR:g}",
                          "nsp", RATIOS[-1], True, decay, lazy, (b1, b2), TOPK_TUNED_LR))
    return runs


def train_config(args) -> TrainConfig:
    """``nsp train``'s defaults (learning rate, warm-up, cosine decay, AdamW betas, weight decay, clipping), at this
    report's model, steps, batch and seed."""
    return TrainConfig(model=args.model, tier="memory", steps=args.steps, batch=args.batch, seq=args.seq,
                       seed=args.seed, eval_batches=args.eval_batches)


def make_tx(contender: Contender, config: TrainConfig, store) -> optax.GradientTransformation:
    """The same clipping and learning-rate schedule for every contender; only the optimizer's home and the
    gradient's compression differ."""
    schedule = learning_rate_schedule(config if contender.lr is None else dataclasses.replace(config, lr=contender.lr))
    b1, b2 = contender.betas or (config.b1, config.b2)
    if contender.kind == "optax":
        opt = optax.adamw(schedule, b1, b2, weight_decay=config.weight_decay)
    else:
        compression = (None if contender.ratio is None
                       else nsp.optim.TopK(contender.ratio, error_feedback=contender.error_feedback,
                                           residual_decay=1.0 if contender.residual_decay is None
                                           else contender.residual_decay,
                                           lazy=bool(contender.lazy)))
        opt = nsp.optim.adamw(schedule, b1, b2, weight_decay=config.weight_decay, store=store,
                              compression=compression)
    return optax.chain(optax.clip_by_global_norm(config.clip), opt)


def loss_fn(graphdef, params, tokens):
    return cross_entropy_loss(nnx.merge(graphdef, params)(tokens[:, :-1]), tokens[:, 1:])


class TrainRun:
    """One contender's model, optimizer and store, advanced a step at a time."""

    def __init__(self, contender: Contender, config: TrainConfig, graphdef, params0):
        self.contender = contender
        self.store = nsp.storage.open(tier="memory") if contender.kind == "nsp" else None
        tx = make_tx(contender, config, self.store)
        self.params = tree_copy(params0)
        self.opt_state = tx.init(self.params)

        def step(p, s, tokens):
            loss, g = jax.value_and_grad(loss_fn, argnums=1)(graphdef, p, tokens)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        self._step = jax.jit(step, donate_argnums=(0, 1))
        self.losses: list[float] = []
        self.step_s: list[float] = []

    def step(self, tokens: jax.Array) -> None:
        t0 = time.perf_counter()
        self.params, self.opt_state, loss = self._step(self.params, self.opt_state, tokens)
        jax.block_until_ready(self.params)  # the store's update is done when the params are
        self.step_s.append(time.perf_counter() - t0)
        self.losses.append(float(loss))

    def update_ms(self) -> float | None:
        if self.store is None:
            return None
        s = self.store.stats()
        return s["update_ns"] / max(s["updates"], 1) / 1e6

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def load_batches(config: TrainConfig) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
    """Training batches for every step and the fixed held-out batches, as ``nsp train`` draws them."""
    tokens = data_lib.load_tokens(None, seq_len=config.seq)
    train, held_out = data_lib.split(tokens, held_out_fraction=0.05, seq_len=config.seq)
    train_b = data_lib.Batcher(train, config.batch, config.seq, seed=config.seed)
    eval_b = data_lib.Batcher(held_out, config.batch, config.seq, seed=config.seed + 1)
    info = {"source": tokens.source, "tokens": int(tokens.num_tokens), "train_tokens": int(train.shape[0]),
            "held_out_tokens": int(held_out.shape[0]), "files": tokens.info.get("file_count")}
    return ([train_b.batch(i) for i in range(config.steps)], [eval_b.batch(i) for i in range(config.eval_batches)],
            info)


def run_training(args) -> dict:
    """Section 2: every contender stepped in lockstep on the same batches; the dense pair compared every step."""
    config = train_config(args)
    train_batches, eval_batches, data_info = load_batches(config)
    model_cfg = get_config(config.model)
    graphdef, params0 = nnx.split(GPT(model_cfg, rngs=nnx.Rngs(config.seed)), nnx.Param)
    evaluate = jax.jit(lambda p, t: loss_fn(graphdef, p, t))
    eval_dev = [jnp.asarray(b) for b in eval_batches]

    def held_out_loss(p) -> float:
        return float(np.mean([float(evaluate(p, b)) for b in eval_dev]))

    start_loss = held_out_loss(params0)
    compare = jax.jit(rel_err)
    runs = [TrainRun(c, config, graphdef, params0) for c in contenders()]
    ref, dense = runs[0], runs[1]
    dense_err: list[float] = []
    t0 = time.perf_counter()
    try:
        for i, batch in enumerate(train_batches):
            tokens = jnp.asarray(batch)
            for run in runs:
                run.step(tokens)
            dense_err.append(float(compare(dense.params, ref.params)))
            if (i + 1) % max(1, config.steps // 10) == 0 or i + 1 == config.steps:
                print(f"  step {i + 1}/{config.steps}: " + ", ".join(
                    f"{r.contender.name.replace('nsp ', '')} {r.losses[-1]:.3f}" for r in runs[:4]) + ", ...",
                    flush=True)
        wall_s = time.perf_counter() - t0
        results = []
        for run in runs:
            c = run.contender
            results.append({
                "name": c.name, "kind": c.kind, "ratio": c.ratio, "error_feedback": c.error_feedback,
                "residual_decay": c.residual_decay, "lazy": c.lazy, "betas": c.betas, "lr": c.lr,
                "held_out_loss": held_out_loss(run.params), "final_train_loss": run.losses[-1],
                # The first step compiles; the median of the others is the step time.
                "step_ms": median(run.step_s[1:]) * 1e3 if len(run.step_s) > 1 else None,
                "compile_s": run.step_s[0], "update_ms": run.update_ms(), "losses": run.losses,
            })
    finally:
        for run in runs:
            run.close()
    return {
        "config": dataclasses.asdict(config),
        "model_params": int(sum(x.size for x in jax.tree_util.tree_leaves(params0))),
        "data": data_info, "start_held_out_loss": start_loss, "dense_rel_err": dense_err,
        "dense_rel_err_max": max(dense_err), "dense_rel_err_final": dense_err[-1], "runs": results,
        "wall_s": wall_s, "quick": args.quick, "command": command_line(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "git": START_GIT, "build": build_info(),
    }


def _ef_label(r: dict) -> str:
    if r["error_feedback"] is None:
        return "-"
    if not r["error_feedback"]:
        return "no"
    decay = r.get("residual_decay")  # absent from reports made before residual_decay existed
    return "yes" if decay is None else f"yes, remainder x{decay:g}/step"


def _variant(r: dict) -> tuple:
    # Reports made before these fields existed lack them (those runs used a decay of 1, the dense update and the
    # config's betas and learning rate).
    return r.get("residual_decay"), r.get("lazy"), tuple(r.get("betas") or ()), r.get("lr")


def _extra_ef(r: dict, runs: list[dict]) -> bool:
    """An error-feedback run whose residual_decay or update differs from that of most error-feedback runs (the
    one comparison run at the smallest ratio)."""
    variants = collections.Counter(_variant(x) for x in runs if x["error_feedback"])
    return bool(r["error_feedback"]) and _variant(r) != variants.most_common(1)[0][0]


def _update_label(r: dict) -> str:
    if r["ratio"] is None:
        return "-"
    return "lazy" if r.get("lazy") else "dense"



def train_rows(train: dict) -> list[dict]:
    dense = next(r for r in train["runs"] if r["name"].startswith("nsp adamw"))
    rows = []
    for r in train["runs"]:
        rows.append({
            "name": r["name"], "ratio": "100%" if r["ratio"] is None else f"{r['ratio']:.0%}",
            "ef": _ef_label(r), "update": _update_label(r),
            "held_out": r["held_out_loss"], "vs_dense": r["held_out_loss"] / dense["held_out_loss"] - 1,
            "train": r["final_train_loss"], "step_ms": r["step_ms"], "update_ms": r["update_ms"],
        })
    return rows


TRAIN_COLUMNS = [("name", "run", ""), ("ratio", "kept", ""), ("ef", "error feedback", ""),
                 ("update", "store update", ""),
                 ("held_out", "held-out loss", ".4f"), ("vs_dense", "vs nsp dense", "+.2%"),
                 ("train", "last train loss", ".4f"), ("step_ms", "step ms (median)", ".1f"),
                 ("update_ms", "store update ms", ".2f")]


# ---- section 3: the benchmarks' JSON -------------------------------------------------------------------------

def pyplot():
    """matplotlib, headless."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_bars(ax, labels: list[str], values: list[float], roof: list[bool], *, log: bool = False,
              fmt: str = "{:.3g}", fontsize: int = 8) -> None:
    """Horizontal bars on ``ax``, top to bottom, rooflines (``roof``) hatched in grey, each labelled with its value."""
    bars = ax.barh(range(len(labels)), values, color=["#bbbbbb" if r else "#3a76af" for r in roof])
    for bar, r in zip(bars, roof):
        bar.set_hatch("//" if r else "")
    ax.set_yticks(range(len(labels)), labels, fontsize=fontsize)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    for i, v in enumerate(values):
        ax.text(v, i, " " + fmt.format(v), va="center", fontsize=7)


def save_figure(fig, path: Path, suptitle: str | None = None) -> None:
    """Writes ``fig`` as a PNG (with an overall title when given) and frees it."""
    if suptitle:
        fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def bar_chart(path: Path, labels: list[str], values: list[float], *, title: str, xlabel: str,
              roofline: set[str] = frozenset(), log: bool = False, fmt: str = "{:.3g}") -> None:
    """Horizontal bars, rooflines hatched in grey, each bar labelled with its value."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.4))
    draw_bars(ax, labels, values, [lab in roofline for lab in labels], log=log, fmt=fmt)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.15)
    save_figure(fig, path)


def md_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table; ``columns`` holds (key, header, format) triples as for ``print_table``."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---:" if fmt else "---" for _, _, fmt in columns) + "|"]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            v = row.get(key)
            cells.append("-" if v is None else (v if isinstance(v, str) else format(v, fmt)))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


# Options that only say where files go: left out of the commands the report shows (they change no result).
PLACEMENT_OPTIONS = ("--dir", "--json", "--out", "--results-dir")


def shown_command(command: str) -> str:
    """``command`` without its placement options (``PLACEMENT_OPTIONS``), so it reads the same on any machine."""
    words, kept = shlex.split(command), []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in PLACEMENT_OPTIONS:
            skip = True
        elif not word.startswith(tuple(o + "=" for o in PLACEMENT_OPTIONS)):
            kept.append(word)
    return shlex.join(kept)


def bench_header(record: dict, command: str, exact_command: bool, verdict: dict) -> str:
    """The record's provenance line (file, commit, date, machine, fresh or STALE) and the command that made it."""
    how = "Produced by" if exact_command else "Command (rebuilt from the parameters the JSON records)"
    return (provenance_line(verdict, record.get("machine"), record.get("time")) + "\n"
            + f"{how}: `{shown_command(command)}`")


def render_update_kernel(d: dict, out: Path) -> tuple[str, str]:
    med = d["median_s"]
    names = list(med)
    topk = next((k for k in names if k.startswith("nsp top-k ")), None)
    ratio = float(topk.split()[-1].rstrip("%")) / 100 if topk else 0.01
    command = f"python bench/update_kernel.py --size {d['size']} --threads {d['threads']} --repeats {d['repeats']}"
    if abs(ratio - 0.01) > 1e-12:
        command += f" --ratio {ratio:g}"
    roof = {k for k in names if k.startswith("roofline")}
    bpp = d.get("bytes_per_param", {})
    rows = [{"name": k, "ms": v * 1e3, "gparams": d["size"] / v / 1e9,
             "bpp": f"{bpp[k]:g}" if k in bpp else ""} for k, v in med.items()]
    bar_chart(out / "update_kernel.png", names, [d["size"] / v / 1e9 for v in med.values()],
              title=f"fp32 Adam update of {d['size'] / 2**20:.0f}M params, {d['threads']} threads, ISA {d['isa']} "
                    f"(median of {d['repeats']}; {d['time']})", xlabel="Gparam/s (higher is better)", roofline=roof)
    body = md_table(rows, [("name", "contender", ""), ("ms", "median ms", ".1f"), ("gparams", "Gparam/s", ".3f"),
                           ("bpp", "B/param moved", "")])
    notes = "; ".join(f"{k}: {v}" for k, v in d.get("notes", {}).items())
    checks = "\n".join(f"- {c['check']}: {c['ratio']:.2f}x (target {c['target']:.2f}x, "
                       f"{'met' if c['met'] else 'missed'})" for c in d.get("checks", []))
    return command, f"{body}\n\n{notes}\n\n{checks}\n\n![update kernel](update_kernel.png)"


def render_store_update(d: dict, out: Path) -> tuple[str, str]:
    """Reads store_update.json tolerantly: its contenders are found by name (any whose name mentions DeepSpeed or
    "baseline" is a baseline of the disk group) and each sentence of the facts appears only when the record has
    its fields, so that a record with other or more baselines still renders."""
    command = "python bench/store_update.py" + "".join(
        f" {flag} {fmt(d[key])}" for flag, key, fmt in (
            ("--state-mib", "state_bytes", lambda v: f"{v / 2**20:g}"), ("--repeats", "repeats", str),
            ("--page-mib", "page_bytes", lambda v: f"{v / 2**20:g}"), ("--pages-in-flight", "pages_in_flight", str),
            ("--threads", "threads", str), ("--dir", "directory", str)) if key in d)
    med = d["median_s"]
    moved = d["bytes_read_per_update"] + d["bytes_written_per_update"]
    n = d["params"]

    def find(prefix: str) -> str | None:
        return next((k for k in med if k.strip().startswith(prefix)), None)

    # The file tier and the baselines move the same page bytes; the perfect update is their disk roofline.
    raw = [(k, v) for k, v in med.items() if k.startswith("raw disk")]
    baselines = [k for k in med if "deepspeed" in k.lower() or "baseline" in k.lower()]
    disk = ([("perfect update (disk roofline)", d["perfect_update_s"])] if "perfect_update_s" in d else [])
    disk += [(find("nsp file tier"), med.get(find("nsp file tier")))] + [(k.strip(), med[k]) for k in baselines]
    memory = [(k, med.get(k)) for k in [find("kernel alone")] + [k for k in med if k.startswith("memory tier")]]
    memory += [(k.strip(), v) for k, v in med.items() if k.strip().startswith("diag")]
    rows = [{"name": k, "ms": v * 1e3, "gbs": d["probe_bytes"] / v / 1e9 if "probe_bytes" in d else None}
            for k, v in raw]
    rows += [{"name": k, "ms": v * 1e3, "gbs": moved / v / 1e9} for k, v in disk if k]
    rows += [{"name": k, "ms": v * 1e3, "gbs": n * (28 if "kernel" in k or "no param" in k else 32) / v / 1e9}
             for k, v in memory if k]
    listed = {r["name"].strip() for r in rows}
    rows += [{"name": k.strip(), "ms": v * 1e3} for k, v in med.items() if k.strip() not in listed]  # the rest
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.2))
    for ax, group, title in ((axes[0], disk, "file tier vs disk (GB/s of pages moved)"),
                             (axes[1], memory, "memory tier vs the kernel alone (Mparam/s)")):
        group = [(k, v) for k, v in group if k]
        vals = [moved / v / 1e9 if ax is axes[0] else n / v / 1e6 for _, v in group]
        roof = ["roofline" in k or "kernel alone" in k for k, _ in group]
        draw_bars(ax, [k for k, _ in group], vals, roof, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.margins(x=0.2)
    save_figure(fig, out / "store_update.png",
                f"store update, {n / 2**20:.0f}M params"
                + (f" ({d['state_bytes'] / 2**20:.0f} MiB of p, m, v)" if "state_bytes" in d else "") + ", "
                f"median of {d.get('repeats', '?')} ({d.get('time', '?')})")
    body = md_table(rows, [("name", "contender", ""), ("ms", "median ms", ".1f"), ("gbs", "GB/s moved", ".3f")])

    def fact(template: str, *keys: str) -> str:
        return template.format(*(d[k] for k in keys)) if all(k in d for k in keys) else ""

    probe = (f"fastest write: {d['probe_write'].split(': ')[-1]}; fastest read: {d['probe_read'].split(': ')[-1]}"
             if "probe_write" in d and "probe_read" in d else d.get("probe_mode", "?"))
    facts = " ".join(f for f in (
        fact(f"Raw disk ({probe}): write {{:.3f}} GB/s, read {{:.3f}} GB/s.", "write_gbs", "read_gbs"),
        fact("File tier at {:.1f}% of the perfect update.", "file_tier_pct_of_disk"),
        fact("Baseline at {:.1f}% of the perfect update", "baseline_pct_of_disk")
        + fact(" (nsp vs baseline: {:.2f}x", "nsp_vs_baseline_speedup")
        + fact("; baseline Adam: {}", "baseline_adam")
        + (")." if "nsp_vs_baseline_speedup" in d else "." if "baseline_pct_of_disk" in d else ""),
        fact("Memory tier (jitted, as the transforms run it) at {:.1f}% of the kernel alone",
             "memory_tier_pct_of_kernel")
        + fact(" ({:.1f}% counting its 32 B/param against the kernel's 28)",
               "memory_tier_pct_of_kernel_roofline_adjusted")
        + ("." if "memory_tier_pct_of_kernel" in d else ""),
        _perfect_swap_fact(d.get("perfect_serial_swap") or {}),
    ) if f)
    checks = "\n".join(f"- {c.get('check', '?')}: "
                       + (f"{c['value']:.3g}" if isinstance(c.get("value"), (int, float)) else str(c.get("value")))
                       + f" ({'met' if c.get('met') else 'missed'})" for c in d.get("checks", []))
    return command, f"{body}\n\n{facts}\n\n{checks}\n\n![store update](store_update.png)"


def _perfect_swap_fact(perfect: dict) -> str:
    """The file tier against the perfect serial swap: overall, and in the rounds where both read their pages the
    same way (direct or buffered), with how the file tier read each round."""
    if "nsp_speedup" not in perfect:
        return ""
    text = f"Against the perfect serial swap: nsp {perfect['nsp_speedup']:.2f}x"
    same = perfect.get("same_read_method")
    if same:
        text += (f"; in the {len(same['rounds'])} rounds where both read pages the same way, nsp "
                 f"{same['nsp_s'] * 1e3:.0f} ms vs {same['perfect_s'] * 1e3:.0f} ms ({same['nsp_speedup']:.2f}x)")
    if perfect.get("nsp_reads_per_round"):
        text += f"; nsp read its pages per round: {', '.join(perfect['nsp_reads_per_round'])}"
    return text + "."


def _yes_no(value) -> str | None:
    return None if value is None else value if isinstance(value, str) else ("yes" if value else "NO")


def render_topk(d: dict, out: Path) -> tuple[str, str]:
    command = f"python bench/topk.py --size {d['size']} --ratio {d['ratio']:g} --repeats {d['repeats']}"
    inputs = list(dict.fromkeys(r["input"] for r in d["rows"]))
    hard = [i for i in inputs if any(r.get("hard") for r in d["rows"] if r["input"] == i)]
    if not hard:
        command += " --easy-only" if "inputs" in d else ""
    cols = min(3, len(inputs))
    grid = -(-len(inputs) // cols)
    plt = pyplot()
    fig, axes = plt.subplots(grid, cols, figsize=(6 * cols, 3 * grid), squeeze=False)
    for ax, inp in zip(axes.flat, inputs):
        rows = [r for r in d["rows"] if r["input"] == inp]
        roof = [r["method"].startswith("roofline") for r in rows]
        draw_bars(ax, [r["method"] for r in rows], [r["median_ms"] for r in rows], roof, log=True,
                  fmt="{:.3g} ms")
        ax.set_title(f"{inp}{' (hard)' if inp in hard else ''}: median ms (log; lower is better)", fontsize=9)
        ax.margins(x=0.3)
    for ax in list(axes.flat)[len(inputs):]:
        ax.axis("off")
    save_figure(fig, out / "topk.png",
                f"Top-K {d['ratio']:.0%} of {d['size']:,} entries (k = {d['k']:,}), median of {d['repeats']} "
                 f"({d['time']})")
    rows = [{**r, "input": r["input"] + (" (hard)" if r.get("hard") else ""), "correct": _yes_no(r.get("correct")),
             "fallback": _yes_no(r.get("fallback"))} for r in d["rows"]]
    columns = [("input", "input", ""), ("method", "method", ""), ("median_ms", "median ms", ".1f"),
               ("speedup", "vs lax.top_k", ".2f"), ("l2_mass_pct", "L2 mass kept %", ".2f")]
    if any("correct" in r for r in d["rows"]):
        columns += [("correct", "correct", ""), ("fallback", "threshold fell back", "")]
    body = md_table(rows, columns)
    notes = []
    if hard:
        notes.append("Hard inputs (`bench/topk.py`'s docstring): many entries share the k-th largest magnitude, so "
                     "no sampled threshold passes between k and 2k candidates; the threshold method then runs "
                     "its exact fallback after the threshold pass (\"threshold fell back\": its candidate count "
                     "missed). \"correct\": the output checked against numpy (k distinct ascending indices, the "
                     "values at them, every kept magnitude at least the k-th largest and every larger one kept). "
                     f"Threshold method, worst over the easy inputs: {d['threshold_speedup_min']:.2f}x lax.top_k; "
                     f"over the hard ones: {d.get('threshold_speedup_min_hard', float('nan')):.2f}x.")
    return command, body + "".join(f"\n\n{n}" for n in notes) + "\n\n![top-k](topk.png)"


def render_train_step(d: dict, out: Path) -> tuple[str, str]:
    models = d["models"]
    first = next(iter(models.values()))
    repeats = len(next(iter(first["times_s"].values())))
    command = "python bench/train_step.py" + ("" if "gpt2-124m" in models else " --quick")
    command += f" --repeats {repeats}" if repeats != 5 else ""
    split = bool(d.get("engine_cpus"))
    command += f" --engine-cpus {len(d['engine_cpus'])}" if split else ""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3), squeeze=False)
    parts = []
    for ax, (model, m) in zip(axes[0], models.items()):
        rows = m["rows"]
        ax.barh(range(len(rows)), [r["ms"] for r in rows], color="#3a76af")
        ax.set_yticks(range(len(rows)), [r["contender"] for r in rows], fontsize=8)
        ax.invert_yaxis()
        for i, r in enumerate(rows):
            ax.text(r["ms"], i, f" {r['ms']:.3g}", va="center", fontsize=7)
        ax.set_title(f"{model} ({m['params'] / 1e6:.2f}M params): ms per step", fontsize=9)
        ax.margins(x=0.2)
        steady = m.get("staleness_hidden_fraction_steady")
        hides = (f"{steady:.0%} of the file tier's update in steady state, "
                 f"{m.get('staleness_hidden_fraction', float('nan')):.0%} counting each call's final drain"
                 if steady is not None else
                 f"{m.get('staleness_hidden_fraction', float('nan')):.0%} of the file tier's update")
        all_cores = [("ratio_all", "x optax all CPUs", ".2f")] if any("ratio_all" in r for r in rows) else []
        parts.append(f"**{model}** ({m['params']:,} params; staleness 1 hides {hides})\n\n"
                     + md_table(rows, [("contender", "contender", ""), ("ms", "step ms", ".1f"),
                                       ("ratio", "x optax", ".2f"), *all_cores, ("update_ms", "update ms", ".1f"),
                                       ("wait_ms", "wait ms", ".1f"), ("in", "link in B/step", ",.0f"),
                                       ("table1_in", "Table I in", ",.0f"),
                                       ("out", "link out B/step", ",.0f"), ("table1_out", "Table I out", ",.0f")]))
    parts.append("*update ms*: a step's update, start to commit (in the background for staleness 1); *wait ms*: how "
                 "long a staleness-1 step held its caller (the previous update's tail and the copies of gradient and "
                 "params); the rest of what staleness 1 does not hide is the forward/backward slowed by the update "
                 "running beside it.")
    name = "train_step_split" if split else "train_step"
    save_figure(fig, out / f"{name}.png", f"GPT train step (median of {repeats}; {d['time']})")
    if split:
        everywhere = d.get("optax_all_cpus")
        parts.insert(0, f"The update ran on CPUs {d['engine_cpus']} (`NSP_ENGINE_CPUS`), every forward/backward on "
                        f"CPUs {d['compute_cpus']}: a stand-in for a host whose forward/backward runs on an "
                        f"accelerator, so that a staleness-1 update competes with it for memory and caches, not "
                        f"for cores. Step times are those of fewer cores than the run above. "
                        + (f"The nsp contenders use CPUs {everywhere} in all, the pinned optax only "
                           f"{d['compute_cpus']}; so optax also ran on all of {everywhere}, in a process of its own "
                           "driven round by round in the same interleaved rounds (the row \"all N CPUs\"): "
                           "\"x optax all CPUs\" compares every contender with it at equal cores, beside the pinned "
                           "run's \"x optax\"." if everywhere else
                           "(This record has no optax run on all the CPUs; rerun the command to add it.)"))
    return command, "\n\n".join(parts) + f"\n\n![train step]({name}.png)"


def render_checkpoint(d: dict, out: Path) -> tuple[str, str]:
    default_mib = 128 if d.get("quick") else 1024
    mib = round(d["state_bytes"] / 2**20)
    command = "python bench/checkpoint.py" + (" --quick" if d.get("quick") else "")
    command += f" --state-mib {mib}" if mib != default_mib else ""
    command += f" --repeats {d['repeats']} --num-shards {d['num_shards']} --page-mib {d['page_bytes'] / 2**20:g}"
    rows = d["rows"]
    bar_chart(out / "checkpoint.png", [r["name"] for r in rows], [r["median_s"] for r in rows],
              title=f"checkpoint save of {d['state_bytes'] / 2**20:.0f} MiB of state, median of {d['repeats']} "
                    f"({d['time']})", xlabel="seconds (log; lower is better)",
              roofline={r["name"] for r in rows if r["name"].startswith("raw")}, log=True, fmt="{:.3g} s")
    body = md_table(rows, [("name", "contender", ""), ("median_s", "median s", ".4f"),
                           ("gbps", "state GB/s", ".2f"), ("ratio", "x nsp snapshot", ".1f")])
    snap = d.get("snapshot", {})
    facts = (f"nsp snapshot vs orbax StandardCheckpointer: {d['ratio_orbax_standard']:.1f}x (target "
             f"{d['target_ratio']:.0f}x: {'met' if d['target_met'] else 'missed'}); snapshot method "
             f"{snap.get('method')}, {snap.get('linked_files')} page files linked, {snap.get('copied_bytes')} "
             "bytes copied. The raw write is the roofline of any checkpoint that copies the state.")
    later = d.get("cost_later")
    if later:
        lrows = [{**r, "replaced": r.get("replaced", "-")} for r in later["rows"]]
        facts += ("\n\n**The cost paid later.** A page file that a snapshot links is replaced, not rewritten in "
                  "place, the next time the store writes it (a new file renamed over it). Versions alternate "
                  "between two slots, so the first update after a snapshot writes the other slot and the second "
                  "rewrites the snapshotted one. Both updates after a snapshot against two with none, the two "
                  f"kinds of round alternating, median of {d['repeats']} (extra: median of the per-round "
                  "differences; pages replaced: page files that got a new inode):\n\n"
                  + md_table(lrows, [("name", "", ""), ("snapshot", "after a snapshot (s)", ".4f"),
                                     ("none", "no snapshot (s)", ".4f"), ("extra", "extra (s)", "+.4f"),
                                     ("replaced", "pages replaced (snapshot / none)", "")])
                  + f"\n\nA checkpoint by snapshot costs its own time plus that extra: {later['snapshot_s']:.4f} + "
                  f"{later['extra_s']:.4f} = **{later['total_s']:.4f} s**, against orbax Standard's "
                  f"{later['total_s'] * later['ratio_orbax_standard']:.4f} s "
                  f"(**{later['ratio_orbax_standard']:.1f}x**) and orbax from the store's "
                  f"{later['total_s'] * later['ratio_orbax_from_store']:.4f} s "
                  f"({later['ratio_orbax_from_store']:.1f}x), all in this run.")
    else:
        facts += " (This record predates the measurement of the cost a snapshot adds to the next updates.)"
    return command, f"{body}\n\n{facts}\n\n![checkpoint](checkpoint.png)"


def render_max_model(d: dict, out: Path) -> tuple[str, str]:
    command = f"python bench/max_model.py --cap-gib {d['cap_gib']:g} --width {d['width']} --seq {d['seq']}"
    rows = d["rows"]
    bar_chart(out / "max_model.png", [r["contender"] for r in rows], [r["params_m"] for r in rows],
              title=f"largest GPT (width {d['width']}) that trains under {d['cap_gib']:g} GiB of address space "
                    f"({d['time']})", xlabel="params (M; higher is better)", fmt="{:.1f} M")
    body = md_table(rows, [("contender", "contender", ""), ("layers", "layers", "d"), ("params_m", "params (M)", ".1f"),
                           ("ratio", "vs optax", ".2f"), ("peak_rss_gib", "peak RSS GiB", ".2f"),
                           ("step_s", "step s", ".1f")])
    return command, f"{body}\n\n![max model](max_model.png)"


def render_fault_campaign(d: dict, out: Path) -> tuple[str, str]:
    trials = d["trials"]
    command = f"python bench/fault_campaign.py --trials {len(trials)} --steps {d['steps']} --seed {d['seed']}"
    modes = list(dict.fromkeys(t["mode"] for t in trials))
    rows = []
    for mode in modes:
        ts = [t for t in trials if t["mode"] == mode]
        rows.append({"mode": mode, "trials": len(ts), "killed": sum(t["killed"] for t in ts),
                     "identical": sum(t["bit_identical"] for t in ts), "corrupt": sum(t["corrupt"] for t in ts),
                     "lost": max(t["lost_steps"] for t in ts)})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 2.6))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["trials"] for r in rows], 0.4, label="trials", color="#bbbbbb")
    ax.bar(x + 0.2, [r["identical"] for r in rows], 0.4, label="bit-identical after resume", color="#3a76af")
    ax.set_xticks(x, [r["mode"] for r in rows])
    ax.legend(fontsize=8)
    ax.set_title(f"fault campaign: {len(trials)} SIGKILLed runs of {d['steps']} steps ({d['time']})", fontsize=9)
    save_figure(fig, out / "fault_campaign.png")
    body = md_table(rows, [("mode", "kill point", ""), ("trials", "trials", "d"), ("killed", "killed", "d"),
                           ("identical", "bit-identical", "d"), ("corrupt", "corrupt", "d"),
                           ("lost", "max lost steps", "d")])
    return command, f"{body}\n\n![fault campaign](fault_campaign.png)"


BENCHES = {
    "update_kernel": ("Update kernel: nsp fused Adam vs optax, torch and the memory roofline",
                      "python bench/update_kernel.py", render_update_kernel),
    "store_update": ("Store update: file tier vs the raw disk and DeepSpeed's optimizer swap; memory tier vs the "
                     "kernel",
                     "python bench/store_update.py", render_store_update),
    "topk": ("Top-K compression: nsp methods vs jax.lax.top_k and a one-pass roofline", "python bench/topk.py",
             render_topk),
    "train_step": ("GPT train step: optax in RAM vs nsp tiers", "python bench/train_step.py", render_train_step),
    "train_step_split": ("GPT train step, the update on a CPU of its own (an accelerator host's split)",
                         "python bench/train_step.py --engine-cpus 1", render_train_step),
    "checkpoint": ("Checkpoint save: nsp snapshot vs orbax and the raw-write roofline", "python bench/checkpoint.py",
                   render_checkpoint),
    "max_model": ("Largest model under a memory cap", "python bench/max_model.py", render_max_model),
    "fault_campaign": ("Fault campaign: kill, resume, compare bit for bit", "python bench/fault_campaign.py",
                       render_fault_campaign),
}

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


def read_records(results_dir: Path) -> dict[str, dict]:
    """The benchmarks' records found in ``results_dir``, by name (an unreadable file is left to render_benches)."""
    records = {}
    for name in BENCHES:
        path = results_dir / f"{name}.json"
        try:
            records[name] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return records


def render_benches(results_dir: Path, out: Path, ran: dict[str, dict], verdicts: dict[str, dict],
                   allow_stale: bool) -> str:
    parts = []
    records = read_records(results_dir)
    for name, (title, default_command, render) in BENCHES.items():
        path = results_dir / f"{name}.json"
        if name in records and not verdicts[name]["fresh"] and not allow_stale:
            record = records[name]
            parts.append(left_out(f"### {title}", verdicts[name], shown_command(record.get("command")
                                                                                 or default_command)))
            continue
        parts.append(f"### {title}\n")
        if not path.exists():
            parts.append(f"**Missing**: `{path.relative_to(REPO) if path.is_relative_to(REPO) else path}` does not "
                         f"exist. Produce it with `{default_command}`, commit it, then rerun this report.\n")
            continue
        if name not in records:
            parts.append(f"**Unreadable**: `{path.name}` is not JSON. Regenerate it with `{default_command}`.\n")
            continue
        record = records[name]
        try:
            command, body = render(record, out)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # an older or foreign record layout
            parts.append(f"**Unreadable**: `{path.name}` does not have the fields this report expects ({e!r}). "
                         f"Regenerate it with `{default_command}`.\n")
            continue
        run = ran.get(name)
        if run is not None and run.get("time") == record.get("time"):
            command, exact_command = run["command"], True
        elif record.get("command"):  # benchmarks record their own command line
            command, exact_command = record["command"], True
        else:
            exact_command = False
        parts.append(bench_header(record, command, exact_command, verdicts[name])
                     + "\n\n" + body + "\n")
    return "\n".join(parts)


# ---- plots of sections 1 and 2 ---------------------------------------------------------------------------------

def plot_traffic(traffic: dict, shared: list[dict], internal: list[dict], M: int, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    shared = [r for r in shared if r.get("total") is not None]  # not the baseline rows DeepSpeed could not run
    labels = [traffic_label(r["key"], traffic, short=True) for r in shared]
    y = np.arange(len(shared))
    axes[0].barh(y, [r["total"] / M for r in shared], color="#3a76af", label="measured")
    axes[0].scatter([r["formula_total"] / M for r in shared], y, marker="D", color="black", zorder=3,
                    label="formula", s=18)
    axes[0].set_yticks(y, labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("shared-link bytes per step / M")
    axes[0].legend(fontsize=7)
    axes[0].set_title("shared link (host <-> store)", fontsize=9)
    nsp_rows = [r for r in internal if r["read"] is not None]
    yi = np.arange(len(nsp_rows))
    axes[1].barh(yi - 0.2, [r["read"] / M for r in nsp_rows], 0.4, label="pages read", color="#3a76af")
    axes[1].barh(yi + 0.2, [r["write"] / M for r in nsp_rows], 0.4, label="pages written", color="#e0873a")
    axes[1].set_yticks(yi, [traffic_label(r["key"], traffic, short=True) for r in nsp_rows], fontsize=7)
    axes[1].invert_yaxis()
    axes[1].set_xlabel("internal bytes per step / M")
    axes[1].legend(fontsize=7)
    axes[1].set_title("store internal link", fontsize=9)
    save_figure(fig, path)


def plot_loss_curves(train: dict, path: Path) -> int:
    """Training loss vs step for every run (moving average); returns the averaging window."""
    plt = pyplot()
    steps = train["config"]["steps"]
    window = max(1, steps // 50)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    cmap = plt.get_cmap("viridis")
    for r in train["runs"]:
        losses = np.asarray(r["losses"])
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        x = np.arange(window, len(losses) + 1)
        if r["ratio"] is None:
            style = {"color": "black" if r["kind"] == "optax" else "#d62728",
                     "linestyle": "-" if r["kind"] == "optax" else ":", "linewidth": 1.6}
        else:
            shade = cmap(RATIOS.index(r["ratio"]) / (len(RATIOS) - 1) * 0.85)
            style = {"color": shade, "linewidth": 1.0,
                     "linestyle": "-." if _extra_ef(r, train["runs"]) else "-" if r["error_feedback"] else "--"}
        ax.plot(x, smooth, label=r["name"], **style)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (moving average of {window})" if window > 1 else "training loss")
    ax.set_title(f"{train['config']['model']} GPT, batch {train['config']['batch']} x {train['config']['seq']} "
                 f"tokens, seed {train['config']['seed']}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)
    return window


def plot_loss_vs_ratio(train: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for ef, style in ((True, "-o"), (False, "--s")):
        pts = sorted((r["ratio"], r["held_out_loss"]) for r in train["runs"]
                     if r["error_feedback"] is ef and not _extra_ef(r, train["runs"]))
        ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], style,
                label="Top-K + error feedback" if ef else "Top-K, no error feedback")
    for r, marker in zip([r for r in train["runs"] if _extra_ef(r, train["runs"])], "^vD<>"):
        ax.plot([r["ratio"] * 100], [r["held_out_loss"]], marker, color="gray",
                label=r["name"].removeprefix("nsp "))
    for r, color in zip(train["runs"][:2], ("black", "#d62728")):
        ax.axhline(r["held_out_loss"], color=color, linestyle=":", linewidth=1, label=r["name"])
    ax.set_xscale("log")
    ax.set_xticks([c * 100 for c in RATIOS], [f"{c:.0%}" for c in RATIOS])
    ax.set_xlabel("gradient entries kept")
    ax.set_ylabel("held-out loss")
    ax.legend(fontsize=7)
    save_figure(fig, path)


# ---- the report ------------------------------------------------------------------------------------------------

def section_header(measurements: dict) -> str:
    m = measurements["machine"]
    v = measurements["versions"]
    verdicts = measurements.get("provenance", {})
    render_git = measurements.get("rendered_at", {})
    fresh = [k for k, x in verdicts.items() if x["fresh"]]
    stale = [k for k, x in verdicts.items() if not x["fresh"]]
    t_seed, s_seed = measurements["traffic"]["seed"], measurements["train"]["config"]["seed"]
    lines = [
        "# nsp results",
        "",
        f"Generated {measurements['generated']} by `{shown_command(measurements['command'])}` in "
        f"{measurements['elapsed_s'] / 60:.1f} min"
        + (" (section 2 is a `--quick` smoke run: few training steps, not for conclusions)."
           if measurements["train"].get("quick") else ".")
        + (f" Re-rendered {measurements['rerendered']} (section 3 read again from `bench/results/`)."
           if measurements.get("rerendered") else ""),
        "Regenerate with `python bench/report.py` (options: `--help`). Every number below comes from a measurement "
        "made by that script (raw values in [`report.json`](report.json)) or from a benchmark's JSON record in "
        "`bench/results/`, committed to git. Each part names its record, the commit it was measured at and the "
        "machine; a part whose code changed after that commit is stale and "
        + ("rendered marked **STALE** (`--allow-stale`)." if measurements.get("allow_stale") else
           "left out, with the reason.")
        + f" Rendered at commit `{(render_git.get('commit') or '?')[:12]}` (`{render_git.get('describe')}`"
        + (f"; {render_git.get('dirty_count')} tracked files with uncommitted changes" if render_git.get("dirty")
           else "; no uncommitted changes") + "): "
        + (f"{len(fresh)} of {len(verdicts)} parts fresh" + (f", stale: {', '.join(stale)}." if stale else ".")),
        "",
        "## Machine and versions",
        "",
        md_table([{"k": "CPU", "v": m["cpu"]}, {"k": "cores", "v": str(m["cores"])}]
                 + [{"k": k, "v": v} for k, v in (
                     ("SIMD flags", " ".join(m["flags"]) if m.get("flags") is not None else None),
                     ("RAM", f"{m['ram_bytes'] / 2**30:.1f} GiB" if m.get("ram_bytes") else None)) if v]
                 + [{"k": "platform", "v": m["platform"]}, {"k": "python", "v": m["python"]},
                  {"k": "nsp kernel ISA / threads", "v": f"{measurements['isa']} / {measurements['threads']}"},
                  {"k": "JAX devices", "v": measurements["devices"]},
                  {"k": "environment", "v": measurements["env"] or "(no NSP_* / XLA_* variables set)"}],
                 [("k", "machine", ""), ("v", "", "")]),
        "",
        md_table([{"lib": k, "ver": val} for k, val in v.items()], [("lib", "library", ""), ("ver", "version", "")]),
        "",
        f"Seeds (`--seed`): section 1's params and gradients come from `np.random.default_rng({t_seed})`; section 2 "
        f"initialises the GPT with `nnx.Rngs({s_seed})` and draws its training batches with `Batcher(seed={s_seed})` "
        f"and its held-out batches with `Batcher(seed={s_seed + 1})`. Nothing else is random. The benchmarks of "
        "section 3 seed their own inputs (see each script).",
        "",
    ]
    return "\n".join(lines)


def baseline_text(traffic: dict) -> tuple[str, str]:
    """(where the baseline rows come from, what their bytes hold against the formula and the OS's counts)."""
    M = 2 * traffic["params"]
    rows = {k: m for k, m in traffic["measured"].items() if k.startswith("baseline")}
    ds = deepspeed_name(traffic)
    if ds is None:
        return ("The baseline rows of this (older) record were modelled with nsp's own engine: whole-state reads "
                "and writes of the store's page files, Adam on the host, not DeepSpeed's swapper.", "")
    missing = {k: m["unavailable"] for k, m in rows.items() if "unavailable" in m}
    measured = {k: m for k, m in rows.items() if "unavailable" not in m}
    info = traffic["deepspeed"]
    parts = []
    if missing:
        parts.append("**The baseline rows " + ", ".join(BASELINE_TAGS[k] for k in missing) + " are left out**: " + "; ".join(sorted(set(missing.values())))
                     + ". Nothing stands in for them (no model of the baseline with nsp's own engine). "
                     f"Install DeepSpeed with `{info.get('install', _deepspeed_swap.INSTALL_HINT)}` to measure them.")
    if not measured:
        return " ".join(parts), ""
    d = next(iter(measured.values()))["deepspeed"]
    aio = d["aio"]
    sub = info.get("sub_group_size_default")
    parts.insert(0, (
        f"The baseline rows are {ds}'s optimizer swap (ZeRO-Infinity's `offload_optimizer: {{device: nvme}}`), driven "
        "through DeepSpeed's own ops by `bench/_deepspeed_swap.py` and measured on a real step, in the "
        f"{d['arrangement']} arrangement: {d['aio_handles']} aio handle (DeepSpeed's default aio settings: "
        f"block_size {aio['block_size']:,}, queue_depth {aio['queue_depth']}, intra_op_parallelism "
        f"{aio['intra_op_parallelism']}, single_submit {aio['single_submit']}, overlap_events "
        f"{aio['overlap_events']}), sub_group_size {sub:.0e} (its default), so "
        + (f"one sub-group of all {d['sub_group_numel']:,} params;" if d["sub_groups"] == 1 else
           f"{d['sub_groups']} sub-groups of up to {d['sub_group_numel']:,} params;")
        + " per sub-group p, m, v swapped in (`async_pread` into page-locked buffers, "
        f"`wait`), {d['optimizer']} on them, swapped out (`async_pwrite`, `wait`). Its swap files are its own (one "
        "per tensor and sub-group, opened O_DIRECT by the aio op, not fsynced, as DeepSpeed's swapper does not "
        "sync), in the same temporary folder as the nsp stores. Serial, not pipelined: the pipelined arrangement "
        "overlaps the same reads and writes, so Table I's bytes are the same, and serial is the simpler one to "
        "count. Row (a) copies the gradient from host memory into the pinned gradient buffer at swap-in (as ZeRO "
        "hands over an unswapped gradient partition); row (a') first swaps it out to each sub-group's gradient file "
        "through the same aio handle and reads it back with the sub-group's state (ZeRO-Infinity's gradient offload "
        "to NVMe). \"to store\" / \"from store\" of these rows are the swapper's own counters (`bytes_written` / "
        "`bytes_read`, added up at each of its aio calls) over the second step; the first sets up DeepSpeedCPUAdam's "
        "state. After the two steps the params in its swap files have moved from p0 by float64 Adam's update to a "
        "relative error of " + ", ".join(f"{m['update_rel_err']:.2g} in row {BASELINE_TAGS[k]}"
                                         for k, m in measured.items()) + "."))

    notes = []
    for key, m in measured.items():
        tag = BASELINE_TAGS[key]
        pad = m["swapped_numel"] - m["numel"]
        f = traffic_formulas(traffic["params"])["baseline"]
        gap_to, gap_from = m["to_store"] - f["to_store"], m["from_store"] - f["from_store"]
        what = (f"Row {tag} moves p, m, v ({m['state_read']:,} B read, {m['state_written']:,} B written = "
                f"{m['state_read'] / M:.4g} M / {m['state_written'] / M:.4g} M)")
        if m["grad_read"] or m["grad_written"]:
            what += (f" and the gradient ({m['grad_written']:,} B written before the step, {m['grad_read']:,} B "
                     f"read back = {m['grad_written'] / M:.4g} M / {m['grad_read'] / M:.4g} M)")
        else:
            what += ", not the gradient, which stays in host memory"
        what += (f": {float(gap_to) / M:+.4g} M to the store and {float(gap_from) / M:+.4g} M from it against the "
                 "formula" if gap_to or gap_from else ": the formula's bytes exactly")
        if not (m["grad_read"] or m["grad_written"]):
            what += (", which also counts ZeRO-Infinity's gradient round trip through storage (2M written by the "
                     "backward, 2M read by the optimizer), the part row (a') adds")
        notes.append(what + ".")
        if pad:
            notes.append(f"DeepSpeed pads every swapped tensor to a multiple of AIO_ALIGNED_BYTES x "
                         f"intra_op_parallelism: row {tag} swaps {m['swapped_numel']:,} entries per tensor for N = "
                         f"{m['numel']:,}, {pad * 4:,} bytes of padding per tensor and direction, counted in its "
                         "bytes and not in the formula.")
    if all(m["swapped_numel"] == m["numel"] for m in measured.values()):
        notes.append("N is a whole number of DeepSpeed's aio alignment (AIO_ALIGNED_BYTES x intra_op_parallelism), "
                     "so its swap files carry no padding.")
    extra = [(BASELINE_TAGS[k], m["os_storage_read"] - m["from_store"],
              m["os_storage_written"] - m["to_store"]) for k, m in measured.items()]
    odd = [f"row {t}: {r:+,} B read, {w:+,} B written" for t, r, w in extra if r or w]
    check = (
        "**Baseline bytes, counted three ways** (the second step): the swapper's own counters; the bytes of the "
        "tensors its aio handle was handed, split by swap file (`CountedAio` in `bench/report.py`: the p, m, v "
        "files and the gradient files; \"calls = counters\" checks that they add up to the counters); and the OS's "
        "counts from `/proc/self/io` over the step. DeepSpeed's aio submits its reads and writes with io_submit on "
        "files opened O_DIRECT: they pass through no read or write system call, so rchar / wchar do not count them "
        "(what those columns show is the process's other system-call I/O in the step, less rchar's own probe of "
        "/proc/self/io); the block-layer counts (read_bytes / write_bytes: what the process fetched from and sent "
        "to the block device, which O_DIRECT I/O reaches without the page cache) do, and the next column is what "
        "they hold beyond the swapper's counters"
        + (" (" + "; ".join(odd) + ": block-layer I/O the kernel charged to this process during the step beyond "
           "the bytes handed to the swapper's aio calls)" if odd else
           ": nothing, to the byte")
        + ". Last column: the params' change in the swap files over the two steps against float64 Adam's.")
    return " ".join(parts), " ".join(notes) + "\n\n" + check + "\n\n" + md_table(baseline_rows(traffic),
                                                                                 BASELINE_COLUMNS)


def section_traffic(traffic: dict, out: Path, provenance: str) -> str:
    shared, internal = traffic_rows(traffic)
    n = traffic["params"]
    M = 2 * n
    dense = traffic["measured"]["dense"]
    plot_traffic(traffic, shared, internal, M, out / "traffic.png")
    baseline_where, baseline_bytes = baseline_text(traffic)
    return "\n".join([
        "## 1. Traffic per optimizer step (Smart-Infinity Table I)",
        "",
        provenance,
        "",
        f"Command: `{shown_command(traffic['command'])}` (measured {traffic.get('time', '?')})",
        "",
        f"N = {n:,} fp32 params (one flat vector `{{\"w\": float32[{n}]}}`); M = 2N = {M:,} bytes (the model in 16-bit "
        f"bytes), fp32 transport = 2M per tensor. One file-tier store shard with pages of "
        f"{traffic['page_bytes']:,} bytes: {dense['pages_per_state']} whole pages per state and no padding "
        f"(the store's padded vector holds {dense['padded_total']:,} entries = N). Adam (p, m, v). Each row is "
        "the second step on a fresh store (the first compiles or builds buffers); seed "
        f"{traffic['seed']}.",
        "",
        "Where the numbers come from: nsp rows are `store.stats()` of a store opened with `nsp.storage.open(..., "
        "tier=\"file\")` and stepped through a jitted `nsp.optim.adam(..., store=store)` (Top-K rows: "
        "`compression=nsp.optim.TopK(c)`). \"to store\" is gradients (and, for the baseline, state) going in; "
        "\"from store\" is params (and state) coming out.",
        "",
        baseline_where,
        "",
        "Formulas: baseline 6M state read + 6M state written + 2M gradients written + 2M gradients read = 16M; "
        "SmartUpdate 2M gradients in + 2M params out; SmartComp at ratio c: c x N x (4 + 4) bytes in (fp32 value + "
        "int32 index per kept entry) + 2M params out.",
        "",
        "**Shared link** (bytes per step):",
        "",
        md_table(shared, SHARED_COLUMNS),
        "",
        *([baseline_bytes, ""] if baseline_bytes else []),
        "**Store internal link** (pages read and written inside the store, bytes per step), with the OS's count of "
        "the bytes this process's read and write system calls moved during the step (`/proc/self/io` rchar / "
        "wchar, less what reading that file adds). The OS figures are an independent check of the counters; the "
        "last column is what the system calls moved beyond them: each page file's 4-byte CRC-32C trailer and, in "
        "writes, the shard manifest a commit rewrites. The baseline has no row here: DeepSpeed's swapper updates "
        "on the host, so everything it moves crosses the shared link (its OS check is the table above).",
        "",
        md_table(internal, INTERNAL_COLUMNS),
        "",
        "Formula: near-storage update reads 3 states x 4 B/param and writes 3 x 4 B/param = 6M each way.",
        "",
        "![traffic](traffic.png)",
        "",
    ])


def section_training(train: dict, out: Path, provenance: str) -> str:
    cfg = train["config"]
    window = plot_loss_curves(train, out / "loss_curves.png")
    plot_loss_vs_ratio(train, out / "loss_vs_ratio.png")
    rows = train_rows(train)
    err = train["dense_rel_err"]
    checkpoints = sorted({1, 10, 100, len(err)} & set(range(1, len(err) + 1)))
    data = train["data"]
    ok = train["dense_rel_err_max"] <= 1e-5
    first_above = next((i + 1 for i, e in enumerate(err) if e > 1e-5), None)
    return "\n".join([
        "## 2. Loss vs compression ratio (Smart-Infinity Table IV / Fig. 16)",
        "",
        provenance,
        "",
        f"Command: `{shown_command(train['command'])}` (measured {train.get('time', '?')}; training took "
        f"{train['wall_s'] / 60:.1f} min of it)",
        "",
        f"Model `{cfg['model']}` ({train['model_params']:,} params), byte-level, trained for {cfg['steps']} steps of "
        f"{cfg['batch']} x {cfg['seq']} tokens on {data['source']} ({data['tokens']:,} tokens; the last 5% held "
        f"out), batches `Batcher(seed={cfg['seed']})`. Every run: `optax.clip_by_global_norm({cfg['clip']:g})`, then "
        f"AdamW (b1 {cfg['b1']:g}, b2 {cfg['b2']:g}, weight decay {cfg['weight_decay']:g}) with `nsp train`'s "
        f"schedule (linear warm-up over {min(cfg['warmup_steps'], cfg['steps'])} steps to {cfg['lr']:g}, cosine "
        f"decay to {cfg['lr'] * cfg['min_lr_ratio']:g}), except a run whose name gives its own b1, b2 and peak (the "
        "moment decays recommended for Top-K near 1%, `nsp.optim.TOPK_ADAM_BETAS`, and a higher peak learning "
        "rate). nsp runs keep their state in a memory-tier store; Top-K "
        "runs compress the clipped gradient with `nsp.optim.TopK(c, error_feedback=..., residual_decay=..., "
        "lazy=...)`: with error feedback the unsent remainder is scaled by `residual_decay` each step (the table's "
        "error-feedback column; 1 is classic error feedback, nsp's default); a lazy store update moves only the "
        "entries sent that step, a dense one runs AdamW on the whole decompressed gradient (the store-update "
        "column; dense is nsp's default). All runs advance in "
        "lockstep on the same batches; each step is timed to completion (the store's update included), and the "
        f"step time is the median over steps 2..{cfg['steps']} (step 1 compiles). Held-out loss: the mean over "
        f"{cfg['eval_batches']} fixed held-out batches (`Batcher(seed={cfg['seed'] + 1})`); before training it is "
        f"{train['start_held_out_loss']:.4f}.",
        "",
        f"**nsp dense vs optax.adamw**: max relative param difference ||p_nsp - p_optax|| / ||p_optax|| over all "
        f"{len(err)} steps = **{train['dense_rel_err_max']:.3g}** "
        f"({'within' if ok else 'above'} the 1e-5 that tests/test_optim.py allows over 50 steps); at steps "
        + ", ".join(f"{s}: {err[s - 1]:.3g}" for s in checkpoints) + "."
        + ("" if first_above is None else f" It first exceeds 1e-5 at step {first_above}: float32 rounding "
           "differences (the kernel's fused arithmetic vs XLA's) that training amplifies step after step."),
        "",
        md_table(rows, TRAIN_COLUMNS),
        "",
        "![loss curves](loss_curves.png)\n\nTraining loss per step"
        + (f" (moving average over {window} steps)" if window > 1 else "") + ", every run.",
        "",
        "![held-out loss vs ratio](loss_vs_ratio.png)",
        "",
    ])


def section_csd() -> str:
    return "\n".join([
        "## 4. Scaling from the CSD emulator",
        "",
        "**Missing: there is no emulated computational-storage backend yet, so no scaling plot is produced.** "
        "`nsp.storage.open(..., tier=\"csd\")` is for now the file tier with one engine worker per shard "
        "(`nsp/storage/store.py`): every shard's pages go to the same disk through the same host CPU, with no "
        "per-device bandwidth, internal link or compute of its own. A plot of update time against the number of "
        "such \"devices\" would measure one disk shared by more and more shards, not the scaling of "
        "computational storage, so none is drawn and no numbers stand in for it.",
        "",
    ])


SECTION_TITLES = {"traffic": "## 1. Traffic per optimizer step (Smart-Infinity Table I)",
                  "train": "## 2. Loss vs compression ratio (Smart-Infinity Table IV / Fig. 16)"}


def render_report(measurements: dict, results_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    allow_stale = bool(measurements.get("allow_stale"))
    verdicts = measurements["provenance"]
    parts = [section_header(measurements)]
    for key, section in (("traffic", section_traffic), ("train", section_training)):
        verdict = verdicts[key]
        if verdict["fresh"] or allow_stale:
            parts.append(section(measurements[key], out,
                                 provenance_line(verdict, measurements["machine"], measurements[key].get("time"))))
        else:
            parts.append(left_out(SECTION_TITLES[key], verdict, "python bench/report.py"))
    where = results_dir.relative_to(REPO) if results_dir.is_relative_to(REPO) else results_dir
    parts.append(f"## 3. Kernel and tier throughput\n\nFrom the JSON records in `{where}/`, each with the "
                 "benchmark's own timestamp, commit and machine; rooflines are grey (hatched) bars measured in the same run. A record "
                 "whose command reads \"Produced by\" names the command line that wrote it (recorded by the "
                 "benchmark, or by this script's `--run-benches`), less the options that only place files ("
                 + ", ".join(f"`{o}`" for o in PLACEMENT_OPTIONS)
                 + "); for older records the command is rebuilt from the parameters they record.\n")
    parts.append(render_benches(results_dir, out, measurements.get("ran_benches") or {}, verdicts, allow_stale))
    parts.append(section_csd())
    path = out / "REPORT.md"
    path.write_text("\n".join(parts).rstrip() + "\n")
    return path


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
        traffic = run_traffic(args)
    if args.reuse or args.skip_train:
        train = previous["train"]
    else:
        print(f"section 2: training {args.model} for {args.steps} steps, {len(contenders())} runs in lockstep",
              flush=True)
        train = run_training(args)
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
    path = render_report(measurements, results_dir, out)
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
