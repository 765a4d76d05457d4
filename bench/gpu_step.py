"""nsp's train step on an accelerator against optax with its state in HBM and optax with its state offloaded to
``pinned_host``: one command, under 5 minutes on one GPU, writing ``bench/results/gpu_step.json``.

    python bench/gpu_step.py                     # on the default JAX backend (a GPU where there is one)
    python bench/gpu_step.py --quick             # tiny model, few steps: a smoke run (CPU: under a minute)
    python bench/gpu_step.py --check-only        # only the params check (run it with NSP_KERNEL_ISA=portable too)

What it does, in order, writing the record after every part (a run cut short still leaves what it measured):

1. nsp: that ``import nsp`` works (the C++ extension built), the kernel ISA, the update threads.
2. The params check: 20 steps of the same small GPT with ``nsp.optim.adamw`` on a memory-tier store, once jitted on
   the benchmark's device (``--platform``, default the default JAX backend) and once on ``jax.devices("cpu")[0]``
   (the CPU path). Both runs feed the update the same gradients (those of the CPU run's forward/backward, step by
   step), so the comparison is of nsp's update path alone: bit for bit under ``NSP_KERNEL_ISA=portable``, else
   within 1e-6 relative. No gradient clipping in that chain (a global norm reduced on another device rounds
   differently). A second run with the forward/backward on the device too ("end to end") is reported beside it,
   not judged: an accelerator's fp32 dots (TF32 on a recent NVIDIA GPU) round differently from the CPU's.
   Where the default backend is the CPU, both runs are CPU runs: still a check of the code path, and the record
   says so.
3. A link probe: a gradient-sized fp32 buffer moved device -> ``pinned_host`` and back (``jax.device_put``), the
   roofline the link times are compared with.
4. At GPT-2 124M (``--size``) and then at the largest of ``--larger`` that fits what is left of
   ``--time-budget-s`` (estimated from the first size's own setup, compile and run times; when only part of the
   contenders fits, the file tier and Top-K ones are left out first, and the record says which and why), these
   contenders, timed interleaved (each round in a fresh seeded order), median of ``--repeats`` (>= 5) rounds
   after one warm-up call, each call ``--steps-per-call`` consecutive steps:

   - ``forward/backward``: ``jax.value_and_grad`` of the loss alone;
   - ``optax.adamw (HBM)``: ``nsp train``'s jitted step with ``optax.chain(clip_by_global_norm, adamw)``;
   - ``optax.adamw (pinned_host)``: MaxText's optimizer offload: the optax state placed with
     ``jax.device_put(x, NamedSharding(mesh, P(), memory_kind="pinned_host"))``, moved to device memory inside the
     jitted step for the update and back out to ``pinned_host`` as the step's output sharding;
   - ``nsp <tier>, s<staleness>, <dense|Top-K 1%>``: ``nsp.optim.adamw`` on a memory-tier and a file-tier store,
     staleness 0 and 1, dense and Top-K 1% (error feedback), after the same clipping. A call ends with
     ``store.barrier()`` (every update committed, the staleness-1 one too), timed as the drain; "steady" is a
     step between drains, as in a long run.

   Each contender's step is split into forward/backward (the forward/backward contender), link down (the gradient
   to the host), update, and link up (new params or state back): the update from the store's own counter
   (``update_ns``) for nsp, step - forward/backward for optax; link bytes from the store's counters
   (``shared_in_bytes``/``shared_out_bytes``) for nsp, the state's size for the pinned_host offload; link times
   from the store's counters where its handler keeps them, else the bytes at the link probe's GB/s (the record
   says which). The share of the update that staleness 1 hides is (t_fwd_bwd + t_update - t_step_stale1) /
   t_update, clipped to [0, 1], all from this run (t_update: the staleness-0 twin's update; t_step_stale1: its
   steady step).

Targets, judged at the batch x sequence the record names (``--batch``/``--seq``; by default batch 16 x 1024 tokens
at 124M, smaller batches at larger sizes where the attention's activations would not fit), for the headline
contender ``nsp memory, s1, dense``: staleness 1 hides >= 80% of the update (judged only where the
forward/backward takes at least as long as the update: the record says whether it does), its step <= 1.2x the
optax-in-HBM step, and faster than the pinned_host offload. A miss is written as MISSED.

Every contender runs inside its own try/except: an error becomes ``"status": "failed: <message>"`` and the run goes
on. Progress lines carry the time since start.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, disk_info, median, print_table, write_json  # noqa: E402

NAME = "gpu_step"
FWD_BWD = "forward/backward"
OPTAX_HBM = "optax.adamw (HBM)"
OPTAX_PINNED = "optax.adamw (pinned_host)"
REFERENCE = "nsp memory, s1, dense"  # the headline nsp contender: the targets are judged on it
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 1.0
TOPK_RATIO = 0.01
CHECK_TOLERANCE = 1e-6  # relative, when the kernel ISA is not "portable" (there: bit for bit)
HIDE_TARGET, HBM_RATIO_TARGET = 0.80, 1.20
STATE_BYTES_PER_PARAM = 24  # an nsp store: p, m, v in fp32, two version slots
# What is left out first when the whole set does not fit the time left (the rest is the core set).
OPTIONAL_ORDER = ("nsp file, s1, Top-K 1%", "nsp file, s0, Top-K 1%", "nsp file, s1, dense", "nsp file, s0, dense",
                  "nsp memory, s1, Top-K 1%", "nsp memory, s0, Top-K 1%")


def nsp_name(tier: str, staleness: int, topk: bool) -> str:
    return f"nsp {tier}, s{staleness}, {'Top-K 1%' if topk else 'dense'}"


NSP_VARIANTS = [(tier, staleness, topk) for tier in ("memory", "file") for topk in (False, True)
                for staleness in (0, 1)]
CONTENDERS = [FWD_BWD, OPTAX_HBM, OPTAX_PINNED] + [nsp_name(*v) for v in NSP_VARIANTS]


def short_error(e: BaseException, limit: int = 600) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " | ")
    return text if len(text) <= limit else text[:limit] + " ..."


def failed(e: BaseException) -> str:
    return "failed: " + short_error(e)


# ---- nsp ------------------------------------------------------------------------------------------------------

try:
    import nsp  # noqa: F401
    import nsp.optim
    import nsp.primitives
    import nsp.storage
    from flax import nnx
    from nsp.models import GPT, get_config
    from nsp.train.trainer import loss_fn, make_train_step

    NSP_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001  (the record says so; nothing else can run)
    NSP_IMPORT_ERROR = e
    traceback.print_exc()


def nsp_info() -> dict[str, Any]:
    if NSP_IMPORT_ERROR is not None:
        return {"import": failed(NSP_IMPORT_ERROR)}
    out: dict[str, Any] = {"import": "ok"}
    here = os.path.dirname(os.path.abspath(nsp.__file__))
    out["installed_from_this_tree"] = os.path.realpath(here).startswith(os.path.realpath(str(REPO)))
    for key, fn in (("kernel_isa", nsp.primitives.kernel_isa), ("num_threads", nsp.primitives.get_num_threads),
                    ("engine_cpus", nsp.primitives.engine_cpus)):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001
            out[key] = failed(e)
    try:
        import importlib.metadata

        out["version"] = importlib.metadata.version("nsp")
    except Exception:  # noqa: BLE001
        out["version"] = None
    return out


# ---- the device -----------------------------------------------------------------------------------------------

def memory_kinds(device) -> list[str]:
    try:
        return [m.kind for m in device.addressable_memories()]
    except Exception:  # noqa: BLE001
        return []


def device_kind_name(device) -> str:
    """The device's own memory kind (``"device"`` on a GPU; XLA:CPU names it too)."""
    try:
        return device.default_memory().kind
    except Exception:  # noqa: BLE001
        return "device"


def shardings(device):
    """(device-memory sharding, pinned_host sharding) of a one-device mesh over ``device``, as MaxText builds them."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array([device]), ("data",))
    return (NamedSharding(mesh, P(), memory_kind=device_kind_name(device)),
            NamedSharding(mesh, P(), memory_kind="pinned_host"))


def device_memory(device) -> dict[str, Any] | None:
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001
        return None
    if not stats:
        return None
    return {k: stats[k] for k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use", "largest_alloc_size")
            if k in stats}


def host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# ---- the model ------------------------------------------------------------------------------------------------

def model_config(name: str, seq: int):
    cfg = get_config(name)
    return cfg if cfg.block_size >= seq else get_config(name, block_size=seq)


def host_model(name: str, seq: int):
    """(graphdef, params as numpy arrays, config): the same model for every contender, built on the CPU."""
    cfg = model_config(name, seq)
    with jax.default_device(jax.devices("cpu")[0]):
        graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        params = jax.tree_util.tree_map(np.asarray, params)
    return graphdef, params, cfg


def n_params_of(params) -> int:
    return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params)))


def optax_tx():
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, weight_decay=WEIGHT_DECAY))


def nsp_tx(store, staleness: int, topk: bool):
    compression = nsp.optim.TopK(TOPK_RATIO) if topk else None
    return optax.chain(optax.clip_by_global_norm(CLIP),
                       nsp.optim.adamw(LR, weight_decay=WEIGHT_DECAY, store=store, compression=compression,
                                       staleness=staleness))


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


# ---- contenders -----------------------------------------------------------------------------------------------

class Contender:
    """One timed contender: a compiled step, the arrays it carries from call to call, its store (nsp)."""

    def __init__(self, name: str, steps_per_call: int):
        self.name = name
        self.steps_per_call = steps_per_call
        self.rec: dict[str, Any] = {"status": "pending", "steps_per_call": steps_per_call}
        self.store = None
        self.lowered = None
        self.compiled = None
        self.params = None
        self.state = None
        self.tokens = None
        self.times: list[float] = []
        self.drains: list[float] = []
        self.calls = 0

    @property
    def ok(self) -> bool:
        return self.rec["status"] in ("pending", "compiled", "ok")

    def fail(self, e: BaseException, where: str) -> None:
        self.rec["status"] = failed(e)
        self.rec["failed_in"] = where
        log(f"  {self.name}: FAILED in {where}: {short_error(e, 300)}")
        self.release()

    def release(self) -> None:
        self.lowered = self.compiled = self.params = self.state = None
        if self.store is not None:
            try:
                self.store.close()
            except Exception as e:  # noqa: BLE001
                self.rec.setdefault("close_error", short_error(e))
            self.store = None

    def call(self) -> None:
        """``steps_per_call`` steps, waited for; then (nsp) every update committed, timed as the drain."""
        if self.name == FWD_BWD:
            for _ in range(self.steps_per_call):
                out = self.compiled(self.params, self.tokens)
            jax.block_until_ready(out)
        else:
            for _ in range(self.steps_per_call):
                self.params, self.state, loss = self.compiled(self.params, self.state, self.tokens)
            jax.block_until_ready((self.params, loss))
            if self.store is not None:
                t0 = time.perf_counter()
                self.store.barrier()
                self.drains.append(time.perf_counter() - t0)
        self.calls += 1


def setup_contender(c: Contender, graphdef, params, tokens, device, workdir: str) -> None:
    """Builds ``c``'s optimizer, its state (an nsp store initialised with the params) and lowers its step."""
    loss = lambda p, t: loss_fn(graphdef, p, t)  # noqa: E731
    c.tokens = tokens
    c.params = jax.device_put(params, device)
    if c.name == FWD_BWD:
        c.lowered = jax.jit(jax.value_and_grad(loss)).lower(c.params, tokens)
        return
    if c.name == OPTAX_HBM:
        tx = optax_tx()
        c.state = tx.init(c.params)
        step, _ = make_train_step(graphdef, tx)
        c.lowered = step.lower(c.params, c.state, tokens)
        return
    if c.name == OPTAX_PINNED:
        if "pinned_host" not in memory_kinds(device):
            raise RuntimeError(f"{device.platform} device has no pinned_host memory (memories: {memory_kinds(device)})")
        dev_s, host_s = shardings(device)
        tx = optax_tx()
        c.params = jax.device_put(params, dev_s)
        c.state = jax.device_put(tx.init(c.params), host_s)  # the optimizer state lives in pinned host memory

        def offload_step(p, s, t):
            value, grads = jax.value_and_grad(loss)(p, t)
            s = jax.device_put(s, dev_s)  # to device memory for the update
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value  # s goes back out to pinned_host (out_shardings)

        step = jax.jit(offload_step, donate_argnums=(0, 1), out_shardings=(dev_s, host_s, dev_s))
        c.lowered = step.lower(c.params, c.state, jax.device_put(tokens, dev_s))
        c.tokens = jax.device_put(tokens, dev_s)
        c.rec["state_bytes"] = int(sum(x.nbytes for x in jax.tree_util.tree_leaves(c.state)))
        return
    tier, staleness, topk = c.variant
    if tier == "file":
        c.store = nsp.storage.open(os.path.join(workdir, c.name.replace(" ", "_").replace(",", "")
                                                .replace("%", "pct")), tier="file")
    else:
        c.store = nsp.storage.open(tier="memory")
    tx = nsp_tx(c.store, staleness, topk)
    c.state = tx.init(c.params)
    step, _ = make_train_step(graphdef, tx)
    c.lowered = step.lower(c.params, c.state, tokens)


def resource_problem(name: str, n: int, workdir: str, planned: dict[str, int]) -> str | None:
    """Why ``name`` cannot run at ``n`` params here (disk for the file tier, host RAM for the memory tier), given
    what the contenders already set up hold (``planned``: bytes of disk and RAM); None when it fits."""
    need = STATE_BYTES_PER_PARAM * n
    if name.startswith("nsp file"):
        free = shutil.disk_usage(workdir).free - planned.get("disk", 0)
        if need * 1.15 > free:
            return f"skipped: its store needs ~{need / 2**30:.1f} GiB of disk, {max(free, 0) / 2**30:.1f} GiB free"
        planned["disk"] = planned.get("disk", 0) + need
    elif name.startswith("nsp memory"):
        avail = host_available_bytes()
        if avail is not None and need * 1.3 > avail - planned.get("ram", 0):
            return (f"skipped: its store needs ~{need / 2**30:.1f} GiB of host RAM, "
                    f"{max(avail - planned.get('ram', 0), 0) / 2**30:.1f} GiB available")
        planned["ram"] = planned.get("ram", 0) + need
    return None


ACTIVATION_SHARE = 0.6  # of the device allocator's limit, for one forward/backward's activations (an estimate)


def auto_shape(cfg, batch: int, seq: int, device) -> tuple[int, int, str]:
    """(batch, seq): ``batch`` x ``seq`` when its forward/backward's estimated activations (the naive attention's
    scores kept for the backward, the logits, ~24 floats per token and layer) fit ``ACTIVATION_SHARE`` of the
    device's memory; else the sequence halved (down to 256: the attention's share falls with it), then the batch.
    As given when the device reports no memory limit (a CPU)."""
    limit = (device_memory(device) or {}).get("bytes_limit")
    if not limit:
        return batch, seq, f"{batch} x {seq}: as given (the device reports no memory limit)"
    L, H, C, V = cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size

    def act_bytes(b: int, t: int) -> int:
        return 4 * b * t * (3 * L * H * t + 4 * V + 24 * L * C)

    b, t = batch, seq
    while act_bytes(b, t) > ACTIVATION_SHARE * limit and (t > 256 or b > 1):
        if t > 256:
            t //= 2
        else:
            b //= 2
    why = (f"{batch} x {seq} fits" if (b, t) == (batch, seq) else f"{batch} x {seq} cut to {b} x {t}") + \
        (f" (activations ~{act_bytes(b, t) / 2**30:.1f} GiB; {ACTIVATION_SHARE:.0%} of {limit / 2**30:.0f} GiB "
         "of device memory allowed)")
    return b, t, why


def stats_times(stats: dict[str, Any]) -> tuple[tuple[str, int] | None, tuple[str, int] | None, dict[str, int]]:
    """Time counters in a store's stats beyond the engine's own: (down key, ns), (up key, ns), all of them. A
    handler that times its copies names them with ``_ns`` keys (h2d/d2h, copy_in/copy_out, ...)."""
    engine = {"update_ns", "sync_ns", "commit_ns", "wait_ns"}
    extra = {k: v for k, v in stats.items() if k.endswith("_ns") and k not in engine and isinstance(v, (int, float))}
    down = up = None
    for key, value in extra.items():
        words = set(key.removesuffix("_ns").split("_"))
        if words & {"d2h", "down", "in", "grad", "grads", "gradient"} and down is None:
            down = (key, value)
        elif words & {"h2d", "up", "out", "params"} and up is None:
            up = (key, value)
    return down, up, extra


# ---- one size -------------------------------------------------------------------------------------------------

def run_size(key: str, model: str, batch: int, seq: int, device, args, names: list[str], skipped: dict[str, str],
             deadline: float, probe: dict[str, Any] | None, record: dict[str, Any], save: Callable[[], None],
             workdir_root: str) -> dict[str, Any]:
    """Sets up, compiles and times ``names`` at ``model``; returns the size's record (also kept in ``record``)."""
    t_start = time.perf_counter()
    graphdef, params, cfg = host_model(model, seq)
    n = n_params_of(params)
    size_rec: dict[str, Any] = {"model": model, "params": n, "batch": batch, "seq": seq,
                                "tokens_per_step": batch * seq, "contenders": {}, "timing_s": {}}
    record["sizes"][key] = size_rec
    rng = np.random.default_rng(1)
    tokens = jax.device_put(jnp.asarray(rng.integers(0, cfg.vocab_size, size=(batch, seq + 1)), jnp.int32), device)
    workdir = tempfile.mkdtemp(prefix=f"{key}-", dir=workdir_root)
    contenders: dict[str, Contender] = {}
    planned: dict[str, int] = {}
    for name in CONTENDERS:
        if name in skipped:
            size_rec["contenders"][name] = {"status": skipped[name]}
            continue
        k = args.file_steps_per_call if name.startswith("nsp file") else args.steps_per_call
        c = Contender(name, k)
        c.variant = next((v for v in NSP_VARIANTS if nsp_name(*v) == name), None)
        contenders[name] = c
        size_rec["contenders"][name] = c.rec
        problem = resource_problem(name, n, workdir, planned)
        if problem:
            c.rec["status"] = problem
            log(f"  {name}: {problem}")
    live = lambda: [c for c in contenders.values() if c.ok]  # noqa: E731
    log(f"{key}: {model}, {n / 1e6:.1f}M params, batch {batch} x {seq} tokens; setting up {len(live())} contenders")
    try:
        # 1. Set up and lower, one after the other (tracing is Python).
        for c in live():
            if time.perf_counter() > deadline - 5:
                c.rec["status"] = "skipped: time budget spent before its set-up"
                continue
            t0 = time.perf_counter()
            try:
                setup_contender(c, graphdef, params, tokens, device, workdir)
                c.rec["setup_s"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                c.fail(e, "set-up")
                traceback.print_exc()
            save()
        size_rec["timing_s"]["setup"] = time.perf_counter() - t_start
        log(f"{key}: set up ({size_rec['timing_s']['setup']:.1f} s); compiling {len(live())} steps")

        # 2. Compile: the first step alone (on a GPU it fills XLA's autotuning cache, which the others then find),
        # the rest several at once (XLA compiles outside the GIL).
        t0 = time.perf_counter()

        def compile_one(c: Contender):
            t = time.perf_counter()
            compiled = c.lowered.compile()
            return compiled, time.perf_counter() - t

        todo = [c for c in live() if c.lowered is not None]
        workers = 1 if args.serial_compile else max(1, min(len(todo), 4, os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {}
            for i, c in enumerate(todo):
                futures[c.name] = pool.submit(compile_one, c)
                if i == 0:
                    futures[c.name].exception()  # waits for it (its error, if any, is taken below)
            for c in todo:
                try:
                    c.compiled, c.rec["compile_s"] = futures[c.name].result()
                    c.lowered = None
                    c.rec["status"] = "compiled"
                except Exception as e:  # noqa: BLE001
                    if workers > 1:  # once more on its own, in case compiling beside others was the trouble
                        try:
                            c.compiled, c.rec["compile_s"] = compile_one(c)
                            c.lowered = None
                            c.rec["status"] = "compiled"
                            c.rec["compile_note"] = f"compiled alone after failing beside others: {short_error(e)}"
                            continue
                        except Exception as e2:  # noqa: BLE001
                            e = e2
                    c.fail(e, "compile")
        size_rec["timing_s"]["compile"] = time.perf_counter() - t0
        size_rec["compile_workers"] = workers
        log(f"{key}: compiled ({size_rec['timing_s']['compile']:.1f} s, {workers} at once)")
        save()

        # 3. Warm up: one call each.
        t_run = time.perf_counter()
        for c in live():
            t0 = time.perf_counter()
            try:
                c.call()
                c.rec["warmup_s"] = time.perf_counter() - t0
                c.rec["status"] = "ok"
                log(f"  warm: {c.name}: {c.rec['warmup_s'] / c.steps_per_call * 1e3:.1f} ms/step")
            except Exception as e:  # noqa: BLE001
                c.fail(e, "warm-up")
                traceback.print_exc()
            save()
        for c in live():
            if c.store is not None:
                c.store.reset_stats()
            c.drains.clear()

        # 4. Timed rounds, interleaved in a fresh seeded order each round.
        order_rng = random.Random(0)
        rounds = 0
        for r in range(args.repeats):
            if time.perf_counter() > deadline and rounds >= 1:
                size_rec["rounds_note"] = (f"stopped after {rounds} of {args.repeats} rounds: the time budget was "
                                           "spent (fewer than the protocol's 5)")
                log(f"{key}: {size_rec['rounds_note']}")
                break
            order = [c.name for c in live()]
            order_rng.shuffle(order)
            for name in order:
                c = contenders[name]
                t0 = time.perf_counter()
                try:
                    c.call()
                    c.times.append(time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001
                    c.fail(e, f"timed round {r + 1}")
                    traceback.print_exc()
            rounds += 1
            log(f"{key}: round {rounds}/{args.repeats} done")
            summarize(size_rec, contenders, probe, device)
            save()
        size_rec["rounds"] = rounds
        size_rec["timing_s"]["run"] = time.perf_counter() - t_run
        summarize(size_rec, contenders, probe, device)
        size_rec["device_memory"] = device_memory(device)
        save()
        print_size(key, size_rec)
    finally:
        for c in contenders.values():
            try:
                c.release()
            except Exception as e:  # noqa: BLE001
                c.rec.setdefault("close_error", short_error(e))
        contenders.clear()
        gc.collect()
        shutil.rmtree(workdir, ignore_errors=True)
        size_rec["timing_s"]["total"] = time.perf_counter() - t_start
    return size_rec


def summarize(size_rec: dict[str, Any], contenders: dict[str, Contender], probe: dict[str, Any] | None,
              device) -> None:
    """Fills each contender's figures (medians per step, split, link) and the size's targets from the times so
    far."""
    recs = size_rec["contenders"]
    for c in contenders.values():
        rec = c.rec
        if not c.times:
            continue
        k = c.steps_per_call
        rec["times_s"] = list(c.times)
        rec["step_ms"] = median(c.times) / k * 1e3
        if c.drains:
            drains = c.drains[-len(c.times):]
            rec["drain_ms"] = median(drains) * 1e3
            rec["steady_step_ms"] = median([t - d for t, d in zip(c.times, drains)]) / k * 1e3
        if c.store is not None:
            try:
                stats = c.store.stats()
                rec["stats"] = stats
                shard = c.store.shard_stats()
                backend = [s.get("backend") for s in shard if s.get("backend")]
                if backend:
                    rec["backend_stats"] = backend
            except Exception as e:  # noqa: BLE001
                rec["stats_error"] = short_error(e)

    fb = recs.get(FWD_BWD, {}).get("step_ms")
    size_rec["fwd_bwd_ms"] = fb
    for name, rec in recs.items():
        if "step_ms" not in rec or name == FWD_BWD:
            continue
        step = rec.get("steady_step_ms", rec["step_ms"])
        split: dict[str, Any] = {"fwd_bwd_ms": fb, "step_ms": step}
        link: dict[str, Any] = {}
        stats = rec.get("stats")
        if stats is not None:
            updates = stats.get("updates") or 0
            if updates:
                split["update_ms"] = stats.get("update_ns", 0) / updates / 1e6
                split["update_source"] = "store stats update_ns per update"
                split["wait_ms"] = stats.get("wait_ns", 0) / updates / 1e6
                link["down_bytes"] = stats.get("shared_in_bytes", 0) / updates
                link["up_bytes"] = stats.get("shared_out_bytes", 0) / updates
                link["bytes_source"] = "store stats shared_in_bytes / shared_out_bytes per update"
                down, up, extra = stats_times(stats)
                if extra:
                    link["time_counters"] = extra
                for side, found in (("down", down), ("up", up)):
                    if found is not None:
                        split[f"{side}_ms"] = found[1] / updates / 1e6
                        split[f"{side}_source"] = f"store stats {found[0]}"
            rec["params_adopted"] = stats.get("params_adopted")
        elif fb is not None:
            split["update_ms"] = max(step - fb, 0.0)
            split["update_source"] = "step - forward/backward (the update and any copies it needs)"
            if name == OPTAX_PINNED and rec.get("state_bytes"):
                link["down_bytes"] = link["up_bytes"] = rec["state_bytes"]
                link["bytes_source"] = ("the optax state's size: moved to the device before the update, back to "
                                        "pinned_host after it")
        if probe is not None and "down_bytes" in link:
            for side in ("down", "up"):
                if f"{side}_ms" not in split and probe.get(f"{side}_GBps"):
                    gbps = probe[f"{side}_GBps"] if name != OPTAX_PINNED else probe[
                        "up_GBps" if side == "down" else "down_GBps"]  # the offload moves state up first
                    split[f"{side}_ms"] = link[f"{side}_bytes"] / gbps / 1e6
                    split[f"{side}_source"] = "bytes at the link probe's GB/s (an estimate, not a counter)"
        for side in ("down", "up"):
            if split.get(f"{side}_ms") and link.get(f"{side}_bytes") is not None:
                link[f"{side}_GBps"] = link[f"{side}_bytes"] / (split[f"{side}_ms"] / 1e3) / 1e9
                link[f"{side}_GBps_source"] = ("the store's time counter" if "store stats" in split[f"{side}_source"]
                                               else "the link probe's (no counter to measure it by)")
        rec["split"] = split
        rec["link"] = link

    ref = recs.get(REFERENCE, {})
    ref_ms = ref.get("steady_step_ms", ref.get("step_ms"))
    for name, rec in recs.items():
        if "step_ms" in rec and ref_ms:
            rec["x_nsp"] = rec.get("steady_step_ms", rec["step_ms"]) / ref_ms

    # The share of the update staleness 1 hides, per staleness-1 contender.
    for tier, _, topk in NSP_VARIANTS:
        s0, s1 = recs.get(nsp_name(tier, 0, topk), {}), recs.get(nsp_name(tier, 1, topk), {})
        if "step_ms" not in s1 or fb is None:
            continue
        t_update = s0.get("split", {}).get("update_ms") or s1.get("split", {}).get("update_ms")
        if not t_update:
            continue
        t_s1 = s1.get("steady_step_ms", s1["step_ms"])
        s1["hidden_share"] = min(max((fb + t_update - t_s1) / t_update, 0.0), 1.0)
        s1["hidden_share_raw"] = (fb + t_update - t_s1) / t_update
        s1["hidden_share_inputs_ms"] = {"fwd_bwd": fb, "update": t_update, "step_stale1_steady": t_s1,
                                        "update_from": "staleness-0 twin" if s0.get("split", {}).get("update_ms")
                                        else "its own store's update_ns"}
        if "steady_step_ms" in s1:
            s1["hidden_share_with_drain"] = min(max((fb + t_update - s1["step_ms"]) / t_update, 0.0), 1.0)
        # The same question asked of everything the update adds to a step (its copies and the step's other work
        # around the store included): the share of (staleness-0 step - forward/backward) that staleness 1 removes.
        if "step_ms" in s0:
            t_s0 = s0.get("steady_step_ms", s0["step_ms"])
            if t_s0 > fb:
                s1["hidden_share_of_step_cost"] = min(max((t_s0 - t_s1) / (t_s0 - fb), 0.0), 1.0)

    size_rec["targets"] = judge(recs, fb)


def judge(recs: dict[str, Any], fb: float | None) -> dict[str, Any]:
    """The issue's targets on the headline contender (REFERENCE)."""
    ref = recs.get(REFERENCE, {})
    out: dict[str, Any] = {"contender": REFERENCE}
    if "step_ms" not in ref:
        out["status"] = f"not judged: {REFERENCE} {ref.get('status', 'did not run')}"
        return out
    ref_ms = ref.get("steady_step_ms", ref["step_ms"])
    twin = recs.get(nsp_name("memory", 0, False), {})
    update = twin.get("split", {}).get("update_ms") or ref.get("split", {}).get("update_ms")
    regime = fb is not None and update is not None and fb >= update
    out["regime"] = {"fwd_bwd_ms": fb, "update_ms": update, "fwd_bwd_at_least_update": regime}
    hidden = ref.get("hidden_share")
    if hidden is None:
        out["hides"] = {"status": "not judged: no hidden share measured"}
    elif not regime:
        out["hides"] = {"value": hidden, "target": HIDE_TARGET,
                        "status": "not judged: the forward/backward is shorter than the update at this batch x seq "
                                  f"({'MISSED' if hidden < HIDE_TARGET else 'met'} if it were)"}
    else:
        out["hides"] = {"value": hidden, "target": HIDE_TARGET, "status": "met" if hidden >= HIDE_TARGET else "MISSED"}
    hbm = recs.get(OPTAX_HBM, {}).get("step_ms")
    if hbm:
        ratio = ref_ms / hbm
        out["vs_hbm"] = {"ratio": ratio, "target": HBM_RATIO_TARGET,
                         "status": "met" if ratio <= HBM_RATIO_TARGET else "MISSED"}
    else:
        out["vs_hbm"] = {"status": f"not judged: {OPTAX_HBM} {recs.get(OPTAX_HBM, {}).get('status')}"}
    pinned = recs.get(OPTAX_PINNED, {}).get("step_ms")
    if pinned:
        ratio = ref_ms / pinned
        out["vs_pinned_host"] = {"ratio": ratio, "target": "< 1", "status": "met" if ratio < 1 else "MISSED"}
    else:
        out["vs_pinned_host"] = {"status": f"not judged: {OPTAX_PINNED} {recs.get(OPTAX_PINNED, {}).get('status')}"}
    # Every nsp contender against both optax contenders, for the record.
    out["all_nsp"] = {name: {"x_hbm": (rec.get("steady_step_ms", rec["step_ms"]) / hbm) if hbm else None,
                             "x_pinned_host": (rec.get("steady_step_ms", rec["step_ms"]) / pinned) if pinned else None}
                      for name, rec in recs.items() if name.startswith("nsp") and "step_ms" in rec}
    return out


def print_size(key: str, size_rec: dict[str, Any]) -> None:
    rows = []
    for name, rec in size_rec["contenders"].items():
        split, link = rec.get("split", {}), rec.get("link", {})
        status = rec.get("status", "")
        rows.append({"contender": name, "status": "ok" if status == "ok" else status[:40],
                     "step": rec.get("steady_step_ms", rec.get("step_ms")), "drain": rec.get("drain_ms"),
                     "x_nsp": rec.get("x_nsp"),
                     "fb": split.get("fwd_bwd_ms") if name != FWD_BWD else rec.get("step_ms"),
                     "down": split.get("down_ms"), "update": split.get("update_ms"), "up": split.get("up_ms"),
                     "down_mb": link.get("down_bytes", 0) / 1e6 if "down_bytes" in link else None,
                     "up_mb": link.get("up_bytes", 0) / 1e6 if "up_bytes" in link else None,
                     "down_gbps": link.get("down_GBps"), "up_gbps": link.get("up_GBps"),
                     "hidden": rec["hidden_share"] * 100 if "hidden_share" in rec else None})
    print_table(
        f"{key}: {size_rec['model']}, {size_rec['params'] / 1e6:.1f}M params, batch {size_rec['batch']} x "
        f"{size_rec['seq']} tokens, median of {size_rec.get('rounds')} interleaved rounds per step (nsp: steady, "
        "between drains); x nsp: the ratio to " + REFERENCE, rows,
        [("contender", "contender", ""), ("status", "status", ""), ("step", "step ms", ".2f"),
         ("x_nsp", "x nsp", ".2f"), ("fb", "fwd/bwd ms", ".2f"), ("down", "link down ms", ".2f"),
         ("update", "update ms", ".2f"), ("up", "link up ms", ".2f"), ("drain", "drain ms", ".2f"),
         ("down_mb", "down MB", ".1f"), ("up_mb", "up MB", ".1f"), ("down_gbps", "down GB/s", ".1f"),
         ("up_gbps", "up GB/s", ".1f"), ("hidden", "s1 hides %", ".0f")])
    t = size_rec.get("targets", {})
    regime = t.get("regime", {})
    if regime:
        longer = regime.get("fwd_bwd_at_least_update")
        print(f"  regime: forward/backward {fmt(regime.get('fwd_bwd_ms'))} ms vs update {fmt(regime.get('update_ms'))}"
              f" ms: forward/backward {'>=' if longer else '<'} update at batch {size_rec['batch']} x "
              f"{size_rec['seq']}")
    for what, label in (("hides", f"staleness 1 hides >= {HIDE_TARGET:.0%} of the update"),
                        ("vs_hbm", f"{REFERENCE} <= {HBM_RATIO_TARGET}x {OPTAX_HBM}"),
                        ("vs_pinned_host", f"{REFERENCE} faster than {OPTAX_PINNED}")):
        item = t.get(what, {})
        value = item.get("value", item.get("ratio"))
        print(f"  target: {label}: {fmt(value, '.3f')} -> {item.get('status', t.get('status'))}")
    for name, rec in size_rec["contenders"].items():
        if "hidden_share" in rec:
            of_step = rec.get("hidden_share_of_step_cost")
            print(f"  {name}: hides {rec['hidden_share']:.0%} of the update (its staleness-0 twin's update_ns), "
                  f"{fmt(None if of_step is None else of_step * 100, '.0f')}% of what the update adds to the "
                  "staleness-0 step")
    for name, rec in size_rec["contenders"].items():
        if "split" in rec and name.startswith("nsp"):
            srcs = {k: v for k, v in rec["split"].items() if k.endswith("_source")}
            if srcs:
                print(f"  {name}: " + "; ".join(f"{k.removesuffix('_source')} from {v}" for k, v in srcs.items()))
            break


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


# ---- main -----------------------------------------------------------------------------------------------------

def plan_larger(first: dict[str, Any], candidates: list[str], seq: int, batch_wanted: int, device, remaining: float,
                workdir_root: str) -> tuple[str | None, list[str], dict[str, Any]]:
    """The largest of ``candidates`` whose estimated time fits ``remaining`` seconds: with every contender, else
    with the core set. The estimate scales the first size's set-up and run by the params and its compile by the
    layers; returns (model, contenders to leave out, the estimates)."""
    timing, n1 = first.get("timing_s", {}), first["params"]
    layers1 = model_config(first["model"], first["seq"]).n_layer
    ran = [name for name, rec in first["contenders"].items() if "step_ms" in rec or rec.get("status") == "ok"]
    setup = {name: first["contenders"][name].get("setup_s", 0.0) for name in ran}
    run = {name: first["contenders"][name].get("warmup_s", 0.0) + sum(first["contenders"][name].get("times_s", []))
           for name in ran}
    compile_each = timing.get("compile", 0.0) / max(len(ran), 1)
    estimates: dict[str, Any] = {}
    for model in candidates:
        try:
            cfg = model_config(model, seq)
        except Exception as e:  # noqa: BLE001
            estimates[model] = {"error": short_error(e)}
            continue
        n = cfg.num_params()
        r_n, r_l = n / n1, cfg.n_layer / layers1
        b, t, _ = auto_shape(cfg, batch_wanted, seq, device)
        r_run = r_n * (b * t) / (first["batch"] * first["seq"])  # the forward/backward scales with the tokens too
        planned: dict[str, int] = {}
        fits = [name for name in ran if resource_problem(name, n, workdir_root, planned) is None]

        def store_init_s(name: str) -> float:  # writing the state into a store: ~1 GB/s to disk, ~4 GB/s in RAM
            rate = 1e9 if name.startswith("nsp file") else 4e9 if name.startswith("nsp") else math.inf
            return STATE_BYTES_PER_PARAM * (n - n1) / rate

        # Tracing and compiling grow with the layers, the steps with the params and tokens.
        cost = {name: setup[name] * r_l + store_init_s(name) + run[name] * r_run + compile_each * r_l
                for name in fits}
        whole = sum(cost.values()) + 10.0
        left_out: list[str] = [name for name in ran if name not in fits]
        total = whole
        for name in OPTIONAL_ORDER:
            if total <= remaining:
                break
            if name in cost:
                total -= cost[name]
                left_out.append(name)
        estimates[model] = {"params": n, "batch": b, "seq": t, "estimate_all_s": whole, "estimate_s": total,
                            "left_out_for_time": [x for x in left_out if x in fits], "left_out_for_resources":
                            [x for x in ran if x not in fits], "remaining_s": remaining}
        if total <= remaining:
            return model, left_out, estimates
    return None, [], estimates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke run")
    parser.add_argument("--platform", default=None,
                        help="the JAX platform to benchmark on (default: the default backend)")
    parser.add_argument("--out", "--json", dest="out", default=None,
                        help=f"where the record goes (default bench/results/{NAME}.json)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="the larger size runs only if its estimate fits what is left of this, and no round "
                             "starts after it (default 270; --quick: 120)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default=None, help="the first size (default gpt2-124m; --quick: tiny)")
    parser.add_argument("--larger", default=None,
                        help="comma-separated candidates for the larger size, largest first, or 'none' "
                             "(default gpt2-1.5b,gpt2-774m,gpt2-355m; --quick: small)")
    parser.add_argument("--batch", type=int, default=None, help="batch (default 16; --quick: 8); the sequence, "
                        "then the batch, is halved where the activations would not fit the device's memory")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; --quick: 64)")
    parser.add_argument("--steps-per-call", type=int, default=None, help="steps per timed call (default 3; "
                        "--quick: 2)")
    parser.add_argument("--file-steps-per-call", type=int, default=2, help="steps per timed call, file tier")
    parser.add_argument("--check-steps", type=int, default=20)
    parser.add_argument("--check-model", default=None, help="the params check's model (default small; --quick: tiny)")
    parser.add_argument("--check-only", action="store_true", help="only the params check")
    parser.add_argument("--serial-compile", action="store_true", help="compile the contenders one at a time")
    parser.add_argument("--dir", default=None, help="where the file-tier stores go (default: a temp dir here)")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be >= 5 (the benchmark protocol)")
    args.size = args.size or ("tiny" if args.quick else "gpt2-124m")
    larger = args.larger or ("small" if args.quick else "gpt2-1.5b,gpt2-774m,gpt2-355m")
    larger_candidates = [] if larger == "none" else [m.strip() for m in larger.split(",") if m.strip()]
    args.batch = args.batch or (8 if args.quick else 16)
    args.seq = args.seq or (64 if args.quick else 1024)
    args.steps_per_call = args.steps_per_call or (2 if args.quick else 3)
    check_model = args.check_model or ("tiny" if args.quick else "small")
    args.time_budget_s = args.time_budget_s or (120.0 if args.quick else 270.0)
    deadline = T0 + args.time_budget_s

    def on_term(signum, frame):  # a timeout's SIGTERM: leave through the finally blocks (record, temp files)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)

    platform = args.platform or jax.default_backend()
    record: dict[str, Any] = {"quick": args.quick, "status": "running", "nsp": nsp_info(), "sizes": {},
                              "skipped": {}, "config": {
                                  "time_budget_s": args.time_budget_s, "repeats": args.repeats,
                                  "steps_per_call": args.steps_per_call,
                                  "file_steps_per_call": args.file_steps_per_call, "batch": args.batch,
                                  "seq": args.seq, "first_size": args.size, "larger_candidates": larger_candidates,
                                  "check_model": check_model, "check_steps": args.check_steps, "lr": LR,
                                  "weight_decay": WEIGHT_DECAY, "clip": CLIP, "topk_ratio": TOPK_RATIO,
                                  "reference": REFERENCE}}
    out_path = {"path": None}

    def save() -> None:
        record["elapsed_s"] = time.perf_counter() - T0
        try:
            out_path["path"] = write_json(NAME, record, args.out)
        except Exception as e:  # noqa: BLE001
            log(f"could not write the record: {short_error(e)}")

    try:
        device = jax.devices(platform)[0]
        record["platform"] = device.platform
        record["device_kind"] = device.device_kind
        record["device"] = {"platform": device.platform, "device_kind": device.device_kind,
                            "count": len(jax.devices(platform)), "memory_kinds": memory_kinds(device),
                            "memory": device_memory(device), "default_backend": jax.default_backend()}
        if device.platform == "cpu":
            record["platform_note"] = (
                "the benchmark ran on the CPU: the params check compares CPU with CPU, and the pinned_host "
                "contender moves nothing (XLA:CPU's device memory and pinned_host are both host RAM)")
    except Exception as e:  # noqa: BLE001
        record["status"] = failed(e)
        save()
        log(f"no {platform} device: {short_error(e)}")
        return 2
    log(f"platform {device.platform} ({device.device_kind}), jax {jax.__version__}; nsp: {record['nsp']}")
    if NSP_IMPORT_ERROR is not None:
        record["status"] = "failed: import nsp: " + short_error(NSP_IMPORT_ERROR)
        save()
        return 2
    save()

    isa = record["nsp"].get("kernel_isa", "unknown")
    try:
        record["params_check"] = {"status": "running"}
        record["params_check"] = params_check(check_model, args.check_steps, 4, min(args.seq, 64), device, isa)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        record["params_check"] = {"status": failed(e), "model": check_model, "steps": args.check_steps}
        log(f"params check: {record['params_check']['status']}")
    save()
    if args.check_only:
        record["status"] = "done (--check-only)"
        save()
        log(f"wrote {out_path['path']}")
        return 0

    workdir_root = tempfile.mkdtemp(prefix="nsp-gpu-step-", dir=args.dir or os.getcwd())
    try:
        try:
            cfg1 = model_config(args.size, args.seq)
            b1, t1, why1 = auto_shape(cfg1, args.batch, args.seq, device)
            record["probe"] = link_probe(device, cfg1.num_params(), 5)
            log(f"link probe: {record['probe']['bytes'] / 1e6:.0f} MB down {record['probe']['down_GBps']:.1f} GB/s, "
                f"up {record['probe']['up_GBps']:.1f} GB/s")
        except Exception as e:  # noqa: BLE001
            record["probe"] = {"status": failed(e)}
            b1, t1, why1 = args.batch, args.seq, "as given"
        save()
        first = None
        try:
            first = run_size(args.size, args.size, b1, t1, device, args, CONTENDERS, {}, deadline,
                             record.get("probe") if "bytes" in record.get("probe", {}) else None, record, save,
                             workdir_root)
            first["shape_choice"] = why1
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record["sizes"].setdefault(args.size, {})["status"] = failed(e)
        save()

        remaining = deadline - time.perf_counter()
        if not larger_candidates:
            record["skipped"]["larger size"] = "none asked for (--larger none)"
        elif first is None or not any("step_ms" in r for r in first.get("contenders", {}).values()):
            record["skipped"]["larger size"] = "the first size measured nothing to estimate from"
        else:
            model, left_out, estimates = plan_larger(first, larger_candidates, args.seq, args.batch, device,
                                                     remaining, workdir_root)
            record["larger_size_plan"] = estimates
            if model is None:
                record["skipped"]["larger size"] = (
                    f"no candidate fits the {remaining:.0f} s left of the {args.time_budget_s:.0f} s budget: "
                    + "; ".join(f"{m} ~{e.get('estimate_s', math.nan):.0f} s" for m, e in estimates.items()))
                log(f"larger size skipped: {record['skipped']['larger size']}")
            else:
                b, t, why = auto_shape(model_config(model, args.seq), args.batch, args.seq, device)
                skipped = {name: ("skipped: does not fit the time left at this size (its estimate)"
                                  if name in estimates[model]["left_out_for_time"] else
                                  "skipped: not enough disk or host RAM at this size")
                           for name in left_out}
                skipped.update({name: "skipped: it did not run at the first size" for name in CONTENDERS
                                if name not in skipped and "step_ms" not in first["contenders"].get(name, {})})
                log(f"larger size: {model} (estimate {estimates[model]['estimate_s']:.0f} s of {remaining:.0f} s "
                    f"left; {len(left_out)} contenders left out)")
                try:
                    size = run_size(model, model, b, t, device, args, CONTENDERS, skipped, deadline,
                                    record.get("probe") if "bytes" in record.get("probe", {}) else None, record,
                                    save, workdir_root)
                    size["shape_choice"] = why
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    record["sizes"].setdefault(model, {})["status"] = failed(e)
        record["status"] = "done"
    except BaseException as e:
        record["status"] = f"interrupted: {short_error(e)}"
        raise
    finally:
        shutil.rmtree(workdir_root, ignore_errors=True)
        record["summary"] = summary_lines(record)
        save()
        print()
        for line in record["summary"]:
            print(line)
        log(f"wrote {out_path['path']}")
    return 0


def summary_lines(record: dict[str, Any]) -> list[str]:
    lines = [f"platform {record.get('platform')} ({record.get('device_kind')}); params check: "
             f"{record.get('params_check', {}).get('status')}"]
    for key, size in record.get("sizes", {}).items():
        t = size.get("targets", {})
        parts = []
        for what in ("hides", "vs_hbm", "vs_pinned_host"):
            item = t.get(what, {})
            value = item.get("value", item.get("ratio"))
            parts.append(f"{what} {fmt(value, '.3f')}: {item.get('status', t.get('status', '-'))}")
        failed_ = [n for n, r in size.get("contenders", {}).items() if str(r.get("status", "")).startswith("failed")]
        lines.append(f"{key} (batch {size.get('batch')} x {size.get('seq')}): " + "; ".join(parts)
                     + (f"; failed: {', '.join(failed_)}" if failed_ else ""))
    for what, why in record.get("skipped", {}).items():
        lines.append(f"skipped {what}: {why}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
