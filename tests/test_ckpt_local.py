"""What ``nsp train --ckpt-local`` refuses (``nsp.train.ckpt_local``), each refusal a clear error on every process:

- a checkpoint directory that processes share (its markers hold another process's token of this run): one run on
  one machine, for real (2 processes, the one run directory);
- processes that hold checkpoint steps but none in common (a host's directory lost or replaced), and the newest
  common step when their newest differ: ``common_step`` on this process's real steps (an unfinished save is no
  step), the other process's steps given as the all-gather would;
- a step written with ``--ckpt-local`` resumed without it, or the other way round, or on another layout:
  ``check_resumable`` on the step's meta.

A share-nothing run resumed for real: ``test_share_nothing.py``.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import pytest

import nsp.distributed
from nsp.storage import checkpoint as ckpt
from nsp.train import ckpt_local
from nsp.train.config import TrainError

NSP = [sys.executable, "-m", "nsp.cli"]
DATA = str(Path(__file__).resolve().parents[1] / "nsp" / "train" / "corpus.py")


def _steps(ckpt_dir: Path, steps: list[int], unfinished: int | None = None) -> None:
    """Finalised checkpoint steps (their meta alone) in ``ckpt_dir``, and a save of step ``unfinished`` that never
    finished (orbax's temporary directory)."""
    manager = ckpt.make_checkpoint_manager(ckpt_dir, max_to_keep=None, local=True)
    try:
        for step in steps:
            manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave({"step": step})))
        manager.wait_until_finished()
    finally:
        manager.close()
    if unfinished is not None:
        (ckpt_dir / f"{unfinished}.orbax-checkpoint-tmp").mkdir()


def _other_process_holds(monkeypatch, steps: list[int]) -> None:
    """``agree_steps`` as on process 0 of 2, process 1 holding ``steps``."""
    monkeypatch.setattr(nsp.distributed, "agree_steps", lambda mine: [sorted(mine), steps])


def test_held_steps_are_the_finalised_ones(tmp_path):
    _steps(tmp_path / "ckpt", [2, 4], unfinished=6)
    assert ckpt_local.held_steps(tmp_path / "ckpt") == [2, 4]
    assert ckpt_local.held_steps(tmp_path / "none") == []


def test_resume_takes_the_newest_step_every_process_holds_and_says_so(tmp_path, monkeypatch):
    _steps(tmp_path / "ckpt", [2, 4], unfinished=6)
    _other_process_holds(monkeypatch, [4, 6])  # process 1 finalised step 6, process 0 did not
    said = []
    assert ckpt_local.common_step(tmp_path / "ckpt", said.append) == 4
    assert said == ["--ckpt-local: the processes' newest checkpoints differ (process 0: [2, 4]; process 1: [4, 6]); "
                    "step 4 is the newest every process holds"]


def test_processes_with_no_step_in_common_are_refused_naming_each_ones_steps(tmp_path, monkeypatch):
    _steps(tmp_path / "ckpt", [2, 4])
    _other_process_holds(monkeypatch, [6, 8])  # process 1's directory is another run's, or was replaced
    with pytest.raises(TrainError) as e:
        ckpt_local.common_step(tmp_path / "ckpt")
    assert str(e.value) == ("--ckpt-local: no checkpoint step is held by every process (process 0: [2, 4]; "
                            "process 1: [6, 8]): a process's checkpoint directory was lost or replaced; there is "
                            "no step to resume all processes from")
    _other_process_holds(monkeypatch, [])  # process 1's directory lost: the same refusal
    with pytest.raises(TrainError, match=r"process 0: \[2, 4\]; process 1: none"):
        ckpt_local.common_step(tmp_path / "ckpt")


def test_no_process_holding_a_step_is_no_step(tmp_path, monkeypatch):
    _other_process_holds(monkeypatch, [])
    assert ckpt_local.common_step(tmp_path / "ckpt") is None


def test_a_checkpoint_resumes_only_as_it_was_written(tmp_path):
    local = {"step": 8, "ckpt_local": True, "process_count": 2, "num_shards": 4}
    shared = {"step": 8, "process_count": 2, "num_shards": 4}
    ckpt_local.check_resumable(local, 8, True, 2, 4)
    ckpt_local.check_resumable(shared, 8, False, 2, 4)
    ckpt_local.check_resumable(shared, 8, False, 1, 2)  # a shared checkpoint reshards (nsp.storage.reshard)
    with pytest.raises(TrainError) as e:
        ckpt_local.check_resumable(local, 8, False, 2, 4)
    assert str(e.value) == ("the checkpoint at step 8 was written with --ckpt-local (each process's own checkpoint "
                            "directory): resume it with --ckpt-local, on as many processes")
    with pytest.raises(TrainError, match="was written without --ckpt-local .*: resume it without --ckpt-local"):
        ckpt_local.check_resumable(shared, 8, True, 2, 4)
    for processes, shards in ((1, 4), (2, 2), (4, 4)):
        with pytest.raises(TrainError) as e:
            ckpt_local.check_resumable(local, 8, True, processes, shards)
        assert str(e.value) == (f"the checkpoint at step 8 was written by 2 process(es) with 4 store shards, this run "
                                f"has {processes} with {shards}: --ckpt-local checkpoints resume only on the layout "
                                "that wrote them (resharding reads every process's part)")


def test_a_marker_of_this_run_from_another_process_is_refused(tmp_path, monkeypatch):
    """``check_not_shared`` as on process 0 of 2 (no runtime: ``together`` raises the error itself)."""
    ckpt_dir = tmp_path / "ckpt"
    monkeypatch.setattr(ckpt_local, "_run_token", lambda: "0badcafe")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    ckpt_dir.mkdir()
    (ckpt_dir / ckpt_local.MARKER.format(1)).write_text("1234abcd")  # an earlier run's marker: not this run's
    ckpt_local.check_not_shared(ckpt_dir)
    assert (ckpt_dir / ckpt_local.MARKER.format(0)).read_text() == "0badcafe"
    (ckpt_dir / ckpt_local.MARKER.format(1)).write_text("0badcafe")  # process 1 of this run writes here too
    with pytest.raises(TrainError) as e:
        ckpt_local.check_not_shared(ckpt_dir)
    assert str(e.value) == (f"--ckpt-local: {ckpt_dir} is shared with process(es) [1] (their markers are in it); "
                            "drop --ckpt-local on a shared checkpoint directory, or give each process its own")


def test_two_processes_sharing_a_run_directory_both_refuse_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1")
    run_dir = tmp_path / "run"
    done = subprocess.run(NSP + ["launch", "-n", "2", "--grace", "20", "--"] + NSP + [
        "train", "--model", "tiny", "--batch", "2", "--seq", "32", "--steps", "2", "--data", DATA, "--run-dir",
        str(run_dir), "--ckpt-local"], env=env, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    for p, other in ((0, 1), (1, 0)):
        said = [line for line in out.splitlines() if line.startswith(f"[{p}] nsp train: error:")]
        assert said and f"{run_dir / 'ckpt'} is shared with process(es) [{other}]" in said[0], out
    assert "Traceback" not in out, out
    assert not any(p.name.isdigit() for p in (run_dir / "ckpt").iterdir()), out  # no step was written
