"""stage_gradients: the gradient staged on the store's disk leaf by leaf, the new params read back leaf by leaf.

The staged update must give exactly the leaves update's results (it is the same engine step, reading its gradient
from the stage file), skip a non-finite gradient, adopt changed params, refuse what it cannot take by name, and
hold less than the whole gradient (XLA's memory analysis of the compiled step: nothing runs for that)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nsp.optim
import nsp.storage as storage
from nsp.models import GPT
from nsp.models.gpt import GPTConfig
from nsp.primitives.staged_update import store_update_staged
from nsp.primitives.store_update import store_update_leaves
from nsp.train.trainer import loss_fn, make_train_step

PAGE = 16 * 1024


def _params():
    rng = np.random.default_rng(0)
    return {"a": jnp.asarray(rng.standard_normal((301, 33)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(77), jnp.float32),
            "c": jnp.asarray(rng.standard_normal((5, 7)), jnp.float32)}


def _grads(step, params, dtype):
    rng = np.random.default_rng(step)
    return [jnp.asarray(rng.standard_normal(p.shape), dtype) for p in jax.tree_util.tree_leaves(params)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_staged_equals_leaves_update_and_skips_non_finite(tmp_path, dtype):
    params = _params()
    spec = storage.OptimizerSpec("adam")
    staged_store = storage.open(tmp_path / "staged", tier="file", num_shards=1, page_bytes=PAGE)
    leaves_store = storage.open(tmp_path / "leaves", tier="file", num_shards=1, page_bytes=PAGE)
    for s in (staged_store, leaves_store):
        s.initialize(params, spec)
    leaves_p = [x.astype(dtype) for x in jax.tree_util.tree_leaves(params)]

    @jax.jit
    def staged(grads, ps, version, t):
        return store_update_staged(staged_store, grads, version=version, lr=0.01, step=t, params=ps)

    @jax.jit
    def leaves(grads, version, t):
        return store_update_leaves(leaves_store, grads, version=version, lr=0.01, step=t)

    try:
        ps = leaves_p
        for t in range(1, 4):
            grads = _grads(t, params, dtype)
            new, version = staged(grads, ps, t - 1, t)
            ref, ref_version = leaves(grads, t - 1, t)
            assert int(version) == int(ref_version) == t
            for x, y in zip(new, ref):
                assert x.dtype == dtype
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            ps = new
        for state in ("param", "mu", "nu"):
            np.testing.assert_array_equal(staged_store.read(state), leaves_store.read(state))

        # NaN in one leaf skips the step: the committed params come back, the version stays.
        bad = _grads(4, params, dtype)
        bad[1] = bad[1].at[3].set(jnp.nan)
        new, version = staged(bad, ps, 3, 4)
        assert int(version) == 3 == staged_store.version
        committed = staged_store.read("param")
        for leaf, x in zip(staged_store.layout.leaves, new):
            want = jnp.asarray(committed[leaf.offset:leaf.offset + leaf.size]).astype(dtype).reshape(leaf.shape)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(want))
        assert staged_store.stats()["skipped"] == 1
    finally:
        staged_store.close()
        leaves_store.close()


def _gpt():
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=256, dtype=jnp.bfloat16,
                    f32_accum=True)
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.block_size + 1), 0, 256, jnp.int32)
    return graphdef, params, tokens


def _run(tmp_path, name, stage, steps=3, edit=None):
    graphdef, params, tokens = _gpt()
    store = storage.open(tmp_path / name, tier="file", num_shards=1)
    try:
        tx = nsp.optim.adamw(1e-3, store=store, stage_gradients=stage)
        state = tx.init(params)
        params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
        step = make_train_step(graphdef, tx)[0]
        losses = []
        for i in range(steps):
            if edit is not None and i == 1:
                params = edit(params)
            params, state, loss = step(params, state, tokens)
            losses.append(float(loss))
        return losses, [np.asarray(x) for x in jax.tree_util.tree_leaves(params)], store.stats()
    finally:
        store.close()


def test_gpt_steps_match_the_default_update_bit_for_bit(tmp_path):
    """nsp train's step with stage_gradients: the same losses and params as without, on the file tier."""
    losses, params, stats = _run(tmp_path, "staged", True)
    ref_losses, ref_params, _ = _run(tmp_path, "leaves", False)
    assert losses == ref_losses
    for x, y in zip(params, ref_params):
        np.testing.assert_array_equal(x, y)
    assert stats["skipped"] == 0


def test_changed_params_are_adopted(tmp_path):
    """Params edited between steps: the staged step starts from them (optax's rule), as the default one does."""
    def halve(params):
        return jax.tree_util.tree_map(lambda x: (x * 0.5).astype(x.dtype), params)

    losses, params, stats = _run(tmp_path, "staged", True, edit=halve)
    ref_losses, ref_params, ref_stats = _run(tmp_path, "leaves", False, edit=halve)
    assert losses == ref_losses
    for x, y in zip(params, ref_params):
        np.testing.assert_array_equal(x, y)
    assert stats["params_adopted"] == ref_stats["params_adopted"] == 1


def test_refuses_what_it_cannot_take(tmp_path):
    graphdef, params, tokens = _gpt()
    memory = storage.open(None, tier="memory", num_shards=1)
    try:
        tx = nsp.optim.adamw(1e-3, store=memory, stage_gradients=True)
        state = tx.init(params)
        with pytest.raises(ValueError, match="memory tier"):
            make_train_step(graphdef, tx)[0].lower(params, state, tokens)
    finally:
        memory.close()
    store = storage.open(tmp_path / "s", tier="file", num_shards=1)
    try:
        with pytest.raises(ValueError, match="staleness 0"):
            nsp.optim.adamw(1e-3, store=store, stage_gradients=True, staleness=1)
        with pytest.raises(ValueError, match="Top-K"):
            nsp.optim.adamw(1e-3, store=store, stage_gradients=True, compression=nsp.optim.TopK(0.01))
        tx = nsp.optim.adamw(1e-3, store=store, stage_gradients=True)
        state = tx.init(params)
        mixed = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)  # bf16 params, fp32 gradient
        grads = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
        with pytest.raises(ValueError, match="all float32 or all bfloat16"):
            jax.jit(tx.update).lower(grads, state, mixed)
    finally:
        store.close()


@pytest.mark.parametrize("float32_updates", [False, True])
def test_step_never_holds_the_whole_gradient(tmp_path, float32_updates):
    """The guard: the staged step's temporaries stay below the forward/backward's own plus half the gradient
    (the default update holds all of it: forward/backward + the whole gradient), and below the default step's.
    float32_updates: what nsp train --bf16-params --stage-gradients runs (its fingerprint hashes where the updates
    land; a hash that read the params in a call of its own cost 1.65 bytes per parameter here)."""
    graphdef, params, tokens = _gpt()
    bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    fwd_bwd = jax.jit(jax.value_and_grad(functools.partial(loss_fn, graphdef))).lower(bf16, tokens).compile()
    own = fwd_bwd.memory_analysis().temp_size_in_bytes
    temps = {}
    for stage in (False, True):
        store = storage.open(tmp_path / f"s{stage}", tier="file", num_shards=1)
        try:
            tx = nsp.optim.adamw(1e-3, store=store, stage_gradients=stage, float32_updates=float32_updates)
            state = tx.init(params)
            compiled = make_train_step(graphdef, tx)[0].lower(bf16, state, tokens).compile()
            temps[stage] = compiled.memory_analysis().temp_size_in_bytes
        finally:
            store.close()
    bound = own + 0.5 * 2 * n
    assert temps[True] <= bound, (f"the staged step holds {temps[True] / n:.2f} bytes per parameter of "
                                  f"temporaries, more than forward/backward + half the gradient ({bound / n:.2f})")
    assert temps[False] > bound  # the guard can fail: the default step holds the whole gradient
    assert temps[True] < temps[False]


def test_users_own_loop_with_optax_apply_updates(tmp_path):
    """A loop written the optax way (tx.update, optax.apply_updates) gets the staged step's memory too."""
    graphdef, params, tokens = _gpt()
    bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    fwd_bwd = jax.jit(jax.value_and_grad(functools.partial(loss_fn, graphdef))).lower(bf16, tokens).compile()
    store = storage.open(tmp_path / "s", tier="file", num_shards=1)
    try:
        tx = nsp.optim.adamw(1e-3, store=store, stage_gradients=True)
        state = tx.init(params)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, state, tokens):
            loss, grads = jax.value_and_grad(functools.partial(loss_fn, graphdef))(params, tokens)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        compiled = step.lower(bf16, state, tokens).compile()
        assert compiled.memory_analysis().temp_size_in_bytes <= fwd_bwd.memory_analysis().temp_size_in_bytes + n
        p, state, loss = step(bf16, state, tokens)
        assert int(state.count) == 1 and np.isfinite(float(loss))
    finally:
        store.close()


def test_clip_norm_scales_the_staged_gradient_as_it_is_read(tmp_path):
    """clip_norm: the norm from the stage calls' sums of squares, the gradient scaled by clip / norm as the update
    reads it: exactly the leaves update of the gradient scaled so, and close to optax.clip_by_global_norm's."""
    params = _params()
    spec = storage.OptimizerSpec("adam")
    stores = {name: storage.open(tmp_path / name, tier="file", num_shards=1, page_bytes=PAGE)
              for name in ("staged", "leaves", "unclipped", "plain")}
    for s in stores.values():
        s.initialize(params, spec)
    ps = jax.tree_util.tree_leaves(params)
    try:
        grads = _grads(1, params, jnp.float32)
        sums = [np.float32(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads]
        norm = np.sqrt(np.sum(np.asarray(sums, np.float32)), dtype=np.float32)
        clip = float(norm) / 4
        scale = np.float32(clip) / norm
        new, _ = jax.jit(lambda g, p: store_update_staged(stores["staged"], g, version=0, lr=0.01, step=1, params=p,
                                                          clip_norm=clip))(grads, ps)
        ref, _ = jax.jit(lambda g: store_update_leaves(stores["leaves"], g, version=0, lr=0.01, step=1))(
            [g * scale for g in grads])
        for x, y in zip(new, ref):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        clipped = optax.clip_by_global_norm(clip).update(grads, optax.EmptyState())[0]
        for g, r in zip(clipped, [g * scale for g in grads]):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6)
        # A norm below clip_norm leaves the gradient as it is.
        same, _ = jax.jit(lambda g, p: store_update_staged(stores["unclipped"], g, version=0, lr=0.01, step=1,
                                                           params=p, clip_norm=float(norm) * 2))(grads, ps)
        plain, _ = jax.jit(lambda g: store_update_leaves(stores["plain"], g, version=0, lr=0.01, step=1))(grads)
        for x, y in zip(same, plain):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert not np.array_equal(np.asarray(same[0]), np.asarray(new[0]))
        with pytest.raises(ValueError, match="clip_norm must be positive"):
            store_update_staged(stores["staged"], grads, version=1, lr=0.01, step=2, params=ps, clip_norm=0.0)
    finally:
        for s in stores.values():
            s.close()


def test_clip_norm_needs_stage_gradients(tmp_path):
    store = storage.open(tmp_path / "s", tier="file", num_shards=1)
    try:
        with pytest.raises(ValueError, match="optax.clip_by_global_norm"):
            nsp.optim.adamw(1e-3, store=store, clip_norm=1.0)
    finally:
        store.close()
