"""Which memory pages the contenders' arrays live on, so that an interleaved benchmark compares like with like.

An update kernel streams its state once per call; on 4 KiB pages it pays a TLB miss every 4 KiB of every stream,
and the CPU's hardware prefetchers stop at each page boundary. On 2 MiB transparent huge pages it does not.
Where the kernel's THP mode is ``madvise`` (Debian's default), who gets huge pages depends on the allocator:
numpy advises them for its large arrays, while XLA's buffers (jax arrays) and torch's tensors come from plain
malloc and stay on 4 KiB pages. A comparison of torch updating numpy arrays against nsp updating jax arrays then
measures the page size as much as the kernels (64M params here: nsp 40.8 ms on 4 KiB pages, 36.0 ms on huge
pages, the same kernel).

``--memory-pages`` puts every contender on the same kind of page:
  huge     all arrays on transparent huge pages: glibc's malloc advises them for every large block
           (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, read when the process starts, so the benchmark restarts
           itself with it), numpy advises its own
  small    all on 4 KiB pages: glibc left as it is, numpy's advice turned off
  as-is    whatever each library does by itself (the mixed case above)

Each contender's share of state bytes on huge pages is measured from /proc/self/smaps and recorded, so the
record shows what the contenders ran on, not just what was asked for.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

CHOICES = ("huge", "small", "as-is")
DEFAULT = "huge"
_TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"


def add_arguments(parser, default: str = DEFAULT) -> None:
    parser.add_argument("--memory-pages", choices=CHOICES, default=default,
                        help="memory pages of every contender's arrays: huge (transparent huge pages for all), "
                             "small (4 KiB for all) or as-is (what each library does by itself); default "
                             f"{default}")


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (always, madvise or never), or "unknown"."""
    try:
        with open(THP_MODE_PATH) as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unknown"


def _tunables_with(env: dict[str, str], on: bool) -> str:
    parts = [p for p in env.get("GLIBC_TUNABLES", "").split(":") if p and not p.startswith("glibc.malloc.hugetlb=")]
    return ":".join(parts + ([_TUNABLE] if on else []))


def apply(choice: str) -> None:
    """Puts this process on the pages ``choice`` asks for, restarting it (same argv) when glibc must be told at
    start; call it first in main(), before any large array exists."""
    if choice == "as-is":
        return
    want = _tunables_with(dict(os.environ), choice == "huge")
    if os.environ.get("GLIBC_TUNABLES", "") != want:
        env = dict(os.environ)
        if want:
            env["GLIBC_TUNABLES"] = want
        else:
            env.pop("GLIBC_TUNABLES", None)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if choice == "small":
        _numpy_advice(False)


def _numpy_advice(on: bool) -> None:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    core.multiarray._set_madvise_hugepage(on)


def span(array) -> tuple[int, int]:
    """(address, bytes) of a numpy array, jax array or torch tensor's buffer."""
    if hasattr(array, "unsafe_buffer_pointer"):  # jax
        return array.unsafe_buffer_pointer(), array.nbytes
    if hasattr(array, "data_ptr"):  # torch
        return array.data_ptr(), array.numel() * array.element_size()
    return array.ctypes.data, array.nbytes  # numpy


def _mappings() -> list[tuple[int, int, int]]:
    """(start, end, bytes on huge pages) of every mapping of this process."""
    out = []
    start = end = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = head.split("-")
                start, end = int(lo, 16), int(hi, 16)
            elif head == "AnonHugePages:" and start is not None:
                out.append((start, end, int(line.split()[1]) * 1024))
    return out


def huge_share(arrays: Iterable) -> float:
    """The share of the arrays' bytes that lie on huge pages (each mapping's huge bytes spread evenly over it)."""
    spans = [span(a) for a in arrays]
    total = sum(n for _, n in spans)
    if total == 0:
        return 0.0
    huge = 0.0
    maps = _mappings()
    for addr, n in spans:
        for lo, hi, huge_bytes in maps:
            overlap = min(hi, addr + n) - max(lo, addr)
            if overlap > 0 and hi > lo:
                huge += overlap * huge_bytes / (hi - lo)
    return min(1.0, huge / total)


def record(choice: str, shares: dict[str, float]) -> dict:
    """The record's fields: what was asked, the kernel's THP mode, and each contender's measured share."""
    return {"pages": choice, "thp_mode": thp_mode(), "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "huge_page_share": shares}
