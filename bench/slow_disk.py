"""An emulated slow disk for the benchmarks: a FUSE file system (bench/slow_disk/slow_disk.c) that passes every
file through to a directory in RAM but serves the bytes no faster than a disk of the given read and write rates.

Why an emulation: the project's machines come with whatever virtual disk they have (one rewrote at 0.67 GB/s,
another at 3.76), and a benchmark must show the file tier on a slow disk as well as a fast one. A cgroup throttle
(io.max) is no stand-in: it keeps separate read and write budgets, so an engine that overlaps reads with writes
would get up to twice what a real disk gives. This disk has one timeline, as an SSD's flash and controller do:
every request occupies it for bytes / rate, first come first served, whatever the queue depth, so nothing moves
more bytes than the rates allow, and its nominal floor

    bytes read / read rate + bytes written / write rate

is exact: no contender can beat it. Its counters (/.slow_disk_stat, in /sys/block/<dev>/stat's format) count
every request the timeline served.

    python bench/slow_disk.py --read-gbps 0.47 --write-gbps 0.67 -- python bench/store_update.py --quick --dir {}

runs a command with `{}` replaced by the mounted directory (bench/store_update.py --slow-disk R,W does this
itself). Needs /dev/fuse, a C compiler and libfuse 3's headers: `apt-get install -y libfuse3-dev fuse3`.
The mount is a bench tool, not part of nsp.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_disk", "slow_disk.c")
BUILD_DIR = os.path.join(os.path.expanduser("~"), ".cache", "nsp", "slow_disk")
STAT_NAME = ".slow_disk_stat"
INSTALL_HINT = "apt-get install -y libfuse3-dev fuse3"


class SlowDiskError(RuntimeError):
    """The emulated disk cannot be built or mounted here; the message says why and what to install."""


def build() -> str:
    """Compiles slow_disk.c once (again when the source is newer than the binary); returns the binary's path."""
    binary = os.path.join(BUILD_DIR, "slow_disk")
    if os.path.exists(binary) and os.path.getmtime(binary) >= os.path.getmtime(SOURCE):
        return binary
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None or shutil.which("pkg-config") is None:
        raise SlowDiskError(f"building the slow disk needs a C compiler and pkg-config ({INSTALL_HINT} pkg-config)")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
    if flags.returncode != 0:
        raise SlowDiskError(f"libfuse 3's headers are not installed ({INSTALL_HINT}): {flags.stderr.strip()}")
    os.makedirs(BUILD_DIR, exist_ok=True)
    tmp = binary + f".{os.getpid()}"
    out = subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-o", tmp, SOURCE, *flags.stdout.split(), "-pthread"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SlowDiskError(f"building {SOURCE} failed:\n{out.stderr}")
    os.replace(tmp, binary)
    return binary


class SlowDisk:
    """A mounted slow disk: ``path`` is its directory while the ``with`` block runs.

    Args:
      read_gbps: read rate in GB/s (1e9 bytes).
      write_gbps: write rate in GB/s.
      backing_parent: where the bytes really go: a folder for a temporary directory (default /dev/shm, RAM, so that
        the real disk adds no time of its own; the files take as much RAM as they hold).
    """

    def __init__(self, read_gbps: float, write_gbps: float, backing_parent: str | None = None):
        if not (read_gbps > 0 and write_gbps > 0):
            raise ValueError(f"slow disk rates must be positive GB/s, got read {read_gbps}, write {write_gbps}")
        self.read_gbps, self.write_gbps = float(read_gbps), float(write_gbps)
        self.backing_parent = backing_parent or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.path = ""
        self.stat_path = ""
        self.summary = ""  # the daemon's own totals, printed when it unmounts
        self._proc: subprocess.Popen | None = None
        self._backing = self._mountpoint = ""

    def nominal_s(self, read_bytes: float, write_bytes: float) -> float:
        """The disk's floor for these bytes: each byte read at the read rate, each byte written at the write rate,
        one after the other (the timeline serves one request at a time)."""
        return read_bytes / (self.read_gbps * 1e9) + write_bytes / (self.write_gbps * 1e9)

    def describe(self) -> dict:
        return {"emulator": "bench/slow_disk/slow_disk.c (FUSE, one timeline for reads and writes)",
                "read_gbps": self.read_gbps, "write_gbps": self.write_gbps, "backing": self.backing_parent}

    def __enter__(self) -> "SlowDisk":
        if not os.path.exists("/dev/fuse"):
            raise SlowDiskError("/dev/fuse does not exist: this machine (or container) has no FUSE")
        if shutil.which("fusermount3") is None:
            raise SlowDiskError(f"fusermount3 is not installed ({INSTALL_HINT})")
        binary = build()
        self._backing = tempfile.mkdtemp(prefix="nsp_slow_disk_backing_", dir=self.backing_parent)
        self._mountpoint = tempfile.mkdtemp(prefix="nsp_slow_disk_")
        self._proc = subprocess.Popen(
            [binary, self._backing, repr(self.read_gbps), repr(self.write_gbps), self._mountpoint, "-f"],
            stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10
        while not os.path.ismount(self._mountpoint):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                err = self._proc.stderr.read() if self._proc.poll() is not None else "no mount after 10 s"
                self._cleanup()
                raise SlowDiskError(f"mounting the slow disk failed: {err.strip()}")
            time.sleep(0.02)
        self.path = self._mountpoint
        self.stat_path = os.path.join(self._mountpoint, STAT_NAME)
        return self

    def __exit__(self, *exc) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        if self._proc is not None:
            if os.path.ismount(self._mountpoint):
                subprocess.run(["fusermount3", "-u", self._mountpoint], capture_output=True)
            try:
                _, err = self._proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                _, err = self._proc.communicate()
            # Its totals line (libfuse may print notices of its own beside it).
            self.summary = "\n".join(l for l in (err or "").splitlines() if l.startswith("slow_disk:"))
            self._proc = None
        for d in (self._mountpoint, self._backing):
            if d and not os.path.ismount(d):
                shutil.rmtree(d, ignore_errors=True)
        self.path = self.stat_path = ""


def parse_rates(text: str) -> tuple[float, float]:
    """'READ,WRITE' in GB/s (e.g. '0.47,0.67') -> (read, write)."""
    try:
        read, write = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"expected READ_GBPS,WRITE_GBPS such as 0.47,0.67, got {text!r}") from None
    if not (read > 0 and write > 0):
        raise ValueError(f"slow disk rates must be positive, got {text!r}")
    return read, write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--read-gbps", type=float, required=True, help="read rate, GB/s")
    parser.add_argument("--write-gbps", type=float, required=True, help="write rate, GB/s")
    parser.add_argument("--backing", default=None, help="folder for the bytes underneath (default /dev/shm)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...; {} is the mounted directory")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command after --, with {} where the mounted directory goes")
    with SlowDisk(args.read_gbps, args.write_gbps, args.backing) as disk:
        print(f"slow disk at {disk.path}: read {disk.read_gbps:g} GB/s, write {disk.write_gbps:g} GB/s",
              file=sys.stderr)
        rc = subprocess.call([disk.path if a == "{}" else a for a in command])
    print(disk.summary, file=sys.stderr)
    sys.exit(rc)


if __name__ == "__main__":
    main()
