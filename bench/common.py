"""What every benchmark shares: interleaved timing, a side-by-side table and a JSON record.

Every benchmark follows the same protocol: each contender is warmed up, then all contenders are run in turn
(interleaved, so that drift in the machine's speed hits all of them alike) for ``repeats`` rounds, and the
median of each contender's times is reported next to its ratio to the reference contender.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def time_interleaved(
    contenders: dict[str, Callable[[], Any]], *, repeats: int = 7, warmup: int = 2,
    before: dict[str, Callable[[], Any]] | None = None, pause: float = 0.0,
    idle_cpu: dict[str, list[float]] | None = None, shuffle_seed: int | None = None,
    orders: list[list[str]] | None = None,
) -> dict[str, list[float]]:
    """Runs every contender ``warmup`` times, then ``repeats`` interleaved rounds; returns seconds per call.

    A contender must block until its work is done (call ``jax.block_until_ready`` inside it). ``before`` maps a
    contender's name to a function run untimed right before each of its calls (warm-up included).

    ``pause`` seconds are slept after every call (warm-up included), so that threads a contender leaves spinning
    (an OpenMP runtime under OMP_WAIT_POLICY=ACTIVE, say) wind down before the next contender starts instead of
    taking its cores. When ``idle_cpu`` is given, it receives, per contender, the CPU seconds this process spent
    during each timed call's pause: about 0 when nothing of that contender keeps running after it returned.

    With ``shuffle_seed``, each timed round runs the contenders in an order drawn afresh (seeded, so a run can be
    repeated): where one contender leaves work behind that slows the next (a disk's write-back), no contender
    always follows the same one. ``orders``, when given, receives each timed round's order.
    """
    rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
    before = before or {}
    unknown = set(before) - set(contenders)
    if unknown:
        raise ValueError(f"before names contenders that are not timed: {sorted(unknown)}")

    def rest() -> float:
        cpu0 = time.process_time()
        time.sleep(pause)
        return time.process_time() - cpu0

    for name, fn in contenders.items():
        for _ in range(warmup):
            if name in before:
                before[name]()
            fn()
            if pause > 0:
                rest()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    if idle_cpu is not None:
        for name in contenders:
            idle_cpu.setdefault(name, [])
    for _ in range(repeats):
        order = list(contenders)
        if rng is not None:
            rng.shuffle(order)
        if orders is not None:
            orders.append(order)
        for name in order:
            fn = contenders[name]
            if name in before:
                before[name]()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            if pause > 0:
                spent = rest()
                if idle_cpu is not None:
                    idle_cpu[name].append(spent)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


REPO = Path(__file__).resolve().parent.parent

# The CPU flags that decide which kernels and checksum paths run (the rest of /proc/cpuinfo's list is not recorded).
SIMD_FLAGS = ("sse4_2", "pclmulqdq", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "vpclmulqdq",
              "sha_ni")
# Libraries a record names the versions of (None: not installed). torch and deepspeed are optional contenders.
VERSIONED_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "tensorstore", "orbax-checkpoint", "numpy", "ml_dtypes",
                       "nsp", "torch", "deepspeed")
ENV_PREFIXES = ("NSP_", "XLA_", "JAX_", "OMP_")


def cpu_caches() -> dict[str, str]:
    """The first CPU's caches as sysfs gives them, e.g. ``{"L1d": "48K", "L2": "2048K", "L3": "491520K"}``."""
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        caches[f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")] = size
    return caches


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU model and the SIMD flags that matter, the kernel ISA nsp picked,
    cores (all, and those this process may run on), RAM, OS kernel. Reads /proc only (no subprocess)."""
    import jax

    cpu, flags, ids = None, None, {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:  # the first processor's entries
                key = line.split(":", 1)[0].strip()
                if key == "model name" and cpu is None:
                    cpu = line.split(":", 1)[1].strip()
                elif key in ("cpu family", "model", "stepping") and key not in ids:
                    ids[key] = line.split(":", 1)[1].strip()
                elif key == "flags" and flags is None:
                    present = set(line.split(":", 1)[1].split())
                    flags = [f for f in SIMD_FLAGS if f in present]
                if cpu is not None and flags is not None:
                    break
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine()
    ram = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    ram = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        from nsp.primitives import kernel_isa

        isa = kernel_isa()
    except Exception as e:  # noqa: BLE001  (a record still says what it can)
        isa = f"unknown ({type(e).__name__})"
    return {
        "cpu": cpu,
        # A virtual machine's CPUs often share one model name ("Intel(R) Xeon(R) Processor"): the family, model
        # and stepping numbers and the cache sizes tell one machine kind from another.
        "cpu_ids": ids,
        "caches": cpu_caches(),
        "flags": flags,
        "kernel_isa": isa,
        "cores": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_bytes": ram,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "platform": platform.platform(),
    }


def library_versions() -> dict[str, str | None]:
    """Installed versions of ``VERSIONED_LIBRARIES`` (package metadata only: nothing is imported)."""
    import importlib.metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED_LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_output(*args: str) -> str | None:
    """stdout of ``git -C REPO args`` (None when git or the repository is missing, or the command fails)."""
    import subprocess

    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_info(max_paths: int = 40) -> dict[str, Any]:
    """The commit the working tree is at, whether tracked files differ from it (and which, at most ``max_paths``),
    ``git describe``. Untracked files are not counted. Three git calls."""
    status = git_output("status", "--porcelain=v2", "--branch", "-z", "--untracked-files=no")
    if status is None:
        # A copy of a commit's tree without its .git (a remote machine's run): the commit it was copied from, as
        # the one who copied it says.
        if os.environ.get("NSP_SOURCE_COMMIT"):
            return {"commit": os.environ["NSP_SOURCE_COMMIT"], "source": "NSP_SOURCE_COMMIT: a copy of that "
                    "commit's tree without .git, run elsewhere", "dirty": None}
        return {"commit": None, "error": "not a git checkout (or git is missing)"}
    commit, branch, dirty = None, None, []
    items = iter(status.split("\0"))
    for item in items:
        if item.startswith("# branch.oid "):
            commit = item.split()[-1]
        elif item.startswith("# branch.head "):
            branch = item.split(" ", 2)[-1]
        elif item[:2] == "1 ":
            dirty.append(item.split(" ", 8)[-1])
        elif item[:2] == "2 ":
            dirty.append(item.split(" ", 9)[-1])
            next(items, None)  # the path it was renamed from
        elif item[:2] == "u ":
            dirty.append(item.split(" ", 10)[-1])
    if commit in (None, "(initial)"):
        return {"commit": None, "error": "no commit yet"}
    log = (git_output("log", "-1", "--format=%cI") or "").strip()
    describe = (git_output("describe", "--always", "--dirty", "--tags") or "").strip()
    return {"commit": commit, "commit_time": log or None, "describe": describe or None, "branch": branch,
            "dirty": bool(dirty), "dirty_paths": dirty[:max_paths], "dirty_count": len(dirty)}


def build_info() -> dict[str, Any]:
    """When nsp's C++ extension was built, and which C++ sources are newer than it (a stale build: the numbers
    would not be those of the code the commit holds). File times only."""
    import importlib.util

    try:  # the compiled module's file, found without loading it
        built = os.stat(importlib.util.find_spec("nsp._nsp_ffi").origin).st_mtime
    except Exception as e:  # noqa: BLE001  (not installed, not built: the record says so)
        return {"extension": None, "error": f"{type(e).__name__}: {e}"}
    sources = [REPO / "CMakeLists.txt"] + sorted((REPO / "ffi").rglob("*"))
    newer = [str(p.relative_to(REPO)) for p in sources if p.is_file() and p.stat().st_mtime > built]
    return {"extension_built": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(built)),
            "sources_newer_than_build": newer}


def disk_info(path: str | os.PathLike) -> dict[str, Any]:
    """The file system a benchmark's files went to (mount point, type, device, free space) from
    /proc/self/mountinfo; a benchmark adds what it measured there (``write_json(..., disk=...)``)."""
    real = os.path.realpath(path)
    best: tuple[str, str, str] | None = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount = left.split()[4].replace("\\040", " ")
                fs_type, device = (right.split() + ["?", "?"])[:2]
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and (best is None or len(mount) >= len(best[0])):
                    best = (mount, fs_type, device)
    except (OSError, IndexError):
        pass
    out: dict[str, Any] = {"path": real}
    if best:
        out.update(mount=best[0], fs_type=best[1], device=best[2])
    try:
        st = os.statvfs(real)
        out["free_bytes"] = st.f_bavail * st.f_frsize
    except OSError:
        pass
    return out


def status_kib(field: str) -> int | None:
    """A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: its peak); None when unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0), so that it then measures one phase; False when not
    possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """ru_maxrss of this process (its peak RSS since it started), in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


# The tree as the benchmark started (its modules were imported then): a record names this commit.
START_GIT = git_info()


def table_cell(value: Any, fmt: str) -> str:
    """A table's cell: "-" for a missing value, a string as it is, anything else formatted with ``fmt``."""
    return "-" if value is None else (value if isinstance(value, str) else format(value, fmt))


def print_table(title: str, rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """Prints ``rows`` as a table; ``columns`` holds (key, header, format) triples."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([table_cell(row.get(key), fmt) for key, _, fmt in columns])
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for i, line in enumerate(cells):
        print("  ".join(str(c).rjust(w) if j else str(c).ljust(w) for j, (c, w) in enumerate(zip(line, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_json(name: str, payload: dict[str, Any], path: str | os.PathLike | None = None, *,
               disk: dict[str, Any] | None = None) -> Path:
    """Writes ``payload`` as benchmark ``name``'s JSON record; returns the file written.

    The default place, ``bench/results/<name>.json``, holds the latest record of each benchmark and is tracked by
    git: commit it with the code it measured (``bench/report.py`` renders only committed records). Besides
    ``payload`` a record carries what its numbers depend on: the command line, ``git`` (the commit the tree was at
    when the benchmark started, whether tracked files differed from it and which, ``git describe``; and
    ``changed_during_run`` when the tree moved before the record was written), ``machine`` (``machine_info()``,
    plus ``disk``: the file system the benchmark wrote to and what it measured there, see ``disk_info``),
    ``versions`` (``library_versions()``), ``build`` (``build_info()``) and the ``NSP_*`` / ``XLA_*`` / ``JAX_*``
    / ``OMP_*`` environment.
    """
    out = Path(path) if path else RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import shlex
    import sys

    command = "python " + shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    git = dict(START_GIT)
    end = git_info()
    if (end.get("commit"), end.get("dirty_paths")) != (git.get("commit"), git.get("dirty_paths")):
        git["changed_during_run"] = {k: end.get(k) for k in ("commit", "dirty", "dirty_paths")}
    machine = machine_info()
    if disk:
        machine["disk"] = disk
    record = {"benchmark": name, "record_format": 2, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "command": command, "git": git, "machine": machine, "versions": library_versions(),
              "build": build_info(),
              "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}, **payload}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out)  # a reader never sees half a record
    return out


def io_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned memory for direct I/O, in huge pages where the kernel allows (``MADV_HUGEPAGE``, as nsp's own
    page buffers, ffi/backends/backend.cc): physically contiguous memory lets a 4 MiB request reach the device whole
    instead of cut into several, so no contender loses to another only by how its buffers were allocated. Private, not
    ``mmap``'s default shared mapping: shared anonymous memory is shmem, which takes huge pages only where
    /sys/kernel/mm/transparent_hugepage/shmem_enabled allows (``never`` by default)."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # transparent huge pages not built in: plain pages
            pass
    return buf


class DeviceCounts(NamedTuple):
    """What a block device did, from its stat file (Documentation/block/stat.rst): totals since boot, or the
    difference over one call."""

    read_bytes: int
    written_bytes: int
    busy_ms: int  # ms with at least one request in flight (io_ticks)
    reads: int  # read requests completed (after merging: what the device was sent)
    writes: int  # write requests completed


class DeviceTraffic:
    """Bytes the block device under a directory actually read and wrote, from its /sys/dev/block/M:m/stat
    (sectors of 512 bytes, whole-machine counters: run nothing else meanwhile). A contender whose device bytes fall
    short of the bytes it says it moved was served (in part) from a cache, not from the disk; one that needs more
    requests for the same bytes sends the device smaller ones.

    ``available`` is False where the directory is not on a block device (tmpfs, overlay, a network file system).
    ``stat_path`` names another file in that format instead: an emulated disk's own counters (bench/slow_disk.py).
    """

    SECTOR = 512

    def __init__(self, directory: str | os.PathLike, stat_path: str | None = None):
        if stat_path is None:
            dev = os.stat(directory).st_dev
            stat_path = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
        self.path = stat_path
        self.available = os.path.exists(self.path)

    def read(self) -> DeviceCounts:
        """What the device did since boot; zeros when unavailable."""
        if not self.available:
            return DeviceCounts(0, 0, 0, 0, 0)
        with open(self.path) as f:
            fields = [int(x) for x in f.read().split()]
        return DeviceCounts(read_bytes=fields[2] * self.SECTOR, written_bytes=fields[6] * self.SECTOR,
                            busy_ms=fields[9], reads=fields[0], writes=fields[4])

    def counted(self, fn: Callable[[], Any], into: list[DeviceCounts]) -> Callable[[], Any]:
        """``fn`` that appends what the device did during each call to ``into``: busy well below the call's time
        means the device sat idle while the call ran (the caller, not the disk, was slow)."""
        def call() -> Any:
            before = self.read()
            out = fn()
            into.append(DeviceCounts(*(b - a for a, b in zip(before, self.read()))))
            return out

        return call


def run_capped(cmd: list[str], cap_bytes: int | None, env: dict[str, str], timeout: float):
    """Runs ``cmd`` in a subprocess under ``RLIMIT_AS`` = ``cap_bytes`` (None: no cap), capturing its output;
    returns the ``CompletedProcess``, or None when it ran past ``timeout`` seconds. For the benchmarks that find
    the largest size that fits under an address-space cap (the cap counts all of a process's address space, JAX
    and XLA included)."""
    import resource
    import subprocess

    def limit():
        if cap_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))

    try:
        return subprocess.run(cmd, preexec_fn=limit, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


#: The cgroup v1 memory controller's mount, where the kernel has one (cgroup v2: ``memory.max`` in the unified tree).
CGROUP_MEMORY_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")


def memory_cgroup_reason() -> str | None:
    """Why ``run_in_memory_cgroup`` cannot run here (None: it can): it makes a cgroup, which needs root and a
    memory controller."""
    if (CGROUP_MEMORY_V1 / "memory.limit_in_bytes").exists() or (CGROUP_V2 / "cgroup.subtree_control").exists():
        if os.access(CGROUP_MEMORY_V1 if CGROUP_MEMORY_V1.exists() else CGROUP_V2, os.W_OK):
            return None
        return "the memory cgroup tree is not writable (not root?)"
    return "no memory cgroup controller on this system"


def run_in_memory_cgroup(cmd: list[str], limit_bytes: int, env: dict[str, str], timeout: float):
    """Runs ``cmd`` in a memory cgroup of its own, limited to ``limit_bytes``; returns ``(CompletedProcess or None
    on timeout, peak bytes the cgroup was charged, whether the kernel killed it for memory)``.

    Unlike ``RLIMIT_AS`` (``run_capped``), the limit counts what a machine with that much RAM would: the
    process's resident memory and the page cache its files fill (spilled activations written and not yet
    evicted), the kernel reclaiming clean cache and writing dirty pages back before it gives up and kills the
    process. No swap is counted (the limit applies to memory plus swap where the kernel accounts both)."""
    import subprocess

    name = f"nsp-bench-{os.getpid()}-{time.monotonic_ns()}"
    v1 = CGROUP_MEMORY_V1.exists() and (CGROUP_MEMORY_V1 / "memory.limit_in_bytes").exists()
    group = (CGROUP_MEMORY_V1 if v1 else CGROUP_V2) / name
    group.mkdir()
    try:
        if v1:
            (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
            swap = group / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit_bytes))
        else:
            (group / "memory.max").write_text(str(limit_bytes))
            (group / "memory.swap.max").write_text("0")
        procs = str(group / "cgroup.procs")

        def enter():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        try:
            proc = subprocess.run(cmd, preexec_fn=enter, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc = None
        if v1:
            peak = int((group / "memory.max_usage_in_bytes").read_text())
            oom = "oom_kill 1" in (group / "memory.oom_control").read_text() or (
                proc is not None and proc.returncode == -9)
        else:
            peak_file = group / "memory.peak"
            peak = int(peak_file.read_text()) if peak_file.exists() else 0
            events = (group / "memory.events").read_text()
            oom = any(line.startswith("oom_kill ") and line.split()[1] != "0" for line in events.splitlines())
        return proc, peak, oom
    finally:
        for _ in range(50):  # the killed process may take a moment to leave the group
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
