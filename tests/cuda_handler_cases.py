"""The store update cases the CUDA handler is checked on (tests/test_cuda_handler.py runs this file).

Run as ``python cuda_handler_cases.py OUT_DIR [NAMES]`` in a fresh process with two host devices: it runs every
case below (or those named, comma-separated; ``fail`` names the failing-copy cases) and writes ``OUT_DIR/results.npz`` (the params after each step and the store's final state) and
``OUT_DIR/info.json`` (per case: the CUDA handlers' counters after each step, and the model's). With
``NSP_CUDA_MODEL`` set, every store update of the process goes through the CUDA handler over the software model;
without it, through the CPU handler: the two runs must agree bit for bit. In the failing-copy cases the model
fails one copy of step 2 (without the model nothing fails), the step is run again, and the runs still agree.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import nsp.optim
import nsp.storage
from nsp.primitives import _ffi

PAGE = 16 * 1024
MODEL = os.environ.get("NSP_CUDA_MODEL")


def model_stats() -> dict:
    if not MODEL:
        return {"copies": 0}
    out = (ctypes.c_int64 * 7)()
    ctypes.CDLL(MODEL).nspCudaModelStats(out)
    names = ("copies", "bytes_h2d", "bytes_d2h", "host_allocs", "host_frees", "syncs", "unpinned")
    return dict(zip(names, map(int, out)))


def fail_copy(number: int) -> None:
    """Makes copy `number` fail (under the model; without it nothing fails and the step simply runs)."""
    if MODEL:
        ctypes.CDLL(MODEL).nspCudaModelFailCopy(ctypes.c_int64(number))


def model_pending() -> int:
    """Copies (and event records) the model has queued and not yet run."""
    return int(ctypes.CDLL(MODEL, mode=ctypes.RTLD_GLOBAL).nspCudaModelPending()) if MODEL else 0


def set_copy_delay_us(us: int) -> None:
    if MODEL:
        ctypes.CDLL(MODEL).nspCudaModelSetDelayUs(ctypes.c_int64(us))


def problem(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w1": jnp.asarray(rng.standard_normal((8, 48)) * 0.3, dtype),
              "b1": jnp.zeros(48, dtype),
              "w2": jnp.asarray(rng.standard_normal((48, 3)) * 0.3, dtype)}
    x = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    y = jnp.sin(x[:, :3])

    def loss(p, scale):
        h = jnp.tanh(x @ p["w1"].astype(jnp.float32) + p["b1"].astype(jnp.float32))
        return scale * jnp.mean((h @ p["w2"].astype(jnp.float32) - y) ** 2)

    return params, loss


def mesh2():
    return jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


# name: (transform maker, store options, params dtype, grads dtype, steps, NaN at step, params changed before steps)
def cases():
    topk = nsp.optim.TopK(0.01)
    lazy = nsp.optim.TopK(0.01, lazy=True)
    return {
        # One store shard, gradient leaves (the pieces target)
        "adam": (lambda s: nsp.optim.adam(3e-3, store=s), {}, jnp.float32, None, 3, None, ()),
        "adamw": (lambda s: nsp.optim.adamw(3e-3, weight_decay=0.01, store=s), {}, jnp.float32, None, 3, None, ()),
        "sgd": (lambda s: nsp.optim.sgd(0.05, momentum=0.9, nesterov=True, store=s), {}, jnp.float32, None, 3, None,
                ()),
        "adagrad": (lambda s: nsp.optim.adagrad(0.05, store=s), {}, jnp.float32, None, 3, None, ()),
        "adam_bf16": (lambda s: nsp.optim.adam(3e-3, store=s), {}, jnp.bfloat16, None, 3, None, ()),
        "adam_stale1": (lambda s: nsp.optim.adam(3e-3, store=s, staleness=1), {}, jnp.float32, None, 4, None, ()),
        "adam_nan": (lambda s: nsp.optim.adam(3e-3, store=s), {}, jnp.float32, None, 4, 2, ()),
        "adam_adopt": (lambda s: nsp.optim.adam(3e-3, store=s), {}, jnp.float32, None, 4, None, (2, 3)),
        # bf16 gradients of fp32 params: the dense target, 2 bytes a gradient element down
        "adam_bf16_grads": (lambda s: nsp.optim.adam(3e-3, store=s), {}, jnp.float32, jnp.bfloat16, 3, None, ()),
        # Top-K: the sparse target
        "adamw_topk": (lambda s: nsp.optim.adamw(3e-3, weight_decay=0.01, store=s, compression=topk), {},
                       jnp.float32, None, 3, None, ()),
        "adam_topk_lazy": (lambda s: nsp.optim.adam(3e-3, store=s, compression=lazy), {}, jnp.float32, None, 3,
                           None, ()),
        # Two devices, one store shard each, inside jax.shard_map (the dense and sparse targets)
        "mesh_adam": (lambda s: nsp.optim.adam(3e-3, store=s, mesh=mesh2(), axis_name="d"), {"num_shards": 2},
                      jnp.float32, None, 5, 2, (4,)),
        "mesh_sgd_stale1": (lambda s: nsp.optim.sgd(0.05, momentum=0.9, store=s, staleness=1, mesh=mesh2(),
                                                     axis_name="d"), {"num_shards": 2}, jnp.float32, None, 3, None,
                            ()),
        "mesh_adamw_topk": (lambda s: nsp.optim.adamw(3e-3, weight_decay=0.01, store=s, mesh=mesh2(), axis_name="d",
                                                       compression=topk),
                            {"num_shards": 2}, jnp.float32, None, 3, None, ()),
    }


def make_step(tx, loss, grads_dtype):
    @jax.jit
    def step(p, s, scale):
        g = jax.grad(loss)(p, scale)
        if grads_dtype is not None:
            g = jax.tree_util.tree_map(lambda x: x.astype(grads_dtype), g)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    return step


def run_case(name, spec, results, info):
    make_tx, store_kw, dtype, grads_dtype, steps, nan_at, changed = spec
    params, loss = problem(dtype)
    with nsp.storage.open(tier="memory", page_bytes=PAGE, **store_kw) as store:
        tx = make_tx(store)
        p, s = params, tx.init(params)
        step = make_step(tx, loss, grads_dtype)
        counters = []
        for t in range(1, steps + 1):
            if t in changed:  # the caller edits its params: the store adopts them
                p = jax.tree_util.tree_map(lambda x: (x * 0.5).astype(x.dtype), p)
            p, s = step(p, s, jnp.float32(np.nan if t == nan_at else 1.0))
            jax.block_until_ready(p)
            for k, leaf in p.items():
                results[f"{name}/step{t}/{k}"] = np.asarray(leaf.astype(jnp.float32))
            counters.append({"handler": _ffi.cuda_stats(), "model": model_stats()})
        store.barrier()
        for state in ("param", "mu", "nu"):
            try:
                results[f"{name}/store/{state}"] = store.read(state)
            except ValueError:
                pass
        results[f"{name}/version"] = np.asarray(store.version)
        info[name] = {"counters": counters, "params": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
                      "padded": int(store.layout.padded_total), "shard_size": int(store.layout.shard_size)}


def run_failures(results, info):
    """A copy fails (down, then up) in a few steps; each failure is reported, the store keeps its committed
    version, and the step run again succeeds. The steps that succeed are recorded as in run_case."""
    for name, store_kw, kw, where in (
        ("fail_down", {}, {}, "gradient leaf 0 down"),
        ("fail_up", {}, {}, "new params leaf 0 up"),
    ):
        params, loss = problem()
        with nsp.storage.open(tier="memory", page_bytes=PAGE, **store_kw) as store:
            tx = nsp.optim.adam(3e-3, store=store, **kw)
            p, s = params, tx.init(params)
            step = make_step(tx, loss, None)
            errors = []
            t = 1
            attempts = 0
            while t <= 3:
                attempts += 1
                failing = t == 2 and not errors
                if failing:
                    base = model_stats()["copies"]
                    scalars, leaves = 6, len(jax.tree_util.tree_leaves(params))
                    if name == "fail_down":
                        fail_copy(base + scalars + 1)  # the first gradient leaf
                    else:
                        fail_copy(base + scalars + leaves + 2)  # after the version: the first params leaf
                        # Slow copies: the version's copy up, queued before the failing one, is still on the
                        # stream when the call returns unless the handler waits for it.
                        set_copy_delay_us(100_000)
                    before = store.version, store.read("param"), store.read("mu")
                try:
                    p2, s2 = step(p, s, jnp.float32(1.0))
                    jax.block_until_ready(p2)
                except Exception as e:  # noqa: BLE001
                    assert failing, f"{name}: step {t} failed unexpectedly: {e}"
                    errors.append(str(e))
                    pending = model_pending()
                    set_copy_delay_us(int(os.environ.get("NSP_CUDA_MODEL_DELAY_US", "0")))
                    after = store.version, store.read("param"), store.read("mu")
                    results[f"{name}/store_after_failure"] = after[1]
                    info[f"{name}/after_failure"] = {
                        "pending_copies": pending,
                        "version_before": int(before[0]), "version_after": int(after[0]),
                        "param_unchanged": bool(np.array_equal(before[1], after[1])),
                        "m_unchanged": bool(np.array_equal(before[2], after[2]))}
                    continue
                p, s = p2, s2
                for k, leaf in p.items():
                    results[f"{name}/step{t}/{k}"] = np.asarray(leaf)
                results[f"{name}/store_step{t}"] = store.read("param")
                t += 1
            results[f"{name}/store/param"] = store.read("param")
            results[f"{name}/version"] = np.asarray(store.version)
            info[name] = {"errors": errors, "where": where, "attempts": attempts}


def main():
    out = sys.argv[1]
    results, info = {}, {}
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
    for name, spec in cases().items():
        if only is None or name in only:
            run_case(name, spec, results, info)
    if only is None or "fail" in only:
        run_failures(results, info)
    info["_model"] = bool(MODEL)
    np.savez(os.path.join(out, "results.npz"), **results)
    with open(os.path.join(out, "info.json"), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main()
