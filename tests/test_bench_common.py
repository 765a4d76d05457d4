"""bench/common.py's interleaved timing and device counters, and bench/page_backing.py's page record, which every
benchmark record rests on."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from common import DeviceCounts, DeviceTraffic, time_interleaved  # noqa: E402
import page_backing  # noqa: E402


def test_shuffled_rounds_run_everyone_once_with_their_before_hook_first():
    calls: list[str] = []
    contenders = {name: (lambda name=name: calls.append(name)) for name in "abcdef"}
    orders: list[list[str]] = []
    times = time_interleaved(contenders, repeats=6, warmup=0, before={"c": lambda: calls.append("before c")},
                             shuffle_seed=3, orders=orders)
    assert all(len(t) == 6 for t in times.values())
    assert len(orders) == 6 and all(sorted(o) == list("abcdef") for o in orders)
    assert len({tuple(o) for o in orders}) > 1, "the order must change between rounds"
    ran = [c for c in calls if c != "before c"]
    assert ran == [name for order in orders for name in order]
    assert all(calls[i + 1] == "c" for i, c in enumerate(calls) if c == "before c")
    again: list[list[str]] = []
    time_interleaved(contenders, repeats=6, warmup=0, shuffle_seed=3, orders=again)
    assert again == orders, "a seed must give the same orders"


def test_unshuffled_rounds_keep_the_given_order():
    orders: list[list[str]] = []
    time_interleaved({n: (lambda: None) for n in "xyz"}, repeats=3, warmup=0, orders=orders)
    assert orders == [list("xyz")] * 3


def test_device_traffic_counts_a_synced_write(tmp_path):
    device = DeviceTraffic(tmp_path)
    if not device.available:
        pytest.skip(f"{tmp_path} is not on a block device ({device.path} is absent)")
    counts: list[DeviceCounts] = []
    size = 8 << 20

    def write() -> None:
        with open(tmp_path / "f.bin", "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())

    device.counted(write, counts)()
    (c,) = counts
    assert c.written_bytes >= size, f"the device wrote {c.written_bytes} bytes of an fsynced {size}-byte file"
    assert c.writes >= 1 and c.busy_ms >= 0


@pytest.mark.skipif(page_backing.thp_mode() not in ("madvise", "always"),
                    reason="the kernel grants no transparent huge pages")
def test_page_backing_measures_which_pages_an_array_lies_on():
    """numpy advises huge pages for its large arrays; with that advice off (--pages small) a new one gets none."""
    advised = np.ones(64 << 18, np.float32)  # 64 MiB, written: its pages exist
    assert page_backing.huge_share([advised]) > 0.5
    page_backing._numpy_advice(False)
    try:
        plain = np.ones(64 << 18, np.float32)
        # Under "always" every large mapping gets huge pages, and so does malloc's where glibc is told to.
        if page_backing.thp_mode() == "madvise" and "hugetlb=1" not in os.environ.get("GLIBC_TUNABLES", ""):
            assert page_backing.huge_share([plain]) < 0.1
    finally:
        page_backing._numpy_advice(True)
    assert page_backing.span(plain) == (plain.ctypes.data, plain.nbytes)


def test_page_backing_sets_only_its_own_glibc_tunable():
    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"}
    assert page_backing._tunables_with(env, True) == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert page_backing._tunables_with(env, False) == "glibc.malloc.arena_max=2"
    assert page_backing._tunables_with({}, False) == ""
