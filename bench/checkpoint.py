"""Checkpoint save time: an nsp tier snapshot (hard links) against a plain orbax save of the same state, one run.

    python bench/checkpoint.py            # 1 GiB of fp32 Adam state (p, m, v: 89M params), median of 5
    python bench/checkpoint.py --quick    # 128 MiB of state

Contenders (interleaved rounds after a warm-up round; every save goes to a fresh directory on the same file system,
removed after it was timed):
  nsp snapshot       nsp.storage.checkpoint.snapshot_store: hard links to the committed version's page files, copies
                     of the small metadata, fsync of the new directories, SNAPSHOT.json (no state byte moves)
  nsp manager        save_checkpoint through an orbax CheckpointManager (items store + a tiny train_state + meta,
                     keep 2): the snapshot plus orbax's own bookkeeping, waited for
  orbax Standard     ocp.StandardCheckpointer().save of {"p", "m", "v"} as jax arrays already in RAM, waited for
                     (what a user would otherwise do; tensorstore writes every chunk durably)
  orbax from store   the same, reading p, m, v from the store first (what checkpointing a tier without snapshots
                     costs)
  raw write          the copy roofline: the state's bytes written sequentially to one new file + fsync. Any
                     checkpoint that copies the state pays at least this; a snapshot does not copy.

The figure of merit is the ratio of each contender's median time to nsp's (target: orbax Standard >= 10x).

The cost paid later. A snapshot's hard links make the next write of the snapshotted pages dearer: the file tier
rewrites a page file in place only when nothing else links it, and replaces a linked one (a new file written and
renamed over it: fresh blocks allocated). A store keeps two version slots and an update writes the one it does not
read, so after a snapshot of version t (slot t % 2) the first update writes the other slot as usual and the second
rewrites the snapshotted slot: every one of its pages is replaced. The benchmark times those two updates after a
snapshot against two updates with none (the snapshot removed before the control pair, so every page has one link
again), the two kinds of round alternating, median of the per-round differences. It reports the snapshot's time plus
that extra (what a checkpoint by snapshot costs in all) against the orbax saves timed above, and counts the page
files each update replaced (a new inode) as evidence of which path ran.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import disk_info, median, print_table, write_json  # noqa: E402

import orbax.checkpoint as ocp  # noqa: E402

import nsp.storage as storage  # noqa: E402
from nsp.storage import checkpoint as ckpt  # noqa: E402

TARGET_RATIO = 10.0
STATES = ("param", "mu", "nu")


def raw_write(path: str, arrays: list[np.ndarray]) -> None:
    """Sequential write of the arrays' bytes into one new file, then fsync: the copy roofline."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for a in arrays:
            view = memoryview(a).cast("B")
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:done + (64 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)


def page_census(store, slot: int) -> dict[str, tuple[int, int]]:
    """(inode, link count) of every page file of ``slot`` in every shard."""
    out = {}
    for shard in store.shard_paths:
        for state in STATES:
            chunk_dir = os.path.join(shard, f"slot{slot}", state, "c")
            if not os.path.isdir(chunk_dir):
                continue
            for entry in os.scandir(chunk_dir):
                if entry.name.isdigit():
                    st = entry.stat()
                    out[entry.path] = (st.st_ino, st.st_nlink)
    return out


def cost_paid_later(store, work: str, n: int, repeats: int) -> dict:
    """Rounds of (snapshot, update, update) and of (update, update) with no snapshot, alternating, after one warm-up
    round of each; see the module docstring. Returns per-round times and page counts and their medians."""
    rng = np.random.default_rng(1)
    g = (rng.standard_normal(store.layout.padded_total, dtype=np.float32) * np.float32(1e-3))
    g[n:] = 0
    steps = iter(range(2, 10**9))

    def update() -> float:
        t = time.perf_counter()
        store.update(g, version=store.version, lr=1e-3, step=next(steps), params_out=False)
        return time.perf_counter() - t

    def cycle(snapshot: bool, dest: str) -> dict:
        out = {}
        if snapshot:
            t = time.perf_counter()
            ckpt.snapshot_store(store, dest)
            out["snapshot_s"] = time.perf_counter() - t
        slot = store.version % 2  # the slot a snapshot now links (or would)
        before = page_census(store, slot)
        out["pages"] = len(before)
        out["linked_pages"] = sum(nlink > 1 for _, nlink in before.values())
        out["update_other_slot_s"] = update()  # writes slot 1 - slot: nothing links it
        out["update_snapshot_slot_s"] = update()  # rewrites slot: in place, or replaced where linked
        after = page_census(store, slot)
        out["replaced_pages"] = sum(after.get(path, (None,))[0] != ino for path, (ino, _) in before.items())
        if snapshot:
            shutil.rmtree(dest)
        return out

    rounds: dict[str, list[dict]] = {"snapshot": [], "none": []}
    for rnd in range(1 + repeats):  # round 0 warms up
        order = ("snapshot", "none") if rnd % 2 == 0 else ("none", "snapshot")
        for kind in order:
            result = cycle(kind == "snapshot", os.path.join(work, f"later_{rnd}"))
            if rnd:
                rounds[kind].append(result)

    def med(kind: str, key: str) -> float:
        return median([r[key] for r in rounds[kind]])

    def pair_extra(key: str) -> float:
        return median([(a[key] if key else a["update_other_slot_s"] + a["update_snapshot_slot_s"])
                       - (b[key] if key else b["update_other_slot_s"] + b["update_snapshot_slot_s"])
                       for a, b in zip(rounds["snapshot"], rounds["none"])])

    return {
        "rounds": rounds,
        "snapshot_s": med("snapshot", "snapshot_s"),
        "update_other_slot_s": {k: med(k, "update_other_slot_s") for k in rounds},
        "update_snapshot_slot_s": {k: med(k, "update_snapshot_slot_s") for k in rounds},
        "extra_other_slot_s": pair_extra("update_other_slot_s"),
        "extra_snapshot_slot_s": pair_extra("update_snapshot_slot_s"),
        "extra_s": pair_extra(""),  # both updates: a whole cycle of the two slots
        "pages": rounds["none"][0]["pages"],
        "linked_pages": {k: max(r["linked_pages"] for r in rounds[k]) for k in rounds},
        "replaced_pages": {k: max(r["replaced_pages"] for r in rounds[k]) for k in rounds},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="128 MiB of state")
    parser.add_argument("--state-mib", type=float, default=None, help="bytes of p + m + v (default 1024, 128 --quick)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (>= 5)")
    parser.add_argument("--num-shards", type=int, default=2)
    parser.add_argument("--page-mib", type=float, default=4.0)
    parser.add_argument("--dir", default=None, help="where the store and checkpoints go (default: the temp dir)")
    parser.add_argument("--json", default=None, help="where to write the JSON record")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be >= 5 (the protocol takes a median of at least 5)")
    state_mib = args.state_mib or (128.0 if args.quick else 1024.0)
    n = int(state_mib * 2**20) // 12
    page_bytes = int(args.page_mib * 2**20) // 4096 * 4096

    work = tempfile.mkdtemp(prefix=".nsp_ckpt_bench_", dir=args.dir)
    closers = []
    try:
        t0 = time.perf_counter()
        store = storage.open(os.path.join(work, "store"), tier="file", num_shards=args.num_shards,
                             page_bytes=page_bytes)
        closers.append(store.close)
        rng = np.random.default_rng(0)
        store.initialize({"w": rng.standard_normal(n, dtype=np.float32)}, storage.OptimizerSpec("adam"))
        g = rng.standard_normal(store.layout.padded_total, dtype=np.float32)
        g[n:] = 0
        store.update(g, version=0, lr=1e-3, step=1)  # non-trivial m and v
        del g
        p, m, v = (jnp.asarray(store.read(s)[:n]) for s in ("param", "mu", "nu"))
        host = [np.asarray(x) for x in (p, m, v)]
        jax.block_until_ready((p, m, v))
        setup_s = time.perf_counter() - t0
        state_bytes = 3 * 4 * n
        print(f"state: {n:,} params x 3 fp32 = {state_bytes / 2**20:.0f} MiB; store: {args.num_shards} shards, "
              f"{store.layout.pages_per_shard} pages of {page_bytes >> 20} MiB each per state, in {work} "
              f"(setup {setup_s:.1f} s)")

        manager = ckpt.make_checkpoint_manager(os.path.join(work, "manager"), max_to_keep=2)
        closers.append(manager.close)
        ckptr = ocp.StandardCheckpointer()
        closers.append(ckptr.close)
        counter = iter(range(1, 10**6))
        last_snapshot = {}

        def nsp_snapshot(dest):
            last_snapshot.update(ckpt.snapshot_store(store, dest))

        def nsp_manager(dest):  # noqa: ARG001  (the manager owns its directory; keep-2 deletes the old steps)
            step = next(counter)
            ckpt.save_checkpoint(manager, step, store, {"step": jnp.asarray(step)}, {"step": step})

        def orbax_standard(dest):
            ckptr.save(dest, {"p": p, "m": m, "v": v})
            ckptr.wait_until_finished()

        def orbax_from_store(dest):
            arrays = {k: jnp.asarray(store.read(s)[:n]) for k, s in (("p", "param"), ("m", "mu"), ("v", "nu"))}
            ckptr.save(dest, arrays)
            ckptr.wait_until_finished()

        def raw(dest):
            raw_write(dest, host)

        contenders = {"nsp snapshot": nsp_snapshot, "nsp manager": nsp_manager, "orbax Standard": orbax_standard,
                      "orbax from store": orbax_from_store, "raw write+fsync": raw}
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for rnd in range(1 + args.repeats):  # round 0 is the warm-up
            for name, fn in contenders.items():
                dest = os.path.join(work, f"out_{rnd}_{name.replace(' ', '_').replace('+', '_')}")
                t = time.perf_counter()
                fn(dest)
                dt = time.perf_counter() - t
                if rnd:
                    times[name].append(dt)
                if os.path.isdir(dest):
                    shutil.rmtree(dest)
                elif os.path.exists(dest):
                    os.unlink(dest)

        # The manager keeps its last checkpoints' links to the live pages: drop them, so that the control updates
        # below find every page with one link.
        manager.close()
        closers.remove(manager.close)
        shutil.rmtree(os.path.join(work, "manager"))
        later = cost_paid_later(store, work, n, args.repeats)

        ref = median(times["nsp snapshot"])
        rows = []
        for name, ts_ in times.items():
            med = median(ts_)
            rows.append({"name": name, "median_s": med, "best_s": min(ts_), "gbps": state_bytes / med / 1e9,
                         "ratio": med / ref})
        print_table(f"checkpoint save, {state_bytes / 2**20:.0f} MiB of state, median of {args.repeats} "
                    "(ratio = time / nsp snapshot time)", rows,
                    [("name", "contender", ""), ("median_s", "median s", ".4f"), ("best_s", "best s", ".4f"),
                     ("gbps", "state GB/s", ".2f"), ("ratio", "x nsp", ".1f")])
        ratio = median(times["orbax Standard"]) / ref
        print(f"\nnsp snapshot vs orbax StandardCheckpointer: {ratio:.1f}x faster "
              f"(target >= {TARGET_RATIO:.0f}x: {'met' if ratio >= TARGET_RATIO else 'NOT met'}); "
              f"snapshot method: {last_snapshot.get('method')}, {last_snapshot.get('linked_files')} page files "
              f"linked, {last_snapshot.get('copied_bytes')} bytes copied")
        total = later["snapshot_s"] + later["extra_s"]
        orbax_s = median(times["orbax Standard"])
        orbax_store_s = median(times["orbax from store"])
        later_rows = [
            {"name": "snapshot", "snapshot": later["snapshot_s"], "none": None, "extra": None},
            {"name": "1st update (writes the other slot)", "snapshot": later["update_other_slot_s"]["snapshot"],
             "none": later["update_other_slot_s"]["none"], "extra": later["extra_other_slot_s"],
             "replaced": "-"},
            {"name": "2nd update (rewrites the snapshot's slot)",
             "snapshot": later["update_snapshot_slot_s"]["snapshot"], "none": later["update_snapshot_slot_s"]["none"],
             "extra": later["extra_snapshot_slot_s"],
             "replaced": f"{later['replaced_pages']['snapshot']} / {later['replaced_pages']['none']} of "
                         f"{later['pages']}"},
        ]
        print_table(f"\nthe cost paid later: the two updates after a snapshot vs two with none, median of "
                    f"{args.repeats} (extra: median of the per-round differences)", later_rows,
                    [("name", "", ""), ("snapshot", "after a snapshot s", ".4f"), ("none", "no snapshot s", ".4f"),
                     ("extra", "extra s", "+.4f"), ("replaced", "pages replaced (snapshot / none)", "")])
        print(f"snapshot + the extra its links cost the next updates: {later['snapshot_s']:.4f} + "
              f"{later['extra_s']:.4f} = {total:.4f} s; orbax Standard {orbax_s:.4f} s ({orbax_s / total:.1f}x), "
              f"orbax from store {orbax_store_s:.4f} s ({orbax_store_s / total:.1f}x)")
        later.update(total_s=total, ratio_orbax_standard=orbax_s / total, ratio_orbax_from_store=orbax_store_s / total,
                     rows=later_rows)
        raw_s = median(times["raw write+fsync"])
        path = write_json("checkpoint", {
            "state_bytes": state_bytes, "params": n, "num_shards": args.num_shards, "page_bytes": page_bytes,
            "repeats": args.repeats, "quick": args.quick,
            "times_s": times, "rows": rows, "ratio_orbax_standard": ratio, "target_ratio": TARGET_RATIO,
            "target_met": ratio >= TARGET_RATIO,
            "snapshot": {k: last_snapshot.get(k) for k in ("method", "linked_files", "linked_bytes", "copied_bytes",
                                                            "num_files", "total_bytes")},
            "cost_later": later,
        }, args.json, disk={**disk_info(work), "raw_write_fsync_gbps": state_bytes / raw_s / 1e9})
        print(f"wrote {path}")
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception:  # noqa: BLE001  (best effort on the way out)
                pass
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
