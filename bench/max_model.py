"""The largest GPT that trains a step under a fixed memory cap: optax.adamw in RAM vs nsp on the file tier.

    python bench/max_model.py                 # cap 3 GiB of address space, GPTs 1024 wide, 1 to 96 layers
    python bench/max_model.py --cap-gib 4 --width 768
    python bench/max_model.py --no-f32-accum --mmap-threshold 0   # the model's and glibc's defaults

Each attempt is a subprocess under ``RLIMIT_AS`` (``prlimit --as``: the cap counts all the process's address
space, JAX and XLA included) that builds a GPT of ``--width`` and ``n_layer`` layers, sets up its optimizer, and
runs two jitted training steps. It either finishes or dies of the cap; a binary search over ``n_layer`` finds each
contender's largest model.

  optax      the standard in-RAM setup: fp32 params, fp32 gradients, ``optax.adamw`` moments in host memory
             (about 16 bytes per parameter, plus the step's temporaries).
  nsp-file   ``nsp.optim.adamw(store=<file tier>, stage_gradients=True)``: fp32 master params and moments on
             disk; the accelerator side keeps bf16 params, each gradient leaf goes to the store's disk as the
             backward pass produces it, and the new params come back a leaf at a time
             (``store_update_staged``): a little over 2 bytes per parameter in memory
             (``--no-stage-gradients``: the gradient leaves stay until the update writes the new params over
             them, ``store_update_leaves``: about 4 bytes per parameter). Set up with
             ``nsp.optim.init_from`` from the GPT's per-part init functions (``LayerwiseInit``): the model is
             never whole in fp32.

Both compute in bf16 on the same batch (1 x ``--seq`` tokens), and both get the same model and process settings:

  --f32-accum        (default on; ``--no-f32-accum`` for the model's default) ``GPTConfig(f32_accum=True)``: the
                     Linear matmuls are bf16 x bf16 -> fp32 dots with a written-out backward pass. Without it
                     XLA:CPU (no bf16 -> bf16 dot) converts every bf16 weight to an fp32 copy and keeps the copies
                     alive through the backward pass: the step's temporaries drop from ~4.5 to ~2.0 bytes per
                     parameter for bf16 params (nsp), from ~4.5 to ~2.5 for fp32 params (optax).
  --mmap-threshold   (default 131072) ``MALLOC_MMAP_THRESHOLD_`` for the attempts (as is ``MALLOC_ARENA_MAX=2``):
                     blocks from that size up are mmapped and unmapped when freed. glibc's default raises the
                     threshold to the size of the blocks freed (up to 32 MiB), so freed parameter-sized blocks
                     stay in the heap, which only shrinks from its top: the fp32 params that nsp's setup
                     replaces with bf16 ones would keep their address space. 0 leaves glibc's default.

The store lives in ``--dir`` (default: a temporary directory here; it needs about 12 bytes per parameter of disk).
The last line reads ``nsp file tier trains <R>x the parameters of optax.adamw under <cap> GiB``.

``--full``: the largest named GPT-3 size each contender trains on the whole machine, without an address-space
cap. Each contender climbs a short ladder of sizes (``--ladder``, default gpt3-760m, gpt3-1.3b, gpt3-2.7b, with
the byte vocabulary of ``nsp train``'s default data) and stops at the first that does not fit: an attempt whose
resident memory passes ``--rss-limit-gib`` (default 20 GiB, what a run may take of this 24 GiB machine beside
others) is stopped there, as is one whose store the disk cannot hold. Contenders:

  optax       fp32 params and gradients, ``optax.adamw`` moments, all in RAM (~16 bytes per parameter).
  nsp-memory  ``nsp.optim.adamw`` on a memory-tier store updated in place (fp32 master and moments in RAM: 12 bytes
              per parameter) with bf16 params for the step: ``nsp train --tier memory --bf16-params``'s set-up.
  nsp-file    the same on a file-tier store at ``--dir`` (fp32 master and moments on disk, two version slots:
              24 bytes per parameter of disk): ``nsp train --bf16-params --stage-gradients``'s set-up, built part
              by part (``--no-stage-gradients``: ``nsp train --bf16-params``'s step). With ``--slots 1`` its store
              keeps one version slot and a redo journal (``nsp train --slots 1``: 14 bytes per parameter of
              disk with the staged bf16 gradient, which the journal names instead of copying, against 26 with two
              slots; 16 and 24 without staging); the other contenders keep no store on disk and are unchanged.

Each attempt sets up (timed), compiles the step, then runs ``--steps`` (default two) steps on different batches
(the learning rate warming up over them, by the model's recipe: ``nsp.train.recipes``), and takes the first
batch's loss again after the last step (each step's loss is on its own batch). ``--repeat-batch`` trains every
step on that first batch instead: a check that the updates land at that scale (the batch's loss must fall step
over step), not a measure of generalisation. The table gives the last step's
time split into forward/backward and update (optax: two jitted calls; nsp: ``nsp train``'s one step, split by the
store's update time), the peak RSS, and the disk the store took. The record goes to
``bench/results/max_model_full.json`` (``--slots 1``: ``bench/results/max_model_full_oneslot.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_bytes, print_table, run_capped, write_json  # noqa: E402

CONTENDERS = ("optax", "nsp-file")
FULL_CONTENDERS = ("optax", "nsp-memory", "nsp-file")
FULL_LADDER = ("gpt3-760m", "gpt3-1.3b", "gpt3-2.7b")


def slots_kw(args) -> dict:
    """The file-tier store's version slots as ``nsp.storage.open`` takes them (asked for only when 1, as nsp train
    does)."""
    return {"slots": 1} if args.slots == 1 else {}


def child(args) -> None:
    """One attempt (run under the cap): prints a JSON line when both steps finished."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import nsp.optim
    import nsp.storage
    from nsp.models import GPT
    from nsp.models.gpt import GPTConfig
    from nsp.train.layerwise import LayerwiseInit
    from nsp.train.trainer import make_train_step

    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.width // 64,
                    n_embd=args.width, dtype=jnp.bfloat16, f32_accum=args.f32_accum)
    t0 = time.perf_counter()
    if args.child == "optax":
        graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        tx = optax.adamw(1e-4)
        state = tx.init(params)
    else:
        store = nsp.storage.open(args.store, tier="file", num_shards=1, **slots_kw(args))
        # stage_gradients: each gradient leaf goes to the store's disk as the backward pass produces it, and the
        # new params come back a leaf at a time: the step holds neither the whole gradient nor a second params.
        tx = nsp.optim.adamw(1e-4, store=store, stage_gradients=args.stage_gradients)
        # The library's set-up for bf16 params: the fp32 master goes into the store leaf by leaf, straight from
        # the model's init functions, and the step keeps a bf16 copy; the model is never whole in fp32.
        parts = LayerwiseInit(cfg, 0)
        graphdef = parts.graphdef
        params, state = nsp.optim.init_from(tx, parts.abstract, parts, dtype=jnp.bfloat16)
        parts.close()
    setup_s = time.perf_counter() - t0
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))

    step, _ = make_train_step(graphdef, tx)  # nsp train's step: params and optimizer state donated
    tokens = jax.random.randint(jax.random.key(0), (1, args.seq + 1), 0, 256, jnp.int32)
    losses, times = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        params, state, loss = step(params, state, tokens)
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    if args.child != "optax":
        store.close()
    print(json.dumps({"params": n_params, "losses": losses, "step_s": times[-1], "setup_s": setup_s,
                      "peak_rss": peak_rss_bytes()}))


def full_child(args) -> None:
    """One attempt of ``--full`` (no cap): ``args.child`` trains ``args.model``; prints a JSON line at the end."""
    import functools

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import nsp.storage
    from nsp.models import GPT
    from nsp.train import trainer
    from nsp.train.config import TrainConfig
    from nsp.train.data import Batcher, load_tokens

    config = TrainConfig(model=args.model, tier="file" if args.child == "nsp-file" else "memory", bf16=True,
                         f32_accum=args.f32_accum, bf16_params=args.child != "optax", batch=1, seq=args.seq,
                         steps=args.steps, checkpoints=False, lr=args.lr, warmup_steps=args.warmup_steps,
                         stage_gradients=args.child == "nsp-file" and args.stage_gradients).resolved()
    model_cfg = trainer.model_config(config, 256)
    tokens = load_tokens(None, seq_len=args.seq)
    batches = Batcher(tokens.tokens, 1, args.seq, seed=0)
    t0 = time.perf_counter()
    store = None
    if args.child == "optax":
        graphdef, params = nnx.split(GPT(model_cfg, rngs=nnx.Rngs(0)), nnx.Param)
        tx = optax.chain(optax.clip_by_global_norm(config.clip),
                         optax.adamw(config.lr, config.b1, config.b2, weight_decay=config.weight_decay))
        state = tx.init(params)
        jax.block_until_ready(state)
    else:
        from nsp.train.layerwise import LayerwiseInit

        layerwise = LayerwiseInit(model_cfg, 0)  # init_store_layerwise keeps the bf16 copy itself
        graphdef = layerwise.graphdef
        store = nsp.storage.open(None if config.tier == "memory" else args.store, tier=config.tier, num_shards=1,
                                 **({"in_place": True} if config.tier == "memory" else slots_kw(args)))
        tx = trainer.make_optimizer(config, store, None)
        params, state = trainer.init_store_layerwise(config, layerwise, store, tx, None, log=lambda line: None)
    setup_s = time.perf_counter() - t0
    setup_rss = peak_rss_bytes()
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    batch = [jnp.asarray(batches.batch(0 if args.repeat_batch else i)) for i in range(args.steps)]
    t0 = time.perf_counter()
    if args.child == "optax":
        loss = functools.partial(trainer.loss_fn, graphdef)
        fwd_bwd = jax.jit(jax.value_and_grad(loss)).lower(params, batch[0]).compile()

        def apply(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        apply = jax.jit(apply, donate_argnums=(0, 1, 2)).lower(params, state, params).compile()
    else:
        step = trainer.make_train_step(graphdef, tx)[0].lower(params, state, batch[0]).compile()
    compile_s = time.perf_counter() - t0
    losses, rows = [], []
    for tokens_ in batch:
        t0 = time.perf_counter()
        if args.child == "optax":
            value, grads = fwd_bwd(params, tokens_)
            jax.block_until_ready(grads)
            t1 = time.perf_counter()
            params, state = apply(params, state, grads)
            jax.block_until_ready(params)
            t2 = time.perf_counter()
            rows.append({"fwd_bwd_s": t1 - t0, "update_s": t2 - t1, "step_s": t2 - t0})
        else:
            before = store.stats()["update_ns"]
            params, state, value = step(params, state, tokens_)
            jax.block_until_ready(params)
            t2 = time.perf_counter()
            update_s = (store.stats()["update_ns"] - before) / 1e9
            rows.append({"fwd_bwd_s": t2 - t0 - update_s, "update_s": update_s, "step_s": t2 - t0})
        losses.append(float(value))
    # Each step's loss is on its own batch (so it moves with the batch as much as with the params): the first
    # batch's loss again after the last step says whether the steps trained.
    first_after = float(jax.jit(functools.partial(trainer.loss_fn, graphdef))(params, batch[0]))
    disk = 0
    if args.child == "nsp-file":
        disk = sum(f.stat().st_blocks * 512 for f in Path(args.store).rglob("*") if f.is_file())
    if store is not None:
        store.close()
    print(json.dumps({"params": n_params, "losses": losses, "first_batch_loss_after": first_after, **rows[-1],
                      "setup_s": setup_s, "compile_s": compile_s,
                      "setup_peak_rss": setup_rss, "peak_rss": peak_rss_bytes(), "disk_bytes": disk}))


def full_attempt(contender: str, model: str, args, workdir: Path) -> dict:
    """Runs one ``--full`` attempt, watching its resident memory; returns its result or why it did not fit."""
    store = workdir / f"store-{model}"
    cmd = ([sys.executable, __file__, "--full", "--child", contender, "--model", model, "--seq", str(args.seq),
           "--store", str(store), "--f32-accum" if args.f32_accum else "--no-f32-accum",
           "--stage-gradients" if args.stage_gradients else "--no-stage-gradients", "--slots", str(args.slots),
           "--steps", str(args.steps), "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps)]
           + (["--repeat-batch"] if args.repeat_batch else []))
    env = dict(os.environ, MALLOC_ARENA_MAX="2", MALLOC_MMAP_THRESHOLD_=str(args.mmap_threshold or 131072))
    limit = int(args.rss_limit_gib * 2**30)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, status = 0, None
    try:
        while proc.poll() is None:
            rss = _rss_bytes(proc.pid)
            peak = max(peak, rss)
            if rss > limit:
                proc.kill()
                status = f"over {args.rss_limit_gib:g} GiB RSS"
            elif time.perf_counter() - t0 > args.timeout:
                proc.kill()
                status = "timeout"
            time.sleep(0.2)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(store, ignore_errors=True)
    wall = time.perf_counter() - t0
    lines = [line for line in out.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    if result is None and status is None:
        lines = err.strip().splitlines()
        tail = [line for line in lines if "Error" in line.split(":")[0]][-1:] or lines[-1:] or [f"rc {proc.returncode}"]
        status = "no room on disk" if "not enough disk" in err else f"failed: {tail[0][:200]}"
    row = {"contender": contender, "model": model, "status": status or "ok", "wall_s": wall,
           "watched_peak_rss": peak, **(result or {})}
    extra = (f", {result['params'] / 1e6:.0f}M params, step {result['step_s']:.1f} s, peak RSS "
             f"{result['peak_rss'] / 2**30:.2f} GiB, losses {', '.join(f'{v:.3f}' for v in result['losses'])}"
             + (f", first batch after {result['first_batch_loss_after']:.3f}" if "first_batch_loss_after" in result
                else "") if result else f", RSS reached {peak / 2**30:.2f} GiB")
    print(f"  {contender:10s} {model:10s}: {row['status']} ({wall:.0f} s{extra})", flush=True)
    return row


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def full(args) -> None:
    base = Path(args.dir or os.getcwd())
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="nsp-maxmodel-", dir=base))
    ladder = args.ladder.split(",")
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free_disk = shutil.disk_usage(workdir).free
    print(f"largest named GPT each contender trains on the whole machine (batch 1 x {args.seq} tokens, bf16 "
          f"compute, f32_accum={args.f32_accum}, file-tier store of {args.slots} version slot"
          f"{'s' if args.slots == 2 else ' and a redo journal'}): ladder {', '.join(ladder)}; an attempt stops at "
          f"{args.rss_limit_gib:g} GiB RSS; RAM {total_ram / 2**30:.1f} GiB, disk free {free_disk / 1e9:.0f} GB "
          f"at {workdir}", flush=True)
    attempts, best = [], {}
    try:
        for contender in args.contenders.split(","):
            for model in ladder:
                row = full_attempt(contender, model, args, workdir)
                attempts.append(row)
                if row["status"] != "ok":
                    break
                best[contender] = row
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = []
    for contender in args.contenders.split(","):
        r = best.get(contender, {})
        rows.append({"contender": contender, "model": r.get("model"), "params_m": r.get("params", 0) / 1e6,
                     "peak_rss_gib": r["peak_rss"] / 2**30 if r else None,
                     "setup_s": r.get("setup_s"), "fwd_bwd_s": r.get("fwd_bwd_s"), "update_s": r.get("update_s"),
                     "step_s": r.get("step_s"), "disk_gb": r["disk_bytes"] / 1e9 if r else None,
                     "losses": r.get("losses"), "first_batch_loss_after": r.get("first_batch_loss_after")})
    base_params = rows[0]["params_m"] if rows and rows[0]["contender"] == "optax" else 0
    for row in rows:
        row["ratio"] = row["params_m"] / base_params if base_params else None
    print_table("largest GPT on the whole machine", rows,
                [("contender", "contender", ""), ("model", "model", ""), ("params_m", "params (M)", ".0f"),
                 ("ratio", "vs optax", ".2f"), ("peak_rss_gib", "peak RSS (GiB)", ".2f"),
                 ("setup_s", "set-up (s)", ".0f"), ("fwd_bwd_s", "fwd/bwd (s)", ".1f"),
                 ("update_s", "update (s)", ".1f"), ("step_s", "step (s)", ".1f"), ("disk_gb", "disk (GB)", ".1f")])
    # What this machine allows, from the bytes per parameter each keeps (RAM for the in-RAM contenders; disk for
    # the file tier: two version slots of fp32 master and moments, 24 B; one slot and its redo journal, whose
    # gradient takes at most 4 B more, 16 B; a staged bf16 gradient adds its stage file, 2 B, which is also the
    # one-slot journal's gradient: 26 B and 14 B).
    disk_bpp = (24 if args.slots == 2 else 12) + (2 if args.stage_gradients else (0 if args.slots == 2 else 4))
    limits = {"ram_bytes": total_ram, "rss_limit_bytes": int(args.rss_limit_gib * 2**30), "disk_free_bytes": free_disk,
              "optax_max_params_by_ram": int(args.rss_limit_gib * 2**30 / 16),
              "nsp_file_disk_bytes_per_param": disk_bpp, "nsp_file_max_params_by_disk": int(free_disk / disk_bpp)}
    default_json = "max_model_full.json" if args.slots == 2 else "max_model_full_oneslot.json"
    write_json("max_model_full", {"mode": "full", "seq": args.seq, "f32_accum": args.f32_accum, "ladder": ladder,
                                  "stage_gradients": args.stage_gradients, "slots": args.slots,
                                  "steps": args.steps, "repeat_batch": args.repeat_batch, "lr": args.lr,
                                  "warmup_steps": args.warmup_steps,
                                  "rss_limit_gib": args.rss_limit_gib, "rows": rows, "attempts": attempts,
                                  "limits": limits}, args.json or str(Path(__file__).parent / "results"
                                                                      / default_json))
    nsp_file = next((r for r in rows if r["contender"] == "nsp-file"), None)
    if nsp_file and nsp_file["ratio"]:
        print(f"nsp file tier trains {nsp_file['ratio']:.2f}x the parameters of optax.adamw on this machine "
              f"({nsp_file['params_m']:.0f}M vs {base_params:.0f}M)")


def attempt(contender: str, layers: int, args, workdir: Path) -> dict | None:
    store = workdir / f"store-{layers}"
    cap = int(args.cap_gib * 2**30)
    cmd = [sys.executable, __file__, "--child", contender, "--layers", str(layers), "--width", str(args.width),
           "--seq", str(args.seq), "--store", str(store), "--f32-accum" if args.f32_accum else "--no-f32-accum",
           "--stage-gradients" if args.stage_gradients else "--no-stage-gradients", "--slots", str(args.slots)]

    env = dict(os.environ, MALLOC_ARENA_MAX="2")  # the same malloc settings for both contenders
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    t0 = time.perf_counter()
    try:
        proc = run_capped(cmd, cap, env, args.timeout)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    wall = time.perf_counter() - t0
    result = None
    if proc is not None and proc.returncode == 0:
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else None
    status = "ok" if result else ("timeout" if proc is None else f"failed (rc {proc.returncode})")
    extra = f", {result['params'] / 1e6:.0f}M params, step {result['step_s']:.1f} s" if result else ""
    print(f"  {contender:9s} {layers:3d} layers: {status} ({wall:.0f} s{extra})", flush=True)
    if proc is not None and result is None and args.verbose:
        print("    " + "\n    ".join(proc.stderr.strip().splitlines()[-3:]))
    return result


def largest(contender: str, args, workdir: Path) -> tuple[int, dict | None]:
    """Binary search for the most layers that fit (fitting is monotone in the layer count)."""
    lo, hi, best = 0, args.max_layers, None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        result = attempt(contender, mid, args, workdir)
        if result:
            lo, best = mid, result
        else:
            hi = mid - 1
    return lo, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap-gib", type=float, default=3.0, help="address-space cap of each attempt (GiB)")
    parser.add_argument("--width", type=int, default=1024, help="n_embd of the GPTs (n_head = width / 64)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (batch 1; default 64, --full 128)")
    parser.add_argument("--max-layers", type=int, default=96, help="upper end of the search")
    parser.add_argument("--stage-gradients", action=argparse.BooleanOptionalAction, default=True,
                        help="nsp-file: nsp.optim.adamw(stage_gradients=...), the step that never holds the whole "
                             "gradient (default on)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds an attempt may take")
    parser.add_argument("--dir", default=None, help="where the nsp stores go (default: a temp dir here)")
    parser.add_argument("--f32-accum", action=argparse.BooleanOptionalAction, default=True,
                        help="GPTConfig(f32_accum=...) for both contenders: bf16 x bf16 -> fp32 dots in the Linear "
                             "layers (default on)")
    parser.add_argument("--mmap-threshold", type=int, default=131072,
                        help="MALLOC_MMAP_THRESHOLD_ (bytes) of the attempts; 0: glibc's dynamic default")
    parser.add_argument("--slots", type=int, choices=(1, 2), default=2,
                        help="version slots of the nsp file tier's store (1: one slot and a redo journal, as "
                             "nsp train --slots 1; default 2)")
    parser.add_argument("--verbose", action="store_true", help="print the end of a failed attempt's stderr")
    parser.add_argument("--json", default=None)
    parser.add_argument("--full", action="store_true",
                        help="the largest named GPT each contender trains on the whole machine (no cap)")
    parser.add_argument("--ladder", default=",".join(FULL_LADDER), help="--full: the sizes tried, in order")
    parser.add_argument("--contenders", default=",".join(FULL_CONTENDERS), help="--full: who is measured")
    parser.add_argument("--steps", type=int, default=2,
                        help="--full: training steps of each attempt, on different batches (at least 2; the table "
                             "times the last, the record keeps every loss)")
    parser.add_argument("--lr", type=float, default=0.0,
                        help="--full: the peak learning rate (default 0: the model's recipe, warming up over the run)")
    parser.add_argument("--warmup-steps", type=int, default=-1,
                        help="--full: linear warm-up steps (default -1: the model's recipe; 0: none)")
    parser.add_argument("--repeat-batch", action="store_true",
                        help="--full: train every step on the first batch (its loss must fall step over step)")
    parser.add_argument("--rss-limit-gib", type=float, default=20.0,
                        help="--full: an attempt whose resident memory passes this is stopped (does not fit)")
    parser.add_argument("--child", choices=FULL_CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step's time includes warming up)")
    if args.seq is None:
        args.seq = 128 if args.full else 64
    if args.full and args.child:
        full_child(args)
        return
    if args.child:
        child(args)
        return
    if args.full:
        if args.timeout == 900:
            args.timeout = 1800  # a file-tier attempt at 2.7B sets up 30 GB and runs two steps of a minute or more
        full(args)
        return
    if args.width % 64:
        parser.error("--width must be a multiple of 64")

    base = Path(args.dir or os.getcwd())
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="nsp-maxmodel-", dir=base))
    print(f"largest GPT (width {args.width}, batch 1 x {args.seq} tokens) that trains two steps under a "
          f"{args.cap_gib:g} GiB address-space cap (RLIMIT_AS); both contenders: f32_accum={args.f32_accum}, "
          f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'glibc default'}, MALLOC_ARENA_MAX=2", flush=True)
    rows = []
    try:
        for contender in CONTENDERS:
            layers, result = largest(contender, args, workdir)
            rows.append({"contender": contender, "layers": layers,
                         "params_m": result["params"] / 1e6 if result else 0.0,
                         "peak_rss_gib": result["peak_rss"] / 2**30 if result else None,
                         "step_s": result["step_s"] if result else None,
                         "losses": result["losses"] if result else None})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base_params = rows[0]["params_m"]
    for row in rows:
        row["ratio"] = row["params_m"] / base_params if base_params else None
    print_table(f"largest model under {args.cap_gib:g} GiB", rows,
                [("contender", "contender", ""), ("layers", "layers", "d"), ("params_m", "params (M)", ".1f"),
                 ("ratio", "vs optax", ".2f"), ("peak_rss_gib", "peak RSS (GiB)", ".2f"),
                 ("step_s", "step (s)", ".1f")])
    write_json("max_model", {"cap_gib": args.cap_gib, "width": args.width, "seq": args.seq,
                             "stage_gradients": args.stage_gradients, "slots": args.slots,
                             "f32_accum": args.f32_accum, "mmap_threshold": args.mmap_threshold, "rows": rows},
               args.json)
    ratio = rows[1]["ratio"]
    print(f"nsp file tier trains {ratio:.2f}x the parameters of optax.adamw under {args.cap_gib:g} GiB"
          if ratio else "optax.adamw fit no model under the cap: raise --cap-gib")


if __name__ == "__main__":
    main()
