"""The `nsp` command end to end on the tiny GPT: smoke, resume bit-exactness, keep-N, bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from nsp.cli import main
from nsp.storage import checkpoint as ckpt


pytestmark = pytest.mark.usefixtures("isolated_cache")  # conftest: a token cache of each test's own


def train(run_dir, corpus, *extra):
    args = ["train", "--model", "tiny", "--run-dir", str(run_dir), "--data", corpus, "--seq", "32", "--batch",
            "4", "--log-every", "2", "--eval-batches", "1", *map(str, extra)]
    return main(args)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_params(run_dir):
    manager = ocp.CheckpointManager(run_dir / "ckpt", item_names=("store", "train_state", "meta"))
    step = manager.latest_step()
    restored = manager.restore(step, args=ocp.args.Composite(train_state=ocp.args.StandardRestore(None)))
    manager.close()
    return step, restored["train_state"]["params"]


def test_one_step_smoke(tmp_path, corpus):
    run = tmp_path / "run"
    assert train(run, corpus, "--steps", "1", "--ckpt-every", "0") == 0
    rows = metrics(run)
    assert rows[-1]["step"] == 1
    for key in ("loss", "tokens_per_s", "lr", "shared_in_bytes", "shared_out_bytes", "internal_read_bytes",
                "internal_write_bytes", "update_s", "fwd_bwd_s", "eval_loss"):
        assert key in rows[-1], key
    # SmartUpdate traffic: fp32 grads in and params out, 4 bytes per (padded) parameter each way.
    assert rows[-1]["shared_in_bytes"] == rows[-1]["shared_out_bytes"] > 0
    assert (run / "store" / "nsp_store.json").exists() and (run / "ckpt" / "1").is_dir()
    assert any((run / "tb").iterdir())


def test_stage_gradients_trains_like_the_default_step(tmp_path, corpus):
    """--stage-gradients (the gradient staged on the store's disk, --clip inside the store): the same training
    as the default step, up to the last bit of the clipped gradient (the two clip in different arithmetic)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device (this process has 4)
    env["NSP_CACHE_DIR"] = str(tmp_path / "cache")
    for name, extra in (("staged", ["--stage-gradients"]), ("default", [])):
        cmd = [sys.executable, "-m", "nsp.cli", "train", "--model", "tiny", "--run-dir", str(tmp_path / name),
               "--data", corpus, "--seq", "32", "--batch", "4", "--steps", "4", "--ckpt-every", "0", "--bf16",
               "--bf16-params", "--f32-accum", "--log-every", "1", "--eval-every", "0", *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert train(tmp_path / "many", corpus, "--stage-gradients", "--steps", "1") == 2  # 4 devices: refused
    staged = [row["loss"] for row in metrics(tmp_path / "staged") if "loss" in row]
    default = [row["loss"] for row in metrics(tmp_path / "default") if "loss" in row]
    assert len(staged) == len(default) == 4
    assert staged[0] == default[0]  # the first step's loss comes before any update
    np.testing.assert_allclose(staged, default, rtol=2e-3)
    assert list((tmp_path / "staged" / "store").rglob("gradient.stage"))


def test_staleness_one_splits_the_step_by_what_it_waited_for(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert train(run, corpus, "--steps", "4", "--staleness", "1", "--ckpt-every", "0") == 0
    rows = [r for r in metrics(run) if "step_s" in r]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        # The update ran beside the next step: the step's own share of it is what the step waited for.
        assert 0 <= r["update_wait_s"] <= r["step_s"]
        assert r["fwd_bwd_s"] == pytest.approx(r["step_s"] - r["update_wait_s"])
        assert r["update_s"] > 0
    printed = capsys.readouterr()
    assert "beside the next step" in printed.out + printed.err


def test_resume_is_bit_exact(tmp_path, corpus):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(straight, corpus, "--steps", "12", "--ckpt-every", "6") == 0
    assert train(split, corpus, "--steps", "12", "--stop-after", "6") == 0
    assert train(split, corpus, "--steps", "12", "--resume") == 0
    a, b = metrics(straight), metrics(split)
    assert [r["loss"] for r in a if r["step"] > 6 and "loss" in r] == [r["loss"] for r in b if r["step"] > 6
                                                                       and "loss" in r]
    (step_a, pa), (step_b, pb) = final_params(straight), final_params(split)
    assert step_a == step_b == 12
    import jax

    for x, y in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))



def test_resume_is_bit_exact_on_one_device(tmp_path, corpus):
    """The default `nsp train` on a one-device machine: one store shard, the gradient-leaves update path."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # this process has 4 emulated devices
    env["NSP_CACHE_DIR"] = str(tmp_path / "cache")

    def run(run_dir, *extra):
        cmd = [sys.executable, "-m", "nsp.cli", "train", "--model", "tiny", "--run-dir", str(run_dir), "--data",
               corpus, "--seq", "32", "--batch", "4", "--steps", "8", "--ckpt-every", "4", "--eval-every", "0",
               *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    straight, split = tmp_path / "straight", tmp_path / "split"
    assert "1 shard(s)" in run(straight)
    run(split, "--stop-after", "4")
    assert "resumed" in run(split, "--resume")
    (step_a, pa), (step_b, pb) = final_params(straight), final_params(split)
    assert step_a == step_b == 8
    import jax

    for x, y in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

def test_topk_memory_tier_and_keep_n(tmp_path, corpus):
    run = tmp_path / "run"
    assert train(run, corpus, "--steps", "8", "--ckpt-every", "2", "--keep-checkpoints", "2", "--tier", "memory",
                 "--topk", "0.05") == 0
    assert sorted(int(p.name) for p in (run / "ckpt").iterdir() if p.name.isdigit()) == [6, 8]
    rows = [r for r in metrics(run) if "loss" in r]
    # Top-K: only the kept values and their indices go down the link.
    assert rows[-1]["shared_in_bytes"] < 0.2 * rows[-1]["shared_out_bytes"]


def test_default_seq_fits_the_model(tmp_path, corpus, capsys):
    """With no --seq, a model whose block size is below the default trains at its block size."""
    args = ["train", "--model", "tiny", "--run-dir", str(tmp_path / "run"), "--data", corpus, "--batch", "4",
            "--steps", "1", "--eval-batches", "1"]
    assert main(args) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["seq"] == 64  # tiny's block size


def test_models_with_a_published_recipe_train_at_its_learning_rate(tmp_path, corpus):
    """GPT-3 sizes take GPT-3's peak learning rate (scaled by the square root of the batch ratio for batches smaller
    than the published ones) and its warm-up of 375M tokens, or the whole run when it is shorter; the others the
    generic defaults; flags win over both. The run records what it used."""
    from nsp.train.config import TrainConfig

    big = TrainConfig(model="gpt3-2.7b", steps=3, batch=1, seq=128).resolved()
    assert big.warmup_steps == 3 and big.lr == pytest.approx(1.6e-4 * (128 / 1e6) ** 0.5)  # ramps over all 3 steps
    assert TrainConfig(model="gpt3-2.7b", batch=1000, seq=1024).resolved().lr == 1.6e-4  # >= 1M tokens: published
    assert TrainConfig(model="gpt3-760m", batch=8).resolved().lr == pytest.approx(2.5e-4 * (1024 / 0.5e6) ** 0.5)
    long_run = TrainConfig(model="gpt3-760m", steps=800_000, batch=8, seq=1024).resolved()
    assert long_run.warmup_steps == math.ceil(375e6 / 8192)  # 375M tokens in steps of 8 x 1024 tokens
    assert TrainConfig(model="gpt3-760m", steps=1).resolved().warmup_steps == 1
    assert (TrainConfig(model="small").resolved().lr, TrainConfig(model="small").resolved().warmup_steps) == (3e-3, 20)
    mine = TrainConfig(model="gpt3-2.7b", lr=1e-3, warmup_steps=5).resolved()
    assert (mine.lr, mine.warmup_steps) == (1e-3, 5)
    assert train(tmp_path / "run", corpus, "--steps", "1") == 0
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (recorded["lr"], recorded["warmup_steps"]) == (3e-3, 20)


def test_train_run_again_with_the_default_run_dir_starts_a_new_run(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["train", "--model", "tiny", "--data", corpus, "--batch", "4", "--steps", "1", "--eval-batches", "1"]
    assert main(args) == 0 and main(args) == 0
    assert "this one goes to runs/default-2" in capsys.readouterr().out
    assert (tmp_path / "runs" / "default" / "config.json").exists()
    assert (tmp_path / "runs" / "default-2" / "config.json").exists()
    # A run directory given on purpose is never switched: the clear error stays.
    assert main([*args, "--run-dir", "runs/default-2"]) == 2


def test_ckpt_and_sample_commands(tmp_path, corpus, capsys, monkeypatch):
    run = tmp_path / "run"
    assert train(run, corpus, "--steps", "4", "--ckpt-every", "2") == 0
    capsys.readouterr()
    assert main(["ckpt", "list", "--run-dir", str(run)]) == 0
    listed = capsys.readouterr().out
    assert "step 2: store version 2" in listed and "step 4: store version 4" in listed
    assert main(["ckpt", "show", "--run-dir", str(run), "--step", "2"]) == 0
    shown = json.loads(capsys.readouterr().out)["store"]
    assert shown["version"] == 2
    # The size shown is the snapshot's files as they lie on disk.
    snap = run / "ckpt" / "2" / "store"
    listed_files = ckpt.load_snapshot_info(snap)["files"]
    on_disk = sum((snap / f["path"]).stat().st_size for f in listed_files)
    assert shown["files"] == len(listed_files) > 0 and shown["bytes"] == on_disk > 0
    assert main(["ckpt", "export", "--run-dir", str(run), "--out", str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "params").is_dir()
    capsys.readouterr()
    assert main(["sample", "--run-dir", str(run), "--prompt", "def ", "--tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    # Relative run directories work too (orbax itself takes only absolute paths).
    monkeypatch.chdir(tmp_path)
    assert main(["sample", "--run-dir", "run", "--prompt", "def ", "--tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["ckpt", "export", "--run-dir", "run", "--out", "export2"]) == 0
    assert (tmp_path / "export2" / "params").is_dir()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "/nonexistent/corpus.txt"], "does not exist"),
        (["--model", "gpt5"], "unknown"),
        (["--seq", "100000"], "exceeds the block size"),
        (["--topk", "2"], "topk must be in"),
        (["--stage-gradients", "--tier", "memory"], "stage_gradients needs the file or csd tier"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, corpus, extra, message):
    args = [sys.executable, "-m", "nsp.cli", "train", "--model", "tiny", "--run-dir", str(tmp_path / "run"),
            "--data", corpus, "--steps", "1", "--seq", "32", *extra]
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ})
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_empty_corpus_and_existing_runs_are_refused_without_overwriting(tmp_path, corpus, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert train(tmp_path / "r0", str(empty), "--steps", "1") == 2
    assert "empty" in capsys.readouterr().err
    run = tmp_path / "run"
    assert train(run, corpus, "--steps", "2") == 0
    before = (run / "store" / "shards" / "00000" / "MANIFEST.json").read_text()
    assert train(run, corpus, "--steps", "2") == 2  # a run is there: --resume or another --run-dir
    assert "already holds a run" in capsys.readouterr().err
    # A store of another layout at --store-dir: refused, untouched.
    other = tmp_path / "other"
    assert train(other, corpus, "--steps", "1", "--store-dir", str(run / "store")) == 2
    assert "already holds a store" in capsys.readouterr().err
    assert (run / "store" / "shards" / "00000" / "MANIFEST.json").read_text() == before
    assert train(tmp_path / "fresh", corpus, "--steps", "1", "--resume") == 2
    assert "holds no run to resume" in capsys.readouterr().err
