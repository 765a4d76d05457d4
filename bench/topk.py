"""Top-K gradient compression: nsp's methods against ``jax.lax.top_k``, side by side, in one run.

    python bench/topk.py [--size 16777216] [--ratio 0.01] [--repeats 7] [--json PATH]
    python bench/topk.py --quick     # 4M entries, 5 rounds

For each input every contender is jitted, warmed up and timed interleaved; the table gives the median time, the
speedup over ``lax.top_k`` and the L2 mass kept (sum of squares of the kept values over that of the exact top-k).
The reference is what a user would write: ``lax.top_k`` on ``|x|`` plus a gather of the values (unsorted indices,
so it does less than nsp must). The roofline row is one fused read pass over the input (max of ``|x|``): no top-k
can be faster than reading x once.

Inputs. Easy: iid gaussian, and heavy-tailed Student-t with 2 degrees of freedom; the threshold method's sampled
cut lands between k and 2k candidates and its fast path runs. Hard: inputs on which many entries share the k-th
largest magnitude, so that no cut can pass between k and 2k of them, the candidate count misses and the exact
fallback runs after the threshold pass (``nsp.primitives.topk``): many ties (a gaussian rounded to multiples of
0.5), a heavy cluster (98% of the entries within a few float32 steps of +-1, the k-th largest inside it), a sparse
gradient (0.5% non-zero: the k-th largest is a zero) and an all-equal tensor. For every method the output is
checked against numpy: k distinct ascending indices, values equal to ``x`` at them, every kept magnitude at least
the k-th largest and every larger one kept ("correct"); "fallback" says whether the threshold method's candidate
count missed (its ``ok`` flag, computed apart from the timed call), i.e. whether the exact path ran.

"nsp auto" is what a user gets by default: on CPU the C++ selection (``ffi/xla/topk_select.cc``: a sampled cut, one
pass collecting the candidates, an exact select among them; a full radix select where the cut falls on many equal
values); on a GPU or TPU the threshold path from
``ACCELERATOR_THRESHOLD_MIN_SIZE`` (64M) entries on and the exact one below, where the threshold path measured
slower than ``lax.top_k`` on an H200. On a GPU run ``--size N --json bench/results/topk_gpu_N.json`` (the
report renders ``topk_gpu_67108864.json``); the record names the platform and device either way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py sits beside this script
from common import median, print_table, time_interleaved, write_json  # noqa: E402

from nsp.primitives import topk as topk_lib  # noqa: E402
from nsp.primitives.topk import kept_count, topk_compress  # noqa: E402

REFERENCE = "lax.top_k"
METHODS = ("exact", "approx", "threshold", "auto")  # auto: what a user gets by default on this platform


EASY = ("gaussian", "student-t df=2")
HARD = ("ties: gaussian rounded to 0.5", "heavy cluster at +-1", "sparse: 0.5% non-zero", "all equal")


def make_inputs(size: int, seed: int = 0, names: tuple[str, ...] = EASY + HARD) -> dict[str, np.ndarray]:
    """The inputs of the module docstring, by name (fp32, ``size`` entries, seeded)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in names:
        if name == "gaussian":
            x = rng.standard_normal(size, dtype=np.float32)
        elif name == "student-t df=2":
            x = rng.standard_t(2, size).astype(np.float32)
        elif name == "ties: gaussian rounded to 0.5":
            x = np.round(rng.standard_normal(size, dtype=np.float32) * 2) / 2
        elif name == "heavy cluster at +-1":
            # +-(1 + N(0, 1e-7)): a float32 step near 1 is 6e-8 below and 1.2e-7 above, so the cluster holds a
            # dozen distinct magnitudes, the k-th largest in one holding ~3.5% of the entries; 2% small entries.
            x = (1.0 + rng.standard_normal(size) * 1e-7).astype(np.float32)
            x *= rng.choice(np.array([-1.0, 1.0], np.float32), size)
            small = rng.random(size) >= 0.98
            x[small] = rng.standard_normal(int(small.sum()), dtype=np.float32) * np.float32(0.01)
        elif name == "sparse: 0.5% non-zero":
            x = np.zeros(size, np.float32)
            at = rng.choice(size, size // 200, replace=False)
            x[at] = rng.standard_normal(at.size, dtype=np.float32)
        elif name == "all equal":
            x = np.full(size, 0.5, np.float32)
        else:
            raise ValueError(f"unknown input {name!r}")
        out[name] = x
    return out


def check(x: np.ndarray, values: jax.Array, indices: jax.Array, k: int, kth: np.float32) -> bool:
    """A correct top-k of ``x``: k distinct in-range indices (ascending where nsp promises it is checked by the
    caller), the values at them, every kept magnitude >= the k-th largest, every larger magnitude kept."""
    values, indices = np.asarray(values), np.asarray(indices)
    if values.shape != (k,) or indices.shape != (k,) or np.unique(indices).size != k:
        return False
    if indices.min() < 0 or indices.max() >= x.size or not np.array_equal(values, x[indices]):
        return False
    kept = np.abs(values)
    return bool(kept.min() >= kth and np.count_nonzero(kept > kth) == np.count_nonzero(np.abs(x) > kth))


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


def threshold_missed(x: jax.Array, k: int) -> bool | None:
    """Whether the threshold method's candidate count left [k, 2k] on ``x`` (its exact fallback ran); None where
    the threshold method does not apply (it takes the exact path outright)."""
    if topk_lib._resolve_method("threshold", x.size, k, x.dtype) != "threshold":
        return None
    ok = jax.jit(lambda v: topk_lib._threshold(v.ravel(), k)[2])(x)
    return not bool(ok)


def run_input(name: str, host: np.ndarray, k: int, repeats: int) -> list[dict]:
    x = jnp.asarray(host)
    fns = contenders(k)
    roofline = jax.jit(lambda x: jnp.max(jnp.abs(x)))
    calls = {label: (lambda f=f: jax.block_until_ready(f(x))) for label, f in fns.items()}
    calls["roofline: one read pass"] = lambda: jax.block_until_ready(roofline(x))
    times = time_interleaved(calls, repeats=repeats, warmup=2)

    kth = np.partition(np.abs(host), host.size - k)[host.size - k]  # the k-th largest magnitude
    exact_values = fns["nsp exact"](x)[0]
    missed = threshold_missed(x, k)
    ref_ms = median(times[REFERENCE]) * 1e3
    rows = []
    for label, ts in times.items():
        ms = median(ts) * 1e3
        row = {"input": name, "hard": name in HARD, "method": label, "median_ms": ms, "speedup": ref_ms / ms,
               "l2_mass_pct": None, "correct": None, "fallback": None, "times_ms": [t * 1e3 for t in ts]}
        if label in fns:
            values, indices = fns[label](x)
            row["l2_mass_pct"] = 100 * l2_mass(values, exact_values)
            ascending = label == REFERENCE or bool(np.all(np.diff(np.asarray(indices)) > 0))
            row["correct"] = ascending and check(host, values, indices, k, kth)
            if label == "nsp threshold":
                row["fallback"] = "n/a (exact path)" if missed is None else ("yes" if missed else "no")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=None, help="entries per input (default 16M, 4M --quick)")
    parser.add_argument("--ratio", type=float, default=0.01, help="fraction kept (default 0.01)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timed rounds (default 7, 5 --quick)")
    parser.add_argument("--json", default=None, help="where to write the JSON record (default bench/results/)")
    parser.add_argument("--easy-only", action="store_true", help="only the gaussian and Student-t inputs")
    parser.add_argument("--quick", action="store_true", help="4M entries, 5 rounds (unless given)")
    args = parser.parse_args(argv)
    args.size = args.size or (4 * 2**20 if args.quick else 16 * 2**20)
    args.repeats = args.repeats or (5 if args.quick else 7)
    if args.repeats < 5:
        parser.error("--repeats must be >= 5 (the protocol takes a median of at least 5)")

    k = kept_count(args.size, ratio=args.ratio)
    # "auto" is the C++ selection on CPU and the threshold or exact path elsewhere (nsp.primitives.topk), where the
    # threshold path applies.
    applies = topk_lib._resolve_method("auto", args.size, k, jnp.float32) == "auto"
    on_cpu = jax.devices()[0].platform == "cpu"
    auto_path = ("C++ selection" if applies and on_cpu else
                 "threshold" if applies and args.size >= topk_lib.ACCELERATOR_THRESHOLD_MIN_SIZE else "exact")
    print(f"Top-K of {args.size:,} fp32 at ratio {args.ratio:g} (k={k:,}); jax {jax.__version__} on "
          f"{jax.devices()[0].platform}; median of {args.repeats} interleaved rounds after 2 warm-ups")
    rows = []
    names = EASY + (() if args.easy_only else HARD)
    for name in names:
        host = make_inputs(args.size, names=(name,))[name]
        input_rows = run_input(name, host, k, args.repeats)
        rows += input_rows
        print_table(f"{name}{' (hard)' if name in HARD else ''}:", input_rows, [
            ("method", "method", ""), ("median_ms", "median ms", ".1f"),
            ("speedup", f"x vs {REFERENCE}", ".2f"), ("l2_mass_pct", "L2 mass kept %", ".3f"),
            ("correct", "correct", ""), ("fallback", "fallback ran", ""),
        ])

    # The headline is the worst case over the easy inputs, and apart the worst over the hard ones.
    threshold = [r for r in rows if r["method"] == "nsp threshold"]
    easy = [r for r in threshold if not r["hard"]]
    hard = [r for r in threshold if r["hard"]]
    speedup = min(r["speedup"] for r in easy)
    mass = min(r["l2_mass_pct"] for r in easy)
    auto = [r for r in rows if r["method"] == "nsp auto"]
    summary = {"threshold_speedup_min": speedup, "threshold_l2_mass_pct_min": mass,
               "auto_path": auto_path, "auto_speedup_min": min(r["speedup"] for r in auto if not r["hard"]),
               "all_correct": all(r["correct"] for r in rows if r["correct"] is not None)}
    if hard:
        summary["threshold_speedup_min_hard"] = min(r["speedup"] for r in hard)
        summary["auto_speedup_min_hard"] = min(r["speedup"] for r in auto if r["hard"])
        summary["fallback_ran"] = {r["input"]: r["fallback"] for r in threshold}
    device = jax.devices()[0]
    out = write_json("topk", {"platform": device.platform, "device_kind": device.device_kind,
                              "size": args.size, "ratio": args.ratio, "k": k, "repeats": args.repeats,
                              "reference": REFERENCE, "inputs": {"easy": list(EASY), "hard": list(names[len(EASY):])},
                              "rows": rows, **summary}, args.json)
    print(f"\nJSON: {out}")
    print(f"threshold on the easy inputs: {speedup:.2f}x the speed of lax.top_k at {mass:.2f}% L2 mass"
          + (f"; on the hard ones (fallback ran on {sum(r['fallback'] == 'yes' for r in hard)} of {len(hard)}): "
             f"{summary['threshold_speedup_min_hard']:.2f}x at worst" if hard else "")
          + f"; auto (the {auto_path} path on {device.platform}): {summary['auto_speedup_min']:.2f}x on the easy "
          + "inputs" + (f", {summary['auto_speedup_min_hard']:.2f}x on the hard ones at worst" if hard else "")
          + f"; every output correct: {'yes' if summary['all_correct'] else 'NO'}")
    if not summary["all_correct"]:
        raise SystemExit("an output was not a correct top-k (see the 'correct' column)")


if __name__ == "__main__":
    main()
