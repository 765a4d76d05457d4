"""Top-K gradient compression: nsp's methods against ``jax.lax.top_k``, side by side, in one run.

    python bench/topk.py [--size 16777216] [--ratio 0.01] [--repeats 7] [--json PATH]

For each input (gaussian, and heavy-tailed Student-t with 2 degrees of freedom) every contender is jitted, warmed
up and timed interleaved; the table gives the median time, the speedup over ``lax.top_k`` and the L2 mass kept
(sum of squares of the kept values over that of the exact top-k). The reference is what a user would write:
``lax.top_k`` on ``|x|`` plus a gather of the values (unsorted indices, so it does less than nsp must).
The roofline row is one fused read pass over the input (max of ``|x|``): no top-k can be faster than reading x once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common sits beside this script
from _common import median, print_table, time_interleaved, write_json  # noqa: E402

from nsp.primitives.topk import kept_count, topk_compress  # noqa: E402

REFERENCE = "lax.top_k"
METHODS = ("exact", "approx", "threshold")


def make_inputs(size: int, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "gaussian": jnp.asarray(rng.standard_normal(size, dtype=np.float32)),
        "student-t df=2": jnp.asarray(rng.standard_t(2, size).astype(np.float32)),
    }


def contenders(k: int) -> dict[str, Callable]:
    """name -> jitted function of x returning (values, indices)."""

    def reference(x):
        _, indices = jax.lax.top_k(jnp.abs(x), k)
        return x[indices], indices

    fns = {REFERENCE: jax.jit(reference)}
    for method in METHODS:
        fns[f"nsp {method}"] = jax.jit(lambda x, m=method: topk_compress(x, k=k, method=m))
    return fns


def l2_mass(values: jax.Array, exact_values: jax.Array) -> float:
    kept = np.square(np.asarray(values, np.float64)).sum()
    return float(kept / np.square(np.asarray(exact_values, np.float64)).sum())


def run_input(name: str, x: jax.Array, k: int, repeats: int) -> list[dict]:
    fns = contenders(k)
    roofline = jax.jit(lambda x: jnp.max(jnp.abs(x)))
    calls = {label: (lambda f=f: jax.block_until_ready(f(x))) for label, f in fns.items()}
    calls["roofline: one read pass"] = lambda: jax.block_until_ready(roofline(x))
    times = time_interleaved(calls, repeats=repeats, warmup=2)

    exact_values = fns["nsp exact"](x)[0]
    ref_ms = median(times[REFERENCE]) * 1e3
    rows = []
    for label, ts in times.items():
        ms = median(ts) * 1e3
        mass = l2_mass(fns[label](x)[0], exact_values) if label in fns else None
        rows.append({"input": name, "method": label, "median_ms": ms, "speedup": ref_ms / ms,
                     "l2_mass_pct": None if mass is None else 100 * mass, "times_ms": [t * 1e3 for t in ts]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=16 * 2**20, help="entries per input (default 16M)")
    parser.add_argument("--ratio", type=float, default=0.01, help="fraction kept (default 0.01)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timed rounds (default 7)")
    parser.add_argument("--json", default=None, help="where to write the JSON record (default bench/results/)")
    args = parser.parse_args(argv)

    k = kept_count(args.size, ratio=args.ratio)
    print(f"Top-K of {args.size:,} fp32 at ratio {args.ratio:g} (k={k:,}); jax {jax.__version__} on "
          f"{jax.devices()[0].platform}; median of {args.repeats} interleaved rounds after 2 warm-ups")
    rows = []
    for name, x in make_inputs(args.size).items():
        input_rows = run_input(name, x, k, args.repeats)
        rows += input_rows
        print_table(f"{name}:", input_rows, [
            ("method", "method", ""), ("median_ms", "median ms", ".1f"),
            ("speedup", f"x vs {REFERENCE}", ".2f"), ("l2_mass_pct", "L2 mass kept %", ".3f"),
        ])

    # The headline is the worst case over the inputs.
    threshold = [r for r in rows if r["method"] == "nsp threshold"]
    speedup = min(r["speedup"] for r in threshold)
    mass = min(r["l2_mass_pct"] for r in threshold)
    out = write_json("topk", {"size": args.size, "ratio": args.ratio, "k": k, "repeats": args.repeats,
                              "reference": REFERENCE, "rows": rows,
                              "threshold_speedup_min": speedup, "threshold_l2_mass_pct_min": mass}, args.json)
    print(f"\nJSON: {out}")
    print(f"threshold: {speedup:.1f}x faster than lax.top_k at {mass:.2f}% L2 mass")


if __name__ == "__main__":
    main()
