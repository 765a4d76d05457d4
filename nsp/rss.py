"""The process's resident memory: now, at its peak, and the peak restarted for one phase.

The peak is Linux's ``VmHWM`` (``/proc/self/status``), which ``reset_peak`` can bring back to the current
resident size (``/proc/self/clear_refs``), so that a phase after a one-time one (the offload planner's profiling,
say) reports its own peak. Elsewhere ``getrusage``'s ``ru_maxrss``, which cannot be reset.
"""

from __future__ import annotations

import os
import resource
import sys


def status_kib(field: str) -> int | None:
    """A field of ``/proc/self/status`` in KiB (``VmRSS``: resident now; ``VmHWM``: its peak); None when
    unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_bytes() -> int:
    """The most resident memory this process has held (since it started, or since ``reset_peak``)."""
    hwm = status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def current_bytes() -> int:
    """What this process holds resident now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """Restarts ``peak_bytes`` from the current resident size; False where the system cannot (then the peak
    keeps counting from the start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return status_kib("VmHWM") is not None


def release_free_memory() -> bool:
    """Hands the C heap's free memory back to the system (glibc's ``malloc_trim``): after a one-time phase that
    allocated and freed much in small pieces (the offload planner's profiling: about 0.25 GiB stays resident
    otherwise). False where the C library has no such call."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)  # returns whether it released any: either is fine
        return True
    except (OSError, AttributeError):
        return False
