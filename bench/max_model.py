"""The largest GPT that trains a step under a fixed memory cap: optax.adamw in RAM vs nsp on the file tier.

    python bench/max_model.py                 # cap 3 GiB of address space, GPTs 1024 wide, 1 to 64 layers
    python bench/max_model.py --cap-gib 4 --width 768
    python bench/max_model.py --no-f32-accum --mmap-threshold 0   # the model's and glibc's defaults

Each attempt is a subprocess under ``RLIMIT_AS`` (``prlimit --as``: the cap counts all the process's address
space, JAX and XLA included) that builds a GPT of ``--width`` and ``n_layer`` layers, sets up its optimizer, and
runs two jitted training steps. It either finishes or dies of the cap; a binary search over ``n_layer`` finds each
contender's largest model.

  optax      the standard in-RAM setup: fp32 params, fp32 gradients, ``optax.adamw`` moments in host memory
             (about 16 bytes per parameter, plus the step's temporaries).
  nsp-file   ``nsp.optim.adamw(store=<file tier>)``: fp32 master params and moments on disk; the accelerator
             side keeps bf16 params, and the update takes the bf16 gradient leaves and writes the new params over
             them (``store_update_leaves``): about 4 bytes per parameter in memory.

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
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_bytes, print_table, write_json  # noqa: E402

CONTENDERS = ("optax", "nsp-file")


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
    from nsp.train.trainer import make_train_step

    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.width // 64,
                    n_embd=args.width, dtype=jnp.bfloat16, f32_accum=args.f32_accum)
    t0 = time.perf_counter()
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    if args.child == "optax":
        tx = optax.adamw(1e-4)
        state = tx.init(params)
    else:
        store = nsp.storage.open(args.store, tier="file", num_shards=1)
        tx = nsp.optim.adamw(1e-4, store=store)
        state = tx.init(params)  # the fp32 master params go to the store, a few pages at a time
        # The accelerator side keeps bf16 params: convert leaf by leaf so fp32 and bf16 copies never coexist.
        leaves, treedef = jax.tree_util.tree_flatten(params)
        del params
        for i in range(len(leaves)):
            leaves[i] = leaves[i].astype(jnp.bfloat16)
        params = jax.tree_util.tree_unflatten(treedef, leaves)
        del leaves
    setup_s = time.perf_counter() - t0

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


def attempt(contender: str, layers: int, args, workdir: Path) -> dict | None:
    store = workdir / f"store-{layers}"
    cap = int(args.cap_gib * 2**30)
    cmd = [sys.executable, __file__, "--child", contender, "--layers", str(layers), "--width", str(args.width),
           "--seq", str(args.seq), "--store", str(store), "--f32-accum" if args.f32_accum else "--no-f32-accum"]

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = dict(os.environ, MALLOC_ARENA_MAX="2")  # the same malloc settings for both contenders
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, preexec_fn=limit, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc = None
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
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (batch 1)")
    parser.add_argument("--max-layers", type=int, default=64, help="upper end of the search")
    parser.add_argument("--timeout", type=float, default=900, help="seconds an attempt may take")
    parser.add_argument("--dir", default=None, help="where the nsp stores go (default: a temp dir here)")
    parser.add_argument("--f32-accum", action=argparse.BooleanOptionalAction, default=True,
                        help="GPTConfig(f32_accum=...) for both contenders: bf16 x bf16 -> fp32 dots in the Linear "
                             "layers (default on)")
    parser.add_argument("--mmap-threshold", type=int, default=131072,
                        help="MALLOC_MMAP_THRESHOLD_ (bytes) of the attempts; 0: glibc's dynamic default")
    parser.add_argument("--verbose", action="store_true", help="print the end of a failed attempt's stderr")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
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
                             "f32_accum": args.f32_accum, "mmap_threshold": args.mmap_threshold, "rows": rows},
               args.json)
    ratio = rows[1]["ratio"]
    print(f"nsp file tier trains {ratio:.2f}x the parameters of optax.adamw under {args.cap_gib:g} GiB"
          if ratio else "optax.adamw fit no model under the cap: raise --cap-gib")


if __name__ == "__main__":
    main()
