"""FlashNeuron's offload planner, per block: which blocks' residuals go to the spill area, and in which format,
so that the step fits a memory budget and the disk keeps up with the forward pass.

``profile_blocks`` runs one profiling pass (nothing is trained) and measures what the plan needs:

- each block's residual bytes (what ``offload`` would spill, traced abstractly) and, on a real batch, how many
  of them are zeros (the bit-vector sparse format stores a 2-byte array with a fraction ``z`` of zeros in
  ``(1 - z) * 2 + 1/8`` bytes per element; 4-byte arrays likewise), so its size in that format;
- each block's forward and backward compute time (its jitted forward, and its VJP, on that batch);
- what a spill costs the step: a block's residuals pushed to and popped from the spill area through the FFI
  calls, timed, raw and sparse; and the disk's own write rate (a file written in the spill directory as the
  area writes: by direct I/O where it can, else synced), which the spilled bytes must not outrun during the
  forward pass;
- the step's memory: the process's peak resident memory once a forward/backward with every block offloaded ran,
  and what keeping blocks adds to it (XLA's memory analysis of the compiled forward/backward without offload and
  with every block offloaded).

``plan_offload`` then picks, as FlashNeuron's two phases do: phase 1 offloads blocks from the first on (their
residuals are read last in the backward pass, so read-ahead has the most time) until the predicted peak fits the
budget; phase 2, where the spilled bytes would take the disk longer than the forward pass, switches to the sparse
format when that shrinks them enough (models with ReLU), or says by how much the disk falls behind. The plan
predicts the peak resident memory and the forward/backward time; ``nsp plan --activations`` prints it and, after
a run, what the run measured beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

import nsp.rss
from nsp.offload.area import SpillArea
from nsp.offload.blocks import block_function, offload_blocks
from nsp.offload.wrap import MIN_SPILL_BYTES, _to_spill
from nsp.primitives.spill import spill_load, spill_save

#: Bytes the disk-rate probe writes and syncs in the spill directory.
DISK_PROBE_BYTES = 64 * 2**20

#: Timed runs (after a warm-up) of a block's push and pop, and of the step with every block offloaded: the
#: median is what the plan uses.
SPILL_REPEATS = 3
STEP_REPEATS = 2


@dataclasses.dataclass(frozen=True)
class BlockProfile:
    """One block, measured: residual bytes raw and in the sparse format, forward and backward seconds."""

    index: int
    bytes: int
    sparse_bytes: int
    forward_s: float
    backward_s: float


@dataclasses.dataclass(frozen=True)
class Profile:
    """What ``plan_offload`` needs, as ``profile_blocks`` measured it.

    Attributes:
      blocks: per block, in the model's order.
      save_s_per_byte, load_s_per_byte: what pushing and popping a byte of residuals costs the step (the FFI
        calls, on the calling thread: a copy into the entry's image and back, the disk's work on the area's I/O
        thread; for an entry over the area's image limit, a copy into the page cache and back); ``*_sparse``:
        the same in the sparse format, per byte before it.
      disk_write_bytes_per_s: the spill directory's disk, written and synced.
      rss_bytes: the process's peak resident memory while a forward/backward with every block offloaded ran
        (params, store buffers, libraries, that step's own memory; from the process's start where the peak cannot
        be restarted).
      profiling_peak_bytes: the process's peak over the whole profiling (one block's VJP run eagerly, the
        compilations): a one-time peak before the first step.
      keep_bytes, all_bytes: XLA's forward/backward temporaries and outputs without offload, and with every
        block offloaded.
      base_s: the forward/backward's seconds without offload, as measured with every block offloaded less what
        its spill calls cost (the blocks' own timings, jitted one by one, add up to more than the fused step).
      activation: the model's MLP nonlinearity (the sparse format is worth trying only after a ReLU).
    """

    blocks: tuple[BlockProfile, ...]
    save_s_per_byte: float
    load_s_per_byte: float
    save_s_per_byte_sparse: float
    load_s_per_byte_sparse: float
    disk_write_bytes_per_s: float
    rss_bytes: int
    keep_bytes: int
    all_bytes: int
    base_s: float
    activation: str = "gelu"
    profiling_peak_bytes: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        data = dict(data)
        data["blocks"] = tuple(BlockProfile(**b) for b in data["blocks"])
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which blocks to offload and how, and what that predicts.

    Attributes:
      layers: the blocks offloaded (indices).
      sparse: whether they go in the sparse format.
      predicted_peak_bytes: the process's peak resident memory predicted for a step.
      predicted_fwd_bwd_s: the forward/backward's seconds predicted (the update's come on top).
      budget_bytes: the budget planned for.
      fits: whether the predicted peak fits the budget.
      notes: what each phase decided, in words.
    """

    layers: tuple[int, ...]
    sparse: bool
    predicted_peak_bytes: int
    predicted_fwd_bwd_s: float
    budget_bytes: int
    fits: bool
    notes: tuple[str, ...]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        data = dict(data)
        data["layers"], data["notes"] = tuple(data["layers"]), tuple(data["notes"])
        return cls(**data)


def parse_budget(text: str) -> int:
    """``"6GiB"``, ``"6G"``, ``"6000MB"``, ``"512MiB"`` or a byte count as bytes. Raises ``ValueError``."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "b": 1, "": 1}
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("kmgtib")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not value > 0:
        raise ValueError(f"a memory budget must be a size such as 6GiB, 6000MB or 512MiB, got {text!r}")
    return int(value * units[unit])


def available_budget() -> int:
    """``auto``'s budget: the process's resident memory now plus 90% of the memory the system has available."""
    available = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        raise ValueError("cannot read MemAvailable from /proc/meminfo: give --offload-activations a budget")
    return nsp.rss.current_bytes() + int(0.9 * available)


def _median_time(fn: Callable[[], Any], repeats: int = 3, *, warm_up: bool = True) -> float:
    if warm_up:
        jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sparse_size(x: jax.Array) -> int:
    """``x``'s bytes in the bit-vector sparse format where that is smaller (``ffi/offload/spill_codec.h``): the
    non-zero values plus one bit per element."""
    raw = x.size * x.dtype.itemsize
    if x.dtype.itemsize not in (2, 4):
        return raw
    nonzero = int(jnp.count_nonzero(x))
    return min(raw, nonzero * x.dtype.itemsize + -(-x.size // 8))


def _disk_write_rate(directory: Path, direct: bool) -> float:
    """Bytes per second of a file written in ``directory`` as a spill area there writes its entries: by direct
    I/O when ``direct`` (the area found the file system takes it), else through the page cache and synced (then
    removed)."""
    import mmap

    block = mmap.mmap(-1, 4 * 2**20)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(len(block)))
    fd, path = tempfile.mkstemp(prefix="nsp-disk-probe-", dir=directory)
    os.close(fd)
    fd = os.open(path, os.O_WRONLY | (os.O_DIRECT if direct else 0))
    try:
        t0 = time.perf_counter()
        for _ in range(DISK_PROBE_BYTES // len(block)):
            os.write(fd, block)
        os.fsync(fd)
        return DISK_PROBE_BYTES / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
        block.close()


def _memory(compiled) -> int:
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def profile_blocks(model, loss_of: Callable[..., jax.Array], params, batch, spill_dir: str | os.PathLike,
                   log: Callable[[str], None] = print) -> Profile:
    """Measures ``model``'s blocks for ``plan_offload`` (module docstring). Nothing is trained.

    Args:
      model: the ``nnx`` GPT (its blocks are ``model.h``), merged from ``params``.
      loss_of: ``loss_of(params, batch, block_call)`` -> the scalar loss (``nsp.train.step.loss_fn`` bound to
        the graph).
      params: the params the step differentiates.
      batch: a real batch (the zeros of the sparse format are counted on its activations).
      spill_dir: where the spill area will be (its disk is probed).
      log: progress lines.
    """
    blocks = list(model.h)
    n = len(blocks)
    tokens = batch[:, :-1]
    x = model.wte.embedding[...][tokens].astype(model.config.dtype)
    x = x + model.wpe.embedding[...][: tokens.shape[1]].astype(model.config.dtype)[None]

    # Block 0's residuals on the real batch: their bytes, zeros, and what spilling them costs. (The GPT's blocks
    # are alike in shape; each block's own zero count is measured below, as its input flows through.)
    log(f"offload planner: profiling {n} blocks on a batch of {tokens.shape[0]} x {tokens.shape[1]} tokens")
    profiles, io = [], None
    fwd_bwd_each = None
    with SpillArea(spill_dir) as area:
        for i, block in enumerate(blocks):
            apply, state = block_function(block)
            y, vjp_fn = jax.vjp(apply, state, x)  # the residuals offload would spill, on the real activations
            leaves = jax.tree_util.tree_leaves(vjp_fn)
            spill = [leaves[j] for j in _to_spill(leaves, (state, x), MIN_SPILL_BYTES)]
            raw = sum(r.size * r.dtype.itemsize for r in spill)
            sparse = sum(_sparse_size(r) for r in spill)
            if fwd_bwd_each is None:  # the blocks are alike: one block's compute times stand for each
                forward = jax.jit(apply)
                backward = jax.jit(lambda s, h, ct: jax.vjp(apply, s, h)[1](ct))
                forward_s = _median_time(lambda: forward(state, x))
                # The VJP runs the block's forward pass again before its backward: what the backward adds is the rest.
                fwd_bwd_each = (forward_s, max(0.0, _median_time(lambda: backward(state, x, y)) - forward_s))
                io = _spill_costs(area, spill)
            profiles.append(BlockProfile(i, int(raw), int(sparse), *fwd_bwd_each))
            x = y
        vjp_fn = leaves = spill = None  # the last block's residuals: not to be held while the steps below run
        log(f"offload planner: a block spills {profiles[0].bytes / 1e6:,.1f} MB ({profiles[0].sparse_bytes / 1e6:,.1f} "
            f"MB sparse), forward {fwd_bwd_each[0] * 1e3:.1f} ms, backward {fwd_bwd_each[1] * 1e3:.1f} ms")

        grad = jax.value_and_grad(loss_of)
        keep = _memory(jax.jit(lambda p, b: grad(p, b, None)).lower(params, batch).compile())
        everything = offload_blocks(area)
        step_all = jax.jit(lambda p, b: grad(p, b, everything))
        all_bytes = _memory(step_all.lower(params, batch).compile())
        jax.block_until_ready(step_all(params, batch))  # a warm-up run, before the memory is handed back
        profiling_peak = nsp.rss.peak_bytes()
        nsp.rss.release_free_memory()
        # The step's own peak from here (where the system lets the peak restart): what the profiling held before
        # is gone by the first step, which is what the plan predicts for.
        nsp.rss.reset_peak()
        all_s = _median_time(lambda: step_all(params, batch), STEP_REPEATS, warm_up=False)
        peak_all = nsp.rss.peak_bytes()
        profiling_peak = max(profiling_peak, peak_all)
        area.reset()
        direct = area.direct_io
    disk = _disk_write_rate(Path(spill_dir), direct)
    spilled = sum(b.bytes for b in profiles)
    base = max(0.0, all_s - spilled * (io[0] + io[1]))
    log(f"offload planner: forward/backward holds {keep / 1e9:.2f} GB without offload, {all_bytes / 1e9:.2f} GB "
        f"with every block offloaded; the disk writes {disk / 1e9:.2f} GB/s")
    return Profile(tuple(profiles), io[0], io[1], io[2], io[3], disk, peak_all, keep, all_bytes, base,
                   model.config.activation, profiling_peak)


def _spill_costs(area: SpillArea, arrays: list[jax.Array]) -> tuple[float, float, float, float]:
    """Seconds per byte of pushing ``arrays`` to ``area`` and popping them back: raw, then sparse."""
    total = sum(a.size * a.dtype.itemsize for a in arrays) or 1
    like = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    out = []
    for sparse in (False, True):
        save = jax.jit(lambda *xs, s=sparse: spill_save(area.id, 10**6 + int(s), list(xs), sparse=s))
        load = jax.jit(lambda token, s=sparse: spill_load(area.id, 10**6 + int(s), token, token, like))
        jax.block_until_ready(load(save(*arrays)))  # compile both; the first push also creates the files
        saves, loads = [], []
        for _ in range(SPILL_REPEATS):  # a step's pushes reuse their files: time those, not the first
            t0 = time.perf_counter()
            token = jax.block_until_ready(save(*arrays))
            t1 = time.perf_counter()
            jax.block_until_ready(load(token))
            t2 = time.perf_counter()
            saves.append(t1 - t0)
            loads.append(t2 - t1)
        out += [statistics.median(saves) / total, statistics.median(loads) / total]
    return out[0], out[1], out[2], out[3]


def predict(profile: Profile, layers: tuple[int, ...], sparse: bool, extra_bytes: int = 0) -> tuple[int, float]:
    """``(peak resident bytes, forward/backward seconds)`` predicted for offloading ``layers``: the peak measured
    with every block offloaded, plus each kept block's share of what offloading every block saves (XLA's analyses
    of the two steps), plus ``extra_bytes`` the step's update holds beside (the store's page buffers); time: the
    step without offload plus the spill calls' cost of the bytes offloaded."""
    total = sum(b.bytes for b in profile.blocks) or 1
    kept = (profile.keep_bytes - profile.all_bytes) * (1 - sum(profile.blocks[i].bytes for i in layers) / total)
    peak = profile.rss_bytes + kept + extra_bytes
    per_byte = (profile.save_s_per_byte_sparse + profile.load_s_per_byte_sparse if sparse
                else profile.save_s_per_byte + profile.load_s_per_byte)
    seconds = profile.base_s + per_byte * sum(profile.blocks[i].bytes for i in layers)
    return int(peak), seconds


def plan_offload(profile: Profile, budget_bytes: int, extra_bytes: int = 0) -> Plan:
    """FlashNeuron's two phases over ``profile`` for a peak of at most ``budget_bytes`` (module docstring);
    ``extra_bytes``: what the step's update holds beside the forward/backward (the store's page buffers)."""
    n = len(profile.blocks)
    notes = []
    # Phase 1: offload blocks from the first on until the predicted peak fits.
    layers: tuple[int, ...] = ()
    for k in range(n + 1):
        layers = tuple(range(k))
        if predict(profile, layers, False, extra_bytes)[0] <= budget_bytes:
            break
    peak, _ = predict(profile, layers, False, extra_bytes)
    fits = peak <= budget_bytes
    if not layers:
        notes.append(f"phase 1: the step fits {budget_bytes / 2**30:.2f} GiB without offload")
    elif fits:
        notes.append(f"phase 1: offloading blocks 0-{layers[-1]} ({len(layers)} of {n}) brings the peak to "
                     f"{peak / 2**30:.2f} GiB, within {budget_bytes / 2**30:.2f} GiB")
    else:
        notes.append(f"phase 1: even with all {n} blocks offloaded the peak is {peak / 2**30:.2f} GiB, over "
                     f"{budget_bytes / 2**30:.2f} GiB: lower the batch or sequence, or raise the budget")
    # Phase 2: the bytes spilled during the forward pass should not outrun the disk.
    sparse = False
    if layers:
        forward = sum(profile.blocks[i].forward_s for i in range(n))
        raw = sum(profile.blocks[i].bytes for i in layers)
        packed = sum(profile.blocks[i].sparse_bytes for i in layers)
        need = raw / profile.disk_write_bytes_per_s
        if need <= forward:
            notes.append(f"phase 2: {raw / 1e9:.2f} GB spilled take the disk {need:.2f} s, within the forward "
                         f"pass's {forward:.2f} s")
        elif profile.activation == "relu" and packed < raw:
            sparse = True
            need = packed / profile.disk_write_bytes_per_s
            verdict = "within" if need <= forward else "still over"
            notes.append(f"phase 2: raw, the disk needs {raw / profile.disk_write_bytes_per_s:.2f} s, over the "
                         f"forward pass's {forward:.2f} s; the sparse format ({packed / 1e9:.2f} GB) needs "
                         f"{need:.2f} s, {verdict} it")
        else:
            notes.append(f"phase 2: the disk needs {need:.2f} s for {raw / 1e9:.2f} GB, over the forward pass's "
                         f"{forward:.2f} s, and no smaller format applies: the page cache absorbs the rest while it "
                         "has room, after that the disk sets the pace")
    peak, seconds = predict(profile, layers, sparse, extra_bytes)
    return Plan(layers, sparse, peak, seconds, int(budget_bytes), fits, tuple(notes))


def write_plan(path: str | os.PathLike, profile: Profile, plan: Plan) -> None:
    Path(path).write_text(json.dumps({"profile": profile.to_json(), "plan": plan.to_json()}, indent=1))


def read_plan(path: str | os.PathLike) -> tuple[Profile, Plan]:
    data = json.loads(Path(path).read_text())
    return Profile.from_json(data["profile"]), Plan.from_json(data["plan"])


def describe(plan: Plan, profile: Profile, measured: dict | None = None) -> str:
    """The plan as ``nsp plan --activations`` prints it: its blocks, bytes and predictions, and (``measured``:
    ``peak_rss_bytes``, ``fwd_bwd_s`` of a run) the measured values beside them."""
    n = len(profile.blocks)
    spilled = sum(profile.blocks[i].sparse_bytes if plan.sparse else profile.blocks[i].bytes for i in plan.layers)
    lines = [f"activation offload plan for a peak of at most {plan.budget_bytes / 2**30:.2f} GiB:",
             f"  blocks offloaded: {_ranges(plan.layers) or 'none'} ({len(plan.layers)} of {n}), "
             f"{'sparse format' if plan.sparse else 'raw'}, {spilled / 1e6:,.1f} MB a step",
             f"  a block's residuals: {profile.blocks[0].bytes / 1e6:,.1f} MB raw, "
             f"{profile.blocks[0].sparse_bytes / 1e6:,.1f} MB sparse" if profile.blocks else "  (no blocks)"]
    rows = [("peak resident memory", f"{plan.predicted_peak_bytes / 2**30:.2f} GiB",
             measured and measured.get("peak_rss_bytes"), lambda v: f"{v / 2**30:.2f} GiB",
             plan.predicted_peak_bytes),
            ("forward/backward", f"{plan.predicted_fwd_bwd_s:.3f} s", measured and measured.get("fwd_bwd_s"),
             lambda v: f"{v:.3f} s", plan.predicted_fwd_bwd_s)]
    for name, predicted, value, fmt, raw in rows:
        line = f"  {name}: predicted {predicted}"
        if value:
            line += f", measured {fmt(value)} (predicted / measured {raw / value:.2f})"
        lines.append(line)
    if profile.profiling_peak_bytes:
        lines.append(f"  the profiling itself peaked at {profile.profiling_peak_bytes / 2**30:.2f} GiB (once, before "
                     "the first step)")
    lines += [f"  {note}" for note in plan.notes]
    if not plan.fits:
        lines.append("  the plan does not fit its budget")
    return "\n".join(lines)


def _ranges(indices: tuple[int, ...]) -> str:
    out, start = [], None
    for i, k in enumerate(indices):
        if start is None:
            start = k
        if i + 1 == len(indices) or indices[i + 1] != k + 1:
            out.append(f"{start}" if start == k else f"{start}-{k}")
            start = None
    return ", ".join(out)
