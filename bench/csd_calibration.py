"""bench/csd_scaling.py's calibration (``--calibrate``): one device's model clock against a real file-tier update
on this machine. ``calibrate`` runs the rounds the script's docstring describes (each update paired with this
machine's disk, copy and updater probes, ``DiskProbe`` for the disk) and returns the record's ``calibration``."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py sits beside this script
from common import io_buffer, print_table  # noqa: E402

from nsp.csd import LinkFigures  # noqa: E402
from nsp.csd.measured import measured_update_s, model_update_time, shard_deltas  # noqa: E402

CALIBRATION_TARGET = 0.15  # the model within 15% of the measured update
STATE_BYTES_PER_PARAM = 12  # fp32 p, m, v
B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 1e-3


@functools.cache
def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _syncfs(fd: int) -> None:
    """Makes the file system of ``fd`` durable, as the file tier's commit does (syncfs(2): on a shared disk this
    also waits for other writers' dirty pages, and so does the commit)."""
    if _libc().syncfs(fd) != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


class DiskProbe:
    """Sequential page-sized requests over one file of ``size`` bytes, ``depth`` in flight (the file tier's
    pipeline depth), O_DIRECT when ``direct``: ``write()`` rewrites it in place and syncs its file system (as the
    file tier's commit does), ``read()`` reads it back (dropped from the page cache first when buffered). Each
    returns its seconds.

    What is written is as unlike itself as the optimizer state: random bytes (``seed``), every 4 KiB of them
    stamped anew before each write. A file of repeated blocks read back at about half the speed of such a file
    here (a virtual disk whose storage shares equal blocks), which would make the disk look slower than it is
    for the state the store reads.
    """

    STAMP = 4096  # bytes between the stamped words

    def __init__(self, path: str, size: int, block: int, depth: int, direct: bool, seed: int):
        self.path, self.block, self.depth, self.direct = path, block, depth, direct
        self.size = -(-size // block) * block  # whole requests (O_DIRECT needs aligned lengths)
        self.data = io_buffer(self.size)
        self.data.write(np.random.default_rng(seed).bytes(self.size))
        self.words = np.frombuffer(self.data, np.uint64)[::self.STAMP // 8]
        self.writes = 0
        self.bufs = [io_buffer(block) for _ in range(depth)]  # where reads land
        self.pool = ThreadPoolExecutor(depth, thread_name_prefix="disk-probe")

    def _run(self, write: bool) -> float:
        if write:  # new contents, as each update writes new state (outside the timed part)
            self.writes += 1
            self.words[:] = np.arange(self.words.size, dtype=np.uint64) + np.uint64(self.writes << 40)
        data = memoryview(self.data)
        t0 = time.perf_counter()
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        try:
            if not write and not self.direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            offsets = iter(range(0, self.size, self.block))
            lock = threading.Lock()

            def worker(w: int) -> None:
                into = memoryview(self.bufs[w])
                while True:
                    with lock:
                        offset = next(offsets, None)
                    if offset is None:
                        return
                    if write:
                        done = os.pwrite(fd, data[offset:offset + self.block], offset)
                    else:
                        done = os.preadv(fd, [into], offset)
                    if done != self.block:
                        raise OSError(f"short {'write' if write else 'read'} of {self.path} at {offset}")

            for f in [self.pool.submit(worker, w) for w in range(self.depth)]:
                f.result()
            if write:
                _syncfs(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - t0

    def write(self) -> float:
        return self._run(True)

    def read(self) -> float:
        return self._run(False)

    def read_while_writing(self, other: DiskProbe) -> float:
        """Seconds to read this file while ``other``'s is rewritten, both ``depth`` requests deep."""
        t0 = time.perf_counter()
        writing = threading.Thread(target=other.write)
        writing.start()
        try:
            self.read()
        finally:
            writing.join()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()
        del self.words
        for b in [*self.bufs, self.data]:
            b.close()


def calibrate(args) -> dict:
    """The calibration of the module docstring; returns its record."""
    import nsp.storage
    from store_contenders import direct_io_works  # here: that module loads jax and the contenders' libraries

    page_bytes = nsp.storage.PAGE_BYTES_DEFAULT
    page_elems = page_bytes // 4
    n = max(1, round(args.calibrate_mib * 2**20 / STATE_BYTES_PER_PARAM / page_elems)) * page_elems
    depth = nsp.storage.PAGES_IN_FLIGHT_DEFAULT
    rng = np.random.default_rng(0)
    p0 = rng.random(n, np.float32) - np.float32(0.5)
    grad = (rng.random(n, np.float32) - np.float32(0.5)) * np.float32(1e-2)
    spec = nsp.storage.OptimizerSpec("adam", b1=B1, b2=B2, eps=EPS)
    work = tempfile.mkdtemp(prefix="nsp-bench-csd-", dir=args.dir)
    with contextlib.ExitStack() as cleanup:  # closes what it opened, then removes `work`, however it ends
        cleanup.callback(shutil.rmtree, work, ignore_errors=True)
        store = nsp.storage.open(os.path.join(work, "store"), tier="file", num_shards=1, page_bytes=page_bytes,
                                 pages_in_flight=depth)
        cleanup.callback(store.close)
        store.initialize({"w": p0}, spec)
        memory = nsp.storage.open(None, tier="memory", page_bytes=page_bytes)
        cleanup.callback(memory.close)
        memory.initialize({"w": p0}, spec)
        direct = direct_io_works(work)
        # Two files written in alternate rounds, so that a round reads the one written a round before: as old as
        # the state its update reads, with as many writes since. A third is written beside a read.
        probes = [DiskProbe(os.path.join(work, f"probe{seed}.bin"), n * STATE_BYTES_PER_PARAM, page_bytes, depth,
                            direct, seed) for seed in (1, 2, 3)]
        for probe in probes:
            cleanup.callback(probe.close)
        (writing, reading), other = probes[:2], probes[2]
        reading.write()
        other.write()
        out_file, out_memory, copy_dst = (np.empty(n, np.float32) for _ in range(3))
        print(f"\ncalibration: a 1-shard file-tier store of {n / 2**20:.0f}M params "
              f"({n * STATE_BYTES_PER_PARAM / 2**20:.0f} MiB of p, m, v) in {work}; {args.repeats} interleaved "
              f"rounds after {args.warmup} warm-up; disk probes {'O_DIRECT' if direct else 'buffered'}, "
              f"{page_bytes >> 20} MiB requests, {depth} in flight", flush=True)

        def update(s, into):
            return s.update(grad, version=s.version, lr=LR, step=s.version + 1, params_into=into)

        rounds = []
        for i in range(args.warmup + args.repeats):
            write_s = writing.write()
            t0 = time.perf_counter()
            np.copyto(copy_dst, grad)
            copy_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            update(memory, out_memory)
            memory_s = time.perf_counter() - t0
            before = store.shard_stats()
            t0 = time.perf_counter()
            update(store, out_file)
            wall_s = time.perf_counter() - t0
            after = store.shard_stats()
            read_s = reading.read()  # written a round before, as the state this round's update read
            both_s = reading.read_while_writing(other)
            writing, reading = reading, writing
            if i < args.warmup:
                continue
            size = writing.size
            overlap = min(1.0, max(0.0, (read_s + write_s - both_s) / min(read_s, write_s)))
            figures = LinkFigures(
                p2p_read_gbps=size / read_s / 1e9, p2p_write_gbps=size / write_s / 1e9,
                ssd_read_gbps=size / read_s / 1e9, ssd_write_gbps=size / write_s / 1e9, ssd_overlap=overlap,
                device_link_gbps=grad.nbytes / copy_s / 1e9, shared_gbps=grad.nbytes / copy_s / 1e9,
                updater_gbps=16 * n / memory_s / 1e9)  # p, m, v and the gradient, 4 B each per param
            model = model_update_time(before, after, figures)
            delta = shard_deltas(before, after)[0]
            rounds.append({"figures": figures.as_dict(), "model_s": model.seconds, "bottleneck": model.bottleneck,
                           "busy_s": model.busy, "measured_wall_s": wall_s,
                           "measured_engine_s": measured_update_s(before, after),
                           "bytes": {k: delta[k] for k in
                                     ("shared_in_bytes", "shared_out_bytes", "internal_read_bytes",
                                      "internal_write_bytes")},
                           "pages_read_direct": after[0].get("pages_read_direct", 0)
                           - before[0].get("pages_read_direct", 0)})
        assert np.array_equal(out_file, out_memory), "the file and memory tiers disagree"

    for r in rounds:
        r["ratio"] = r["model_s"] / r["measured_wall_s"]
    med = {k: statistics.median(r[k] for r in rounds)
           for k in ("model_s", "measured_wall_s", "measured_engine_s", "ratio")}
    figures = {k: statistics.median(r["figures"][k] for r in rounds) for k in rounds[0]["figures"]}
    ratio = med["ratio"]
    print_table("this machine's figures (medians; GB/s, ssd_overlap a fraction)", [figures],
                [(k, k, ".2f") for k in ("p2p_read_gbps", "p2p_write_gbps", "ssd_overlap", "device_link_gbps",
                                         "updater_gbps")])
    print_table("one update: the model clock on those figures vs the real file tier (per round)",
                [{"round": i + 1, **r} for i, r in enumerate(rounds)],
                [("round", "round", "d"), ("model_s", "model s", ".3f"), ("bottleneck", "model bottleneck", ""),
                 ("measured_wall_s", "measured s (store.update)", ".3f"),
                 ("measured_engine_s", "measured s (engine)", ".3f"), ("ratio", "model / measured", ".2f")])
    holds = abs(ratio - 1) <= CALIBRATION_TARGET
    print(f"\ncalibration: model {med['model_s']:.3f} s vs measured {med['measured_wall_s']:.3f} s (medians); "
          f"model / measured {ratio:.2f} (median of the rounds' ratios, {min(r['ratio'] for r in rounds):.2f}-"
          f"{max(r['ratio'] for r in rounds):.2f}) -- target within {CALIBRATION_TARGET:.0%}: "
          f"{'HOLDS' if holds else 'MISSED'}")
    return {"params": n, "state_bytes": n * STATE_BYTES_PER_PARAM, "page_bytes": page_bytes,
            "pages_in_flight": depth, "direct_io": direct, "repeats": args.repeats, "warmup": args.warmup,
            "rounds": rounds, "median_s": med, "median_figures": figures, "ratio": ratio,
            "target": CALIBRATION_TARGET, "holds": holds}
