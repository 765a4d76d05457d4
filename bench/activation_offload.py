"""Activation offload (FlashNeuron) against keeping activations and against rematerialisation, on one GPT.

    python bench/activation_offload.py                   # both parts, the record in bench/results/
    python bench/activation_offload.py --quick           # a smaller model, fewer steps: a smoke run

Every contender trains the same OPT-style GPT (``GPTConfig(activation="relu")``, bf16 compute, ``f32_accum``)
with ``nsp.optim.adamw`` on a memory-tier store, in one jitted, donated step, each in a subprocess of its own:

  keep         the plain step: every block's residuals stay in memory until the backward pass
  remat        ``jax.checkpoint`` around every block: only the blocks' inputs are kept, the rest is recomputed
  offload      ``nsp.offload.offload_blocks``: the blocks' residuals go to a spill area on ``--dir`` and come back
               in the backward pass (lossless)
  offload-sparse  the same with FlashNeuron's bit-vector sparse format where it shrinks an array (lossless)
  offload-bf16    float32 residuals stored as bf16 (lossy)

Part 1, one shared size (``--batch`` x ``--seq`` tokens): each contender's step time (median of ``--steps``
steps after two warm-up steps), its tokens per second, its peak RSS, the bytes it spilled per step, and its
time per token against ``keep``.

Part 2, a cap of ``--cap-gib``: the largest batch (sequences of ``--seq`` tokens, doubling then bisecting) each
contender trains two steps of, and its tokens per second at that batch. ``--cap-kind cgroup`` (the default where
the benchmark can make a memory cgroup: root, a memory controller) runs each attempt in a cgroup limited to that
much memory, which counts what a machine with that much RAM would: the process's resident memory and the page
cache its spill files fill, the kernel writing dirty pages back and evicting clean ones before it kills the
process. ``--cap-kind address-space`` caps ``RLIMIT_AS`` instead, as ``bench/max_model.py`` does; it counts only
the process's own memory, so offload's files in the page cache are outside it. Targets (the issue's): offload >= 4x
the tokens per step of ``keep`` under the cap at <= 1.25x its time per token; offload faster per token than
``remat`` at the same batch.

Part 3, the planner (``nsp.offload.planner``, as ``nsp train --offload-activations BUDGET`` runs it) at the
shared size, for three budgets between part 1's peak with every block offloaded and its peak keeping them: the
blocks it offloads, and its predicted peak RSS and forward/backward time beside the measured ones (target:
within 15%).

The record goes to ``bench/results/activation_offload.json`` (or ``--json``), and a plot of part 2 (tokens per
step against peak RSS, a line per contender, a point per batch that trained) beside it as ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (memory_cgroup_reason, peak_rss_bytes, print_table, run_capped,  # noqa: E402
                    run_in_memory_cgroup, write_json)

CONTENDERS = ("keep", "remat", "offload", "offload-sparse", "offload-bf16")


def child(args) -> None:
    """One contender at one size: prints a JSON line with its step times, peak RSS and spill counters."""
    import functools

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import nsp.offload
    import nsp.optim
    import nsp.storage
    from nsp.models import GPT, cross_entropy_loss
    from nsp.models.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.width // 64,
                    n_embd=args.width, dtype=jnp.bfloat16, f32_accum=True, activation="relu")
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    store = nsp.storage.open(None, tier="memory")
    tx = nsp.optim.adamw(1e-4, store=store)
    state = tx.init(params)
    area, planned = None, None
    if args.child == "planner":
        # FlashNeuron's planner (nsp.offload.planner) on this step's first batch, for a peak of --budget-gib.
        import nsp.rss
        from nsp.offload import planner

        area = nsp.offload.SpillArea(args.spill_dir, read_ahead=args.read_ahead, write_behind=args.write_behind,
                                      image_limit_bytes=args.image_limit_mib * 2**20)
        first = jax.random.randint(jax.random.fold_in(jax.random.key(0), 0), (args.batch, args.seq + 1), 0, 256,
                                   jnp.int32)
        model = nnx.merge(graphdef, params)

        def loss_of(p, tokens, block_call):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1], block_call=block_call)
            return cross_entropy_loss(logits, tokens[:, 1:])

        profile = planner.profile_blocks(model, loss_of, params, first, args.spill_dir, log=lambda m: None)
        plan = planner.plan_offload(profile, int(args.budget_gib * 2**30))
        del model
        nsp.rss.release_free_memory()  # as nsp train does after planning
        nsp.rss.reset_peak()  # the steps' peak from here (the profiling's is in the plan)
        planned = {"profiling_peak_rss": profile.profiling_peak_bytes, "layers": list(plan.layers),
                   "sparse": plan.sparse, "fits": plan.fits, "notes": list(plan.notes),
                   "predicted_peak_rss": plan.predicted_peak_bytes, "predicted_fwd_bwd_s": plan.predicted_fwd_bwd_s}
        block_call = (nsp.offload.offload_blocks(area, sparse=plan.sparse, layers=plan.layers, num_layers=args.layers)
                      if plan.layers else None)
    elif args.child.startswith("offload"):
        area = nsp.offload.SpillArea(args.spill_dir, read_ahead=args.read_ahead, write_behind=args.write_behind,
                                      image_limit_bytes=args.image_limit_mib * 2**20)
        block_call = nsp.offload.offload_blocks(area, sparse=args.child == "offload-sparse",
                                                compress=jnp.bfloat16 if args.child == "offload-bf16" else None)
    elif args.child == "remat":
        def block_call(block, x):
            block_graph, block_state = nnx.split(block)
            return jax.checkpoint(lambda s, x: nnx.merge(block_graph, s)(x, deterministic=True))(block_state, x)
    else:
        block_call = None

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, tokens):
        def loss(params):
            logits = nnx.merge(graphdef, params)(tokens[:, :-1], block_call=block_call)
            return cross_entropy_loss(logits, tokens[:, 1:])

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    key = jax.random.key(0)
    times, losses = [], []
    for i in range(args.steps + 2):
        tokens = jax.random.randint(jax.random.fold_in(key, i), (args.batch, args.seq + 1), 0, 256, jnp.int32)
        t0 = time.perf_counter()
        params, state, value = step(params, state, tokens)
        losses.append(float(value))
        times.append(time.perf_counter() - t0)
    fwd_bwd = []
    peak = peak_rss_bytes()
    if planned is not None:
        peak = nsp.rss.peak_bytes()  # the steps' (reset after planning), before the timing below compiles more
        # The planner predicts the forward/backward alone: timed apart, on the trained params, after the steps.
        grad = jax.jit(jax.value_and_grad(lambda p, tokens: cross_entropy_loss(
            nnx.merge(graphdef, p)(tokens[:, :-1], block_call=block_call), tokens[:, 1:])))
        jax.block_until_ready(grad(params, tokens))
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(grad(params, tokens))
            fwd_bwd.append(time.perf_counter() - t0)
    stats = area.stats() if area is not None else {}
    if area is not None:
        area.close()
    store.close()
    print(json.dumps({"times": times[2:], "losses": losses, "peak_rss": peak, "spill": stats,
                      "steps_run": len(times), "plan": planned, "fwd_bwd_times": fwd_bwd}))


def attempt(contender: str, batch: int, args, *, steps: int, cap: int | None, budget_gib: float = 0.0) -> dict | None:
    """Runs one contender at one batch in a subprocess (under ``cap`` bytes of address space, if given)."""
    spill = Path(tempfile.mkdtemp(prefix="nsp-actoff-", dir=args.dir))
    cmd = [sys.executable, __file__, "--child", contender, "--batch", str(batch), "--seq", str(args.seq),
           "--layers", str(args.layers), "--width", str(args.width), "--steps", str(steps),
           "--spill-dir", str(spill), "--budget-gib", str(budget_gib), "--read-ahead", str(args.read_ahead),
           "--write-behind", str(args.write_behind),
           "--image-limit-mib", str(args.image_limit_mib)]

    env = dict(os.environ, MALLOC_ARENA_MAX="2", MALLOC_MMAP_THRESHOLD_="131072")
    charged = None
    try:
        if cap and args.cap_kind == "cgroup":
            proc, charged, _ = run_in_memory_cgroup(cmd, cap, env, args.timeout)
        else:
            proc = run_capped(cmd, cap, env, args.timeout)
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    if proc is None or proc.returncode != 0:
        if proc is not None and args.verbose:
            print("    " + "\n    ".join(proc.stderr.strip().splitlines()[-3:]))
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return None
    result = json.loads(lines[-1])
    result["charged_peak"] = charged  # the cgroup's peak: RSS and the page cache the spill files filled
    return result


def shared_size(args) -> list[dict]:
    rows = []
    for contender in CONTENDERS:
        result = attempt(contender, args.batch, args, steps=args.steps, cap=None)
        if result is None:
            rows.append({"contender": contender, "status": "failed"})
            print(f"  {contender:15s} failed", flush=True)
            continue
        step_s = statistics.median(result["times"])
        spill = result["spill"]
        rows.append({"contender": contender, "status": "ok", "step_s": step_s, "step_times": result["times"],
                     "tokens_per_s": args.batch * args.seq / step_s, "peak_rss_gib": result["peak_rss"] / 2**30,
                     "spilled_mb_per_step": spill.get("bytes_written", 0) / result["steps_run"] / 1e6,
                     "residual_mb_per_step": spill.get("array_bytes", 0) / result["steps_run"] / 1e6,
                     "losses": result["losses"]})
        print(f"  {contender:15s} step {step_s:.3f} s, peak RSS {result['peak_rss'] / 2**30:.2f} GiB", flush=True)
    keep = next((r for r in rows if r["contender"] == "keep" and r["status"] == "ok"), None)
    for r in rows:
        if keep and r["status"] == "ok":
            r["time_vs_keep"] = r["step_s"] / keep["step_s"]
            r["rss_vs_keep"] = r["peak_rss_gib"] / keep["peak_rss_gib"]
    return rows


def planner_accuracy(args, shared: list[dict]) -> list[dict]:
    """Part 3: the planner at the shared size, for budgets between the peak with every block offloaded and the
    peak keeping them all: what it picked, and its predicted peak RSS and forward/backward time beside the
    measured ones (the steps' peak, restarted after the profiling, whose own peak is recorded beside; the
    forward/backward timed apart after the steps, median of 3)."""
    peaks = {r["contender"]: r["peak_rss_gib"] for r in shared if r["status"] == "ok"}
    if "keep" not in peaks or "offload" not in peaks:
        return []
    rows = []
    for fraction in (0.25, 0.5, 0.75):
        budget = peaks["offload"] + fraction * (peaks["keep"] - peaks["offload"])
        result = attempt("planner", args.batch, args, steps=args.steps, cap=None, budget_gib=budget)
        row = {"budget_gib": budget, "status": "ok" if result else "failed"}
        if result:
            plan = result["plan"]
            fwd_bwd = statistics.median(result["fwd_bwd_times"])
            row.update(blocks=len(plan["layers"]), layers=plan["layers"], sparse=plan["sparse"], fits=plan["fits"],
                       notes=plan["notes"], predicted_peak_gib=plan["predicted_peak_rss"] / 2**30,
                       measured_peak_gib=result["peak_rss"] / 2**30,
                       profiling_peak_gib=plan["profiling_peak_rss"] / 2**30,
                       predicted_fwd_bwd_s=plan["predicted_fwd_bwd_s"], measured_fwd_bwd_s=fwd_bwd,
                       fwd_bwd_times=result["fwd_bwd_times"], step_s=statistics.median(result["times"]))
            row["peak_ratio"] = row["predicted_peak_gib"] / row["measured_peak_gib"]
            row["time_ratio"] = row["predicted_fwd_bwd_s"] / fwd_bwd
            row["within_15pct"] = abs(row["peak_ratio"] - 1) <= 0.15 and abs(row["time_ratio"] - 1) <= 0.15
        print(f"  planner, budget {budget:.2f} GiB: " + (
            f"{row['blocks']} blocks, peak {row['predicted_peak_gib']:.2f} predicted / {row['measured_peak_gib']:.2f}"
            f" measured GiB, forward/backward {row['predicted_fwd_bwd_s']:.2f} / {fwd_bwd:.2f} s"
            if result else "failed"), flush=True)
        rows.append(row)
    return rows


def largest_batch(contender: str, args) -> tuple[int, dict | None, list[dict]]:
    """Doubles the batch from 1 until a step fails under the cap, then bisects. Also returns every batch that
    trained, with its peak RSS (the points of the plot)."""
    cap = int(args.cap_gib * 2**30)
    lo, best, hi = 0, None, None
    batch = 1
    points = []

    def run(b):
        result = attempt(contender, b, args, steps=1, cap=cap)
        print(f"  {contender:15s} batch {b:4d}: {'ok' if result else 'failed'}", flush=True)
        if result:
            points.append({"batch": b, "tokens_per_step": b * args.seq, "peak_rss_gib": result["peak_rss"] / 2**30,
                           "charged_peak_gib": (result["charged_peak"] or 0) / 2**30,
                           "step_s": statistics.median(result["times"])})
        return result

    while hi is None and batch <= args.max_batch:
        result = run(batch)
        if result:
            lo, best, batch = batch, result, batch * 2
        else:
            hi = batch
    hi = hi or lo + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        result = run(mid)
        if result:
            lo, best = mid, result
        else:
            hi = mid
    return lo, best, sorted(points, key=lambda p: p["batch"])


def plot(rows: list[dict], cap_gib: float, path: Path, cap_kind: str) -> Path | None:
    """Tokens per step against peak memory, one line per contender (every batch that trained under the cap):
    the process's peak RSS, and under a cgroup cap what the cgroup was charged at most (RSS and page cache)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no matplotlib: no plot)")
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in rows:
        pts = r.get("points") or []
        if pts:
            key = "charged_peak_gib" if cap_kind == "cgroup" else "peak_rss_gib"
            ax.plot([p[key] for p in pts], [p["tokens_per_step"] for p in pts], marker="o",
                    label=f"{r['contender']} (max {r['tokens_per_step']})")
    ax.axvline(cap_gib, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("peak memory charged: RSS + page cache (GiB)" if cap_kind == "cgroup" else "peak RSS (GiB)")
    ax.set_ylabel("tokens per step")
    ax.set_title(f"Largest batch under a {cap_gib:g} GiB "
                 + ("memory cgroup" if cap_kind == "cgroup" else "address-space cap"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def capped(args) -> list[dict]:
    rows = []
    for contender in CONTENDERS:
        batch, result, points = largest_batch(contender, args)
        row = {"contender": contender, "batch": batch, "tokens_per_step": batch * args.seq, "points": points}
        if result:
            step_s = statistics.median(result["times"])
            row.update(step_s=step_s, tokens_per_s=batch * args.seq / step_s,
                       peak_rss_gib=result["peak_rss"] / 2**30,
                       charged_peak_gib=(result["charged_peak"] or 0) / 2**30)
        rows.append(row)
    keep = next((r for r in rows if r["contender"] == "keep"), None)
    for r in rows:
        if keep and keep["batch"] and r.get("step_s"):
            r["tokens_vs_keep"] = r["batch"] / keep["batch"]
            r["time_per_token_vs_keep"] = (r["step_s"] / r["tokens_per_step"]) / (
                keep["step_s"] / keep["tokens_per_step"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="part 1: sequences per step")
    parser.add_argument("--steps", type=int, default=5, help="part 1: timed steps (after two warm-up steps)")
    parser.add_argument("--cap-gib", type=float, default=2.0, help="part 2: address-space cap (0: skip part 2)")
    parser.add_argument("--max-batch", type=int, default=512, help="part 2: the largest batch tried")
    parser.add_argument("--cap-kind", choices=["cgroup", "address-space"], default=None,
                        help="part 2's cap: a memory cgroup (counts RSS and page cache, as a machine with that much "
                        "RAM; default where one can be made) or RLIMIT_AS (the process's address space)")
    parser.add_argument("--dir", default=None, help="where the spill areas go (default: a temp dir here)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--read-ahead", type=int, default=1, help="the spill areas' read_ahead (entries)")
    parser.add_argument("--write-behind", type=int, default=1, help="the spill areas' write_behind (entries)")
    parser.add_argument("--image-limit-mib", type=int, default=256,
                        help="the spill areas' image_limit_bytes, in MiB (larger entries go through the page cache)")
    parser.add_argument("--quick", action="store_true", help="4 layers of width 256, batch 8, 3 steps, no cap part")
    parser.add_argument("--skip-planner", action="store_true", help="leave out part 3")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=CONTENDERS + ("planner",), help=argparse.SUPPRESS)
    parser.add_argument("--spill-dir", help=argparse.SUPPRESS)
    parser.add_argument("--budget-gib", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.layers, args.width, args.batch, args.steps, args.cap_gib = 4, 256, 8, 3, 0.0
    why_not = memory_cgroup_reason()
    if args.cap_kind is None:
        args.cap_kind = "cgroup" if why_not is None else "address-space"
    elif args.cap_kind == "cgroup" and why_not:
        parser.error(f"--cap-kind cgroup: {why_not}")
    base = Path(args.dir or os.getcwd())
    base.mkdir(parents=True, exist_ok=True)
    args.dir = tempfile.mkdtemp(prefix="nsp-actoff-", dir=base)
    try:
        print(f"activation offload: GPT {args.layers} x {args.width} (ReLU, bf16 compute), nsp adamw on the memory "
              f"tier; part 1 at batch {args.batch} x {args.seq} tokens", flush=True)
        shared = shared_size(args)
        print_table(f"one shared size: batch {args.batch} x {args.seq} tokens", shared,
                    [("contender", "contender", ""), ("step_s", "step (s)", ".3f"),
                     ("time_vs_keep", "vs keep", ".2f"), ("tokens_per_s", "tokens/s", ".0f"),
                     ("peak_rss_gib", "peak RSS (GiB)", ".2f"), ("rss_vs_keep", "RSS vs keep", ".2f"),
                     ("residual_mb_per_step", "residuals (MB)", ".1f"),
                     ("spilled_mb_per_step", "spilled (MB)", ".1f")])
        planned = []
        if not args.skip_planner:
            print("part 3: the planner's predictions at budgets between offloading every block and none", flush=True)
            planned = planner_accuracy(args, shared)
        print_table(f"the planner at batch {args.batch} x {args.seq}", planned,
                    [("budget_gib", "budget (GiB)", ".2f"), ("blocks", "blocks", "d"),
                     ("predicted_peak_gib", "peak pred.", ".2f"), ("measured_peak_gib", "peak meas.", ".2f"),
                     ("peak_ratio", "ratio", ".2f"), ("profiling_peak_gib", "profiling peak", ".2f"),
                     ("predicted_fwd_bwd_s", "fwd/bwd pred. (s)", ".2f"),
                     ("measured_fwd_bwd_s", "fwd/bwd meas. (s)", ".2f"), ("time_ratio", "ratio", ".2f")])
        cap_rows = []
        if args.cap_gib > 0:
            print(f"part 2: the largest batch under {args.cap_gib:g} GiB "
                  + ("in a memory cgroup (RSS and page cache)" if args.cap_kind == "cgroup" else "of address space"),
                  flush=True)
            cap_rows = capped(args)
            print_table(f"largest batch under {args.cap_gib:g} GiB", cap_rows,
                        [("contender", "contender", ""), ("batch", "batch", "d"),
                         ("tokens_per_step", "tokens/step", "d"), ("tokens_vs_keep", "vs keep", ".2f"),
                         ("tokens_per_s", "tokens/s", ".0f"),
                         ("time_per_token_vs_keep", "time/token vs keep", ".2f"),
                         ("peak_rss_gib", "peak RSS (GiB)", ".2f"),
                         ("charged_peak_gib", "charged (GiB)", ".2f")])
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    out = write_json("activation_offload", {"layers": args.layers, "width": args.width, "seq": args.seq,
                                            "batch": args.batch, "steps": args.steps, "cap_gib": args.cap_gib,
                                            "cap_kind": args.cap_kind,
                                            "quick": args.quick, "shared": shared, "planner": planned,
                                            "capped": cap_rows}, args.json)
    if cap_rows:
        png = plot(cap_rows, args.cap_gib, Path(out).with_suffix(".png"), args.cap_kind)
        if png:
            print(f"plot: {png}")


if __name__ == "__main__":
    main()
