"""Multi-process training on JAX's distributed runtime: real processes on a loopback coordinator, CPU devices.

2 processes x 2 devices must train exactly as 1 process x 4 devices; a killed process ends its peer within the
documented bound and ``--resume`` finishes bit-identically, also on another process count (resharded); a process
that cannot use its store directory stops every process with a clear error and commits nothing; a multi-process
checkpoint exports to one directory plain orbax reads, and a missing part is named.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import nsp.storage
from nsp.distributed import PEER_LOST_EXIT
from nsp.distributed.launch import free_port
from nsp.distributed.runtime import HEARTBEAT_TIMEOUT_S
from nsp.storage import checkpoint as ckpt

NSP = [sys.executable, "-m", "nsp.cli"]
DATA = str(Path(__file__).resolve().parents[1] / "nsp" / "train" / "corpus.py")
STEPS = 10
TRAIN = ["train", "--model", "tiny", "--steps", str(STEPS), "--batch", "4", "--seq", "32", "--log-every", "1",
         "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "4", "--page-mib", "0.0625", "--data", DATA]
BOUND_S = HEARTBEAT_TIMEOUT_S + 10  # heartbeat timeout, the watchdog's poll, and start-up slack


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", PYTHONUNBUFFERED="1", **extra)
    return env


def _launch(run_dir: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(NSP + ["launch", "-n", "2", "--devices-per-process", "2", "--grace", "20", "--"] + NSP
                          + TRAIN + ["--run-dir", str(run_dir), *args], env=_env(2), capture_output=True,
                          text=True, timeout=timeout)


def _state(run_dir: Path) -> dict:
    """The final params (checkpoint) and every store state, gathered over the processes' stores."""
    step = max(int(p.name) for p in (run_dir / "ckpt").iterdir() if p.name.isdigit())
    out = {f"params/{i}": np.asarray(x) for i, x in
           enumerate(__import__("jax").tree_util.tree_leaves(ckpt.load_train_state(run_dir / "ckpt" / str(step))))}
    parts = sorted((run_dir / "store").glob("process-*")) or [run_dir / "store"]
    per = 4 // len(parts)
    for state in ("param", "mu", "nu"):
        chunks = []
        for p, part in enumerate(parts):
            shards = list(range(p * per, (p + 1) * per))
            with nsp.storage.open(part, shards=shards) as store:
                chunks += [store.read_shard(state, i) for i in shards]
        out[state] = np.concatenate(chunks)
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dist")
    single = subprocess.run(NSP + TRAIN + ["--run-dir", str(base / "one")], env=_env(4), capture_output=True,
                            text=True, timeout=240)
    assert single.returncode == 0, single.stdout + single.stderr
    multi = _launch(base / "two")
    assert multi.returncode == 0, multi.stdout + multi.stderr
    return base


def test_two_processes_match_one_process_bit_for_bit(runs):
    assert (runs / "two" / "store" / "process-00001").is_dir()
    assert (runs / "two" / "ckpt" / str(STEPS) / "store" / "process-00001").is_dir()
    _assert_same(_state(runs / "one"), _state(runs / "two"))


def test_ckpt_list_and_show_read_a_multi_process_checkpoint(runs, capsys):
    """``nsp ckpt list/show`` see every process's part of a step: its version, shards and files on disk."""
    from nsp.cli import main

    run = runs / "two"
    assert main(["ckpt", "list", "--run-dir", str(run)]) == 0
    assert f"step {STEPS}: store version {STEPS}, 2 processes" in capsys.readouterr().out
    assert main(["ckpt", "show", "--run-dir", str(run), "--step", str(STEPS)]) == 0
    shown = json.loads(capsys.readouterr().out)["store"]
    item = run / "ckpt" / str(STEPS) / "store"
    assert shown["version"] == STEPS and shown["local_shards"] == [0, 1, 2, 3]
    assert [(p["process"], p["shards"]) for p in shown["processes"]] == [(0, [0, 1]), (1, [2, 3])]
    on_disk = [sum((part / f["path"]).stat().st_size for f in ckpt.load_snapshot_info(part)["files"])
               for part in (item / "process-00000", item / "process-00001")]
    assert [p["bytes"] for p in shown["processes"]] == on_disk and all(on_disk)
    assert shown["bytes"] == sum(on_disk) and shown["total_bytes"] >= sum(on_disk)


def _kill_mid_run(run_dir: Path, victim: int, at_step: int) -> tuple[int, str, float]:
    """Starts 2 processes of a run, kills process ``victim`` once it printed step ``at_step``, and returns the
    survivor's exit status, its output, and the seconds it took to stop after the kill."""
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(NSP + TRAIN + ["--run-dir", str(run_dir), "--coordinator", address,
                                             "--num-processes", "2", "--process-id", str(i)],
                              env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    killed, survivor = procs[victim], procs[1 - victim]
    for line in killed.stdout:
        if line.startswith(f"step {at_step:5d}/"):
            break
    killed.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    out, _ = survivor.communicate(timeout=BOUND_S + 30)
    waited = time.monotonic() - killed_at
    killed.wait()
    return survivor.returncode, out, waited


def test_killed_process_stops_its_peer_and_resume_is_bit_exact(runs):
    run_dir = runs / "killed"
    status, out, waited = _kill_mid_run(run_dir, victim=1, at_step=6)  # after the step-4 checkpoint
    assert status == PEER_LOST_EXIT, out
    assert "stopped answering" in out and "--resume" in out, out
    assert waited < BOUND_S, f"the survivor took {waited:.1f} s to stop (bound {BOUND_S} s)"
    resumed = _launch(run_dir, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed" in resumed.stdout
    _assert_same(_state(runs / "two"), _state(run_dir))


def _make_read_only(path: Path) -> None:
    """``path`` that nobody may write into: its mode, and for root (whom modes do not stop) the immutable flag."""
    path.chmod(0o555)
    if os.geteuid() == 0:
        made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"running as root on a file system without chattr +i ({made.stderr.strip()}): "
                        "nothing makes a directory read-only here")


@pytest.mark.parametrize("problem", ["read-only", "foreign store"])
def test_bad_store_directory_stops_every_process_and_commits_nothing(runs, problem):
    run_dir = runs / problem.replace(" ", "-")
    part = run_dir / "store" / "process-00001"
    part.parent.mkdir(parents=True)
    if problem == "read-only":
        part.mkdir()
        _make_read_only(part)
    else:  # another run's store, of another layout
        with nsp.storage.open(part, num_shards=2) as store:
            store.initialize({"w": np.zeros(10, np.float32)}, nsp.storage.OptimizerSpec("adam"))
    try:
        result = _launch(run_dir, timeout=120)
    finally:
        subprocess.run(["chattr", "-i", str(part)], capture_output=True)
        part.chmod(0o755)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    for p in (0, 1):  # every process says what failed, and where
        said = [line for line in out.splitlines() if line.startswith(f"[{p}] nsp train: error:")]
        assert said and "process 1:" in said[0] and "nothing was committed" in said[0], out
    assert not (run_dir / "store" / "process-00000" / nsp.storage.store.METADATA).exists()
    assert not any(p.name.isdigit() for p in (run_dir / "ckpt").glob("*")), out


_ABORT = """
import os, sys
from nsp import _nsp_ffi
_nsp_ffi.install_abort_guard("127.0.0.1", int(sys.argv[1]), 500, "nsp: error: the service is gone\\n", 75)
os.abort()
"""


@pytest.mark.parametrize("service", ["gone", "listening"])
def test_abort_guard_exits_cleanly_only_when_the_service_is_gone(service):
    """Process 0's death makes JAX's client abort the others; the guard turns that abort into the documented exit
    when, and only when, the coordination service no longer accepts connections."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if service == "listening":
            listener.listen()
        else:
            listener.close()  # nothing listens there any more: connections are refused
        done = subprocess.run([sys.executable, "-c", _ABORT, str(port)], capture_output=True, text=True, timeout=60)
    if service == "gone":
        assert done.returncode == PEER_LOST_EXIT, done.stderr
        assert "the service is gone" in done.stderr
    else:
        assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr)
        assert "the service is gone" not in done.stderr


def test_killed_process_0_stops_its_peer_with_the_message(runs):
    """Process 0 hosts the coordination service: its death ends the others with the documented message and exit
    status (never a bare SIGABRT), at once."""
    status, out, waited = _kill_mid_run(runs / "killed-0", victim=0, at_step=3)
    assert status == PEER_LOST_EXIT, out
    assert "nsp: error: process 1:" in out and "--resume" in out, out
    assert waited < BOUND_S, f"the survivor took {waited:.1f} s to stop (bound {BOUND_S} s)"


def _from_step(src: Path, dest: Path, step: int) -> Path:
    """A copy of run ``src`` (its stores too) whose newest checkpoint is ``step``: the run as a kill after that
    checkpoint leaves it."""
    shutil.copytree(src, dest, symlinks=True)
    for p in (dest / "ckpt").iterdir():
        if p.name.isdigit() and int(p.name) > step:
            shutil.rmtree(p)
    return dest


def test_resume_on_one_process_reshards_and_is_bit_exact(runs):
    """A 2 x 2 run's checkpoint resumed by 1 process x 4 devices: each new shard re-cut from both processes'
    parts, the earlier layout's store directories replaced; it ends exactly where the 1 x 4 run ended."""
    run_dir = _from_step(runs / "two", runs / "two-then-one", 4)
    resumed = subprocess.run(NSP + TRAIN + ["--run-dir", str(run_dir), "--resume"], env=_env(4),
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resharding the checkpoint at step 4: written by 2 process(es) with 4 store shards" in resumed.stdout
    assert not (run_dir / "store" / "process-00000").exists()
    _assert_same(_state(runs / "one"), _state(run_dir))


@pytest.mark.slow
def test_resume_on_two_processes_from_one_reshards_and_is_bit_exact(runs):
    """The other way: a 1 x 4 run's checkpoint resumed by 2 processes x 2 devices ends where the 2 x 2 run did."""
    run_dir = _from_step(runs / "one", runs / "one-then-two", 4)
    resumed = _launch(run_dir, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resharding the checkpoint at step 4: written by 1 process(es)" in resumed.stdout
    _assert_same(_state(runs / "two"), _state(run_dir))


def test_multi_process_checkpoint_exports_for_plain_orbax_and_show_names_a_missing_part(runs, tmp_path, capsys):
    """``nsp ckpt export`` of a 2-process step: one directory that plain orbax restores on one process, the
    params as the processes' shards hold them. ``nsp ckpt show`` names a part that is missing."""
    import orbax.checkpoint as ocp

    from nsp.cli import main
    from nsp.storage.reshard import ItemSource

    step_dir = runs / "two" / "ckpt" / str(STEPS)
    assert main(["ckpt", "export", "--run-dir", str(runs / "two"), "--out", str(tmp_path / "x")]) == 0
    params = ocp.StandardCheckpointer().restore(tmp_path / "x" / "params")
    moments = ocp.StandardCheckpointer().restore(tmp_path / "x" / "opt_state")
    record = json.loads((tmp_path / "x" / "export.json").read_text())
    source = ItemSource(step_dir / "store")
    for state, tree in (("param", params), ("mu", moments["mu"]), ("nu", moments["nu"])):
        flat = source.read(state)
        for leaf in record["leaves"]:
            node = tree
            for key in leaf["keys"]:
                node = node[key]
            offset = next(x.offset for x in source.layout.leaves if x.path == leaf["path"])
            np.testing.assert_array_equal(np.ravel(node), flat[offset:offset + int(np.prod(leaf["shape"]))])
    capsys.readouterr()
    broken = tmp_path / "run"
    shutil.copytree(runs / "two" / "ckpt", broken / "ckpt", symlinks=True)
    shutil.rmtree(broken / "ckpt" / str(STEPS) / "store" / "process-00001")
    assert main(["ckpt", "show", "--run-dir", str(broken), "--step", str(STEPS)]) == 1
    out = capsys.readouterr()
    shown = json.loads(out.out)["parts"]
    assert [(p["process"], p["present"], p["shards"]) for p in shown] == [(0, True, [0, 1]), (1, False, [2, 3])]
    assert "process 1's part" in out.err and "process-00001" in out.err and "missing" in out.err
    assert main(["ckpt", "export", "--run-dir", str(broken), "--step", str(STEPS), "--out",
                 str(tmp_path / "y")]) == 1
    assert "process 1's part (process-00001)" in capsys.readouterr().err and not (tmp_path / "y").exists()
