"""Shared helpers for the benchmarks: interleaved timing, a side-by-side table and a JSON record.

Every benchmark follows the same protocol: each contender is warmed up, then all contenders are run in turn
(interleaved, so that drift in the machine's speed hits all of them alike) for ``repeats`` rounds, and the
median of each contender's times is reported next to its ratio to the reference contender.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def time_interleaved(
    contenders: dict[str, Callable[[], Any]], *, repeats: int = 7, warmup: int = 2,
    before: dict[str, Callable[[], Any]] | None = None, pause: float = 0.0,
    idle_cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Runs every contender ``warmup`` times, then ``repeats`` interleaved rounds; returns seconds per call.

    A contender must block until its work is done (call ``jax.block_until_ready`` inside it). ``before`` maps a
    contender's name to a function run untimed right before each of its calls (warm-up included).

    ``pause`` seconds are slept after every call (warm-up included), so that threads a contender leaves spinning
    (an OpenMP runtime under OMP_WAIT_POLICY=ACTIVE, say) wind down before the next contender starts instead of
    taking its cores. When ``idle_cpu`` is given, it receives, per contender, the CPU seconds this process spent
    during each timed call's pause: about 0 when nothing of that contender keeps running after it returned.
    """
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
        for name, fn in contenders.items():
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


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "platform": platform.platform(),
    }


def print_table(title: str, rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """Prints ``rows`` as a table; ``columns`` holds (key, header, format) triples."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        line = []
        for key, _, fmt in columns:
            value = row.get(key)
            line.append("-" if value is None else (value if isinstance(value, str) else format(value, fmt)))
        cells.append(line)
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for i, line in enumerate(cells):
        print("  ".join(str(c).rjust(w) if j else str(c).ljust(w) for j, (c, w) in enumerate(zip(line, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_json(name: str, payload: dict[str, Any], path: str | os.PathLike | None = None) -> Path:
    """Writes ``payload`` (plus the machine description) as JSON; returns the file written."""
    out = Path(path) if path else RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import shlex
    import sys

    command = "python " + shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    record = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": command,
              "machine": machine_info(), **payload}
    out.write_text(json.dumps(record, indent=2) + "\n")
    return out
