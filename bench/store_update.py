"""State-store update: the file tier against DeepSpeed's NVMe optimizer swap, a perfect serial swap and the raw
disk; the memory tier against the kernel alone; in one run.

    python bench/store_update.py             # 1.1 GiB of fp32 Adam state (96M params), median of 7
    python bench/store_update.py --quick     # ~256 MiB of state, median of 5
    python bench/store_update.py --memory-only --runs 3   # the memory tier against the kernel alone, 3 runs;
                                                          # each timed call the second of two back to back
    python bench/store_update.py --quick --slow-disk 0.47,0.67   # on an emulated disk of 0.47 GB/s reads,
                                                                 # 0.67 GB/s writes (bench/slow_disk.py)

DeepSpeed is an optional contender. To install it (Debian/Ubuntu; its async I/O op needs libaio's headers):

    apt-get install -y libaio-dev && pip install -e ".[bench]"

(On a machine without a GPU, install a CPU build of torch first, so that pip keeps it instead of fetching a CUDA
one.) Its C++ ops (async_io, cpu_adam) are compiled with ninja the first time they are used (minutes on 2 cores,
once). Where it cannot be installed or built, the table says why and the other contenders still run.

Contenders (median of N interleaved rounds after a warm-up, in two groups: the disk contenders, in a fresh seeded
order each round, then the contenders in RAM; the gradient is made once, lives in RAM and is never timed; a pause
after every call and OMP_WAIT_POLICY=PASSIVE keep one contender's idle threads off the next one's cores -- see
bench/wait_policy.py):
  raw disk writes    the bytes an update writes, sequential page-sized requests + fsync: a new file (its blocks
                     allocated anew) and a rewrite in place (blocks already allocated), each O_DIRECT from
                     page-aligned (mmap) buffers and buffered; the fastest is the roofline's write bandwidth
  raw disk reads     as many bytes read sequentially, O_DIRECT and buffered (uncached), from a file rewritten
                     right before each file-tier update (so it is as old as the state that update writes and
                     the next round reads); the fastest counts
  read + write at    the same read and an in-place rewrite at the same time, O_DIRECT with pages_in_flight
  once               requests in flight each: against the two one after the other, what overlapping reads with
                     writes can win on this disk at all (a disk serving both from one budget: nothing)
  perfect update     derived: bytes read / read bandwidth + bytes written / write bandwidth (p, m, v are read and
                     written: 12 + 12 B/param) -- the roofline of the file tier, which overlaps reads and writes
  perfect serial     measured: p, m, v in three plain files, read whole with the fastest read method of the raw
  swap               probes, updated in RAM by the fastest in-place kernel (torch fused Adam on zero-copy views
                     when torch is installed, else nsp fused_update), written whole with the fastest write method
                     + fsync; nothing overlapped: the floor of any swapper that does not overlap I/O with compute
  nsp file tier      store.update(grad, version=store.version, step=store.version + 1, params_into=out): read,
                     compute and write pages overlapped, then sync + commit of the new version; the new params
                     land in one reused array (the other contenders update theirs in place too); the
                     engine's clocks split its time into the page stream, the sync and the commit
  nsp file tier,     the same on a one-slot store (nsp.storage.open(..., slots=1): one copy of p, m, v and a redo
  one slot           journal): the gradient written to the journal and synced first, then windows of new pages
                     written beside the old ones, synced, recorded and renamed in, then the commit; against the
                     two-slot row, what the one slot's half of the disk costs per update (one_slot in the record)
  DeepSpeed          ZeRO-Infinity's optimizer swap with DeepSpeed's own ops (bench/deepspeed_swap.py): its aio
                     handle (O_DIRECT, page-locked buffers, documented defaults: 1 MiB blocks, queue depth 8, one
                     I/O thread per handle, overlap_events) and DeepSpeedCPUAdam, per sub-group swap p, m, v in,
                     update, swap out. Three rows: serial (PartitionedOptimizerSwapper) at DeepSpeed's default
                     sub_group_size (1e9: the whole state is one sub-group below a billion params); serial and
                     pipelined (PipelinedOptimizerSwapper: the next sub-group's swap-in and the previous one's
                     swap-out overlap the update) at --ds-sub-group params (default 4M = 16 MiB per tensor), so
                     that the pipeline has sub-groups to overlap. Its files are not fsynced (DeepSpeed's swapper
                     does not sync); nsp's file tier syncs and commits every update
  footprint (diag)   the fastest probes' way again (O_DIRECT, one request in flight; the write in place + fsync),
                     each request landing in the next of pages_in_flight x 3 buffers in turn (the file tier's page
                     buffers) instead of in one reused buffer: not floor candidates; they say what the probes' one
                     buffer is worth on this disk (on a virtual disk, whose host presumably copies every request
                     into the guest's memory, how much memory the requests land in can change its speed)
  kernel alone       nsp fused_update in place under jax.jit with donated state (28 B/param)
  memory tier        the transforms' path: a jitted store_update_leaves (reads slot t, writes slot t+1, new
                     params over the donated gradient: 32 B/param) -- the target's figure; the same on a store
                     opened with in_place=True (one copy updated in place); and store.update (numpy gradient
                     in, a fresh numpy params array out)
  diagnostics        the memory tier's store.update with its params written into one reused array
                     (params_into) and with no params out at all (params_out=False), to split the memory tier's
                     overhead into its parts

Threads: nsp's kernel threads, torch's (torch.set_num_threads) and DeepSpeedCPUAdam's (OpenMP, in torch's
runtime) are the same number, all cores by default.

On an emulated slow disk (--slow-disk READ,WRITE: bench/slow_disk.py, a FUSE mount that serves reads and
writes from one timeline at the given rates, its files in RAM) the floor is the disk's nominal one, bytes read /
read rate + bytes written / write rate, which nothing can beat (the raw probes, which pay the FUSE layer's
per-request round trips, are shown beside it); "serial swap at the nominal rates" adds the perfect serial swap's
measured Adam time to that floor: the best any swapper that does not overlap I/O with compute could do there. The
device counters are the emulated disk's own.

Memory pages (--memory-pages, bench/page_backing.py): every array on transparent huge pages by default, as the
stores' own buffers and state are; the record gives the kernel alone's measured share.

Peak extra memory of the file tier is bounded by pages_in_flight x 3 x page_bytes (its preallocated buffers) plus
the params it returns (4 B/param); the run measures it (VmHWM after clear_refs) and reports ru_maxrss.

Where each part lives: this file holds the command line and the measurement (``run``); the contenders are
bench/store_contenders.py's; the derived figures, the printed table and targets, and the JSON record are
bench/store_update_record.py's (``report``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import os
import shutil
import signal
import sys
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import page_backing  # noqa: E402
import wait_policy  # noqa: E402
from common import (DeviceCounts, DeviceTraffic, median, reset_peak_rss, status_kib, time_interleaved,  # noqa: E402
                    write_json)
from slow_disk import SlowDisk, SlowDiskError, parse_rates  # noqa: E402
from store_contenders import (B1, B2, EPS, LR, MEMORY_NAMES, DiskProbe, PerfectSerialSwap, in_ram_adam,  # noqa: E402
                              memory_contenders, setup_deepspeed)
from store_update_record import (CALIBRATION_CALLS, DISK_ORDER_SEED, READ_MODE_CALIBRATION_UPDATES,  # noqa: E402
                                 Measured, report)

import nsp.storage  # noqa: E402
from nsp.primitives import get_num_threads, kernel_isa, set_num_threads  # noqa: E402

STATE_BYTES_PER_PARAM = 12  # fp32 p, m, v


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


# ---- main --------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~256 MiB of state, median of 5, one warm-up")
    parser.add_argument("--state-mib", type=float, default=None,
                        help="MiB of fp32 Adam state (p + m + v = 12 B/param); default 1152 (96M params), 256 --quick")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (>= 5; default 7, 5 --quick)")
    parser.add_argument("--dir", default=None,
                        help="directory on the file system to measure (a temporary folder is made in it and "
                             "removed at exit); default: the current directory")
    parser.add_argument("--slow-disk", default=None, metavar="READ_GBPS,WRITE_GBPS",
                        help="run on an emulated slow disk of these rates (e.g. 0.47,0.67; bench/slow_disk.py), its "
                             "files in RAM (/dev/shm); instead of --dir")
    parser.add_argument("--pages-in-flight", type=int, default=nsp.storage.PAGES_IN_FLIGHT_DEFAULT,
                        help="file-tier pipeline depth (default: nsp's)")
    parser.add_argument("--page-mib", type=float, default=4.0, help="page size of the stores and probe requests")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of nsp's kernels, torch and DeepSpeedCPUAdam (default: nsp's, all cores)")
    parser.add_argument("--ds-sub-group", type=float, default=4 * 2**20,
                        help="params per DeepSpeed sub-group for its serial and pipelined rows besides its default "
                             "sub_group_size (default 4M = 4194304)")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even when installed")
    parser.add_argument("--memory-only", action="store_true",
                        help="only the memory group (the kernel alone and the memory tier's rows), several runs "
                             "apart; record bench/results/store_update_memory.json")
    parser.add_argument("--runs", type=int, default=3, help="--memory-only: runs, each its own interleaved rounds")
    parser.add_argument("--back-to-back", action=argparse.BooleanOptionalAction, default=True,
                        help="--memory-only: time the second of two back-to-back calls of each contender (default "
                             "on; off: a single call after the pause)")
    wait_policy.add_arguments(parser)
    page_backing.add_arguments(parser)
    parser.add_argument("--json", default=None, help="where to write the JSON record")
    args = parser.parse_args()
    page_backing.apply(args.memory_pages)  # may restart this process, before any array exists
    args.omp_wait_policy = wait_policy.set_omp_wait_policy(args.omp_wait_policy)  # before torch loads OpenMP
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
    if args.memory_only:
        run_memory_only(args, n, page_bytes, repeats, threads)
        return
    disk = None
    if args.slow_disk:
        if args.dir:
            parser.error("--slow-disk and --dir exclude each other: the emulated disk is its own directory")
        try:
            disk = SlowDisk(*parse_rates(args.slow_disk))
        except ValueError as e:
            parser.error(f"--slow-disk: {e}")
    parent = os.path.abspath(args.dir or os.getcwd())
    if not os.path.isdir(parent):
        parser.error(f"--dir {parent} is not a directory")

    old_handlers = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with disk or contextlib.nullcontext():
            work = Workdir(disk.path if disk else parent)
            try:
                run(args, work, n, page_bytes, repeats, warmup, threads, disk)
            finally:
                work.cleanup()  # before the emulated disk unmounts
    except SlowDiskError as e:
        raise SystemExit(f"--slow-disk: {e}") from None
    except KeyboardInterrupt as e:
        print("\ninterrupted; removing temporary files", file=sys.stderr)
        raise SystemExit(128 + getattr(e, "signum", signal.SIGINT)) from None
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
    if disk:
        print(f"  slow disk: {disk.summary}")


def run_memory_only(args, n: int, page_bytes: int, repeats: int, threads: int) -> None:
    """The memory group alone: the kernel alone against the memory tier's paths (store_contenders.MEMORY_NAMES),
    ``args.runs`` runs of ``repeats`` interleaved rounds each in this process, a pause between runs; the record
    gives each run's medians and, per ratio to the kernel, the median over runs and its range."""
    if args.runs < 1:
        raise SystemExit("--runs must be >= 1")
    rng = np.random.default_rng(0)
    p0 = rng.random(n, np.float32) - np.float32(0.5)
    grad = (rng.random(n, np.float32) - np.float32(0.5)) * np.float32(1e-2)
    spec = nsp.storage.OptimizerSpec("adam", b1=B1, b2=B2, eps=EPS)

    closers = types.SimpleNamespace(closers=[])  # what memory_contenders opens, closed at the end
    print(f"fp32 Adam memory-tier update of {n / 2**20:.0f}M params, {threads} threads, ISA {kernel_isa()}, "
          f"{args.runs} runs of {repeats} interleaved rounds, OMP_WAIT_POLICY={args.omp_wait_policy}")
    streamed: dict = {}
    fns = memory_contenders(closers, p0, grad, spec, page_bytes, streamed)
    group = {MEMORY_NAMES[key]: fn for key, fn in fns.items()}
    # Each timed call is the second of two back-to-back calls of the same contender (the first untimed): its
    # threads are awake and its state's memory was just touched, as in a training loop. After the pause, memory
    # idle for a fraction of a second is slow to touch again on the virtual machines of these records
    # (bench/cache_reset.pre_touch); the stores' state is theirs, so no read from here could warm it.
    before = dict(group) if args.back_to_back else None
    kernel = MEMORY_NAMES["kernel"]
    runs = []
    try:
        for r in range(args.runs):
            times = time_interleaved(group, repeats=repeats, warmup=2 if r == 0 else 1, pause=args.pause,
                                     shuffle_seed=r, before=before)
            runs.append({name: median(ts) for name, ts in times.items()})
            print(f"  run {r + 1}: " + ", ".join(f"{name.strip()} {runs[-1][kernel] / t * 100:.1f}%"
                                               for name, t in runs[-1].items() if name != kernel), flush=True)
            time.sleep(2.0)
    finally:
        for close in closers.closers:
            close()
    pct = {name: [run[kernel] / run[name] * 100 for run in runs] for name in group if name != kernel}
    summary = {name: {"median": median(v), "min": min(v), "max": max(v), "per_run": v} for name, v in pct.items()}
    targets = {MEMORY_NAMES["mem_jit"]: 90.0, MEMORY_NAMES["mem_in_place"]: 90.0,
               MEMORY_NAMES["mem_jit_bf16"]: 90.0, MEMORY_NAMES["mem_in_place_bf16"]: 90.0,
               MEMORY_NAMES["mem"]: 70.0}
    print(f"\n% of the kernel alone ({median([run[kernel] for run in runs]) * 1e3:.1f} ms), median over runs "
          f"(lowest-highest):")
    checks = []
    for name, e in summary.items():
        target = targets.get(name)
        mark = "" if target is None else (" ok" if e["median"] >= target else " MISSED") + f" (target {target:.0f}%)"
        print(f"  {name.strip():70s} {e['median']:6.1f}%  ({e['min']:.1f}-{e['max']:.1f}){mark}")
        if target is not None:
            checks.append({"check": f"{name.strip()} >= {target:.0f}% of the kernel", "median": e["median"],
                           "min": e["min"], "max": e["max"], "met": e["median"] >= target,
                           "met_in_every_run": e["min"] >= target})
    huge = page_backing.huge_share(streamed["kernel"]()) if "kernel" in streamed else None
    path = write_json("store_update_memory", {
        "params": n, "threads": threads, "isa": kernel_isa(), "runs": args.runs, "repeats": repeats,
        "page_bytes": page_bytes, "bytes_per_param": {
            MEMORY_NAMES["kernel"]: 28, MEMORY_NAMES["mem_jit"]: 32, MEMORY_NAMES["mem_in_place"]: 32,
            MEMORY_NAMES["mem_jit_bf16"]: 28, MEMORY_NAMES["mem_in_place_bf16"]: 28, MEMORY_NAMES["mem"]: 32},
        "median_s_per_run": runs, "pct_of_kernel": summary, "checks": checks,
        "kernel_huge_page_share": huge, "back_to_back": args.back_to_back,
        **wait_policy.record(args.omp_wait_policy, args.pause, {}),
    }, args.json)
    print(f"\nwrote {path}")


def run(args, work: Workdir, n: int, page_bytes: int, repeats: int, warmup: int, threads: int,
        disk: SlowDisk | None) -> None:
    rng = np.random.default_rng(0)
    p0 = rng.random(n, np.float32) - np.float32(0.5)
    grad = (rng.random(n, np.float32) - np.float32(0.5)) * np.float32(1e-2)  # made once, never timed
    spec = nsp.storage.OptimizerSpec("adam", b1=B1, b2=B2, eps=EPS)
    state_bytes = n * STATE_BYTES_PER_PARAM
    print(f"fp32 Adam store update of {n / 2**20:.0f}M params ({state_bytes / 2**20:.0f} MiB of p, m, v), "
          f"{threads} threads, ISA {kernel_isa()}, pages of {page_bytes / 2**20:g} MiB, "
          f"{args.pages_in_flight} in flight, median of {repeats} interleaved rounds after {warmup} warm-up, "
          f"OMP_WAIT_POLICY={args.omp_wait_policy}, {args.pause:g} s pause after each call")
    print(f"directory: {work.path}" + (f" (emulated slow disk: reads {disk.read_gbps:g} GB/s, writes "
                                        f"{disk.write_gbps:g} GB/s, one timeline; files in {disk.backing_parent})"
                                        if disk else ""))

    # -- nsp file tier (created first, so that its first update's memory growth is measured cleanly)
    t0 = time.perf_counter()
    store = nsp.storage.open(os.path.join(work.path, "nsp"), tier="file", page_bytes=page_bytes,
                             pages_in_flight=args.pages_in_flight, checksum=True)
    work.closers.append(store.close)
    store.initialize({"w": p0}, spec)
    assert store.layout.padded_total == n

    rss_before = status_kib("VmRSS")
    can_reset = reset_peak_rss()
    stats0 = store.stats()
    # The first update allocates the pipeline buffers; it is also the file tier's first warm-up round.
    store.update(grad, version=store.version, lr=LR, step=store.version + 1)
    hwm = status_kib("VmHWM")
    first_update_growth = (hwm - rss_before) * 1024 if can_reset and hwm and rss_before else None
    stats1 = store.stats()
    read_bytes = stats1["internal_read_bytes"] - stats0["internal_read_bytes"]
    write_bytes = stats1["internal_write_bytes"] - stats0["internal_write_bytes"]
    # -- the same on a one-slot store (one copy of the state and a redo journal), made and warmed up the same way
    store1 = nsp.storage.open(os.path.join(work.path, "nsp1"), tier="file", page_bytes=page_bytes,
                              pages_in_flight=args.pages_in_flight, checksum=True, slots=1)
    work.closers.append(store1.close)
    store1.initialize({"w": p0}, spec)
    # Its second and third updates choose the read mode (the second reads direct, the third buffered, each
    # timed whole: ffi/backends/read_mode.h), as a run's do once at its start (and 1 update in 32 tries the other way
    # again): warm-up here too, so that the timed rounds read the way the file tier settled on.
    for _ in range(READ_MODE_CALIBRATION_UPDATES):
        store.update(grad, version=store.version, lr=LR, step=store.version + 1)
    for _ in range(1 + READ_MODE_CALIBRATION_UPDATES):
        store1.update(grad, version=store1.version, lr=LR, step=store1.version + 1)

    nsp_reads: list[str] = []  # how each call read its pages (the file tier picks direct or buffered itself)

    def timed_update(st, reads: list[str] | None = None):
        """One update of ``st`` per call, the params landing in one array, reused (as the others update in
        place), and ``phases``: where each call's time went (the engine's own clocks): the page stream (read,
        compute, write overlapped), the sync that makes the new version durable, the commit that records it."""
        out = np.empty(n, np.float32)
        phases: dict[str, list[float]] = {"stream": [], "sync": [], "commit": []}

        def call() -> None:
            before = st.stats()
            st.update(grad, version=st.version, lr=LR, step=st.version + 1, params_into=out)
            after = st.stats()
            spent = {k: (after[f"{k}_ns"] - before[f"{k}_ns"]) / 1e9 for k in ("update", "sync", "commit")}
            phases["stream"].append(spent["update"] - spent["sync"] - spent["commit"])
            phases["sync"].append(spent["sync"])
            phases["commit"].append(spent["commit"])
            if reads is not None:
                direct = after["pages_read_direct"] - before["pages_read_direct"]
                pages = after["pages_read"] - before["pages_read"]
                reads.append("O_DIRECT" if direct == pages else "buffered" if direct == 0 else "both")

        return call, phases

    nsp_file, nsp_phases = timed_update(store, nsp_reads)
    nsp_file_one_slot, nsp1_phases = timed_update(store1)

    # -- DeepSpeed's optimizer swap (its own files in the same directory: the same p, m, v bytes)
    ds_swaps, ds_info = setup_deepspeed(args, work, p0, threads)
    if ds_info["available"]:
        print(f"DeepSpeed {ds_info['version']}: aio {ds_info['aio_defaults']}, default sub_group_size "
              f"{ds_info['sub_group_size_default']:.0e}")
    else:
        print(f"DeepSpeed: unavailable -- {ds_info['reason']}")

    # -- raw disk
    io_pool = ThreadPoolExecutor(args.pages_in_flight, thread_name_prefix="disk-probe")  # idle: blocked, not spinning
    work.closers.append(io_pool.shutdown)
    probe = DiskProbe(work.path, max(read_bytes, write_bytes), page_bytes, args.pages_in_flight, io_pool)
    work.closers.append(probe.close)
    probe.refresh()

    # -- the memory group: the kernel alone, the memory tier three ways, its diagnostics
    streamed: dict = {}  # what the kernel alone streams, for its pages' record
    memory_fns = memory_contenders(work, p0, grad, spec, page_bytes, streamed)

    writers, readers = probe.contenders(write=True), probe.contenders(write=False)
    both_name, both_read, both_write, both_fn = probe.side_by_side()
    # The roofline's read and write again, landing in as many buffers in turn as the file tier's page buffers
    # (pages_in_flight sets of p, m, v): diagnostics of what the probes' one reused buffer is worth on this disk.
    footprint_buffers = args.pages_in_flight * 3
    footprint = probe.footprint(footprint_buffers)

    # -- the perfect serial swap reads and writes the way the raw probes found fastest so far in this run: by their
    # medians over CALIBRATION_CALLS interleaved calls before the timed rounds (their warm-up) and the rounds done
    # so far, chosen again right before each of its calls (the probes run before it in every round).
    t_cal = time.perf_counter()
    for _ in range(CALIBRATION_CALLS):
        for fn in {**writers, **readers}.values():
            fn()
    perfect = PerfectSerialSwap(os.path.join(work.path, "perfect"), p0, page_bytes, probe.fastest(write=False),
                                probe.fastest(write=True), io_pool)
    work.closers.append(perfect.close)
    perfect.adam, perfect_kernel = in_ram_adam(perfect.bufs, grad, threads)
    perfect_used: list[tuple[str, str]] = []

    def choose_perfect_methods() -> None:
        perfect.read, perfect.write = probe.fastest(write=False), probe.fastest(write=True)
        perfect_used.append((perfect.read.label, perfect.write.label))

    setup_s = t_cal - t0  # the calibration calls are warm-up, not setup

    names = {
        "nsp": "nsp file tier (update + commit)",
        "nsp1": "nsp file tier, one slot (journal + update + commit)",
        "perfect": "perfect serial swap (read all, Adam in RAM, write all + fsync)",
        **MEMORY_NAMES,
    }
    ds_fns = {name: functools.partial(swap.step, grad) for name, swap in ds_swaps.items()}
    # Two groups, each interleaved: the disk group, then the memory group (so that no contender in RAM shares a
    # round with the disk's write-back and page-cache work).
    disk_group = {**writers, **readers, both_name: both_fn, names["nsp"]: nsp_file,
                  names["nsp1"]: nsp_file_one_slot, names["perfect"]: perfect,
                  **ds_fns, **footprint}
    # Every disk contender's calls also count the bytes the block device under --dir moved (the kernel's own
    # counters): a contender served from a cache shows fewer device bytes than it moved.
    device = DeviceTraffic(work.path, disk.stat_path if disk else None)
    device_bytes: dict[str, list[DeviceCounts]] = {name: [] for name in disk_group}
    disk_group = {name: device.counted(fn, device_bytes[name]) for name, fn in disk_group.items()}
    memory_group = {MEMORY_NAMES[key]: fn for key, fn in memory_fns.items()}
    # One warm-up call each (the file tier had its own above, the probes theirs in the calibration), then the rest
    # in time_interleaved; the other swappers take as many untimed steps as the file tier (its first update and
    # its calibration updates), so that all their params can be compared at the end.
    swappers = {names["perfect"], *ds_fns}
    t0 = time.perf_counter()
    for name, fn in {**disk_group, **memory_group}.items():
        if name not in (names["nsp"], names["nsp1"]) and name not in probe.by_name:
            for _ in range(1 + READ_MODE_CALIBRATION_UPDATES if name in swappers else 1):
                fn()
    # The read probe's file is rewritten right before each file-tier update (why: DiskProbe's docstring). The disk
    # group runs in a fresh seeded order each round: on this virtual disk what ran just before a contender moved its
    # time by up to a third (the file tier measured 0.81x the perfect swap right after the probes' writes and 0.61x
    # right after DeepSpeed's unsynced writes, in two runs with fixed orders), so no contender always follows the
    # same one.
    idle_cpu: dict[str, list[float]] = {}
    disk_orders: list[list[str]] = []
    times = time_interleaved(disk_group, repeats=repeats, warmup=warmup - 1,
                             before={names["nsp"]: probe.refresh, names["perfect"]: choose_perfect_methods},
                             pause=args.pause, idle_cpu=idle_cpu, shuffle_seed=DISK_ORDER_SEED,
                             orders=disk_orders)
    times.update(time_interleaved(memory_group, repeats=repeats, warmup=warmup - 1, pause=args.pause,
                                  idle_cpu=idle_cpu))
    timed_s = time.perf_counter() - t0
    for phases in [perfect.phases, nsp_phases, nsp1_phases] + [swap.phases for swap in ds_swaps.values()]:
        for phase in phases.values():  # keep only the timed rounds' phases
            del phase[: len(phase) - repeats]
    med = {name: median(ts) for name, ts in times.items()}

    # -- every swapper made the same steps with the same gradient: their params must agree
    p_nsp = store.read("param")
    agree = {names["perfect"]: float(np.max(np.abs(perfect.bufs[0] - p_nsp)))}
    # the one-slot store ran the same kernel on the same steps: the same bits
    one_slot_equal = all(np.array_equal(store1.read(s), store.read(s)) for s in ("param", "mu", "nu"))
    if not one_slot_equal:
        raise SystemExit("the one-slot store's state differs from the two-slot store's after the same updates")
    for name, swap in ds_swaps.items():
        agree[name] = float(np.max(np.abs(swap.read_params() - p_nsp)))
    moved_p = float(np.max(np.abs(p_nsp - p0)))

    report(Measured(args=args, work=work, disk=disk, n=n, page_bytes=page_bytes, state_bytes=state_bytes,
                    repeats=repeats, warmup=warmup, threads=threads, grad=grad, store=store, read_bytes=read_bytes,
                    write_bytes=write_bytes, first_update_growth=first_update_growth, nsp_reads=nsp_reads,
                    nsp_phases=nsp_phases, nsp1_phases=nsp1_phases, ds_swaps=ds_swaps, ds_info=ds_info, probe=probe, writers=writers,
                    readers=readers, both_name=both_name, both_read=both_read, both_write=both_write,
                    footprint=footprint, footprint_buffers=footprint_buffers, perfect=perfect,
                    perfect_kernel=perfect_kernel, perfect_used=perfect_used, streamed=streamed, names=names,
                    device=device, device_bytes=device_bytes, idle_cpu=idle_cpu, disk_orders=disk_orders,
                    times=times, med=med, setup_s=setup_s, timed_s=timed_s, agree=agree, moved_p=moved_p))


if __name__ == "__main__":
    main()
