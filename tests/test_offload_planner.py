"""FlashNeuron's planner (nsp.offload.planner): its two phases on measured profiles, the budget syntax, and
``nsp train --offload-activations BUDGET`` with ``nsp plan --activations`` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import nsp.rss
from nsp.offload import planner
from nsp.offload.planner import BlockProfile, Profile

GiB = 2**30


def _profile(n=8, block_bytes=100 * 2**20, sparse_bytes=40 * 2**20, activation="relu", disk=1e9):
    blocks = tuple(BlockProfile(i, block_bytes, sparse_bytes, 0.01, 0.02) for i in range(n))
    # keep - all = what offloading every block saves: here exactly the blocks' bytes
    return Profile(blocks, 1e-10, 1e-10, 2e-10, 2e-10, disk, rss_bytes=1 * GiB, keep_bytes=n * block_bytes + GiB,
                   all_bytes=GiB, base_s=0.05, activation=activation)


def test_phase_one_offloads_the_fewest_first_blocks_that_fit():
    profile = _profile()
    assert planner.plan_offload(profile, 4 * GiB).layers == ()  # 1 GiB + 0.8 GiB kept: fits as it is
    plan = planner.plan_offload(profile, int(1.5 * GiB))  # 0.5 GiB of residuals may stay: 5 blocks, 3 go
    assert plan.layers == (0, 1, 2) and plan.fits
    assert plan.predicted_peak_bytes == 1 * GiB + 5 * 100 * 2**20
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    tight = planner.plan_offload(profile, int(0.9 * GiB))  # below the all-offloaded peak
    assert not tight.fits and tight.layers == tuple(range(8))
    assert "even with all 8 blocks offloaded" in tight.notes[0]


def test_phase_two_takes_the_sparse_format_when_the_disk_falls_behind():
    forward = 8 * 0.01
    slow = 3 * 100 * 2**20 / (2 * forward)  # three raw blocks take the disk twice the forward pass
    plan = planner.plan_offload(_profile(disk=slow), int(1.5 * GiB))
    assert plan.layers == (0, 1, 2) and plan.sparse and "sparse format" in plan.notes[1]
    gelu = planner.plan_offload(_profile(disk=slow, activation="gelu"), int(1.5 * GiB))
    assert not gelu.sparse and "no smaller format applies" in gelu.notes[1]
    fast = planner.plan_offload(_profile(disk=1e12), int(1.5 * GiB))
    assert not fast.sparse and "within the forward pass" in fast.notes[1]
    # the sparse format's spill calls cost more per byte here: the time prediction says so
    assert plan.predicted_fwd_bwd_s > fast.predicted_fwd_bwd_s


def test_budget_syntax():
    assert planner.parse_budget("6GiB") == 6 * GiB
    assert planner.parse_budget("1.5G") == int(1.5 * GiB)
    assert planner.parse_budget("6000MB") == 6 * 10**9
    assert planner.parse_budget("512mib") == 512 * 2**20
    assert planner.parse_budget("4096") == 4096
    for bad in ("", "six", "-1G", "0", "6XB"):
        with pytest.raises(ValueError, match="memory budget"):
            planner.parse_budget(bad)
    assert planner.available_budget() > nsp.rss.current_bytes()


def test_plan_round_trips_and_describes(tmp_path):
    profile = _profile()
    plan = planner.plan_offload(profile, int(1.5 * GiB))
    planner.write_plan(tmp_path / "plan.json", profile, plan)
    assert planner.read_plan(tmp_path / "plan.json") == (profile, plan)
    text = planner.describe(plan, profile, {"peak_rss_bytes": plan.predicted_peak_bytes, "fwd_bwd_s": 1.0})
    assert "blocks offloaded: 0-2 (3 of 8)" in text and "predicted / measured 1.00" in text


def test_train_with_a_budget_then_plan_activations(tmp_path, corpus):
    """nsp train --offload-activations BUDGET profiles, plans, writes the plan and trains; nsp plan --activations
    prints it beside the run's measurements. A budget below anything that fits is a clear error."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device (the planner plans one)
    env["NSP_CACHE_DIR"] = str(tmp_path / "cache")

    def train(run, budget):
        cmd = [sys.executable, "-m", "nsp.cli", "train", "--model", "tiny", "--run-dir", str(run), "--data", corpus,
               "--seq", "32", "--batch", "4", "--steps", "2", "--eval-every", "0", "--ckpt-every", "0",
               "--activation", "relu", "--offload-activations", budget]
        return subprocess.run(cmd, env=env, capture_output=True, text=True)

    proc = train(tmp_path / "run", "64GiB")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "offload planner: profiling 2 blocks" in proc.stdout
    saved = json.loads((tmp_path / "run" / "offload_plan.json").read_text())
    assert saved["plan"]["layers"] == [] and saved["plan"]["fits"]
    shown = subprocess.run([sys.executable, "-m", "nsp.cli", "plan", "--activations", "--run-dir",
                            str(tmp_path / "run")], env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and "measured" in shown.stdout, shown.stdout + shown.stderr

    proc = train(tmp_path / "small", "1MiB")
    assert proc.returncode == 2 and "even with all 2 blocks offloaded" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_offload_blocks_layers_offloads_only_those(tmp_path):
    """What a plan runs: ``offload_blocks(layers=..., num_layers=...)`` spills only the chosen blocks, and the
    gradients are those without offload, bit for bit."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import nsp.offload
    from nsp.models import GPT
    from nsp.models.gpt import GPTConfig
    from nsp.train.step import loss_fn

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=64, activation="relu")
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (2, 33), 0, 256, jnp.int32)
    plain = jax.jit(jax.grad(functools.partial(loss_fn, graphdef)))(params, tokens)
    with nsp.offload.SpillArea(tmp_path) as area:
        call = nsp.offload.offload_blocks(area, layers=[0, 2], num_layers=3)
        step = jax.jit(jax.grad(functools.partial(loss_fn, graphdef, block_call=call)))
        for _ in range(2):  # a second call: the same blocks again
            grads = step(params, tokens)
        stats = area.stats()
    for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(grads)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert stats["saves"] == stats["loads"] == 2 * 2  # two blocks a step, two steps
    with pytest.raises(ValueError, match="num_layers"):
        nsp.offload.offload_blocks(area, layers=[0])


def test_a_planned_offload_on_several_devices_trains_as_without_offload(tmp_path, monkeypatch, capsys):
    """``--offload-activations BUDGET`` on a mesh (the suite's 4 host devices, one process): the planner profiles
    the whole batch on one device, counts the other devices' gradients beside the step, and the plan it writes
    runs under the sharded step. The plan is narrowed to block 0 here, so that a partial offload on the mesh is
    what runs whatever this machine's memory: the losses equal those of the run without offload."""
    import dataclasses

    import jax

    from nsp.cli import main

    assert jax.device_count() >= 2, "the suite runs on several host devices (conftest)"
    real = planner.plan_offload
    monkeypatch.setattr(planner, "plan_offload",
                        lambda profile, budget, extra=0: dataclasses.replace(real(profile, budget, extra), layers=(0,)))
    common = ["train", "--model", "tiny", "--steps", "3", "--seq", "32", "--batch", "8", "--activation", "relu",
              "--log-every", "1", "--eval-every", "0", "--tier", "memory", "--no-checkpoints"]
    assert main(common + ["--run-dir", str(tmp_path / "keep")]) == 0
    keep = capsys.readouterr().out
    from nsp.train import activations

    stats, close = [], activations.close
    monkeypatch.setattr(activations, "close", lambda area: (area and stats.append(area.stats()), close(area)))
    assert main(common + ["--run-dir", str(tmp_path / "planned"), "--offload-activations", "64GiB"]) == 0
    # Block 0 alone went to the spill area, from each device, every step (all blocks would be twice as many).
    assert len(stats) == 1 and stats[0]["saves"] == stats[0]["loads"] == 3 * jax.device_count(), stats
    planned = capsys.readouterr().out
    assert f"offload planner: {jax.device_count()} devices: the whole batch profiled on one" in planned
    assert "blocks offloaded: 0 (1 of 2)" in planned
    saved = json.loads((tmp_path / "planned" / "offload_plan.json").read_text())
    assert saved["plan"]["layers"] == [0]
    losses = [[line.split("loss ")[1].split()[0] for line in out.splitlines() if line.startswith("step ")]
              for out in (keep, planned)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
