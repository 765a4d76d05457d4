"""bench/gpu_step.py's contenders: ``Contender`` (a compiled step and what it carries from call to call),
``setup_contender`` (each one's optimizer, state and lowered step), what fits the machine (``resource_problem``,
``auto_shape``), and ``run_size``: one model size set up, compiled, warmed up and timed in interleaved rounds."""

from __future__ import annotations

import gc
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_step_common import (CONTENDERS, FWD_BWD, NSP_VARIANTS, OPTAX_HBM, OPTAX_PINNED,  # noqa: E402
                             STATE_BYTES_PER_PARAM, device_memory, failed, host_available_bytes, host_model,
                             log, loss_fn, make_train_step, memory_kinds, n_params_of, nsp, nsp_name, nsp_tx,
                             optax_tx, short_error, shardings)
from gpu_step_summary import print_size, summarize  # noqa: E402


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


