"""Big-model set-up: the GPT built part by part (bit for bit the whole model's init) straight into the store, and
``nsp train --bf16-params`` training on bf16 params with the fp32 master on the file tier."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nsp.storage
from nsp.cli import main
from nsp.models import GPT, get_config
from nsp.models.gpt import gpt_parts
from nsp.train.config import TrainConfig
from nsp.train import store_resume
from nsp.train.layerwise import LayerwiseInit, SetupProgress


pytestmark = pytest.mark.usefixtures("isolated_cache")  # conftest: a token cache of each test's own


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16}[x.dtype.itemsize])


@pytest.mark.parametrize("name,seed,overrides", [
    ("tiny", 0, {}),
    ("small", 7, {"dtype": jnp.bfloat16, "f32_accum": True}),
    ("tiny", 3, {"bias": False, "n_layer": 11}),  # layers 10 and 2 apart in key order: the order comes from the tree
])
def test_layerwise_init_equals_the_whole_model_bit_for_bit(name, seed, overrides):
    config = get_config(name, **overrides)
    whole = jax.tree_util.tree_leaves(nnx.state(GPT(config, rngs=nnx.Rngs(seed)), nnx.Param))
    init = LayerwiseInit(config, seed, keep=jnp.bfloat16)
    assert init.num_leaves == len(whole) and init.num_params == sum(x.size for x in whole)
    for i, leaf in enumerate(whole):
        got = init(i)
        assert got.dtype == np.float32 and np.array_equal(_bits(got), _bits(leaf)), f"leaf {i}"
    init.close()
    kept = jax.tree_util.tree_leaves(init.kept_params())
    assert all(k.dtype == jnp.bfloat16 and np.array_equal(_bits(k), _bits(w.astype(jnp.bfloat16)))
               for k, w in zip(kept, whole))
    # The abstract tree is the whole model's (the store's layout comes from it).
    assert jax.tree_util.tree_structure(init.abstract) == jax.tree_util.tree_structure(
        nnx.state(GPT(config, rngs=nnx.Rngs(seed)), nnx.Param))


def test_gpt_parts_follow_the_model_and_refuse_dropout():
    config = get_config("tiny")
    assert [path for path, _ in gpt_parts(config)] == [("wte",), ("wpe",), ("h", 0), ("h", 1), ("ln_f",)]
    with pytest.raises(ValueError, match="dropout"):
        gpt_parts(get_config("tiny", dropout=0.1))
    init = LayerwiseInit(config)
    with pytest.raises(ValueError, match="never asked"):
        LayerwiseInit(config, keep=jnp.bfloat16).kept_params()
    assert init(0).shape == init.shapes[0]


def test_setup_progress_reports_bytes_pages_rate_and_eta():
    lines = []
    progress = SetupProgress(lines.append, page_bytes=4 << 20, every_s=0.0)
    progress(8 << 20, 32 << 20)
    progress(32 << 20, 32 << 20)
    assert "8 of 34 MB written (25%, page 2 of 8)" in lines[0] and "ETA" in lines[0] and "MB/s" in lines[0]
    assert "done" in lines[1] and "peak RSS" in lines[1]


def test_bf16_params_train_on_the_file_tier_with_an_fp32_master(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    args = ["train", "--model", "tiny", "--run-dir", str(run), "--data", corpus, "--seq", "32", "--batch", "4",
            "--steps", "12", "--log-every", "1", "--eval-batches", "1", "--lr", "3e-3", "--warmup-steps", "2",
            "--bf16", "--f32-accum", "--bf16-params", "--no-checkpoints", "--progress-s", "0.001"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.1, losses  # it learns (different batches each step)
    assert all(r["peak_rss_bytes"] > 0 for r in rows if "loss" in r)
    # The set-up's log: what was written (MB, pages, rate), then its time and the peak RSS.
    assert "built part by part" in out and "MB written" in out
    assert any(line.startswith("set-up:") and "peak RSS" in line and "GiB" in line for line in out.splitlines())
    assert any(line.startswith("done: 12 logged step(s)") and "peak RSS" in line for line in out.splitlines())
    assert not (run / "ckpt").exists() or not any((run / "ckpt").iterdir())  # --no-checkpoints
    # The store kept the fp32 master (finer than the bf16 params the step held) and its moments.
    store = nsp.storage.open(run / "store")
    try:
        assert store.version == 12 and {leaf.dtype for leaf in store.layout.leaves} == {"float32"}
        master = store.read("param")[:store.layout.total]
        assert master.dtype == np.float32
        assert np.any(master != master.astype(jnp.bfloat16).astype(np.float32))
        assert np.any(store.read("nu") != 0)
    finally:
        store.close()


def test_bf16_params_need_bf16_compute():
    with pytest.raises(ValueError, match="bf16"):
        TrainConfig(bf16_params=True)
    with pytest.raises(ValueError, match="bf16"):
        TrainConfig(f32_accum=True)
    TrainConfig(bf16=True, f32_accum=True, bf16_params=True)


def _store_state(store_dir) -> list:
    store = nsp.storage.open(store_dir)
    try:
        return [store.version] + [store.read(state) for state in ("param", "mu", "nu")]
    finally:
        store.close()


def test_bf16_params_run_resumes_bit_exactly_from_a_checkpoint_or_from_its_store(tmp_path, corpus):
    """A --bf16-params run stopped at a checkpoint and resumed ends with the params of one that never stopped (the
    params are restored from the checkpoint in bf16, never built). So does a --no-checkpoints run SIGKILLed inside
    an update: --resume continues from its store's committed version, the bf16 params rounded from the fp32
    master leaf by leaf (the step's params are always exactly that rounding: float32_updates)."""
    common = ["--model", "tiny", "--data", corpus, "--seq", "32", "--batch", "4", "--steps", "6", "--log-every", "1",
              "--eval-batches", "1", "--eval-every", "0", "--bf16", "--f32-accum", "--bf16-params", "--tier", "file"]

    def final(run):
        import orbax.checkpoint as ocp

        manager = ocp.CheckpointManager(run / "ckpt", item_names=("store", "train_state", "meta"))
        step = manager.latest_step()
        restored = manager.restore(step, args=ocp.args.Composite(train_state=ocp.args.StandardRestore(None)))
        manager.close()
        return step, jax.tree_util.tree_leaves(restored["train_state"]["params"])

    def losses(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in rows if "loss" in r]

    whole, cut, killed = tmp_path / "whole", tmp_path / "cut", tmp_path / "killed"
    assert main(["train", "--run-dir", str(whole), *common, "--ckpt-every", "2"]) == 0
    assert main(["train", "--run-dir", str(cut), *common, "--ckpt-every", "2", "--stop-after", "4"]) == 0
    assert main(["train", "--run-dir", str(cut), *common, "--ckpt-every", "2", "--resume"]) == 0
    (step_a, params_a), (step_b, params_b) = final(whole), final(cut)
    assert step_a == step_b == 6
    assert all(a.dtype == jnp.bfloat16 and np.array_equal(_bits(a), _bits(b)) for a, b in zip(params_a, params_b))

    # Each of the 4 shards counts its own page writes: 3 at set-up, 3 per update; the 11th is inside step 3's.
    env = {**os.environ, "NSP_DEBUG_KILL_AFTER_WRITES": "11"}
    proc = subprocess.run([sys.executable, "-m", "nsp.cli", "train", "--run-dir", str(killed), *common,
                           "--no-checkpoints"], env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert json.loads((killed / store_resume.RECORD).read_text()) == {"version": 2, "step": 2}
    assert main(["train", "--run-dir", str(killed), *common, "--no-checkpoints", "--resume"]) == 0
    ref, got = _store_state(whole / "store"), _store_state(killed / "store")
    assert ref[0] == got[0] == 6
    assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(ref[1:], got[1:]))  # fp32 p, m, v
    assert losses(killed) == losses(whole)  # step 3 logged once: after the resume


@pytest.mark.parametrize("stored,expected", [(4, 7), (5, 8)])
def test_the_resumed_step_follows_the_store_version(tmp_path, stored, expected):
    """The record says step 7 left version 4: a store still at 4 resumes at 7 (the next step never committed, or
    was skipped), one at 5 at 8 (it committed before its record)."""
    store_resume.write_record(tmp_path, 4, 7)
    assert store_resume.step_to_resume(tmp_path, stored) == expected
    with pytest.raises(ValueError, match="not this run's"):
        store_resume.step_to_resume(tmp_path, 6)
    (tmp_path / store_resume.RECORD).unlink()
    with pytest.raises(ValueError, match="does not say which step"):
        store_resume.step_to_resume(tmp_path, 4)


def test_runs_that_cannot_resume_from_their_store_say_why(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    run.mkdir()
    store_resume.write_record(run, 1, 1)  # even with a record, these runs cannot continue from their store
    common = ["--model", "tiny", "--data", corpus, "--run-dir", str(run), "--tier", "file", "--no-checkpoints",
              "--resume"]
    assert main(["train", *common, "--bf16", "--f32-accum", "--bf16-params", "--topk", "0.1"]) == 2
    assert "cannot continue from its store: Top-K's error-feedback residual" in capsys.readouterr().err
    assert main(["train", *common]) == 2  # fp32 params
    assert "--bf16-params land on its rounding exactly" in capsys.readouterr().err
    assert store_resume.why_not(TrainConfig(tier="file", bf16=True, f32_accum=True, bf16_params=True)) is None
