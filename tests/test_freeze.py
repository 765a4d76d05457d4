"""Fine-tuning with a frozen backbone (nsp.train.freeze): frozen leaves untouched and out of the store, their
gradients never computed, the same training as a masked optimizer on zeroed gradients, --init-from then --resume
bit for bit, and the refusals."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nsp.storage
from nsp.cli import main
from nsp.models import GPT, get_config
from nsp.storage import checkpoint as ckpt
from nsp.train import freeze as freeze_lib
from nsp.train.config import TrainConfig
from nsp.train.optimizer import make_optimizer
from nsp.train.step import loss_fn, make_train_step

STEPS = 3


def tiny():
    return nnx.split(GPT(get_config("tiny"), rngs=nnx.Rngs(0)), nnx.Param)


def config(**kw):
    return TrainConfig(model="tiny", steps=STEPS, lr=1e-2, warmup_steps=1, tier="memory", **kw)


def tokens(step):
    return jax.random.randint(jax.random.key(step), (4, 33), 0, 256, jnp.int32)


def named(params):
    """``{name: a copy of the leaf}`` (a copy: the step donates the arrays it is given)."""
    return {freeze_lib.leaf_name(p): np.array(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def train_frozen(cfg, params, graphdef, steps=STEPS):
    """``steps`` steps of nsp train's step with ``cfg``'s freeze; returns (params, store's layout)."""
    freeze = freeze_lib.resolve(cfg, params)
    store = nsp.storage.open(None, tier="memory", page_bytes=4096)
    tx = make_optimizer(cfg, store, None)
    opt_state = tx.init(freeze.split(params)[0])
    step, _ = make_train_step(graphdef, tx, freeze=freeze)
    for t in range(steps):
        params, opt_state, _ = step(params, opt_state, tokens(t))
    params = jax.block_until_ready(params)
    layout = store.layout
    store.close()
    return params, layout, freeze


def test_frozen_leaves_stay_bit_identical_and_stay_out_of_the_store():
    graphdef, params = tiny()
    before = named(params)
    cfg = config(freeze_layers=1, freeze="ln_f")
    after, layout, freeze = train_frozen(cfg, params, graphdef)
    after = named(after)
    assert freeze.names == {n for n in before if n.startswith(("wte/", "wpe/", "h/0/", "ln_f/"))}
    for name in before:
        if name in freeze.names:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        else:
            assert not np.array_equal(after[name], before[name]), f"{name} did not train"
    # The store holds the trainable leaves only, named as in the whole model.
    trainable = sorted(n for n in before if n not in freeze.names)
    assert len(layout.leaves) == len(trainable)
    assert layout.total == sum(before[n].size for n in trainable) < sum(x.size for x in before.values()) // 2
    whole = nsp.storage.Layout.from_tree(params, num_shards=1, page_bytes=4096)
    assert layout.pages_per_shard < whole.pages_per_shard


def _dot_count(cfg, graphdef, params):
    """Dot products in the jitted train step as JAX hands it to XLA, and XLA's temp bytes for the step."""
    freeze = freeze_lib.resolve(cfg, params)
    store = nsp.storage.open(None, tier="memory", page_bytes=4096)
    tx = make_optimizer(cfg, store, None)
    opt_state = tx.init(freeze.split(params)[0])
    step, _ = make_train_step(graphdef, tx, freeze=freeze)
    lowered = step.lower(params, opt_state, tokens(0))
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    store.close()
    return len(re.findall(r"stablehlo\.dot_general", lowered.as_text())), temp


def test_the_step_does_not_compute_the_frozen_gradients():
    graphdef, params = tiny()
    n_layer = get_config("tiny").n_layer
    full, full_temp = _dot_count(config(), graphdef, params)
    # The forward pass alone: what every step computes whatever is frozen.
    forward = len(re.findall(r"stablehlo\.dot_general", jax.jit(
        lambda p, t: loss_fn(graphdef, p, t)).lower(params, tokens(0)).as_text()))
    per_block = (forward - 1) // n_layer  # the last dot: logits from the tied token embedding
    assert full == 3 * forward  # the backward pass: a weight and an input gradient for every forward dot
    frozen, frozen_temp = _dot_count(config(freeze_layers=1), graphdef, params)
    # Block 0 frozen with the embeddings below it: its backward pass goes (2 dots for each of its forward ones),
    # and the tied embedding's gradient from the logits (1).
    assert frozen == full - 2 * per_block - 1
    assert frozen_temp < full_temp


def test_freezing_trains_as_a_masked_optimizer_on_zeroed_gradients():
    """The step that leaves the frozen leaves out equals, bit for bit, the whole model's step with their
    gradients zeroed and the optimizer masked to the trainable leaves (the store holding those only)."""
    graphdef, params = tiny()
    cfg = config(freeze_layers=1)
    got, _, freeze = train_frozen(cfg, tiny()[1], graphdef)

    trainable_mask = jax.tree_util.tree_map_with_path(lambda p, _: freeze_lib.leaf_name(p) not in freeze.names,
                                                      params)
    store = nsp.storage.open(None, tier="memory", page_bytes=4096)
    inner = make_optimizer(dataclasses.replace(cfg, clip=0.0), store, None)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip), optax.masked(inner, trainable_mask))
    opt_state = tx.init(params)

    @jax.jit
    def step(p, s, t):
        loss, g = jax.value_and_grad(lambda q: loss_fn(graphdef, q, t))(p)
        g = jax.tree_util.tree_map(lambda x, m: x if m else jnp.zeros_like(x), g, trainable_mask)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    ref = params
    for t in range(STEPS):
        ref, opt_state = step(ref, opt_state, tokens(t))
    store.close()
    got, ref = named(got), named(ref)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)


# ---- nsp train end to end ------------------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("isolated_cache")  # conftest: a token cache of each test's own


def train(run_dir, corpus, *extra):
    return main(["train", "--model", "tiny", "--run-dir", str(run_dir), "--data", corpus, "--seq", "32", "--batch",
                 "4", "--log-every", "2", "--eval-every", "0", "--eval-batches", "1", *map(str, extra)])


def saved_params(run_dir):
    manager = ckpt.make_checkpoint_manager(run_dir / "ckpt", max_to_keep=None)
    step = manager.latest_step()
    manager.close()
    return step, named(ckpt.load_train_state(run_dir / "ckpt" / str(step))["params"])


def test_init_from_then_resume_continues_bit_for_bit(tmp_path, corpus, capsys):
    base = tmp_path / "base"
    assert train(base, corpus, "--steps", "2") == 0
    _, pretrained = saved_params(base)
    tune = ["--init-from", base, "--freeze-layers", "1", "--steps", "4", "--ckpt-every", "2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(straight, corpus, *tune) == 0
    assert train(split, corpus, *tune, "--stop-after", "2") == 0
    assert train(split, corpus, *tune, "--resume") == 0
    (step_a, a), (step_b, b) = saved_params(straight), saved_params(split)
    assert step_a == step_b == 4
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        if name.startswith(("wte/", "wpe/", "h/0/")):  # frozen: the pretrained values, kept in the checkpoint
            np.testing.assert_array_equal(a[name], pretrained[name], err_msg=name)
        else:
            assert not np.array_equal(a[name], pretrained[name]), f"{name} did not train"
    out = capsys.readouterr().out
    assert f"fine-tuning from {base / 'ckpt' / '2'}" in out and "14 of 28 leaves frozen" in out
    assert main(["sample", "--run-dir", str(straight), "--tokens", "4"]) == 0  # the whole model is checkpointed


@pytest.mark.parametrize("extra, message", [
    (["--freeze", "no_such_leaf"], "matches no parameter"),
    (["--freeze", "."], "nothing is left to train"),
    (["--freeze-layers", "2", "--freeze", "ln_f"], "nothing is left to train"),
    (["--freeze-layers", "3"], "model 'tiny' has 2 blocks"),
    (["--freeze", "("], "not a valid regular expression"),
    (["--init-from", "{missing}"], "no such run or checkpoint directory"),
])
def test_refusals(tmp_path, corpus, capsys, extra, message):
    extra = [x.replace("{missing}", str(tmp_path / "missing")) for x in extra]
    assert train(tmp_path / "run", corpus, "--steps", "1", *extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "store").exists()


def test_init_from_another_model_names_the_leaf(tmp_path, corpus, capsys):
    base = tmp_path / "base"
    assert train(base, corpus, "--steps", "1") == 0
    assert train(tmp_path / "run", corpus, "--model", "small", "--init-from", base, "--steps", "1") == 2
    assert "leaf h/0/attn/c_attn/bias has shape (192,) there, (768,) in this model" in capsys.readouterr().err
    assert not (tmp_path / "run" / "store").exists()


def test_an_abstract_template_loads_the_same_params_and_a_zero_head(tmp_path, corpus):
    """An extractor loads ``--init-from`` into the model's shape alone (``setup.abstract_model``): every leaf the
    checkpoint holds is the same as through a fresh model, and a classifier's new head, which it never runs,
    is zeros of the head's shape instead of random values."""
    from nsp.train.setup import abstract_model, init_model

    base = tmp_path / "base"
    assert train(base, corpus, "--steps", "1") == 0
    cfg = dataclasses.replace(config(), task="classify", classes=3)
    _, fresh = init_model(cfg, 256)
    _, template = abstract_model(cfg, 256)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(template))
    through_fresh = named(freeze_lib.load_params(base, fresh))
    through_shape = named(freeze_lib.load_params(base, template))
    assert through_fresh.keys() == through_shape.keys()
    heads = [n for n in through_fresh if n.startswith("cls/")]
    assert heads, "the classifier config has no head"
    for name, value in through_fresh.items():
        assert through_shape[name].shape == value.shape and through_shape[name].dtype == value.dtype, name
        if name in heads:
            np.testing.assert_array_equal(through_shape[name], np.zeros_like(value), err_msg=name)
        else:
            np.testing.assert_array_equal(through_shape[name], value, err_msg=name)
    assert any(np.any(through_fresh[n] != 0) for n in heads)  # a fresh head is random: the two differ there
