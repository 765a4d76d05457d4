"""Resharding a checkpoint (``nsp ckpt reshard``) against the disk floor for the same bytes.

A GPT-2 124M-sized state (124.4M fp32 params, Adam's m and v: 1.49 GB, 4 MiB pages) is written as the store item
of a checkpoint step by 1 process (one shard) and by 4 processes (one shard each), then resharded:

- ``1->4``: the 1-process step for 4 processes x 1 device (4 shards, 4 parts);
- ``4->2``: the 4-process step for 2 processes x 1 device (2 shards, 2 parts).

The floor is what the disk takes to read those bytes and write them once: every page file of the source read
whole, written to a new file and fsynced, as many files at a time as the reshard copies pages (``COPY_THREADS``). The reshard
does that plus what the format needs: CRC-32C checked on each page read (and each trailer checked against the
manifest's record) and computed on each page written, pages cut at new boundaries. Contenders alternate over
``--reps`` repetitions, each on a fresh output directory; medians are reported, and the ratio floor/reshard
(the target: at least 0.7). The source was just written, so reads come mostly from the page cache for both.

    python bench/reshard.py [--params 124439808] [--reps 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import disk_info, median, print_table, write_json  # noqa: E402

import nsp.storage as storage  # noqa: E402
from nsp.storage.reshard import COPY_THREADS, process_shards  # noqa: E402
from nsp.storage.reshard_checkpoint import reshard_checkpoint  # noqa: E402
from nsp.storage.snapshot import snapshot_store  # noqa: E402

GPT2_124M = 124_439_808  # GPT-2 small's parameter count (tied embeddings)


def make_step(root: Path, num_shards: int, params: int, processes: int) -> Path:
    """A checkpoint step directory whose store item holds ``params`` elements of state over ``num_shards`` shards,
    written by ``processes`` processes (one update applied: m and v are not zeros)."""
    rng = np.random.default_rng(0)
    tree = {"w": rng.standard_normal(params, dtype=np.float32)}
    store_dir = root / f"store{num_shards}"
    store = storage.open(store_dir, tier="file", num_shards=num_shards)
    store.initialize(tree, storage.OptimizerSpec("adamw", weight_decay=0.01))
    grad = np.zeros(store.layout.padded_total, np.float32)
    grad[:params] = rng.standard_normal(params, dtype=np.float32)
    store.update(grad, version=0, lr=1e-3, step=1)
    store.close()
    step = root / f"ckpt{num_shards}" / "1"
    step.mkdir(parents=True)
    if processes == 1:
        with storage.open(store_dir) as whole:
            snapshot_store(whole, step / "store")
    else:
        for p in range(processes):
            with storage.open(store_dir, shards=process_shards(num_shards, processes, p)) as part:
                snapshot_store(part, step / "store" / f"process-{p:05d}")
    return step


def floor_copy(src: Path, dest: Path, threads: int = COPY_THREADS) -> int:
    """Every file under ``src`` read whole, written to ``dest`` and fsynced, ``threads`` files at a time (as the
    reshard copies pages): the disk's floor for those bytes. Returns the bytes copied."""
    files = sorted(p for p in src.rglob("*") if p.is_file())
    for d in {dest / p.parent.relative_to(src) for p in files}:
        d.mkdir(parents=True, exist_ok=True)

    def copy(path: Path) -> int:
        data = path.read_bytes()
        fd = os.open(dest / path.relative_to(src), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return len(data)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(copy, files))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=GPT2_124M)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the stores and checkpoints go (default: a temp dir)")
    ap.add_argument("--note", default="", help="recorded as is (e.g. what else ran on the machine)")
    ap.add_argument("--no-record", action="store_true", help="print only; write no bench/results record")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nsp-reshard-bench-", dir=a.dir))
    rows = []
    try:
        cases = [("1->4", make_step(root, 1, a.params, 1), 4, 4), ("4->2", make_step(root, 4, a.params, 4), 2, 2)]
        for name, step, shards, processes in cases:
            times = {"reshard": [], "floor": []}
            done = None
            for rep in range(a.reps):
                for contender in ("reshard", "floor"):
                    out = root / f"out-{contender}"
                    shutil.rmtree(out, ignore_errors=True)
                    t0 = time.perf_counter()
                    if contender == "reshard":
                        done = reshard_checkpoint(step, out, shards, processes=processes)
                    else:
                        out.mkdir()
                        floor_bytes = floor_copy(step / "store", out)
                    times[contender].append(time.perf_counter() - t0)
                    shutil.rmtree(out, ignore_errors=True)
            r, f = median(times["reshard"]), median(times["floor"])
            rows.append({"case": name, "params": a.params, "read_bytes": done["read_bytes"],
                         "written_bytes": done["written_bytes"], "floor_bytes": floor_bytes,
                         "reshard_s": r, "floor_s": f, "reshard_s_all": times["reshard"],
                         "floor_s_all": times["floor"], "reshard_gbps": done["written_bytes"] / r / 1e9,
                         "floor_gbps": floor_bytes / f / 1e9, "fraction_of_floor": f / r})
        disk = disk_info(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table("reshard vs disk floor (read + write once, fsynced)", rows, [
        ("case", "case", "s"), ("written_bytes", "bytes", ".3g"), ("reshard_s", "reshard s", ".2f"),
        ("floor_s", "floor s", ".2f"), ("reshard_gbps", "reshard GB/s", ".2f"), ("floor_gbps", "floor GB/s", ".2f"),
        ("fraction_of_floor", "of floor", ".2f")])
    if not a.no_record:
        path = write_json("reshard", {"rows": rows, "reps": a.reps, "note": a.note, "target_fraction": 0.7},
                          disk=disk)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
