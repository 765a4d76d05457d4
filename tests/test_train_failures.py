"""Runs that cannot start as asked end with one clear line, not a traceback: a second ``nsp train`` on a store that
another one is writing (the run it would disturb goes on), a resume with another device count than the
checkpoint's, and a process of a multi-process run whose coordinator address nothing answers at (JAX's client
would abort it, a C++ stack trace, once its join timed out). (A full disk: ``test_disk_full.py``; a peer lost
mid-run: ``test_distributed.py``.)
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nsp.distributed.launch import free_port

NSP = [sys.executable, "-m", "nsp.cli"]
DATA = str(Path(__file__).resolve().parents[1] / "nsp" / "train" / "corpus.py")
TRAIN = ["train", "--model", "tiny", "--seq", "32", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
         "--data", DATA]


def _env(devices: int = 1) -> dict:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", PYTHONUNBUFFERED="1")


def test_a_second_run_on_a_store_in_use_is_refused_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(NSP + TRAIN + ["--run-dir", str(run_dir), "--batch", "2", "--steps", "100000",
                                            "--ckpt-every", "0"],
                             env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:  # its store is open (and locked) once it steps
            if line.startswith("step "):
                break
        assert first.poll() is None, "the first run ended before its first step"
        # The same command resumed beside it: its restore would overwrite the store the first run writes.
        second = subprocess.run(NSP + TRAIN + ["--run-dir", str(run_dir), "--batch", "2", "--steps", "100000",
                                               "--resume"], env=_env(), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert "Traceback" not in second.stderr, second.stderr
        assert f"store {run_dir / 'store'} is open for writing (pid {first.pid})" in second.stderr, second.stderr
        assert first.poll() is None, "the first run goes on"
    finally:
        first.send_signal(signal.SIGINT)  # finishes its step and checkpoints
        rest, _ = first.communicate(timeout=120)
    assert first.returncode == 130, rest
    assert "Traceback" not in rest, rest


def test_resume_with_another_device_count_reshards_and_says_so(tmp_path):
    # The tiny model's shards are smaller than a page, so each store's pages are cut to its shards: 4 shards have
    # smaller pages than 2, and the resharded store must record the new size (once it kept the old one, and the
    # store's own check refused it).
    run_dir = tmp_path / "run"
    args = TRAIN + ["--run-dir", str(run_dir), "--batch", "4", "--steps", "2"]
    done = subprocess.run(NSP + args, env=_env(2), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    again = subprocess.run(NSP + args[:-1] + ["3", "--resume"], env=_env(4), capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert ("resharding the checkpoint at step 2: written by 1 process(es) with 2 store shards, this run has 1 "
            "with 4") in again.stdout, again.stdout


def test_a_coordinator_nothing_answers_at_is_named_within_the_join_timeout():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    # nsp train waits INIT_TIMEOUT_S (two minutes) for its peers; the same join, with a short timeout.
    code = ("import nsp.distributed, sys\n"
            "try:\n"
            f"    nsp.distributed.initialize({address!r}, 2, 1, init_timeout_s=3)\n"
            "except nsp.distributed.DistributedError as e:\n"
            "    print(e); sys.exit(2)\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (f"process 1 could not join the run at {address} within 3 s (a process never started, crashed before "
            f"joining, or the address is wrong): nothing answers at {address}") in done.stdout, done.stdout
    assert "Check failure" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert time.monotonic() - t0 < 30
