"""Update-kernel throughput: nsp fused_update against optax, torch and the memory roofline, in one run.

    python bench/update_kernel.py            # 64M fp32 params, 2 threads, median of 7
    python bench/update_kernel.py --size 16M --threads 1 --repeats 5

Contenders (all updating the same number of fp32 Adam parameters in place, interleaved, median of N):
  nsp dense fp32     fused_update(kind="adam") under jax.jit with donated state (28 B/param moved)
  nsp bf16 grads     the same with a bfloat16 gradient (26 B/param)
  nsp top-k 1%       the same with a 1% Top-K compressed gradient, decompressed inside the kernel (~24 B/param)
  optax.adam         under jax.jit on CPU, params and state donated (what a JAX user would otherwise run)
  torch fused Adam   torch.optim.Adam(fused=True) on CPU, when torch is installed (pip install ".[bench]")
  DeepSpeedCPUAdam   when deepspeed is installed
  roofline           a streaming loop reading p, g, m, v and writing p, m, v (28 B/param), same threads

The roofline is the bound for dense fp32 Adam on a machine where the update is memory-bound.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, print_table, time_interleaved, write_json  # noqa: E402

from nsp import _nsp_ffi  # noqa: E402
from nsp.primitives import fused_update, kernel_isa, set_num_threads  # noqa: E402

LR = 1e-3


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


def nsp_contenders(n: int, rng: np.random.Generator, ratio: float):
    """Three nsp variants sharing one state (each call is one in-place Adam step)."""
    state = {
        "p": jnp.asarray(rng.standard_normal(n, np.float32)),
        "m": jnp.zeros(n, jnp.float32),
        "v": jnp.zeros(n, jnp.float32),
        "t": 0,
    }
    grad = jnp.asarray(rng.standard_normal(n, np.float32))
    grad_bf16 = grad.astype(jnp.bfloat16)
    k = max(1, int(n * ratio))
    idx = jnp.asarray(np.sort(rng.choice(n, size=k, replace=False)).astype(np.int32))
    vals = jnp.asarray(rng.standard_normal(k, np.float32))

    @functools.partial(jax.jit, donate_argnums=(0, 2, 3))
    def dense(p, g, m, v, t):
        return fused_update(p, g, m, v, kind="adam", step=t, lr=LR)[:3]

    @functools.partial(jax.jit, donate_argnums=(0, 3, 4))
    def sparse(p, values, indices, m, v, t):
        return fused_update(p, values, m, v, kind="adam", step=t, lr=LR, indices=indices)[:3]

    def run(call):
        def fn():
            state["t"] += 1
            out = call(state["t"])
            state["p"], state["m"], state["v"] = jax.block_until_ready(out)

        return fn

    return {
        "nsp dense fp32": run(lambda t: dense(state["p"], grad, state["m"], state["v"], t)),
        "nsp bf16 grads": run(lambda t: dense(state["p"], grad_bf16, state["m"], state["v"], t)),
        f"nsp top-k {ratio:.0%}": run(lambda t: sparse(state["p"], vals, idx, state["m"], state["v"], t)),
    }, k


def optax_contender(n: int, rng: np.random.Generator):
    opt = optax.adam(LR)
    params = jnp.asarray(rng.standard_normal(n, np.float32))
    grad = jnp.asarray(rng.standard_normal(n, np.float32))
    box = {"p": params, "s": opt.init(params)}

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, g):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    def fn():
        box["p"], box["s"] = jax.block_until_ready(step(box["p"], box["s"], grad))

    return fn


def torch_contender(n: int, threads: int):
    try:
        import torch
    except ImportError:
        return None, "not installed (pip install '.[bench]')"
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    try:
        opt = torch.optim.Adam([p], lr=LR, fused=True)
    except (RuntimeError, TypeError) as e:  # older torch: no fused CPU Adam
        return None, f"fused CPU Adam unavailable ({e})"

    def fn():
        opt.step()

    return fn, f"torch {torch.__version__}, {threads} threads"


def deepspeed_contender(n: int):
    try:
        import torch
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001  (deepspeed raises various errors when its ops cannot build)
        return None, "not installed"
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([p], lr=LR)

    def fn():
        opt.step()

    return fn, "deepspeed"


def roofline_contender(n: int, rng: np.random.Generator):
    arrays = [rng.standard_normal(n, np.float32) * 0 for _ in range(4)]

    def fn():
        _nsp_ffi.stream_roofline(*arrays)

    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="64M", help="parameters (e.g. 64M, 16M, 1000000)")
    parser.add_argument("--threads", type=int, default=2, help="threads for nsp, torch and the roofline")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ratio", type=float, default=0.01, help="Top-K density of the compressed contender")
    parser.add_argument("--json", default=None, help="where to write the JSON record")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be >= 5 (the protocol reports a median of at least 5)")
    n = parse_size(args.size)
    set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    contenders, k = nsp_contenders(n, rng, args.ratio)
    notes = {}
    contenders["optax.adam (jit, donated)"] = optax_contender(n, rng)
    for name, (fn, note) in {
        "torch fused Adam": torch_contender(n, args.threads),
        "DeepSpeedCPUAdam": deepspeed_contender(n),
    }.items():
        notes[name] = note
        if fn is not None:
            contenders[name] = fn
    contenders["roofline (28 B/param stream)"] = roofline_contender(n, rng)

    print(f"fp32 Adam update of {n / 2**20:.0f}M params, {args.threads} threads, kernel ISA {kernel_isa()}, "
          f"median of {args.repeats} interleaved rounds")
    times = time_interleaved(contenders, repeats=args.repeats, warmup=2)
    med = {name: median(ts) for name, ts in times.items()}
    bytes_per_param = {
        "nsp dense fp32": 28.0,
        "nsp bf16 grads": 26.0,
        f"nsp top-k {args.ratio:.0%}": 24.0 + 8.0 * k / n,
        "roofline (28 B/param stream)": 28.0,
    }
    ref = med["nsp dense fp32"]
    rows = []
    for name, t in med.items():
        bpp = bytes_per_param.get(name, 28.0)
        rows.append({
            "contender": name,
            "ms": t * 1e3,
            "gparams": n / t / 1e9,
            "gbs": n * bpp / t / 1e9,
            "vs_nsp": ref / t,
        })
    for name, note in notes.items():
        if name not in med:
            rows.append({"contender": f"{name}: {note}"})
    print_table(
        "Adam update throughput",
        rows,
        [("contender", "contender", ""), ("ms", "median ms", ".1f"), ("gparams", "Gparam/s", ".3f"),
         ("gbs", "GB/s moved", ".1f"), ("vs_nsp", "speed vs nsp dense", ".2f")],
    )

    checks = []

    def ratio_line(label, num, den, target):
        if num in med and den in med:
            r = med[den] / med[num]
            checks.append({"check": label, "ratio": r, "target": target, "met": r >= target})
            print(f"  {label}: {r:.2f}x (target >= {target:.2f}x) {'ok' if r >= target else 'MISSED'}")

    print("\nTargets")
    ratio_line("nsp dense vs torch fused Adam", "nsp dense fp32", "torch fused Adam", 1.05)
    ratio_line("nsp dense vs roofline", "nsp dense fp32", "roofline (28 B/param stream)", 0.90)
    ratio_line(f"nsp top-k {args.ratio:.0%} vs torch fused dense", f"nsp top-k {args.ratio:.0%}", "torch fused Adam",
               1.15)
    ratio_line("nsp bf16 grads vs nsp fp32 grads", "nsp bf16 grads", "nsp dense fp32", 1.05)
    ratio_line("nsp dense vs optax.adam", "nsp dense fp32", "optax.adam (jit, donated)", 1.0)
    path = write_json(
        "update_kernel",
        {"size": n, "threads": args.threads, "repeats": args.repeats, "isa": kernel_isa(),
         "times_s": times, "median_s": med, "notes": notes, "checks": checks},
        args.json,
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
