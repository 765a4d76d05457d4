"""A multi-process run whose wall clock steps, forward and back (a clock set by hand, an NTP step after a suspend).

nsp times everything by the monotonic clock; JAX's coordination service times its heartbeats and barriers by the
wall clock of process 0's host, and orbax its waits. So a step smaller than the heartbeat timeout passes: the run
goes on. A step of hours either marks every process dead (the service) or times a wait out (orbax): the run cannot
go on, and every process stops within seconds saying that the wall clock jumped, not that a peer died or a disk
failed; ``--resume`` then continues, and the run ends bit for bit as one whose clock never moved.

The steps come from ``wallclock_shift.c``, an LD_PRELOAD shim built here with the C compiler (skipped without
one): it shifts the processes' wall clock by the seconds in a file, leaving the monotonic clock alone.
"""

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import nsp.storage
from nsp.storage import checkpoint as ckpt

NSP = [sys.executable, "-m", "nsp.cli"]
HERE = Path(__file__).resolve().parent
DATA = str(HERE.parent / "nsp" / "train" / "corpus.py")
TRAIN = ["train", "--model", "tiny", "--batch", "2", "--seq", "32", "--log-every", "1", "--eval-every", "0",
         "--eval-batches", "1", "--ckpt-every", "4", "--steps", "400", "--data", DATA,
         "--heartbeat-timeout", "30"]
# A step the run takes in its stride, forward then back: above the 1 s the watchdog counts as a step of the clock,
# and well below the heartbeat timeout less the heartbeat interval less how late a heartbeat may run on a loaded
# machine. With nsp's default timeout (10 s) a step of 3 s, and later one of 1.5 s, each once stopped a run here
# beside other tests (the service took every process for dead): so this run takes a timeout of 30 s.
SMALL_S = 3.0
HOLD_S = 1.5  # each held this long, past a check of the service's (once a second)
BIG_S = 3 * 3600  # a step the run cannot take
STOP_BOUND_S = 15.0  # from the big step to the end of every process


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no C compiler to build the wall-clock shim (tests/wallclock_shift.c) with")
    lib = tmp_path_factory.mktemp("shim") / "libwallclock_shift.so"
    built = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(lib), str(HERE / "wallclock_shift.c"),
                            "-ldl"], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"cannot build the wall-clock shim: {built.stderr.strip()}")
    return lib


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", PYTHONUNBUFFERED="1", **extra)
    return env


def _state(run_dir: Path, step: int) -> dict:
    """The params of the checkpoint of ``step`` and every state of the store, gathered over the processes' parts."""
    out = {f"params/{i}": np.asarray(x) for i, x in
           enumerate(jax.tree_util.tree_leaves(ckpt.load_train_state(run_dir / "ckpt" / str(step))))}
    parts = sorted((run_dir / "store").glob("process-*")) or [run_dir / "store"]
    for state in ("param", "mu", "nu"):
        chunks = []
        for p, part in enumerate(parts):
            shards = [p] if len(parts) > 1 else [0, 1]
            with nsp.storage.open(part, shards=shards) as store:
                chunks += [store.read_shard(state, i) for i in shards]
        out[state] = np.concatenate(chunks)
    return out


def test_small_steps_of_the_wall_clock_pass_a_big_one_stops_the_run_clearly_and_resume_is_bit_exact(shim, tmp_path):
    run_dir, shift = tmp_path / "run", tmp_path / "shift"
    shift.write_text("0\n")
    env = _env(1, LD_PRELOAD=str(shim), WALLCLOCK_SHIFT_FILE=str(shift))
    launch = NSP + ["launch", "-n", "2", "--grace", "30", "--"] + NSP
    proc = subprocess.Popen(launch + TRAIN + ["--run-dir", str(run_dir)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    lines: list[tuple[float, str]] = []
    stepped: dict[str, float] = {}

    def steps():  # +3 s, held; back to 0 (a step of -3 s), held; then +3 h
        for name, seconds, hold in (("small forward", SMALL_S, HOLD_S), ("small back", 0, HOLD_S),
                                    ("big", BIG_S, 0)):
            shift.write_text(f"{seconds}\n")
            stepped[name] = time.monotonic() - t0
            time.sleep(hold)

    driver = threading.Thread(target=steps, daemon=True)
    try:
        for line in proc.stdout:
            lines.append((time.monotonic() - t0, line))
            if not driver.is_alive() and not stepped and re.match(r"\[0\] step +1/", line):
                driver.start()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    ended = time.monotonic() - t0
    out = "".join(line for _, line in lines)
    assert "big" in stepped, out
    # The small steps passed: the run stepped on after each, and stopped only after the big one.
    after_small = [t for t, line in lines if re.match(r"\[\d\] step +\d+/", line) and t > stepped["small back"]]
    assert after_small and min(after_small) < stepped["big"], out
    assert proc.returncode in (1, 75), out  # a wait timed out (orbax), or the service lost every process
    for p in (0, 1):  # every process says the clock jumped by 3 hours, and how to go on
        said = "".join(line[4:] for _, line in lines if line.startswith(f"[{p}] "))
        error = said[said.rfind("error: "):]
        assert re.search(r"wall clock (had just )?jumped by \+3 h 0 min 0 s", error), out
        assert "--resume" in error, out
    for noise in ("Traceback", "Check failure", "Exception ignored", "stopped answering", "No space"):
        assert noise not in out, f"{noise!r} in the output of a run whose clock stepped:\n{out}"
    assert ended - stepped["big"] < STOP_BOUND_S, f"{ended - stepped['big']:.1f} s to stop after the big step"

    # The clock stays 3 hours ahead (a run started on it is a run like any other); the run goes on from its last
    # checkpoint, up to a step a few past where it stopped.
    stopped = max(int(m[1]) for _, line in lines if (m := re.match(r"\[\d\] step +(\d+)/", line)))
    end = stopped + 2
    resumed = subprocess.run(launch + TRAIN + ["--run-dir", str(run_dir), "--resume", "--stop-after", str(end)],
                             env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed" in resumed.stdout, resumed.stdout
    # Bit for bit what one process with both devices trains, its clock untouched (2 x 1 trains as 1 x 2).
    reference = subprocess.run(NSP + TRAIN + ["--run-dir", str(tmp_path / "reference"), "--stop-after", str(end)],
                               env=_env(2), capture_output=True, text=True, timeout=120)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    a, b = _state(run_dir, end), _state(tmp_path / "reference", end)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
