"""bench/slow_disk.py's emulated disk, which bench/store_update.py --slow-disk rests on: reads and writes share one
timeline, so nothing runs faster than its nominal floor, and its counters count every byte it served."""

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from common import DeviceTraffic  # noqa: E402
from slow_disk import SlowDisk, parse_rates  # noqa: E402


def _fuse_missing() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if shutil.which("fusermount3") is None or shutil.which("pkg-config") is None:
        return "fuse3 / pkg-config not installed (apt-get install -y libfuse3-dev fuse3 pkg-config)"
    if subprocess.run(["pkg-config", "--exists", "fuse3"]).returncode != 0:
        return "libfuse 3's headers not installed (apt-get install -y libfuse3-dev)"
    return None


needs_fuse = pytest.mark.skipif(_fuse_missing() is not None, reason=str(_fuse_missing()))

MB = 10**6


def test_parse_rates_names_bad_input():
    assert parse_rates("0.47,0.67") == (0.47, 0.67)
    for bad in ("0.47", "a,b", "0,1", "-1,1"):
        with pytest.raises(ValueError, match="0.47,0.67|positive"):
            parse_rates(bad)


@needs_fuse
def test_reads_and_writes_share_one_timeline_and_are_counted(tmp_path):
    read_gbps, write_gbps = 0.2, 0.4
    size = 8 * MB
    with SlowDisk(read_gbps, write_gbps, backing_parent=str(tmp_path)) as disk:
        device = DeviceTraffic(disk.path, disk.stat_path)
        assert device.available
        a, b = os.path.join(disk.path, "a"), os.path.join(disk.path, "b")
        payload = os.urandom(size)
        with open(a, "wb") as f:
            f.write(payload)
        before = device.read()
        t0 = time.perf_counter()

        def write_b() -> None:
            with open(b, "wb") as f:
                f.write(payload)
                os.fsync(f.fileno())

        writer = threading.Thread(target=write_b)
        writer.start()  # a read and a write at once: one budget, so no faster than one after the other
        with open(a, "rb") as f:
            assert f.read() == payload
        writer.join()
        elapsed = time.perf_counter() - t0
        after = device.read()
        with open(b, "rb") as f:
            assert f.read() == payload, "the bytes written must come back unchanged"
    nominal = disk.nominal_s(size, size)
    assert nominal == pytest.approx(size / (read_gbps * 1e9) + size / (write_gbps * 1e9))
    assert elapsed >= nominal * 0.99, f"{size} B read and written at once in {elapsed:.3f} s < floor {nominal:.3f} s"
    assert after.read_bytes - before.read_bytes == size
    assert after.written_bytes - before.written_bytes == size
    assert after.busy_ms - before.busy_ms == pytest.approx(nominal * 1e3, abs=2)
    assert not os.path.exists(a), "the mount and its files are gone after the with block"
    assert "read" in disk.summary and not list(tmp_path.iterdir()), "the backing directory is removed"
