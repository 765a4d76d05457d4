"""nsp.offload: residuals spilled to disk in the forward pass, read back in the backward pass."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nsp.offload
from nsp.models import GPT, cross_entropy_loss, get_config


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.sin(h @ params["w2"]) * x


def _mlp_params(key, width=64):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (width, 4 * width)) / 8, "b1": jnp.zeros(4 * width),
            "w2": jax.random.normal(k2, (4 * width, width)) / 16}


def _loss(layer, stacked, x):
    for params in stacked:
        x = layer(params, x)
    return jnp.mean(x ** 2)


@pytest.mark.parametrize("io", [dict(), dict(direct_io=False), dict(write_behind=0, read_ahead=0),
                                dict(write_behind=4, read_ahead=4), dict(image_limit_bytes=40_000)],
                         ids=["direct", "buffered", "on-the-calling-thread", "behind4-ahead4", "large-entries"])
def test_offloaded_gradients_equal_the_plain_ones_bit_for_bit(tmp_path, io):
    layers = [_mlp_params(jax.random.key(i)) for i in range(4)]
    x = jax.random.normal(jax.random.key(9), (32, 64))
    with nsp.offload.SpillArea(tmp_path, **io) as area:
        assert area.direct_io == io.get("direct_io", True)  # tmp_path is on a disk, which takes O_DIRECT
        offloaded = nsp.offload.offload(_mlp, area)
        got = jax.jit(jax.value_and_grad(functools.partial(_loss, offloaded)))(layers, x)
        stats = area.stats()
        assert stats["saves"] == stats["loads"] == 4  # one entry a layer, each read back once
        # Per layer: tanh's output and the pre-sin value (32 x 256 and 32 x 64 float32) at least; no params.
        assert stats["bytes_written"] >= 4 * (32 * 256 + 32 * 64) * 4
        assert stats["bytes_written"] < 4 * (64 * 256 * 2) * 4  # the weights stay where they are
        assert stats["bytes_read"] == stats["bytes_written"]
        if io.get("write_behind", 1) == 0 or "image_limit_bytes" in io:  # every push wrote, every pop read
            assert stats["disk_bytes_written"] >= stats["bytes_written"]
            assert stats["disk_bytes_read"] >= stats["bytes_read"]
            assert stats["loads_from_memory"] == 0
            assert stats["read_ahead"] == (0 if io.get("read_ahead") == 0 else 3)  # hints to the kernel
        else:  # the disk saw at most the entries, each rounded up to whole blocks
            assert stats["disk_bytes_written"] <= stats["bytes_written"] + 4 * 4096
    want = jax.jit(jax.value_and_grad(functools.partial(_loss, _mlp)))(layers, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not list(tmp_path.iterdir())  # close removed the area


def test_offload_inside_a_scan_over_layers(tmp_path):
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[_mlp_params(jax.random.key(i)) for i in range(5)])
    x = jax.random.normal(jax.random.key(3), (16, 64))

    def loss(layer, stacked, x):
        x, _ = jax.lax.scan(lambda x, p: (layer(p, x), None), x, stacked)
        return jnp.mean(x ** 2)

    with nsp.offload.SpillArea(tmp_path, read_ahead=1) as area:
        step = jax.jit(jax.grad(functools.partial(loss, nsp.offload.offload(_mlp, area))))
        for _ in range(2):  # the stacks are empty again after each step
            got = step(stacked, x)
        assert area.stats()["saves"] == area.stats()["loads"] == 10
    want = jax.jit(jax.grad(functools.partial(loss, _mlp)))(stacked, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_gpt_blocks_offloaded_train_with_the_same_gradients(tmp_path, activation):
    config = get_config("tiny", activation=activation)
    graphdef, params = nnx.split(GPT(config, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, config.vocab_size)

    def loss(params, block_call=None):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1], block_call=block_call)
        return cross_entropy_loss(logits, tokens[:, 1:])

    want = jax.jit(jax.value_and_grad(loss))(params)
    with nsp.offload.SpillArea(tmp_path) as area:
        block_call = nsp.offload.offload_blocks(area, sparse=activation == "relu")
        got = jax.jit(jax.value_and_grad(functools.partial(loss, block_call=block_call)))(params)
        stats = area.stats()
        assert stats["saves"] == config.n_layer
        assert (stats["arrays_sparse"] > 0) == (activation == "relu")  # the ReLU's output, about half zeros
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_host_memory_target_gives_the_same_gradients_and_refuses_what_it_cannot_do():
    # On a CPU the moves to pinned_host compile and move nothing (tests/test_gpu.py checks a GPU frees memory).
    layers = [_mlp_params(jax.random.key(i)) for i in range(3)]
    x = jax.random.normal(jax.random.key(9), (32, 64))
    host = nsp.offload.HostMemory()
    assert host.moves_data == (jax.devices()[0].platform != "cpu")
    got = jax.jit(jax.value_and_grad(functools.partial(_loss, nsp.offload.offload(_mlp, host))))(layers, x)
    want = jax.jit(jax.value_and_grad(functools.partial(_loss, _mlp)))(layers, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="sparse format"):
        nsp.offload.offload(_mlp, host, sparse=True)
    with pytest.raises(TypeError, match="SpillArea or a HostMemory"):
        nsp.offload.offload(_mlp, "/tmp/spill")

    class NoHost:  # a device without a pinned_host memory (a TPU runtime without host offload, say)
        platform = "tpu"

        def addressable_memories(self):
            return [type("M", (), {"kind": "device"})()]

        def __str__(self):
            return "TPU_0"

    with pytest.raises(ValueError, match="TPU_0 has no pinned_host memory .it has device.: offload to a spill"):
        nsp.offload.HostMemory([NoHost()])


def test_offload_frees_the_residuals_memory_in_the_compiled_step(tmp_path):
    # Activation-heavy: 6 layers of a 256-wide MLP on 2048 rows. The step's temporaries without offload hold every
    # layer's residuals until the backward; with it, those of the layer being computed (measured here: 83.9 MB
    # against 41.9 MB, 4.0 layers' residuals less; at 12 layers 159.4 against 54.5 MB, 10.0 less).
    layers = [_mlp_params(jax.random.key(i), width=256) for i in range(6)]
    x = jax.random.normal(jax.random.key(0), (2048, 256))
    plain = jax.jit(jax.grad(functools.partial(_loss, _mlp))).lower(layers, x).compile()
    with nsp.offload.SpillArea(tmp_path) as area:
        off = jax.jit(jax.grad(functools.partial(_loss, nsp.offload.offload(_mlp, area)))).lower(layers, x).compile()
    per_layer = 2048 * (4 * 256 + 256) * 4  # tanh output and pre-sin value, float32
    saved = plain.memory_analysis().temp_size_in_bytes - off.memory_analysis().temp_size_in_bytes
    assert saved >= 3.5 * per_layer, (plain.memory_analysis(), off.memory_analysis())


def test_bf16_compression_halves_the_bytes_and_stays_close(tmp_path):
    layers = [_mlp_params(jax.random.key(i)) for i in range(3)]
    x = jax.random.normal(jax.random.key(9), (32, 64))
    want = jax.grad(functools.partial(_loss, _mlp))(layers, x)
    written = {}
    for compress in (None, jnp.bfloat16):
        with nsp.offload.SpillArea(tmp_path) as area:
            got = jax.grad(functools.partial(_loss, nsp.offload.offload(_mlp, area, compress=compress)))(layers, x)
            written[compress] = area.stats()["array_bytes"]
    assert written[jnp.bfloat16] * 2 == written[None]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        err = np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b)))
        assert 0 < err < 2e-2  # lossy (bf16 has 8 bits of mantissa), but close


def _relu_mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return (h @ params["w2"]) * jnp.where(x > 0.5, -0.0, 1.0)  # some residual entries are -0.0: kept as they are


def test_the_sparse_format_is_lossless_and_used_where_it_shrinks(tmp_path):
    layers = [_mlp_params(jax.random.key(i)) for i in range(3)]
    x = jax.random.normal(jax.random.key(9), (64, 64))
    want = jax.jit(jax.grad(functools.partial(_loss, _relu_mlp)))(layers, x)
    with nsp.offload.SpillArea(tmp_path) as area:
        got = jax.jit(jax.grad(functools.partial(_loss, nsp.offload.offload(_relu_mlp, area, sparse=True))))(
            layers, x)
        stats = area.stats()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert stats["arrays_sparse"] >= 3  # the ReLU outputs (about half zeros), one a layer
    assert stats["bytes_written"] < 0.9 * stats["array_bytes"]
    assert stats["bytes_read"] == stats["bytes_written"]

    # Dense residuals (tanh: no zeros) stay as they are: the sparse form would be larger.
    with nsp.offload.SpillArea(tmp_path) as area:
        jax.block_until_ready(jax.grad(functools.partial(_loss, nsp.offload.offload(_mlp, area, sparse=True)))(
            layers, x))
        assert area.stats()["arrays_sparse"] == 0


def test_offload_says_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        nsp.offload.SpillArea(tmp_path / "missing")
    with pytest.raises(ValueError, match="compress must be"):
        nsp.offload.offload(_mlp, None, compress=jnp.int8)
    area = nsp.offload.SpillArea(tmp_path)
    grad = jax.jit(jax.grad(functools.partial(_loss, nsp.offload.offload(_mlp, area))))
    layers, x = [_mlp_params(jax.random.key(0))], jnp.ones((8, 64))
    grad(layers, x)
    area.close()
    with pytest.raises(Exception, match="spill area .* is closed"):
        jax.block_until_ready(grad(layers, x))


def test_a_spill_directory_removed_mid_run_fails_the_step_clearly(tmp_path):
    area = nsp.offload.SpillArea(tmp_path)
    grad = jax.jit(jax.grad(functools.partial(_loss, nsp.offload.offload(_mlp, area))))
    layers, x = [_mlp_params(jax.random.key(0))], jnp.ones((8, 64))
    grad(layers, x)
    import shutil

    shutil.rmtree(area.path)
    with pytest.raises(Exception, match="cannot write spilled activations to .*No such file"):
        jax.block_until_ready(grad(layers, x))
    area.reset()
    area.path.mkdir()
    grad(layers, x)  # back once the directory is
    area.close()


def test_offload_and_the_nsp_optimizer_in_one_jitted_step(tmp_path):
    import nsp.optim
    import nsp.storage
    from nsp.train.step import make_train_step

    config = get_config("tiny", activation="relu")
    graphdef, params = nnx.split(GPT(config, rngs=nnx.Rngs(0)), nnx.Param)
    batches = jax.random.randint(jax.random.key(2), (3, 2, 33), 0, config.vocab_size)

    def run(block_call, store_dir):
        store = nsp.storage.open(store_dir, tier="file")
        tx = nsp.optim.adamw(1e-3, store=store)
        p = jax.tree.map(jnp.copy, params)  # the step donates them
        state = tx.init(p)
        step, _ = make_train_step(graphdef, tx, block_call=block_call)  # nsp train's step: donates p and state
        losses = []
        for tokens in batches:
            p, state, value = step(p, state, tokens)
            losses.append(float(value))
        store.close()
        return p, losses

    want, want_losses = run(None, tmp_path / "plain")
    (tmp_path / "spill").mkdir()
    with nsp.offload.SpillArea(tmp_path / "spill") as area:
        got, losses = run(nsp.offload.offload_blocks(area, sparse=True), tmp_path / "offloaded")
        assert area.stats()["loads"] == 3 * config.n_layer
    assert losses == want_losses
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nsp_train_offloads_activations_with_the_same_losses(tmp_path, capsys):
    from nsp.cli import main

    common = ["train", "--model", "tiny", "--steps", "4", "--seq", "32", "--batch", "4", "--activation", "relu",
              "--log-every", "1", "--eval-every", "0", "--tier", "memory", "--no-checkpoints"]
    assert main(common + ["--run-dir", str(tmp_path / "keep")]) == 0
    keep = capsys.readouterr().out
    assert main(common + ["--run-dir", str(tmp_path / "spill"), "--offload-activations", "all",
                          "--spill-dir", str(tmp_path / "scratch")]) == 0
    spill = capsys.readouterr().out
    assert "backward-pass activations" in spill and "sparse format" in spill
    assert main(common + ["--run-dir", str(tmp_path / "host"), "--offload-activations", "all",
                          "--offload-to", "host"]) == 0
    host = capsys.readouterr().out
    assert "pinned host memory (on a CPU that is where they are" in host
    losses = [[line.split("loss ")[1].split()[0] for line in out.splitlines() if line.startswith("step ")]
              for out in (keep, spill, host)]
    assert len(losses[0]) == 4 and losses[0] == losses[1] == losses[2]
    assert not list((tmp_path / "scratch").iterdir())  # scratch only: removed at the end
    assert main(common + ["--run-dir", str(tmp_path / "bad"), "--offload-activations", "auto",
                          "--offload-to", "host"]) == 2
    assert "offload_to host takes --offload-activations all" in capsys.readouterr().err


def test_nsp_train_says_when_the_spill_directory_is_too_small(tmp_path, capsys, monkeypatch):
    import shutil as shutil_

    from nsp.cli import main

    real = shutil_.disk_usage
    monkeypatch.setattr(shutil_, "disk_usage", lambda p: real(p)._replace(free=1000))
    assert main(["train", "--model", "tiny", "--steps", "1", "--seq", "32", "--tier", "memory", "--no-checkpoints",
                 "--run-dir", str(tmp_path / "r"), "--offload-activations", "all"]) == 2
    err = capsys.readouterr().err
    assert "has 0.00 GB free; a step spills up to" in err
