"""A disk that fills under a run, and checkpoints on another file system than the store's.

``nsp train`` with its run on a small file system (a tmpfs mounted for the test, nearly filled by a file of the
test's) stops when the disk fills with one message: the error's line, what was kept (the store's committed
version, the last checkpoint) and how to go on; a non-zero exit status, no traceback. The store stays whole
(``nsp store verify``) and, once there is room again, ``--resume`` continues. A run that checkpoints onto another
file system than its store's says once, not at every checkpoint, that pages were copied.

Mounting needs root (or CAP_SYS_ADMIN): elsewhere, in most containers, these tests are skipped, saying why.
"""

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nsp.distributed.runtime import HEARTBEAT_TIMEOUT_S

NSP = [sys.executable, "-m", "nsp.cli"]
DATA = str(Path(__file__).resolve().parents[1] / "nsp" / "train" / "corpus.py")
TRAIN = ["train", "--model", "tiny", "--batch", "2", "--seq", "32", "--log-every", "1", "--eval-every", "0",
         "--eval-batches", "1", "--ckpt-every", "1", "--data", DATA]
#: Free space the test leaves on the small file system: room for the store (two versions and one checkpoint's
#: pages: its set-up check asks 4.5 MB of the tiny model) and little more, so that a few steps' checkpoints fill it.
LEFT_FREE = 5_200_000


def _env() -> dict:
    # One CPU device: the tests' own four (conftest) would make a four-shard store.
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1")


def _nsp(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(NSP + list(args), env=_env(), capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def _mounted(mount: Path, size: str):
    """A tmpfs of ``size`` mounted at ``mount`` (unmounted afterwards); skips where mounting is refused."""
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a small file system: {e}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small file system (needs root): {(done.stderr or done.stdout).strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


@pytest.fixture
def small_fs(tmp_path):
    """A 16 MB tmpfs mounted under ``tmp_path`` (unmounted afterwards); skips where mounting is refused."""
    mount = tmp_path / "small"
    mount.mkdir()
    with _mounted(mount, "16m"):
        yield mount


def _fill(mount: Path, leave: int) -> Path:
    """A file that takes all of ``mount``'s free space but ``leave`` bytes."""
    filler = mount / "filler"
    size = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize - leave
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)
    return filler


def test_a_full_disk_stops_the_run_with_one_message_and_resume_continues(small_fs):
    run_dir = small_fs / "run"
    filler = _fill(small_fs, LEFT_FREE)
    args = TRAIN + ["--run-dir", str(run_dir), "--steps", "8"]
    full = _nsp(*args)
    out = full.stdout + full.stderr
    assert full.returncode == 1, out
    assert "No space left on device" in out or "not enough disk" in out, out
    for noise in ("Traceback", "Exception ignored", "Exception in thread", "ERROR:"):
        assert noise not in out, f"{noise!r} in the output of a run that filled its disk:\n{out}"
    message = out[out.index("nsp train: error:"):]
    assert message.count("\n") == 3, f"the message is three lines:\n{message}"  # failed / kept / to go on
    kept = re.search(r"kept: the store at version (\d+), committed and whole", message)
    assert kept, message
    assert re.search(r"the checkpoint of step \d+ \(", message), message
    assert "to go on: free space on the file system of" in message and "--resume" in message, message

    verify = _nsp("store", "verify", str(run_dir / "store"))
    assert verify.returncode == 0 and "checked: OK" in verify.stdout, verify.stdout + verify.stderr
    assert f"version {kept[1]}," in verify.stdout, (verify.stdout, message)  # the version the message named

    filler.unlink()  # room again: the run goes on from its last checkpoint, to the end
    resumed = _nsp(*args, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed" in resumed.stdout and re.search(r"step +8/8", resumed.stdout), resumed.stdout


def test_checkpoints_on_another_file_system_warn_once(small_fs, tmp_path):
    # The store on the test's disk, the checkpoints on the tmpfs: every checkpoint copies the store's pages.
    done = _nsp(*TRAIN, "--run-dir", str(small_fs / "run"), "--store-dir", str(tmp_path / "store"), "--steps", "2")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert len(list((small_fs / "run" / "ckpt").glob("[0-9]*"))) >= 2, out  # steps 0, 1, 2 (three kept)
    assert out.count("pages were copied") == 1, out
    assert "EXDEV" in out, out


def test_a_spill_directory_turned_read_only_mid_run_stops_it_with_the_store_whole(small_fs, tmp_path):
    # The run's store and checkpoints on the ordinary disk; its offloaded activations on the small file system,
    # which becomes read-only while the run trains.
    run_dir = tmp_path / "run"
    args = TRAIN + ["--run-dir", str(run_dir), "--steps", "200", "--offload-activations", "all",
                    "--spill-dir", str(small_fs), "--ckpt-every", "2"]
    proc = subprocess.Popen(NSP + args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.match(r"step\s+3/", line):
                # The kernel refuses to make a file system read-only while a file on it is open for writing
                # ("mount point is busy"): tried again until it catches the run between two spill writes.
                deadline = time.monotonic() + 20
                while True:
                    remount = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True,
                                             text=True)
                    if remount.returncode == 0 or "busy" not in remount.stderr or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
                assert remount.returncode == 0, remount.stderr
                break
        out = "".join(lines) + proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], capture_output=True)
    assert proc.returncode == 1, out
    message = out[out.index("nsp train: error:"):]
    assert "spilled activations" in message and "Read-only file system" in message, message
    for noise in ("Traceback", "Exception ignored"):
        assert noise not in out, out
    kept = re.search(r"kept: the store at version (\d+), committed and whole", message)
    assert kept, message
    verify = _nsp("store", "verify", str(run_dir / "store"))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f"version {kept.group(1)}" in verify.stdout + verify.stderr


def test_a_full_disk_under_one_process_of_two_stops_both_with_its_message_and_resume_continues(tmp_path, capsys):
    """Process 1's part of the store on a small file system of its own, which another program fills mid-run (the
    checkpoints and process 0's part on the test's disk). Process 1 says what failed, what was kept and how to go
    on; process 0 stops at once (not after the heartbeat timeout that tells a process that died) with process 1's
    message, naming it; neither prints a traceback. Both parts of the store verify, and the run resumes."""
    from nsp.cli import main

    run_dir = tmp_path / "run"
    part = run_dir / "store" / "process-00001"
    part.mkdir(parents=True)
    with _mounted(part, "8m"):
        args = TRAIN + ["--run-dir", str(run_dir), "--steps", "4"]
        launch = NSP + ["launch", "-n", "2", "--grace", "30", "--"] + NSP
        proc = subprocess.Popen(launch + args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        lines, filled_at = [], None
        try:
            for line in proc.stdout:
                lines.append(line)
                if filled_at is None and re.match(r"\[1\] step\s+1/", line):
                    filler = _fill(part, 0)
                    filled_at = time.monotonic()
            out = "".join(lines) + proc.communicate(timeout=120)[0]
            stopped_s = time.monotonic() - filled_at
        finally:
            proc.kill()
        assert filled_at is not None, out
        assert proc.returncode == 1, out
        for noise in ("Traceback", "Exception ignored", "Exception in thread", "stopped answering", "failed: ["):
            assert noise not in out, f"{noise!r} in the output of a run that filled a disk:\n{out}"
        mine = "".join(line[4:] for line in out.splitlines(keepends=True) if line.startswith("[1] "))
        message = mine[mine.index("nsp train: error:"):]
        assert message.count("\n") == 3, f"the message is three lines:\n{message}"
        assert re.search(rf"failed: cannot (write|reserve space for) {re.escape(str(part))}/\S+: No space left on "
                         "device", message), message
        kept = re.search(r"kept: the store at version (\d+), committed and whole .*nsp store verify (\S+) "
                         r"--shards 1 checks it\); the checkpoint of step (\d+) \(", message)
        assert kept and kept[2] == str(part), message
        assert "to go on: free space on the file system of the store" in message and "--resume" in message, message
        theirs = "".join(line[4:] for line in out.splitlines(keepends=True) if line.startswith("[0] "))
        said = theirs[theirs.index("nsp: error: process 0: stopping, because process 1 stopped the run:\n"):]
        assert "".join(f"  {line}" for line in message.replace("nsp train: error: ", "").splitlines(keepends=True)) \
            in said, (message, said)
        assert stopped_s < HEARTBEAT_TIMEOUT_S, f"the run took {stopped_s:.1f} s to stop after the disk filled"

        capsys.readouterr()
        for p in (0, 1):  # each process's part at its committed version, whole
            assert main(["store", "verify", str(run_dir / "store" / f"process-{p:05d}"), "--shards", str(p)]) == 0
        verified = capsys.readouterr().out
        assert f"process-00001 (shards 1 of 2): version {kept[1]}," in verified and "checked: OK" in verified, verified

        filler.unlink()  # room again: both go on from the last checkpoint, to the end
        resumed = subprocess.run(launch + args + ["--resume"], env=_env(), capture_output=True, text=True,
                                 timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed" in resumed.stdout and re.search(r"\[1\] step +4/4", resumed.stdout), resumed.stdout


def test_a_spill_area_that_fills_fails_its_step_by_name_and_trains_again_once_freed(small_fs):
    # A write that fails on the area's I/O thread is reported by the step's next push or pop, naming the file.
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    import nsp.offload

    def layer(w, x):
        return jnp.sin(jnp.tanh(x @ w) @ w.T)

    def loss(layer_fn, ws, x):
        for w in ws:
            x = layer_fn(w, x)
        return jnp.sum(x ** 2)

    ws = [jax.random.normal(jax.random.key(i), (64, 512)) * 0.05 for i in range(4)]
    x = jax.random.normal(jax.random.key(9), (256, 64))  # each layer spills about 0.6 MB
    want = jax.jit(jax.grad(functools.partial(loss, layer)))(ws, x)
    with nsp.offload.SpillArea(small_fs) as area:
        grad = jax.jit(jax.grad(functools.partial(loss, nsp.offload.offload(layer, area))))
        filler = _fill(small_fs, 100_000)
        with pytest.raises(Exception, match="cannot write spilled activations to .*No space left on device"):
            jax.block_until_ready(grad(ws, x))
        filler.unlink()
        area.reset()
        got = grad(ws, x)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
