"""A small fault campaign (the full one is `python bench/fault_campaign.py --trials 100`)."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "fault_campaign.py"


def test_killed_runs_resume_bit_identically_and_no_store_is_corrupt(tmp_path):
    # One trial per kill mode: random delay, inside an update, at a commit, at a checkpoint snapshot.
    proc = subprocess.run([sys.executable, str(BENCH), "--trials", "4", "--steps", "4", "--seed", "1", "--dir",
                           str(tmp_path), "--json", str(tmp_path / "campaign.json")], capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1]
    assert last == "bit-identical: 4/4, corrupt: 0", proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0
    assert " 1 " in proc.stdout.split("mode ")[1]  # the table lists what was killed


def test_runs_with_offloaded_activations_resume_bit_identically(tmp_path):
    # Activations spilled to disk in every step are scratch: a run killed inside a step (inside its update, after
    # the backward pass read the spilled activations back) resumes from its store and checkpoints to the same params
    # as a run never killed. (`python bench/fault_campaign.py --train-args ...` runs every kill mode.)
    proc = subprocess.run([sys.executable, str(BENCH), "--trials", "1", "--steps", "4", "--seed", "3", "--modes",
                           "update", "--train-args", "--offload-activations all --activation relu", "--dir",
                           str(tmp_path), "--json", str(tmp_path / "campaign.json")], capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1]
    assert last == "bit-identical: 1/1, corrupt: 0", proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0


def test_one_slot_runs_resume_bit_identically(tmp_path):
    # A one-slot store (one copy of the state, a redo journal) in a training run: a kill inside an update, then one
    # inside the recovery that follows it. (`python bench/fault_campaign.py --slots 1` cycles through every kill
    # point, the two-slot ones and halfway through a journal's write too; tests/test_oneslot.py kills each point on
    # a bare store.)
    proc = subprocess.run([sys.executable, str(BENCH), "--slots", "1", "--trials", "1", "--steps", "4", "--seed", "1",
                           "--modes", "recovery", "--dir", str(tmp_path), "--json",
                           str(tmp_path / "campaign.json")], capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1]
    assert last == "bit-identical: 1/1, corrupt: 0", proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0
