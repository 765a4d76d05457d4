"""Near-data fine-tuning: a frozen backbone's features written by ``nsp features`` (one part per extractor
process), and a Tuner (``nsp train --features``) that trains the top from them to the same params, bit for bit, as
a run that computes the backbone itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from nsp.cli import main
from nsp.storage import checkpoint as ckpt

COMMON = ["--model", "tiny", "--seq", "32", "--batch", "4", "--tier", "memory", "--eval-every", "0",
          "--log-every", "1"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    run = tmp_path_factory.mktemp("pre") / "run"
    assert main(["train", *COMMON, "--run-dir", str(run), "--steps", "2"]) == 0
    return run


def _params(run_dir, step):
    saved = ckpt.load_train_state(run_dir / "ckpt" / str(step))["params"]
    import jax

    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(saved)[0]}


def test_the_tuner_trains_from_fp32_features_to_the_same_params_bit_for_bit(pretrained, tmp_path, capsys):
    fine = ["--init-from", str(pretrained), "--freeze-layers", "1", "--steps", "3", "--seed", "7"]
    assert main(["train", *COMMON, *fine, "--run-dir", str(tmp_path / "whole")]) == 0
    capsys.readouterr()
    assert main(["features", *COMMON, *fine, "--features-out", str(tmp_path / "f"),
                 "--features-dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "3 steps x 4 sequences" in out
    meta = json.loads((tmp_path / "f" / "features.json").read_text())
    assert meta["blocks"] == 1 and meta["dtype"] == "float32" and meta["processes"] == 1
    # Per token, the features (width 64, 4 bytes each) are far larger than the token (one byte): said, not hidden.
    assert meta["bytes_features"] == 3 * 4 * 32 * 64 * 4 and meta["bytes_tokens"] == 3 * 4 * 33
    assert main(["train", *COMMON, *fine, "--features", str(tmp_path / "f"), "--run-dir", str(tmp_path / "tuner")]) == 0
    assert "features: training blocks 1.." in capsys.readouterr().out
    whole, tuner = _params(tmp_path / "whole", 3), _params(tmp_path / "tuner", 3)
    assert whole.keys() == tuner.keys()
    changed = 0
    for name in whole:
        np.testing.assert_array_equal(tuner[name], whole[name], err_msg=name)
        changed += not np.array_equal(whole[name], _params(pretrained, 2)[name])
    assert changed > 0  # the top trained


def test_bf16_features_train_close_and_a_wrong_run_is_refused(pretrained, tmp_path, capsys):
    fine = ["--init-from", str(pretrained), "--freeze-layers", "1", "--steps", "2"]
    assert main(["features", *COMMON, *fine, "--features-out", str(tmp_path / "f")]) == 0
    assert json.loads((tmp_path / "f" / "features.json").read_text())["dtype"] == "bfloat16"
    assert main(["train", *COMMON, *fine, "--features", str(tmp_path / "f"), "--run-dir", str(tmp_path / "t")]) == 0
    capsys.readouterr()
    refusals = [
        (["--freeze-layers", "2"], "made with blocks (--freeze-layers) 1, this run has 2"),
        (["--batch", "8"], "made with batch 4, this run has 8"),
        (["--steps", "5"], "holds 2 steps, the run asks for 5"),
    ]
    for extra, message in refusals:
        args = ["train", *COMMON, *fine, "--features", str(tmp_path / "f"), "--run-dir", str(tmp_path / "x"), *extra]
        assert main(args) == 2, extra
        assert message in capsys.readouterr().err, extra
    # Another backbone than the one the features came from.
    other = tmp_path / "other"
    assert main(["train", *COMMON, "--run-dir", str(other), "--steps", "1", "--seed", "3"]) == 0
    capsys.readouterr()
    assert main(["train", *COMMON, "--init-from", str(other), "--freeze-layers", "1", "--steps", "2",
                 "--features", str(tmp_path / "f"), "--run-dir", str(tmp_path / "y")]) == 2
    assert "computed with another backbone" in capsys.readouterr().err
    assert main(["features", *COMMON, *fine, "--features-out", str(tmp_path / "f")]) == 2
    assert "already holds features" in capsys.readouterr().err


def test_extractor_processes_each_write_their_own_part(pretrained, tmp_path):
    out = tmp_path / "f"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    # Four devices each, as this test process has: each device then computes the rows it computes here.
    cmd = [sys.executable, "-m", "nsp.cli", "launch", "-n", "2", "--devices-per-process", "4", "--",
           sys.executable, "-m", "nsp.cli", "features",
           *COMMON, "--init-from", str(pretrained), "--freeze-layers", "1", "--steps", "5",
           "--features-out", str(out), "--features-dtype", "float32"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    meta = json.loads((out / "features.json").read_text())
    assert meta["processes"] == 2 and meta["rows_per_device"] == 1
    assert json.loads((out / "process-00000" / "done.json").read_text())["steps"] == [0, 2, 4]
    assert json.loads((out / "process-00001" / "done.json").read_text())["steps"] == [1, 3]
    # The same features as one process writes.
    assert main(["features", *COMMON, "--init-from", str(pretrained), "--freeze-layers", "1", "--steps", "5",
                 "--features-out", str(tmp_path / "one"), "--features-dtype", "float32"]) == 0
    from nsp.train.features import FeatureBatches, FeatureMeta

    two = FeatureBatches(out, FeatureMeta.read(out))
    one = FeatureBatches(tmp_path / "one", FeatureMeta.read(tmp_path / "one"))
    for step in range(5):
        for key in ("x", "tokens"):
            np.testing.assert_array_equal(two.batch(step)[key], one.batch(step)[key])


def test_a_tuner_beside_the_extractor_trains_run_by_run_to_the_same_params(pretrained, tmp_path):
    # The pipelined schedule: the extractor writes 4 sub-datasets one after another, the Tuner starts as soon as
    # the set is described and trains each run once it is marked done.
    import time

    fine = [*COMMON, "--init-from", str(pretrained), "--freeze-layers", "1", "--steps", "4"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    nsp = [sys.executable, "-m", "nsp.cli"]
    extractor = subprocess.Popen([*nsp, "features", *fine, "--features-out", str(tmp_path / "f"),
                                  "--features-dtype", "float32", "--features-runs", "4"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "f" / "features.json").exists():
        assert extractor.poll() is None and time.monotonic() < deadline, extractor.communicate()[0]
        time.sleep(0.05)
    tuner = subprocess.run([*nsp, "train", *fine, "--features", str(tmp_path / "f"), "--run-dir",
                            str(tmp_path / "tuner")], env=env, capture_output=True, text=True, timeout=300)
    assert extractor.wait(timeout=120) == 0, extractor.communicate()[0]
    assert tuner.returncode == 0, tuner.stdout + tuner.stderr
    assert "features: waited" in tuner.stdout
    assert sorted(p.name for p in (tmp_path / "f" / "process-00000").glob("run-*.done")) == [
        f"run-{r:05d}.done" for r in range(4)]
    whole = subprocess.run([*nsp, "train", *fine, "--run-dir", str(tmp_path / "whole")], env=env,
                           capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    a, b = _params(tmp_path / "whole", 4), _params(tmp_path / "tuner", 4)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    # A run its extractor never marks done: the Tuner says so instead of waiting for ever.
    from nsp.train import features

    (tmp_path / "f" / "process-00000" / "run-00003.done").unlink()
    batches = features.FeatureBatches(tmp_path / "f", features.FeatureMeta.read(tmp_path / "f"), wait_s=0.3)
    batches.batch(2)
    with pytest.raises(features.TrainError, match="extractor process 0 marked nothing for 0 s and run 4 of 4"):
        batches.batch(3)


def test_a_classifier_trains_from_fp32_pooled_features_to_the_same_params_bit_for_bit(pretrained, tmp_path, capsys):
    # A language model's checkpoint starts a classifier (its head starts fresh). With every block frozen the
    # extractors send one pooled vector per sequence. (Per-token features of a classifier run the language model's
    # path above, then pool: loss_from_features.)
    blocks = 2
    fine = ["--task", "classify", "--classes", "4", "--init-from", str(pretrained), "--freeze-layers", str(blocks),
            "--steps", "3", "--seed", "5", "--eval-batches", "2"]
    assert main(["train", *COMMON, *fine, "--run-dir", str(tmp_path / "whole")]) == 0
    assert "4 classes of" in capsys.readouterr().out
    assert main(["features", *COMMON, *fine, "--features-out", str(tmp_path / "f"),
                 "--features-dtype", "float32"]) == 0
    meta = json.loads((tmp_path / "f" / "features.json").read_text())
    assert meta["task"] == "classify" and meta["classes"] == 4 and meta["pooled"] == (blocks == 2)
    per_row = 64 if blocks == 2 else 32 * 64
    assert meta["bytes_features"] == 3 * 4 * per_row * 4 and meta["bytes_tokens"] == 3 * 4 * 32
    assert main(["train", *COMMON, *fine, "--features", str(tmp_path / "f"), "--run-dir", str(tmp_path / "tuner")]) == 0
    whole, tuner = _params(tmp_path / "whole", 3), _params(tmp_path / "tuner", 3)
    assert whole.keys() == tuner.keys() and any("cls" in name for name in whole)
    for name in whole:
        np.testing.assert_array_equal(tuner[name], whole[name], err_msg=name)
    rows = [json.loads(line) for line in (tmp_path / "tuner" / "metrics.jsonl").read_text().splitlines()]
    assert 0 <= rows[-1]["eval_accuracy"] <= 1
    # A classifier keeps its (tied) language-model head: nsp sample reads its checkpoint as any run's.
    assert main(["sample", "--run-dir", str(tmp_path / "whole"), "--tokens", "3"]) == 0
    # Features of one task do not serve the other.
    capsys.readouterr()
    lm = ["--init-from", str(pretrained), "--freeze-layers", str(blocks), "--steps", "3", "--seed", "5"]
    assert main(["train", *COMMON, *lm, "--features", str(tmp_path / "f"), "--run-dir", str(tmp_path / "x")]) == 2
    assert "made with task 'classify', this run has 'lm'" in capsys.readouterr().err
