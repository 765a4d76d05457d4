"""Big-model set-up: the GPT built part by part (bit for bit the whole model's init) straight into the store, and
``nsp train --bf16-params`` training on bf16 params with the fp32 master on the file tier."""

from __future__ import annotations

import json

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


def test_bf16_params_run_resumes_bit_exactly(tmp_path, corpus):
    """A --bf16-params run stopped at a checkpoint and resumed ends with the params of one that never stopped (the
    params are restored from the checkpoint in bf16, never built)."""
    common = ["--model", "tiny", "--data", corpus, "--seq", "32", "--batch", "4", "--steps", "6", "--log-every", "2",
              "--eval-batches", "1", "--ckpt-every", "2", "--bf16", "--f32-accum", "--bf16-params"]

    def final(run):
        import orbax.checkpoint as ocp

        manager = ocp.CheckpointManager(run / "ckpt", item_names=("store", "train_state", "meta"))
        step = manager.latest_step()
        restored = manager.restore(step, args=ocp.args.Composite(train_state=ocp.args.StandardRestore(None)))
        manager.close()
        return step, jax.tree_util.tree_leaves(restored["train_state"]["params"])

    assert main(["train", "--run-dir", str(tmp_path / "whole"), *common]) == 0
    assert main(["train", "--run-dir", str(tmp_path / "cut"), *common, "--stop-after", "4"]) == 0
    assert main(["train", "--run-dir", str(tmp_path / "cut"), *common, "--resume"]) == 0
    (step_a, whole), (step_b, cut) = final(tmp_path / "whole"), final(tmp_path / "cut")
    assert step_a == step_b == 6
    assert all(a.dtype == jnp.bfloat16 and np.array_equal(_bits(a), _bits(b)) for a, b in zip(whole, cut))
