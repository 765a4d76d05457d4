"""Train-step time: optax.adamw in RAM vs nsp (memory tier, file tier, file tier + Top-K 1%), same run.

    python bench/train_step.py                     # tiny, small (batch 2 and 8) and gpt2-124m, median of 5
    python bench/train_step.py --quick             # tiny and small only
    python bench/train_step.py --quick --engine-cpus 1   # the update on a CPU of its own (see below)

Each contender runs ``nsp train``'s jitted step (``nsp.train.trainer.make_train_step``: forward/backward of a Flax
GPT, then the contender's optax chain of clipping and the optimizer) on the same batch; each timed call runs 8
consecutive steps and waits for every update to commit, calls are interleaved across contenders, median of >= 5
after a warm-up, reported per step. Next to each nsp row: the bytes its store moved over the shared link per step
(gradients in, params out) and the Smart-Infinity Table I prediction (M = 2 bytes x params: SmartUpdate moves 2M in
and 2M out with fp32 transport; SmartComp moves the kept fraction c of 2M in, plus 4-byte indices). The staleness-1
row overlaps step t+1's forward/backward with step t's update (params one step old); the share of the update time it
hides is printed under the table, in steady state (each call's time less its final wait for the last update, the
drain) and counting the drain; "wait ms" is the time a staleness-1 step held its caller (store.stats()["wait_ns"]:
the previous update's tail, the copies).

By default every contender's forward/backward and nsp's update share all of this machine's cores, so a staleness-1
update running beside the next forward/backward takes CPU from it. On a GPU host they would not compete: the
forward/backward runs on the accelerator and the update on the host's cores. ``--engine-cpus N`` stands in for
that split: it reserves the last N CPUs for the update work (NSP_ENGINE_CPUS) and runs the forward/backward
(XLA) on the others, re-executing itself pinned so (JSON: ``train_step_split``). The forward/backward then runs
on fewer cores, so its step times are not those of the default run; the two runs answer different questions.
optax pinned so runs on fewer cores than nsp, whose update has the reserved ones as well; so the split run also
times optax on all the CPUs the nsp contenders use together (forward/backward CPUs + update CPUs), in a process of
its own started with that affinity (XLA sizes its thread pool by the CPUs a process may use, when it starts), driven
round by round through a pipe so that it stays interleaved with the others; its row is "optax.adamw (RAM), all N
CPUs" and the "x optax all CPUs" column compares every contender with it, beside the pinned optax's "x optax".
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import disk_info, median, print_table, time_interleaved, write_json  # noqa: E402

import nsp.optim  # noqa: E402
import nsp.primitives  # noqa: E402
import nsp.storage  # noqa: E402
from nsp.models import GPT, get_config  # noqa: E402
from nsp.train.trainer import make_train_step  # noqa: E402


STEPS_PER_CALL = 8  # the last update of a call cannot overlap anything: 1/8 of them

# (record key, model, batch, tokens per sequence). The small model runs twice: at batch 2 its forward/backward
# is about twice its update, where the share of the update staleness 1 hides is measured with the least noise
# (at batch 8 the update is ~10% of a step, and a 2% wobble of the step moves that share by 20 points).
WORKLOADS = [("tiny", "tiny", 8, 64), ("small (batch 2)", "small", 2, 128), ("small", "small", 8, 128)]
FULL_WORKLOADS = [("gpt2-124m", "gpt2-124m", 1, 128)]
SPLIT_FLAG = "NSP_BENCH_SPLIT_CPUS"  # set on the re-executed, pinned run
ALL_CPUS_VAR = "NSP_BENCH_ALL_CPUS"  # the CPUs the split run uses in all (compute + engine), for optax's own run
OPTAX = "optax.adamw (RAM)"


def split_cpus(n_engine: int) -> tuple[list[int], list[int]]:
    """(CPUs for the forward/backward, CPUs for the update): the last ``n_engine`` of this process's CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 1 <= n_engine < len(cpus):
        raise SystemExit(f"--engine-cpus {n_engine}: this process may run on {len(cpus)} CPUs ({cpus}); reserve "
                         f"at least 1 for the update and leave at least 1 for the forward/backward")
    return cpus[:-n_engine], cpus[-n_engine:]


def reexec_split(n_engine: int) -> None:
    """Re-executes this benchmark with the forward/backward pinned to the first CPUs and NSP_ENGINE_CPUS naming
    the rest (both must be in place before JAX and nsp start their threads)."""
    compute, engine = split_cpus(n_engine)
    env = dict(os.environ, NSP_ENGINE_CPUS=",".join(map(str, engine)),
               **{SPLIT_FLAG: "1", ALL_CPUS_VAR: ",".join(map(str, compute + engine))})
    os.sched_setaffinity(0, compute)  # inherited across exec by every thread the new process starts
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def workload(model_name: str, batch: int, seq: int):
    """(graphdef, params, tokens, param count): the same model and batch in every process."""
    cfg = get_config(model_name, vocab_size=256, block_size=max(seq, 64))
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, size=(batch, seq + 1)), jnp.int32)
    return graphdef, params, tokens, n_params


def steps_of(graphdef, params, tokens, tx: optax.GradientTransformation):
    """A call that runs ``STEPS_PER_CALL`` consecutive steps of ``nsp train``'s jitted step (forward/backward, then
    ``tx``) on a copy of ``params`` and waits for the last one."""
    step, _ = make_train_step(graphdef, tx)
    box = {"p": jax.tree_util.tree_map(jnp.copy, params)}
    box["s"] = tx.init(box["p"])

    def run():
        for _ in range(STEPS_PER_CALL):
            box["p"], box["s"], loss = step(box["p"], box["s"], tokens)
        jax.block_until_ready((box["p"], loss))

    return run


def optax_tx() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))


def contenders_for(model_name: str, batch: int, seq: int, workdir: str):
    graphdef, params, tokens, n_params = workload(model_name, batch, seq)

    def make(tx, store=None):
        steps = steps_of(graphdef, params, tokens, tx)
        drains: list[float] = []

        def run():
            # A few consecutive steps per timed call, and then every update committed (a background update of
            # staleness 1 included): each contender pays all of its own work inside its own timing, so
            # interleaving cannot hide one contender's update behind another's steps. The wait for that last
            # update (the drain) is timed too, to tell steady-state steps from the end of a run.
            steps()
            if store is not None:
                t0 = time.perf_counter()
                store.barrier()
                drains.append(time.perf_counter() - t0)

        run.drains = drains
        return run

    stores = {
        "nsp memory tier": nsp.storage.open(tier="memory"),
        "nsp file tier": nsp.storage.open(os.path.join(workdir, f"{model_name}-file"), tier="file"),
        "nsp file tier + Top-K 1%": nsp.storage.open(os.path.join(workdir, f"{model_name}-topk"), tier="file"),
        "nsp file tier, staleness 1": nsp.storage.open(os.path.join(workdir, f"{model_name}-stale"), tier="file"),
    }
    clip = optax.clip_by_global_norm(1.0)
    runs = {OPTAX: make(optax_tx())}
    for name, store in stores.items():
        compression = nsp.optim.TopK(0.01) if "Top-K" in name else None
        staleness = 1 if "staleness" in name else 0
        runs[name] = make(optax.chain(clip, nsp.optim.adamw(1e-3, weight_decay=0.01, store=store,
                                                            compression=compression, staleness=staleness)),
                          store)
    return runs, stores, n_params


class OptaxElsewhere:
    """The optax contender in a process of its own on ``cpus`` (``--optax-worker``): each call runs one timed call
    there (``STEPS_PER_CALL`` steps, waited for) and keeps the time the worker measured around it."""

    def __init__(self, model_name: str, batch: int, seq: int, cpus: list[int]):
        env = {k: v for k, v in os.environ.items() if k not in ("NSP_ENGINE_CPUS", SPLIT_FLAG, ALL_CPUS_VAR)}
        # A new process inherits the affinity of the thread that starts it: widen this thread's for the start only
        # (JAX's and nsp's threads keep theirs; no Python runs between fork and exec).
        own = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--optax-worker",
                 f"{model_name},{batch},{seq}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        finally:
            os.sched_setaffinity(0, own)
        ready = self.proc.stdout.readline().split()
        if ready[:1] != ["ready"]:
            raise RuntimeError(f"the optax worker did not start (it said {ready!r})")
        self.cpus = [int(c) for c in ready[1].split(",")]
        self.times: list[float] = []

    def __call__(self) -> None:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the optax worker ended (exit code {self.proc.wait()})")
        self.times.append(float(reply))

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        finally:
            self.proc.wait(timeout=60)


def optax_worker(spec: str) -> None:
    """``--optax-worker MODEL,BATCH,SEQ``: the optax contender's timed calls, one per "run" line on stdin, each
    answered with its seconds on a line; ends at end of input."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr, not into the replies
    model_name, batch, seq = spec.split(",")
    graphdef, params, tokens, _ = workload(model_name, int(batch), int(seq))
    steps = steps_of(graphdef, params, tokens, optax_tx())
    proto.write(f"ready {','.join(map(str, sorted(os.sched_getaffinity(0))))}\n")
    proto.flush()
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        steps()
        proto.write(f"{time.perf_counter() - t0!r}\n")
        proto.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny and small models only")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the file-tier stores go (default: a temp dir here)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--engine-cpus", type=int, default=0, metavar="N",
                        help="run the update on the last N CPUs and the forward/backward on the others, as on a "
                             "host beside an accelerator (default 0: all share every core); optax also runs on "
                             "all of them, in a process of its own")
    parser.add_argument("--optax-worker", default=None, help=argparse.SUPPRESS)  # MODEL,BATCH,SEQ (internal)
    args = parser.parse_args()
    if args.optax_worker:
        optax_worker(args.optax_worker)
        return
    if args.repeats < 5:
        parser.error("--repeats must be >= 5")
    if args.engine_cpus and os.environ.get(SPLIT_FLAG) != "1":
        reexec_split(args.engine_cpus)  # does not return
    record = {"models": {}, "engine_cpus": nsp.primitives.engine_cpus(),
              "compute_cpus": sorted(os.sched_getaffinity(0))}
    all_cpus = [int(c) for c in os.environ[ALL_CPUS_VAR].split(",")] if args.engine_cpus else None
    optax_all = f"{OPTAX}, all {len(all_cpus)} CPUs" if all_cpus else None
    if args.engine_cpus:
        print(f"forward/backward on CPUs {record['compute_cpus']}, the update on CPUs {record['engine_cpus']} "
              f"(NSP_ENGINE_CPUS); {optax_all}: optax in a process of its own on CPUs {all_cpus}")
        record["optax_all_cpus"] = all_cpus
    workloads = WORKLOADS + ([] if args.quick else FULL_WORKLOADS)
    workdir = tempfile.mkdtemp(prefix="nsp-bench-", dir=args.dir or os.getcwd())
    try:
        for key, model_name, batch, seq in workloads:
            runs, stores, n = contenders_for(model_name, batch, seq, tempfile.mkdtemp(dir=workdir))
            elsewhere = None
            if all_cpus:
                elsewhere = OptaxElsewhere(model_name, batch, seq, all_cpus)
                runs = {OPTAX: runs[OPTAX], optax_all: elsewhere,
                        **{k: v for k, v in runs.items() if k != OPTAX}}
            for store in stores.values():
                store.reset_stats()
            try:
                times = time_interleaved(runs, repeats=args.repeats, warmup=2)
            finally:
                if elsewhere is not None:
                    elsewhere.close()
            if elsewhere is not None:  # the worker's own clock, as for the others (no pipe round trip)
                times[optax_all] = elsewhere.times[-args.repeats:]
            med = {k: median(v) / STEPS_PER_CALL for k, v in times.items()}  # per step
            # Per step without the call's final drain (the timed rounds' drains only; the warm-up's come first).
            steady = {k: median([t - d for t, d in zip(v, runs[k].drains[-len(v):])]) / STEPS_PER_CALL
                      for k, v in times.items() if getattr(runs[k], "drains", None)}
            ref = med[OPTAX]
            M = 2 * n
            rows = []
            for name, t in med.items():
                row = {"contender": name, "ms": t * 1e3, "ratio": t / ref}
                if optax_all:
                    row["ratio_all"] = t / med[optax_all]
                store = stores.get(name)
                if store is not None:
                    s = store.stats()
                    steps = s["updates"]
                    row["update_ms"] = s["update_ns"] / steps / 1e6 if steps else None
                    row["wait_ms"] = s["wait_ns"] / steps / 1e6 if steps else None
                    row["in"] = s["shared_in_bytes"] / steps
                    row["out"] = s["shared_out_bytes"] / steps
                    padded = store.layout.padded_total
                    if "Top-K" in name:
                        k = nsp.primitives.kept_count(padded // store.num_shards, ratio=0.01) * store.num_shards
                        row["table1_in"] = k * 4 + k * 4  # c x 2M of values + 4-byte indices
                    else:
                        row["table1_in"] = 2 * M * padded / n
                    row["table1_out"] = 2 * M * padded / n
                rows.append(row)
            print_table(
                f"{key}: {n / 1e6:.2f}M params, batch {batch} x {seq} tokens, median of {args.repeats}",
                rows,
                [("contender", "contender", ""), ("ms", "step ms", ".1f"), ("ratio", "x optax", ".2f")]
                + ([("ratio_all", "x optax all CPUs", ".2f")] if optax_all else []) + [
                 ("update_ms", "update ms", ".1f"), ("wait_ms", "wait ms", ".1f"), ("in", "link in B/step", ".0f"),
                 ("table1_in", "Table I in", ".0f"), ("out", "link out B/step", ".0f"),
                 ("table1_out", "Table I out", ".0f")],
            )
            memory_ratio = med["nsp memory tier"] / ref
            print(f"  nsp memory tier: {memory_ratio:.2f}x optax step time (target <= 1.10x) "
                  f"{'ok' if memory_ratio <= 1.10 else 'MISSED'}")
            if optax_all:
                print(f"  at equal cores (optax on all {len(all_cpus)} CPUs, {med[optax_all] * 1e3:.1f} ms/step): "
                      + ", ".join(f"{k.removeprefix('nsp ')} {med[k] / med[optax_all]:.2f}x" for k in med
                                  if k.startswith("nsp")))
            update_s = next(r["update_ms"] for r in rows if r["contender"] == "nsp file tier") / 1e3
            fwd_bwd_s = max(med["nsp file tier"] - update_s, 0.0)
            hidden = (med["nsp file tier"] - med["nsp file tier, staleness 1"]) / update_s
            # Steady state: between drains, as in a long run (a drain comes only at a checkpoint or the end).
            hidden_steady = (med["nsp file tier"] - steady["nsp file tier, staleness 1"]) / update_s
            regime = fwd_bwd_s > update_s
            print(f"  staleness 1 hides {hidden_steady:.0%} of the file tier's update in steady state "
                  f"({steady['nsp file tier, staleness 1'] * 1e3:.1f} ms/step between drains; target >= 80% when "
                  f"forward/backward is longer than the update: "
                  f"{('ok' if hidden_steady >= 0.8 else 'MISSED') if regime else 'not that regime'}), "
                  f"{hidden:.0%} counting the drain that ends each {STEPS_PER_CALL}-step call "
                  f"(update {update_s * 1e3:.0f} ms; forward/backward ~{fwd_bwd_s * 1e3:.0f} ms)")
            # Where the rest goes: the time a staleness-1 step held its caller for the update (its wait) against
            # the slowdown of the forward/backward running beside the update on the same cores.
            stale_wait_s = next(r["wait_ms"] for r in rows if r["contender"] == "nsp file tier, staleness 1") / 1e3
            shared = ("its CPU's memory and caches with the update" if args.engine_cpus else
                      "the CPU with the update")
            print(f"  staleness 1 held its caller {stale_wait_s * 1e3:.1f} ms/step (the update's tail and the copies: "
                  f"{1 - stale_wait_s / update_s:.0%} of the update ran beside the next step); the rest of the "
                  f"difference is the forward/backward slowed by sharing {shared}")
            record["models"][key] = {"params": n, "batch": batch, "seq": seq, "median_s": med, "times_s": times,
                                     "rows": rows, "staleness_wait_s": stale_wait_s}
            for store in stores.values():
                store.close()
            record["models"][key]["staleness_hidden_fraction"] = hidden
            record["models"][key]["staleness_hidden_fraction_steady"] = hidden_steady
            record["models"][key]["steady_s"] = steady
        path = write_json("train_step_split" if args.engine_cpus else "train_step", record, args.json,
                          disk=disk_info(workdir))
        print(f"\nwrote {path}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
