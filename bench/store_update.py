"""State-store update: the file tier against the raw disk and a DeepSpeed-style swap, the memory tier against the
kernel alone, in one run.

    python bench/store_update.py             # 1.1 GiB of fp32 Adam state (96M params), median of 7
    python bench/store_update.py --quick     # ~256 MiB of state, median of 5, well under a minute

Contenders (median of N interleaved rounds after a warm-up, in two groups: the disk contenders, then the
contenders in RAM; the gradient is made once and never timed):
  raw disk writes    the bytes an update writes, sequential page-sized requests + fsync: a new file (its blocks
                     allocated anew) and a rewrite in place (blocks already allocated), each O_DIRECT from
                     page-aligned (mmap) buffers and buffered; the fastest is the roofline's write bandwidth
  raw disk reads     as many bytes read sequentially, O_DIRECT and buffered (uncached), from a file rewritten
                     right before each file-tier update (so it is as old as the state that update writes and
                     the next round reads); the fastest counts
  perfect update     derived: bytes read / read bandwidth + bytes written / write bandwidth (p, m, v are read and
                     written: 12 + 12 B/param; the gradient comes from RAM) -- the roofline of the file tier
  nsp file tier      store.update(grad, version=store.version, step=store.version + 1): read, compute and write
                     pages overlapped, then sync + commit of the new version
  DeepSpeed-style    the same file format (a second store's page files, through a ShardEngine): read all of p, m,
                     v into host buffers, Adam on them (DeepSpeedCPUAdam when installed, else torch fused Adam on
                     zero-copy views, else nsp fused_update), write them all back + sync -- nothing overlapped
  kernel alone       nsp fused_update in place under jax.jit with donated state (28 B/param)
  memory tier        the transforms' path: a jitted store_update_leaves (reads slot t, writes slot t+1, new
                     params over the donated gradient: 32 B/param) -- the target's figure; the same on a store
                     opened with in_place=True (one copy updated in place); and store.update (numpy gradient
                     in, a fresh numpy params array out)
  diagnostics        the memory-tier ShardEngine driven directly, with a reused params_out buffer and with no
                     param copy at all, to split the memory tier's overhead into its parts

Peak extra memory of the file tier is bounded by pages_in_flight x 3 x page_bytes (its preallocated buffers) plus
the params it returns (4 B/param); the run measures it (VmHWM after clear_refs) and reports ru_maxrss.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import mmap
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, print_table, time_interleaved, write_json  # noqa: E402

import nsp.storage  # noqa: E402
from nsp import _nsp_ffi  # noqa: E402
from nsp.primitives import (fused_update, get_num_threads, kernel_isa, set_num_threads,  # noqa: E402
                            store_update_leaves)

LR = 1e-3
B1, B2, EPS = 0.9, 0.999, 1e-8
ADAM = 0  # nsp.primitives.fused_update.KINDS["adam"]
STATE_BYTES_PER_PARAM = 12  # fp32 p, m, v

TARGET_FILE_PCT = 85.0
TARGET_MEMORY_PCT = 90.0


# ---- temporary directory, removed at exit (also on Ctrl-C / SIGTERM) ---------------------------------------------

class Workdir:
    """A temporary directory for stores and probe files, and everything that must be closed before removing it."""

    def __init__(self, parent: str):
        self.path = tempfile.mkdtemp(prefix=".nsp_store_bench_", dir=parent)
        self.closers: list = []
        self._removed = False
        atexit.register(self.cleanup)

    def cleanup(self) -> None:
        if self._removed:
            return
        self._removed = True
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # noqa: BLE001  (best effort at exit)
                pass
        self.closers.clear()
        shutil.rmtree(self.path, ignore_errors=True)


class Interrupted(KeyboardInterrupt):
    """SIGTERM / SIGHUP, turned into an exception so that the temporary files are removed on the way out."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_interrupt(signum, frame):  # noqa: ARG001
    raise Interrupted(signum)


# ---- memory accounting ---------------------------------------------------------------------------------------------

def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """ru_maxrss of this process, in bytes (kilobytes on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- raw disk probe -------------------------------------------------------------------------------------------------

class DiskProbe:
    """Sequential writes and reads of `size` bytes in `block`-sized requests.

    The disk's roofline is the fastest way it moves those bytes, so the probe measures each way an update could:
    writing a fresh file (new blocks to allocate), rewriting the file in place (blocks already allocated: what
    the file tier does with a page no snapshot shares), each direct (O_DIRECT) and buffered (+ fsync); reading
    direct and buffered (dropped from the page cache first). The roofline takes the fastest write and read.

    The reads read a second file that ``refresh`` rewrites (untimed) right before each file-tier update, when
    that update writes the state the next round reads: both are read with the same writes in between, so a
    virtual disk's host-side cache helps the probe no more than it helps the update (reading recently written
    data measured up to 3-4x faster here than reading data a few GB of writes old).
    """

    def __init__(self, directory: str, size: int, block: int):
        self.path = os.path.join(directory, "raw_probe.bin")
        self.read_path = os.path.join(directory, "raw_read_probe.bin")
        self.block = block
        self.size = -(-size // block) * block  # whole blocks (O_DIRECT needs aligned lengths)
        self.buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
        self.buf.write(np.random.default_rng(1).bytes(block))  # incompressible, like fp32 state
        self.direct = hasattr(os, "O_DIRECT") and self._direct_works(directory)

    def _direct_works(self, directory: str) -> bool:
        path = os.path.join(directory, "direct_check.bin")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError:
            return False
        try:
            os.write(fd, self.buf)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
            os.unlink(path)

    def writers(self) -> dict[str, Any]:
        """name -> callable, for every write method this file system takes."""
        out = {"new file, buffered + fsync": functools.partial(self.write, fresh=True, direct=False),
               "rewrite in place, buffered + fsync": functools.partial(self.write, fresh=False, direct=False)}
        if self.direct:
            out["new file, O_DIRECT + fsync"] = functools.partial(self.write, fresh=True, direct=True)
            out["rewrite in place, O_DIRECT + fsync"] = functools.partial(self.write, fresh=False, direct=True)
        return out

    def readers(self) -> dict[str, Any]:
        out = {"buffered, uncached": functools.partial(self.read, direct=False)}
        if self.direct:
            out["O_DIRECT"] = functools.partial(self.read, direct=True)
        return out

    def refresh(self) -> None:
        """Rewrites the file the reads read (untimed, between rounds)."""
        self.write(fresh=False, direct=self.direct, path=self.read_path)

    def write(self, *, fresh: bool, direct: bool, path: str | None = None) -> None:
        path = path or self.path
        if fresh:
            try:
                os.unlink(path)  # a fresh file: the file system allocates its blocks anew
            except FileNotFoundError:
                pass
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
        try:
            for i in range(self.size // self.block):
                if os.pwrite(fd, self.buf, i * self.block) != self.block:
                    raise OSError(f"short write to {path}")
            os.fsync(fd)
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def read(self, *, direct: bool) -> None:
        fd = os.open(self.read_path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            if not direct:  # make sure nothing of it is cached
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done = 0
            while done < self.size:
                got = os.preadv(fd, [self.buf], done)
                if got <= 0:
                    raise OSError(f"short read from {self.read_path} at {done}")
                done += got
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.buf.close()


# ---- the DeepSpeed-style swap ----------------------------------------------------------------------------------------

def make_host_adam(bufs: list[np.ndarray], grad: np.ndarray, threads: int):
    """An in-place Adam step on host arrays p, m, v (what ZeRO-Infinity runs between swap-in and swap-out).

    Returns (fn(step), description). Prefers DeepSpeedCPUAdam, then torch fused Adam, both on zero-copy views of
    the host buffers; falls back to nsp fused_update under jit (which copies the buffers into JAX arrays).
    """
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(threads)
        views = [torch.from_numpy(b) for b in bufs]
        param = torch.nn.Parameter(views[0])
        param.grad = torch.from_numpy(grad)
        assert param.data_ptr() == bufs[0].ctypes.data, "torch did not wrap the host buffer in place"
        opt, what = None, None
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt, what = DeepSpeedCPUAdam([param], lr=LR, betas=(B1, B2), eps=EPS), "DeepSpeedCPUAdam"
            opt.step()  # a trial step (the buffers are overwritten before every timed use): its op must build
            opt.state.clear()
        except Exception:  # noqa: BLE001  (deepspeed raises various errors when its ops cannot build)
            try:
                opt = torch.optim.Adam([param], lr=LR, betas=(B1, B2), eps=EPS, fused=True)
                what = f"torch {torch.__version__} fused Adam"
            except (RuntimeError, TypeError):
                opt = None
        if opt is not None:
            step_t = torch.zeros((), dtype=torch.float32)
            opt.state[param] = {"step": step_t, "exp_avg": views[1], "exp_avg_sq": views[2]}

            def torch_step(step: int) -> None:
                # The optimizers increment the step count before using it for bias correction.
                if what == "DeepSpeedCPUAdam":
                    opt.state[param]["step"] = step - 1
                else:
                    step_t.fill_(step - 1)
                opt.step()

            return torch_step, f"{what} on zero-copy views, {threads} threads"

    @functools.partial(jax.jit, donate_argnums=(0, 2, 3))
    def step_fn(p, g, m, v, t):
        return fused_update(p, g, m, v, kind="adam", step=t, lr=LR, b1=B1, b2=B2, eps=EPS)[:3]

    g = jnp.asarray(grad)

    def jax_step(step: int) -> None:
        out = jax.block_until_ready(step_fn(jnp.asarray(bufs[0]), g, jnp.asarray(bufs[1]), jnp.asarray(bufs[2]),
                                            step))
        for b, o in zip(bufs, out):
            np.copyto(b, np.asarray(o))

    return jax_step, "nsp fused_update (copies host buffers in and out: torch fused Adam unavailable)"


# ---- main -----------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~256 MiB of state, median of 5, one warm-up")
    parser.add_argument("--state-mib", type=float, default=None,
                        help="MiB of fp32 Adam state (p + m + v = 12 B/param); default 1152 (96M params), 256 --quick")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (>= 5; default 7, 5 --quick)")
    parser.add_argument("--dir", default=None,
                        help="directory on the file system to measure (a temporary folder is made in it and "
                             "removed at exit); default: the current directory")
    parser.add_argument("--pages-in-flight", type=int, default=nsp.storage.PAGES_IN_FLIGHT_DEFAULT,
                        help="file-tier pipeline depth (default: nsp's)")
    parser.add_argument("--page-mib", type=float, default=4.0, help="page size of the stores and probe requests")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: nsp's, all cores)")
    parser.add_argument("--json", default=None, help="where to write the JSON record")
    args = parser.parse_args()
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 7)
    if repeats < 5:
        parser.error("--repeats must be >= 5 (the protocol reports a median of at least 5)")
    warmup = 1 if args.quick else 2
    state_mib = args.state_mib if args.state_mib is not None else (256.0 if args.quick else 1152.0)
    page_bytes = int(args.page_mib * 2**20)
    page_elems = page_bytes // 4
    # Whole pages, so every page (and probe request) is full-sized.
    n = max(1, round(state_mib * 2**20 / STATE_BYTES_PER_PARAM / page_elems)) * page_elems
    if args.threads is not None:
        set_num_threads(args.threads)
    threads = get_num_threads()
    parent = os.path.abspath(args.dir or os.getcwd())
    if not os.path.isdir(parent):
        parser.error(f"--dir {parent} is not a directory")

    old_handlers = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    work = Workdir(parent)
    try:
        run(args, work, n, page_bytes, page_elems, repeats, warmup, threads)
    except KeyboardInterrupt as e:
        print("\ninterrupted; removing temporary files", file=sys.stderr)
        raise SystemExit(128 + getattr(e, "signum", signal.SIGINT)) from None
    finally:
        work.cleanup()
        for s, h in old_handlers.items():
            signal.signal(s, h)


def run(args, work: Workdir, n: int, page_bytes: int, page_elems: int, repeats: int, warmup: int,
        threads: int) -> None:
    rng = np.random.default_rng(0)
    p0 = rng.random(n, np.float32) - np.float32(0.5)
    grad = (rng.random(n, np.float32) - np.float32(0.5)) * np.float32(1e-2)  # made once, never timed
    spec = nsp.storage.OptimizerSpec("adam", b1=B1, b2=B2, eps=EPS)
    used = list(spec.states_used())
    state_bytes = n * STATE_BYTES_PER_PARAM
    print(f"fp32 Adam store update of {n / 2**20:.0f}M params ({state_bytes / 2**20:.0f} MiB of p, m, v), "
          f"{threads} kernel threads, ISA {kernel_isa()}, pages of {page_bytes / 2**20:g} MiB, "
          f"{args.pages_in_flight} in flight, median of {repeats} interleaved rounds after {warmup} warm-up")
    print(f"directory: {work.path}")

    # -- nsp file tier (created first, so that its first update's memory growth is measured cleanly)
    t0 = time.perf_counter()
    store = nsp.storage.open(os.path.join(work.path, "nsp"), tier="file", page_bytes=page_bytes,
                             pages_in_flight=args.pages_in_flight, checksum=True)
    work.closers.append(store.close)
    store.initialize({"w": p0}, spec)
    assert store.layout.padded_total == n

    rss_before = _status_kib("VmRSS")
    can_reset = _reset_peak_rss()
    stats0 = store.stats()
    # The first update allocates the pipeline buffers; it is also the file tier's first warm-up round.
    store.update(grad, version=store.version, lr=LR, step=store.version + 1)
    hwm = _status_kib("VmHWM")
    first_update_growth = (hwm - rss_before) * 1024 if can_reset and hwm and rss_before else None
    stats1 = store.stats()
    read_bytes = stats1["internal_read_bytes"] - stats0["internal_read_bytes"]
    write_bytes = stats1["internal_write_bytes"] - stats0["internal_write_bytes"]

    # -- DeepSpeed-style baseline: its own store files (same format), driven whole-array through a ShardEngine
    base_store = nsp.storage.open(os.path.join(work.path, "baseline"), tier="file", page_bytes=page_bytes,
                                  pages_in_flight=args.pages_in_flight, checksum=True)
    base_store.initialize({"w": p0}, spec)
    base_dir = str(base_store.shard_paths[0])
    base_store.close()
    base_engine = _nsp_ffi.ShardEngine("file", base_dir, n, page_elems, args.pages_in_flight, used, True)
    base_bufs = [np.empty(n, np.float32) for _ in range(3)]  # host buffers, allocated once (pinned in DeepSpeed)
    host_adam, base_note = make_host_adam(base_bufs, grad, threads)
    base_state = {"version": 0}
    base_phases: dict[str, list[float]] = {"read": [], "compute": [], "write+sync": []}

    def deepspeed_style() -> None:
        v = base_state["version"]
        src, dst = v % 2, (v + 1) % 2
        t0 = time.perf_counter()
        for s in range(3):
            base_engine.read_state(src, s, base_bufs[s])
        t1 = time.perf_counter()
        host_adam(v + 1)
        t2 = time.perf_counter()
        for s in range(3):
            base_engine.write_state(dst, s, base_bufs[s])
        base_engine.sync(dst)
        t3 = time.perf_counter()
        base_state["version"] = v + 1
        base_phases["read"].append(t1 - t0)
        base_phases["compute"].append(t2 - t1)
        base_phases["write+sync"].append(t3 - t2)

    def nsp_file() -> None:
        store.update(grad, version=store.version, lr=LR, step=store.version + 1)

    # -- raw disk
    probe = DiskProbe(work.path, max(read_bytes, write_bytes), page_bytes)
    work.closers.append(probe.close)
    probe.refresh()

    # -- memory tier and the kernel alone
    mem = nsp.storage.open(None, tier="memory", page_bytes=page_bytes)
    work.closers.append(mem.close)
    mem.initialize({"w": p0}, spec)

    def memory_tier() -> None:
        mem.update(grad, version=mem.version, lr=LR, step=mem.version + 1)

    # -- the memory tier as the nsp.optim transforms drive it with one shard: a jitted store_update_leaves whose
    # new params are written over the donated gradient. Each round's params buffer is the next round's gradient
    # (finite values; their size does not matter to the speed), so no round allocates or copies anything.
    # Both memory layouts: two version slots (the default: replayable) and in place (one copy, no replay).
    def jitted_memory_update(in_place: bool):
        store = nsp.storage.open(None, tier="memory", page_bytes=page_bytes, in_place=in_place)
        work.closers.append(store.close)
        store.initialize({"w": p0}, spec)

        @functools.partial(jax.jit, donate_argnums=0)
        def leaves_step(g, version):
            (new_p,), committed = store_update_leaves(store, [g], version=version, lr=LR, step=version + 1)
            return new_p, committed

        state = {"g": jnp.asarray(grad), "version": 0}

        def run() -> None:
            new_p, committed = leaves_step(state["g"], state["version"])
            state["g"], state["version"] = new_p, int(committed)

        return run

    memory_jit, memory_jit_in_place = jitted_memory_update(False), jitted_memory_update(True)

    kstate = {"p": jnp.asarray(p0), "m": jnp.zeros(n, jnp.float32), "v": jnp.zeros(n, jnp.float32), "t": 0}
    kgrad = jnp.asarray(grad)

    @functools.partial(jax.jit, donate_argnums=(0, 2, 3))
    def kernel_step(p, g, m, v, t):
        return fused_update(p, g, m, v, kind="adam", step=t, lr=LR, b1=B1, b2=B2, eps=EPS)[:3]

    def kernel_alone() -> None:
        kstate["t"] += 1
        kstate["p"], kstate["m"], kstate["v"] = jax.block_until_ready(
            kernel_step(kstate["p"], kgrad, kstate["m"], kstate["v"], kstate["t"]))

    # -- diagnostics: the memory-tier engine itself, with a reused params_out, and with no param copy
    diag = _nsp_ffi.ShardEngine("memory", "", n, page_elems, 2, used, False)
    diag.write_state(0, 0, p0)
    diag.write_state(0, 1, np.zeros(n, np.float32))
    diag.write_state(0, 2, np.zeros(n, np.float32))
    diag_out = np.zeros(n, np.float32)  # touched once, reused
    diag_state = {"version": 0}

    def diag_update(params_out) -> None:
        v = diag_state["version"]
        diag.update(v % 2, (v + 1) % 2, ADAM, LR, v + 1, B1, B2, EPS, 0.0, 0.0, False, False, grad=grad,
                    params_out=params_out)
        diag_state["version"] = v + 1

    setup_s = time.perf_counter() - t0
    writers = {f"raw disk write: {k}": fn for k, fn in probe.writers().items()}
    readers = {f"raw disk read: {k}": fn for k, fn in probe.readers().items()}
    names = {
        "nsp": "nsp file tier (update + commit)",
        "base": "DeepSpeed-style (read all, Adam, write all + sync)",
        "kernel": "kernel alone (fused_update in place, donated)",
        "mem_jit": "memory tier, jitted (params over the donated gradient)",
        "mem_in_place": "memory tier in place (in_place=True), jitted",
        "mem": "memory tier (store.update, numpy in and out)",
        "diag_out": "  diag: memory engine, params_out reused",
        "diag_none": "  diag: memory engine, no param copy",
    }
    # Two groups, each interleaved: the disk group, then the memory group (so that no contender in RAM shares a
    # round with the disk's write-back and page-cache work).
    disk_group = {**writers, **readers, names["nsp"]: nsp_file, names["base"]: deepspeed_style}
    memory_group = {
        names["kernel"]: kernel_alone,
        names["mem_jit"]: memory_jit,
        names["mem_in_place"]: memory_jit_in_place,
        names["mem"]: memory_tier,
        names["diag_out"]: lambda: diag_update(diag_out),
        names["diag_none"]: lambda: diag_update(None),
    }
    # One warm-up call each (the file tier had its own above, measuring memory), then the rest in time_interleaved.
    t0 = time.perf_counter()
    for name, fn in {**disk_group, **memory_group}.items():
        if name != names["nsp"]:
            fn()
    # The read probe's file is rewritten right before each file-tier update (why: DiskProbe's docstring).
    times = time_interleaved(disk_group, repeats=repeats, warmup=warmup - 1, before={names["nsp"]: probe.refresh})
    times.update(time_interleaved(memory_group, repeats=repeats, warmup=warmup - 1))
    timed_s = time.perf_counter() - t0
    for phase in base_phases.values():  # keep only the timed rounds' phases
        del phase[: len(phase) - repeats]
    med = {name: median(ts) for name, ts in times.items()}

    # -- derived figures
    # The disk's roofline: its fastest write and its fastest read of the probe's bytes.
    best_write = min(writers, key=lambda k: med[k])
    best_read = min(readers, key=lambda k: med[k])
    t_write, t_read = med[best_write], med[best_read]
    write_bw, read_bw = probe.size / t_write, probe.size / t_read
    perfect = read_bytes / read_bw + write_bytes / write_bw
    t_nsp, t_base = med[names["nsp"]], med[names["base"]]
    file_pct = perfect / t_nsp * 100
    base_pct = perfect / t_base * 100
    speedup = t_base / t_nsp
    # Per-round figures (each round's own probe), to show the spread.
    round_pct = [
        (read_bytes * tr / probe.size + write_bytes * tw / probe.size) / tn * 100
        for tr, tw, tn in zip(times[best_read], times[best_write], times[names["nsp"]])
    ]
    t_kernel, t_mem, t_mem_jit = med[names["kernel"]], med[names["mem"]], med[names["mem_jit"]]
    t_mem_in_place = med[names["mem_in_place"]]
    mem_pct = t_kernel / t_mem_jit * 100  # the transforms' path is the memory tier users run
    mem_in_place_pct = t_kernel / t_mem_in_place * 100
    mem_api_pct = t_kernel / t_mem * 100
    mem_pct_adj = mem_pct * 32 / 28  # the memory tier moves 32 B/param (the params out too), the kernel 28

    disk_bpp = (read_bytes + write_bytes) / n
    rows = [
        {"contender": k, "ms": med[k] * 1e3, "gbs": probe.size / med[k] / 1e9,
         "bpp": f"{probe.size / n:.0f} {'w' if k in writers else 'r'}",
         "vs": "fastest: the roofline's" if k in (best_write, best_read) else "-"}
        for k in (*writers, *readers)
    ] + [
        {"contender": "perfect update (bytes read/read bw + bytes written/write bw)", "ms": perfect * 1e3,
         "gbs": (read_bytes + write_bytes) / perfect / 1e9, "bpp": f"{disk_bpp:.0f}", "vs": "100% of disk"},
        {"contender": names["nsp"], "ms": t_nsp * 1e3, "gbs": (read_bytes + write_bytes) / t_nsp / 1e9,
         "bpp": f"{disk_bpp:.0f}", "mps": n / t_nsp / 1e6, "vs": f"{file_pct:.1f}% of disk"},
        {"contender": names["base"], "ms": t_base * 1e3, "gbs": (read_bytes + write_bytes) / t_base / 1e9,
         "bpp": f"{disk_bpp:.0f}", "mps": n / t_base / 1e6,
         "vs": f"{base_pct:.1f}% of disk; nsp {speedup:.2f}x"},
        {"contender": names["kernel"], "ms": t_kernel * 1e3, "gbs": n * 28 / t_kernel / 1e9, "bpp": "28",
         "mps": n / t_kernel / 1e6, "vs": "100% of kernel"},
        {"contender": names["mem_jit"], "ms": t_mem_jit * 1e3, "gbs": n * 32 / t_mem_jit / 1e9, "bpp": "32",
         "mps": n / t_mem_jit / 1e6, "vs": f"{mem_pct:.1f}% of kernel"},
        {"contender": names["mem_in_place"], "ms": t_mem_in_place * 1e3, "gbs": n * 32 / t_mem_in_place / 1e9,
         "bpp": "32", "mps": n / t_mem_in_place / 1e6, "vs": f"{mem_in_place_pct:.1f}% of kernel"},
        {"contender": names["mem"], "ms": t_mem * 1e3, "gbs": n * 32 / t_mem / 1e9, "bpp": "32",
         "mps": n / t_mem / 1e6, "vs": f"{mem_api_pct:.1f}% of kernel"},
    ]
    for key, bpp in (("diag_out", 32), ("diag_none", 28)):
        t = med[names[key]]
        rows.append({"contender": names[key], "ms": t * 1e3, "gbs": n * bpp / t / 1e9, "bpp": str(bpp),
                     "mps": n / t / 1e6, "vs": f"{t_kernel / t * 100:.1f}% of kernel"})
    print_table(
        "Store update (median of interleaved rounds)",
        rows,
        [("contender", "contender", ""), ("ms", "median ms", ".1f"), ("gbs", "GB/s moved", ".3f"),
         ("bpp", "B/param", ""), ("mps", "Mparam/s", ".0f"), ("vs", "ratio", "")],
    )
    phase_med = {k: median(v) for k, v in base_phases.items()}
    print(f"\n  DeepSpeed-style phases (median): read {phase_med['read'] * 1e3:.0f} ms "
          f"({read_bytes / phase_med['read'] / 1e9:.2f} GB/s), compute {phase_med['compute'] * 1e3:.0f} ms, "
          f"write+sync {phase_med['write+sync'] * 1e3:.0f} ms ({write_bytes / phase_med['write+sync'] / 1e9:.2f} "
          f"GB/s); the same page I/O as the file tier, not overlapped. Adam: {base_note}")
    print(f"  bytes per update: read {read_bytes / 2**20:.0f} MiB, written {write_bytes / 2**20:.0f} MiB "
          f"(p, m, v; gradient from RAM); raw probe: {probe.size / 2**20:.0f} MiB in "
          f"{page_bytes / 2**20:g} MiB requests; roofline from the fastest write ({best_write.split(': ')[1]}) "
          f"and read ({best_read.split(': ')[1]})")
    print(f"  file tier per round (% of that round's own disk probe): {', '.join(f'{p:.0f}' for p in round_pct)} "
          f"(median {median(round_pct):.1f}%)")
    print(f"  memory tier, roofline-adjusted (moves 32 B/param incl. the params out, the kernel 28): "
          f"{mem_pct_adj:.1f}% of the kernel's bandwidth; through store.update (numpy arrays in and out): "
          f"{mem_api_pct:.1f}% of the kernel")

    # -- memory
    buffer_bytes = store.stats()["buffer_bytes"]
    bound = args.pages_in_flight * 3 * page_bytes
    peak = peak_rss_bytes()
    print(f"\n  pages in flight: {args.pages_in_flight}; file-tier buffers: {buffer_bytes / 2**20:.0f} MiB "
          f"(bound pages_in_flight x 3 x page = {bound / 2**20:.0f} MiB, whatever the model size)")
    if first_update_growth is not None:
        print(f"  first file-tier update grew RSS by {first_update_growth / 2**20:.0f} MiB at peak = buffers "
              f"{buffer_bytes / 2**20:.0f} MiB + returned params {n * 4 / 2**20:.0f} MiB (4 B/param, the output) "
              f"+ {(first_update_growth - buffer_bytes - n * 4) / 2**20:.0f} MiB other")
    print(f"  peak RSS of the whole run (ru_maxrss, all contenders' state in RAM): {peak / 2**30:.2f} GiB")

    # -- targets
    checks = [
        {"check": "file tier >= 85% of raw disk bandwidth", "value": file_pct, "met": file_pct >= TARGET_FILE_PCT},
        {"check": "memory tier >= 90% of the kernel", "value": mem_pct, "met": mem_pct >= TARGET_MEMORY_PCT},
        {"check": "memory tier in place >= 90% of the kernel", "value": mem_in_place_pct,
         "met": mem_in_place_pct >= TARGET_MEMORY_PCT},
        {"check": "nsp file tier beats the DeepSpeed-style baseline", "value": speedup, "met": speedup > 1.0},
    ]
    print("\nTargets")
    print(f"  file tier {file_pct:.1f}% of raw disk (target >= {TARGET_FILE_PCT:.0f}%): "
          f"{'ok' if checks[0]['met'] else 'MISSED'}")
    print(f"  memory tier {mem_pct:.1f}% of the kernel (target >= {TARGET_MEMORY_PCT:.0f}%): "
          f"{'ok' if checks[1]['met'] else 'MISSED'}")
    print(f"  memory tier in place {mem_in_place_pct:.1f}% of the kernel (target >= {TARGET_MEMORY_PCT:.0f}%): "
          f"{'ok' if checks[2]['met'] else 'MISSED'}")
    print(f"  nsp file tier vs DeepSpeed-style: {speedup:.2f}x faster (target > 1): "
          f"{'ok' if checks[3]['met'] else 'MISSED'}")

    path = write_json(
        "store_update",
        {"params": n, "state_bytes": state_bytes, "threads": threads, "isa": kernel_isa(), "repeats": repeats,
         "warmup": warmup, "page_bytes": page_bytes, "pages_in_flight": args.pages_in_flight,
         "directory": os.path.dirname(work.path), "probe_write": best_write, "probe_read": best_read,
         "probe_bytes": probe.size,
         "bytes_read_per_update": read_bytes, "bytes_written_per_update": write_bytes,
         "write_gbs": write_bw / 1e9, "read_gbs": read_bw / 1e9, "perfect_update_s": perfect,
         "file_tier_pct_of_disk": file_pct, "file_tier_pct_per_round": round_pct,
         "baseline_pct_of_disk": base_pct, "nsp_vs_baseline_speedup": speedup, "baseline_adam": base_note,
         "baseline_phases_s": base_phases, "memory_tier_pct_of_kernel": mem_pct,
         "memory_tier_store_update_pct_of_kernel": mem_api_pct, "memory_tier_in_place_pct_of_kernel": mem_in_place_pct,
         "memory_tier_pct_of_kernel_roofline_adjusted": mem_pct_adj, "buffer_bytes": buffer_bytes,
         "buffer_bound_bytes": bound, "first_update_rss_growth_bytes": first_update_growth,
         "peak_rss_bytes": peak, "setup_s": setup_s, "timed_s": timed_s,
         "times_s": times, "median_s": med, "checks": checks},
        args.json,
    )
    print(f"\nwrote {path}")
    print(f"file tier: {file_pct:.1f}% of raw disk bandwidth")


if __name__ == "__main__":
    main()
