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


def test_one_slot_runs_with_offloaded_activations_resume_bit_identically(tmp_path):
    # Two claims in one killed run (each run is a few seconds of start-up on 2 cores). A one-slot store (one copy of
    # the state, a redo journal): a kill inside an update, then one inside the recovery that follows it. And
    # activations spilled to disk in every step are scratch: the run killed inside a step (after its backward pass
    # read them back) resumes from its store and checkpoints to the same params as a run never killed.
    # (`python bench/fault_campaign.py --slots 1` cycles through every kill point, the two-slot ones and halfway
    # through a journal's write too, `--train-args ...` every mode with offload; tests/test_oneslot.py kills each
    # one-slot point on a bare store.)
    proc = subprocess.run([sys.executable, str(BENCH), "--slots", "1", "--trials", "1", "--steps", "4", "--seed", "3",
                           "--modes", "recovery", "--train-args", "--offload-activations all --activation relu",
                           "--dir", str(tmp_path), "--json", str(tmp_path / "campaign.json")],
                          capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1]
    assert last == "bit-identical: 1/1, corrupt: 0", proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0
