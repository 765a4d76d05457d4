"""bench/gpu_step.py's measurements besides the contenders: the params check (nsp's update on the device against
the CPU path, fed the same gradients) and the link probe (device <-> ``pinned_host`` GB/s)."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median  # noqa: E402
from gpu_step_common import (CHECK_TOLERANCE, LR, WEIGHT_DECAY, failed, host_model, log, loss_fn,  # noqa: E402
                             n_params_of, nsp, shardings)


# ---- the params check -----------------------------------------------------------------------------------------

def compare_trees(got, want) -> dict[str, Any]:
    """Bit-for-bit equality and the largest relative difference (per element, |got - want| / |want|) of two
    pytrees of arrays."""
    a_leaves, b_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    if len(a_leaves) != len(b_leaves):
        return {"bitwise_equal": False, "max_rel": math.inf, "error": "different tree structure"}
    bitwise, max_rel, max_abs, differing = True, 0.0, 0.0, 0
    for a, b in zip(a_leaves, b_leaves):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return {"bitwise_equal": False, "max_rel": math.inf, "error": f"leaf {a.shape}/{a.dtype} vs "
                    f"{b.shape}/{b.dtype}"}
        if a.tobytes() == b.tobytes():
            continue
        bitwise = False
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        diff = np.abs(a64 - b64)
        differing += int(np.count_nonzero(diff))
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(diff == 0, 0.0, diff / np.maximum(np.abs(b64), 1e-30))
        max_rel = max(max_rel, float(np.nanmax(rel)) if rel.size else 0.0)
        max_abs = max(max_abs, float(np.nanmax(diff)) if diff.size else 0.0)
        if not np.all(np.isfinite(a64) == np.isfinite(b64)):
            max_rel = math.inf
    return {"bitwise_equal": bitwise, "max_rel": max_rel, "max_abs": max_abs, "elements_differing": differing}


def params_check(model: str, steps: int, batch: int, seq: int, device, isa: str) -> dict[str, Any]:
    """``steps`` steps of ``nsp.optim.adamw`` (memory tier) on ``device`` and on the CPU, fed the same gradients."""
    cpu = jax.devices("cpu")[0]
    graphdef, params0, cfg = host_model(model, seq)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(steps, batch, seq + 1)).astype(np.int32)
    out: dict[str, Any] = {"model": model, "params": n_params_of(params0), "steps": steps, "batch": batch,
                           "seq": seq, "device": f"{device.platform}:{device.id} ({device.device_kind})",
                           "reference": f"cpu:{cpu.id}", "kernel_isa": isa, "tier": "memory",
                           "criterion": "bit for bit" if isa == "portable" else
                           f"bit for bit, or within {CHECK_TOLERANCE:g} relative (kernel ISA {isa})"}
    if device.platform == "cpu":
        out["note"] = ("the default backend is the CPU: both runs ran on the CPU (a check of the code path, not of "
                       "an accelerator's)")
    grad_fn = jax.jit(jax.grad(lambda p, t: loss_fn(graphdef, p, t)))

    def update_fn(tx):
        def update(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
        return jax.jit(update, donate_argnums=(0, 1))

    def run(where, grads_from=None, record_grads=None):
        store = nsp.storage.open(tier="memory")
        try:
            tx = nsp.optim.adamw(LR, weight_decay=WEIGHT_DECAY, store=store)
            p = jax.device_put(params0, where)
            s = tx.init(p)
            update = update_fn(tx)
            for i in range(steps):
                if grads_from is not None:
                    g = jax.device_put(grads_from[i], where)
                else:
                    g = grad_fn(p, jax.device_put(tokens[i], where))
                    if record_grads is not None:
                        record_grads.append(jax.device_get(g))
                p, s = update(p, s, g)
            p = jax.device_get(p)
            store.barrier()
            return p, store.stats()
        finally:
            store.close()

    t0 = time.perf_counter()
    grads: list[Any] = []
    reference, ref_stats = run(cpu, record_grads=grads)
    out["reference_updates"] = ref_stats.get("updates")
    log(f"params check: CPU reference done ({steps} steps of {model}, {time.perf_counter() - t0:.1f} s)")
    t1 = time.perf_counter()
    got, dev_stats = run(device, grads_from=grads)
    out["device_updates"] = dev_stats.get("updates")
    out["device_params_adopted"] = dev_stats.get("params_adopted")
    cmp = compare_trees(got, reference)
    out.update(cmp)
    passed = cmp["bitwise_equal"] or (isa != "portable" and cmp["max_rel"] <= CHECK_TOLERANCE)
    out["status"] = "passed" if passed else (
        f"failed: params differ (max relative difference {cmp['max_rel']:.3g}, {cmp.get('elements_differing')} "
        f"elements; {out['criterion']})")
    log(f"params check: same gradients, {device.platform} vs cpu: {out['status']} (bitwise "
        f"{cmp['bitwise_equal']}, max rel {cmp['max_rel']:.3g}; {time.perf_counter() - t1:.1f} s)")
    try:  # informational: the forward/backward on the device as well
        end, _ = run(device)
        e2e = compare_trees(end, reference)
        out["end_to_end"] = {**e2e, "judged": False,
                             "note": "forward/backward on the device too: another device's dots round differently"}
        log(f"params check, end to end (forward/backward on {device.platform} too, not judged): bitwise "
            f"{e2e['bitwise_equal']}, max rel {e2e['max_rel']:.3g}")
    except Exception as e:  # noqa: BLE001
        out["end_to_end"] = {"status": failed(e)}
    out["seconds"] = time.perf_counter() - t0
    return out


# ---- the link probe -------------------------------------------------------------------------------------------

def link_probe(device, n_floats: int, repeats: int) -> dict[str, Any]:
    """GB/s of ``jax.device_put`` of an ``n_floats`` fp32 buffer to ``pinned_host`` (down) and back (up)."""
    dev_s, host_s = shardings(device)
    x = jax.device_put(jnp.zeros((n_floats,), jnp.float32), dev_s)
    h = jax.block_until_ready(jax.device_put(x, host_s))
    down, up = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        h = jax.block_until_ready(jax.device_put(x, host_s))
        down.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        y = jax.block_until_ready(jax.device_put(h, dev_s))
        up.append(time.perf_counter() - t0)
        del y
    nbytes = 4 * n_floats
    down_s, up_s = median(down[1:]), median(up[1:])
    out = {"bytes": nbytes, "down_s": down_s, "up_s": up_s, "down_GBps": nbytes / down_s / 1e9,
           "up_GBps": nbytes / up_s / 1e9, "how": "jax.device_put of one fp32 buffer device -> pinned_host "
           "(down) and pinned_host -> device (up), median of the timed repeats after one warm-up"}
    if device.platform == "cpu":
        out["note"] = "XLA:CPU: pinned_host and device memory are both host RAM; this is a copy in RAM"
    return out


