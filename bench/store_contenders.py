"""The contenders of bench/store_update.py besides nsp's file tier: the raw disk, the perfect serial swap,
DeepSpeed's optimizer swap, and the memory group (the kernel alone, the memory tier three ways, its diagnostics).

Each is set up here and handed back as something to call once per round; bench/store_update.py times them
interleaved, derives the rooflines and writes the record. Every contender runs the same Adam step (LR, B1, B2,
EPS) with the same gradient, so that their params can be checked against each other at the end.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import deepspeed_swap
from adam_steps import nsp_adam_step, torch_fused_adam
from common import io_buffer, median

import nsp.storage
from nsp.primitives import store_update_leaves

LR = 1e-3
B1, B2, EPS = 0.9, 0.999, 1e-8


# ---- raw disk I/O: the probes and the perfect serial swap share it -----------------------------------------------

class Method(NamedTuple):
    """One way to move a file's bytes: sequential ``block``-sized requests, ``depth`` of them in flight (1: one
    after another on the calling thread; more: that many threads, each taking the next block when its request is
    done), direct (O_DIRECT, page-aligned buffers) or through the page cache; a write also says whether the file
    is made anew (its blocks allocated again) or rewritten in place, and ends with fsync."""

    write: bool
    direct: bool
    depth: int = 1
    fresh: bool = False

    @property
    def label(self) -> str:
        how = "O_DIRECT" if self.direct else ("buffered" if self.write else "buffered, uncached")
        if self.depth > 1:
            how += f", {self.depth} requests in flight"
        if not self.write:
            return how
        return f"{'new file' if self.fresh else 'rewrite in place'}, {how} + fsync"


def transfer(method: Method, path: str, size: int, block: int, buffer_for, pool: ThreadPoolExecutor | None) -> None:
    """Reads or writes ``size`` bytes of ``path`` the way ``method`` says; ``buffer_for(worker, offset)`` gives the
    memory of each request (page-aligned when direct)."""
    if method.write and method.fresh:
        try:
            os.unlink(path)  # a fresh file: the file system allocates its blocks anew
        except FileNotFoundError:
            pass
    flags = (os.O_WRONLY | os.O_CREAT) if method.write else os.O_RDONLY
    fd = os.open(path, flags | (os.O_DIRECT if method.direct else 0), 0o644)
    try:
        if not method.write and not method.direct:  # make sure nothing of it is cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def one(worker: int, offset: int) -> None:
            buf = memoryview(buffer_for(worker, offset))
            if method.write:
                if os.pwrite(fd, buf, offset) != block:
                    raise OSError(f"short write to {path}")
                return
            done = 0
            while done < block:
                got = os.preadv(fd, [buf[done:]], offset + done)
                if got <= 0:
                    raise OSError(f"short read from {path} at {offset + done}")
                done += got

        offsets = range(0, size, block)
        if method.depth == 1:
            for offset in offsets:
                one(0, offset)
        else:
            queue = iter(offsets)
            lock = threading.Lock()

            def worker(w: int) -> None:
                while True:
                    with lock:
                        offset = next(queue, None)
                    if offset is None:
                        return
                    one(w, offset)

            for f in [pool.submit(worker, w) for w in range(method.depth)]:
                f.result()
        if method.write:
            os.fsync(fd)
        if not method.direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def direct_io_works(directory: str) -> bool:
    path = os.path.join(directory, "direct_check.bin")
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except (OSError, AttributeError):
        return False
    try:
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()


class DiskProbe:
    """Sequential writes and reads of `size` bytes in `block`-sized requests.

    The disk's roofline is the fastest way it moves those bytes, so the probe measures each way an update could:
    writing a fresh file (new blocks to allocate), rewriting the file in place (blocks already allocated: what
    the file tier does with a page no snapshot shares), each direct (O_DIRECT) and buffered (+ fsync); reading
    direct and buffered (dropped from the page cache first); and, direct, with `depth` requests in flight (a disk
    can serve several at once: DeepSpeed's aio keeps 8 in flight, nsp's file tier pages_in_flight). The roofline
    takes the fastest write and read.

    The reads read a second file that ``refresh`` rewrites (untimed) right before each file-tier update, when
    that update writes the state the next round reads: both are read with the same writes in between, so a
    virtual disk's host-side cache helps the probe no more than it helps the update (reading recently written
    data measured up to 3-4x faster here than reading data a few GB of writes old).
    """

    def __init__(self, directory: str, size: int, block: int, depth: int, pool: ThreadPoolExecutor):
        self.path = os.path.join(directory, "raw_probe.bin")
        self.read_path = os.path.join(directory, "raw_read_probe.bin")
        self.block = block
        self.size = -(-size // block) * block  # whole blocks (O_DIRECT needs aligned lengths)
        self.depth = depth
        self.pool = pool
        self.bufs = [io_buffer(block) for _ in range(depth)]
        for i, b in enumerate(self.bufs):
            b.write(np.random.default_rng(1 + i).bytes(block))  # incompressible, like fp32 state
        self.writes = 0  # write calls so far: part of each block's stamp
        self.direct = direct_io_works(directory)
        self._side_by_side: tuple[list[ThreadPoolExecutor], list[mmap.mmap]] | None = None  # side_by_side's
        self._footprint: list[mmap.mmap] = []  # footprint's buffers
        self.by_name = {f"raw disk {'write' if m.write else 'read'}: {m.label}": m
                        for m in self.methods(write=True) + self.methods(write=False)}
        # Every timed call's duration, by method (calibration, warm-up and timed rounds alike).
        self.times: dict[str, list[float]] = {name: [] for name in self.by_name}

    def methods(self, write: bool) -> list[Method]:
        """Every method of that kind this file system takes."""
        directs = (False, True) if self.direct else (False,)
        out = [Method(write, d, 1, fresh) for fresh in ((True, False) if write else (False,)) for d in directs]
        if self.direct and self.depth > 1:
            out += [Method(write, True, self.depth, fresh) for fresh in ((True, False) if write else (False,))]
        return out

    def contenders(self, write: bool) -> dict[str, Callable[[], None]]:
        """One timed call per method of that kind, by name (``by_name``); each call's duration goes to ``times``."""
        def timed(name: str):
            def call() -> None:
                t0 = time.perf_counter()
                self.run(self.by_name[name])
                self.times[name].append(time.perf_counter() - t0)

            return call

        return {name: timed(name) for name, m in self.by_name.items() if m.write == write}

    def fastest(self, write: bool) -> Method:
        """The method of that kind with the smallest median time of its calls so far."""
        names = [name for name, m in self.by_name.items() if m.write == write]
        return self.by_name[min(names, key=lambda name: median(self.times[name]))]

    def run(self, method: Method, path: str | None = None) -> None:
        path = path or (self.path if method.write else self.read_path)
        self.writes += method.write
        transfer(method, path, self.size, self.block, self._stamped if method.write else self._buffer, self.pool)

    def _buffer(self, worker: int, offset: int) -> mmap.mmap:
        return self.bufs[worker]

    def _stamped(self, worker: int, offset: int) -> mmap.mmap:
        return self._stamp(self.bufs[worker], offset)

    def _stamp(self, buf: mmap.mmap, offset: int) -> mmap.mmap:
        """``buf`` with every 4 KiB stamped with (offset, write call): no two blocks the probe writes hold the same
        bytes, as no two pages of real state do (a virtual disk read a file of one repeated block at about half the
        speed of unique data: a probe of such a file would understate the disk)."""
        stamps = np.frombuffer(buf, np.uint64)[:: 4096 // 8]
        stamps[:] = (np.arange(stamps.size, dtype=np.uint64) + np.uint64(offset)) ^ np.uint64(self.writes << 40)
        return buf

    def refresh(self) -> None:
        """Rewrites the file the reads read (untimed, between rounds)."""
        self.run(Method(True, self.direct, 1, False), self.read_path)

    def footprint(self, buffers: int) -> dict[str, Callable[[], None]]:
        """Diagnostic contenders, not floor candidates: the roofline's direct read and in-place write, one request
        in flight, each request landing in the next of ``buffers`` page buffers in turn, as an updater's requests
        land in the page buffers it computes on, instead of in the one buffer the probes reuse.

        On a virtual disk whose host copies each request into the guest's memory, the destination's footprint can
        change the disk's speed: on a 2-core virtual machine (Firecracker guest), 63 reads of 4 MiB took 96 ms into
        one buffer and 124 ms into 24 in turn, writes 91 and 101 ms (interleaved, median of 7). Returns
        {name: call}, empty where the file system refuses direct I/O.
        """
        if not self.direct or buffers < 2:
            return {}
        bufs = [io_buffer(self.block) for _ in range(buffers)]
        for i, b in enumerate(bufs):
            b.write(np.random.default_rng(100 + i).bytes(self.block))
        self._footprint = bufs
        read, write = Method(False, True), Method(True, True)

        def in_turn(offset: int) -> mmap.mmap:
            return bufs[(offset // self.block) % buffers]

        def read_call() -> None:
            transfer(read, self.read_path, self.size, self.block, lambda worker, offset: in_turn(offset), None)

        def write_call() -> None:
            self.writes += 1
            transfer(write, self.path, self.size, self.block,
                     lambda worker, offset: self._stamp(in_turn(offset), offset), None)

        where = f"{buffers} buffers in turn (diagnostic)"
        return {f"raw disk read: {read.label}, {where}": read_call,
                f"raw disk write: {write.label.replace(' + fsync', '')}, {where} + fsync": write_call}

    def side_by_side(self) -> tuple[str, Method, Method, Callable[[], None]]:
        """A contender that reads the read file and rewrites the write file at the same time, each the way a
        pipelined updater would (direct where the file system takes it, ``depth`` requests in flight, in place).

        Compared with the same read and write one after the other, it says how much any overlap of reads with
        writes can win on this disk: a disk that serves both from one budget (measured here: a virtual disk whose
        reads and writes at once took as long as one after the other) gives a pipelined updater nothing over a
        serial swap but the compute it hides. Returns (name, read method, write method, the call).
        """
        depth = self.depth if self.direct else 1
        read, write = Method(False, self.direct, depth), Method(True, self.direct, depth, False)
        # Two pools and a second buffer set: the read must not wait for the write's workers, nor land in the
        # buffers the write is writing.
        pools = [ThreadPoolExecutor(n, thread_name_prefix="side-by-side") for n in (1, depth)]
        read_bufs = [io_buffer(self.block) for _ in range(depth)]
        self._side_by_side = (pools, read_bufs)
        name = f"raw disk read + write at once: {read.label}; {write.label}"

        def call() -> None:
            self.writes += 1
            reading = pools[0].submit(transfer, read, self.read_path, self.size, self.block,
                                      lambda worker, offset: read_bufs[worker], pools[1] if depth > 1 else None)
            transfer(write, self.path, self.size, self.block, self._stamped, self.pool)
            reading.result()

        return name, read, write, call

    def close(self) -> None:
        for b in self.bufs + self._footprint:
            b.close()
        if self._side_by_side is not None:
            pools, read_bufs = self._side_by_side
            for pool in pools:
                pool.shutdown()
            for b in read_bufs:
                b.close()


# ---- the perfect serial swap -------------------------------------------------------------------------------------

class PerfectSerialSwap:
    """p, m, v in three plain files; an update reads them whole, updates them in RAM, writes them whole + fsync.

    Reads and writes use the given methods (the raw probes' fastest), into and out of page-aligned buffers; the
    update is ``adam(step)`` on those buffers in place. Nothing overlaps, so its time is what a swapper that does
    not overlap I/O with compute could reach at best on this disk.
    """

    def __init__(self, directory: str, p0: np.ndarray, block: int, read: Method, write: Method,
                 pool: ThreadPoolExecutor):
        os.makedirs(directory, exist_ok=True)
        self.paths = [os.path.join(directory, f"{name}.bin") for name in ("p", "m", "v")]
        self.block = block
        self.read, self.write, self.pool = read, write, pool
        n = p0.size
        self.nbytes = n * 4
        assert self.nbytes % block == 0, "whole blocks only (O_DIRECT needs aligned lengths)"
        self._maps = [io_buffer(self.nbytes) for _ in range(3)]
        self.bufs = [np.frombuffer(m, np.float32) for m in self._maps]
        self.bufs[0][:] = p0
        self.version = 0
        self.phases: dict[str, list[float]] = {"read": [], "compute": [], "write+fsync": []}
        self.adam = None
        self._all(self.write)

    def _all(self, method: Method) -> None:
        for path, m in zip(self.paths, self._maps):
            view = memoryview(m)
            transfer(method, path, self.nbytes, self.block, lambda w, offset, v=view: v[offset:offset + self.block],
                     self.pool)

    def __call__(self) -> None:
        t0 = time.perf_counter()
        self._all(self.read)
        t1 = time.perf_counter()
        self.version += 1
        self.adam(self.version)
        t2 = time.perf_counter()
        self._all(self.write)
        t3 = time.perf_counter()
        self.phases["read"].append(t1 - t0)
        self.phases["compute"].append(t2 - t1)
        self.phases["write+fsync"].append(t3 - t2)

    def close(self) -> None:
        self.bufs = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view still alive (torch's); the mapping goes with the process
                pass


def in_ram_adam(bufs: list[np.ndarray], grad: np.ndarray, threads: int):
    """The fastest in-place Adam step on host arrays p, m, v that needs no copy: torch fused Adam on zero-copy
    views when torch is installed, else nsp fused_update under jit (which copies the arrays in and out). Returns
    (fn(step), description)."""
    torch_step, note = torch_fused_adam(*bufs[:1], grad, *bufs[1:], threads=threads, lr=LR, b1=B1, b2=B2, eps=EPS)
    if torch_step is not None:
        return torch_step, note
    kernel = nsp_adam_step(LR, B1, B2, EPS)
    g = jnp.asarray(grad)

    def jax_step(step: int) -> None:
        out = jax.block_until_ready(kernel(jnp.asarray(bufs[0]), g, jnp.asarray(bufs[1]), jnp.asarray(bufs[2]),
                                           step))
        for b, o in zip(bufs, out):
            np.copyto(b, np.asarray(o))

    return jax_step, f"nsp fused_update (copies the buffers in and out; torch {note})"


# ---- DeepSpeed's optimizer swap (bench/deepspeed_swap.py) --------------------------------------------------------

def _count(x: int) -> str:
    """4194304 -> '4M', 1000000000 -> '1e9' (how sub-group sizes are named in the rows)."""
    if x % 10**9 == 0:
        return f"{x // 10**9}e9"
    if x % 2**20 == 0:
        return f"{x // 2**20}M"
    return str(x)


def setup_deepspeed(args, work, p0: np.ndarray, threads: int):
    """DeepSpeed's optimizer swap in its three arrangements (name -> DeepSpeedOptimizerSwap), and what the record
    says about it (available, reason when not, version, defaults, each variant's configuration). Its swap files go
    under ``work.path``; their closing joins ``work.closers``."""
    if args.no_deepspeed:
        return {}, {"available": False, "reason": "left out (--no-deepspeed)"}
    print("DeepSpeed: loading its async_io and cpu_adam ops (the first use compiles them, minutes) ...", flush=True)
    t0 = time.perf_counter()
    info = deepspeed_swap.status()
    info["load_s"] = time.perf_counter() - t0
    if not info["available"]:
        return {}, info
    n = p0.size
    default = info["sub_group_size_default"]
    small = int(args.ds_sub_group)
    variants = [("serial", default, False), ("serial", small, False), ("pipelined", small, True)]
    swaps: dict[str, Any] = {}
    errors = {}
    for label, sub_group, pipelined in variants:
        groups = -(-n // sub_group)
        name = (f"DeepSpeed {label}, sub-group {_count(sub_group)}{' (default)' if sub_group == default else ''}: "
                f"{groups} x {_count(min(sub_group, n))}")
        try:
            swap = deepspeed_swap.DeepSpeedOptimizerSwap(
                os.path.join(work.path, f"deepspeed_{label}_{sub_group}"), p0, sub_group_numel=sub_group,
                pipelined=pipelined, lr=LR, betas=(B1, B2), eps=EPS, threads=threads)
        except Exception as e:  # noqa: BLE001  (what DeepSpeed raises varies; the record says what it was)
            errors[name] = f"{type(e).__name__}: {e}"
            continue
        work.closers.append(swap.close)
        swaps[name] = swap
    info["variants"] = {name: swap.describe() for name, swap in swaps.items()}
    if errors:
        info["errors"] = errors
    if not swaps:
        info["available"] = False
        info["reason"] = "; ".join(f"{k}: {v}" for k, v in errors.items())
    return swaps, info


# ---- the memory group: the kernel alone and the memory tier ------------------------------------------------------

MEMORY_NAMES = {
    "kernel": "kernel alone (fused_update in place, donated)",
    "mem_jit": "memory tier, jitted (params over the donated gradient)",
    "mem_in_place": "memory tier in place (in_place=True), jitted",
    "mem_jit_bf16": "memory tier, jitted, bf16 gradient and params (mixed precision)",
    "mem_in_place_bf16": "memory tier in place, jitted, bf16 gradient and params",
    "mem": "memory tier (store.update, numpy in and out)",
    "diag_out": "  diag: memory tier store.update, params_into reused",
    "diag_none": "  diag: memory tier store.update, no params out",
}


def memory_contenders(work, p0: np.ndarray, grad: np.ndarray, spec, page_bytes: int,
                      arrays: dict | None = None) -> dict[str, Callable[[], None]]:
    """The memory group, keyed as ``MEMORY_NAMES``: each call is one Adam step of its own state (stores opened in
    memory; their closing joins ``work.closers``). ``arrays`` receives, for the kernel alone, a function listing
    the arrays it streams (the stores' state is their own)."""
    n = p0.size

    def memory_store(**kw):
        store = nsp.storage.open(None, tier="memory", page_bytes=page_bytes, **kw)
        work.closers.append(store.close)
        store.initialize({"w": p0}, spec)
        assert store.layout.padded_total == n
        return store

    mem = memory_store()

    def memory_tier() -> None:
        mem.update(grad, version=mem.version, lr=LR, step=mem.version + 1)

    # The memory tier as the nsp.optim transforms drive it with one shard: a jitted store_update_leaves whose new
    # params are written over the donated gradient. Each round's params buffer is the next round's gradient (finite
    # values; their size does not matter to the speed), so no round allocates or copies anything. Both memory
    # layouts: two version slots (the default: replayable) and in place (one copy, no replay).
    def jitted_memory_update(in_place: bool, dtype=jnp.float32):
        store = memory_store(in_place=in_place)

        @functools.partial(jax.jit, donate_argnums=0)
        def leaves_step(g, version):
            (new_p,), committed = store_update_leaves(store, [g], version=version, lr=LR, step=version + 1)
            return new_p, committed

        state = {"g": jnp.asarray(grad, dtype), "version": 0}

        def run() -> None:
            new_p, committed = leaves_step(state["g"], state["version"])
            state["g"], state["version"] = new_p, int(committed)

        return run

    kernel = nsp_adam_step(LR, B1, B2, EPS)
    kstate = {"p": jnp.asarray(p0), "m": jnp.zeros(n, jnp.float32), "v": jnp.zeros(n, jnp.float32), "t": 0}
    kgrad = jnp.asarray(grad)

    if arrays is not None:
        arrays["kernel"] = lambda: [kstate["p"], kstate["m"], kstate["v"], kgrad]

    def kernel_alone() -> None:
        kstate["t"] += 1
        kstate["p"], kstate["m"], kstate["v"] = jax.block_until_ready(
            kernel(kstate["p"], kgrad, kstate["m"], kstate["v"], kstate["t"]))

    # Diagnostics: store.update with the new params written into one array touched once and reused, and with no
    # params out at all, against "mem" (a fresh array each call): what the params' copy out and a fresh array's
    # first touch add to the memory tier.
    diag = memory_store()
    diag_out = np.zeros(n, np.float32)

    def diag_update(params_into: np.ndarray | None) -> None:
        diag.update(grad, version=diag.version, lr=LR, step=diag.version + 1, params_out=params_into is not None,
                    params_into=params_into)

    return {
        "kernel": kernel_alone,
        "mem_jit": jitted_memory_update(False),
        "mem_in_place": jitted_memory_update(True),
        # Mixed precision, as a bf16 model trains: the gradient comes as bf16 and the new params go back as bf16
        # over it, so the pass moves 28 B/param like the kernel alone (fp32: 32, the params out in fp32).
        "mem_jit_bf16": jitted_memory_update(False, jnp.bfloat16),
        "mem_in_place_bf16": jitted_memory_update(True, jnp.bfloat16),
        "mem": memory_tier,
        "diag_out": lambda: diag_update(diag_out),
        "diag_none": lambda: diag_update(None),
    }
