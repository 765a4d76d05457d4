"""nsp.optim against optax: same trajectories, chains, schedules, sharding, compression, bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nsp.optim
import nsp.storage
from nsp.models import GPT, cross_entropy_loss, get_config

PAGE = 16 * 1024


def mlp_problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(rng.standard_normal((8, 64)) * 0.3, jnp.float32),
        "b1": jnp.zeros(64, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((64, 1)) * 0.3, jnp.float32),
    }
    x = jnp.asarray(rng.standard_normal((128, 8)), jnp.float32)
    y = jnp.sin(x.sum(1, keepdims=True))

    def loss(p):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    return params, loss


def make_step(tx, loss):
    @jax.jit
    def step(p, s):
        value, g = jax.value_and_grad(loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    return step


def max_rel_err(a, b):
    """||a - b|| / ||b|| over the whole parameter tree (float32 rounding differences, amplified by training,
    make an element-wise relative error meaningless for parameters that sit near zero)."""
    pairs = list(zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    diff = sum(float(jnp.sum((x.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)) for x, y in pairs)
    norm = sum(float(jnp.sum(y.astype(jnp.float32) ** 2)) for _, y in pairs)
    return (diff / max(norm, 1e-30)) ** 0.5


def assert_same_trajectory(nsp_tx, ref_tx, params, loss, steps=50, tol=1e-5):
    step, ref_step = make_step(nsp_tx, loss), make_step(ref_tx, loss)
    p, s = params, nsp_tx.init(params)
    rp, rs = params, ref_tx.init(params)
    for i in range(steps):
        p, s, _ = step(p, s)
        rp, rs, _ = ref_step(rp, rs)
        err = max_rel_err(p, rp)
        assert err <= tol, f"step {i + 1}: params differ from optax by {err:.3g} (relative)"
    return p, s


OPTIMIZERS = {
    "adam": (lambda store: nsp.optim.adam(3e-3, store=store), optax.adam(3e-3)),
    "adamw": (lambda store: nsp.optim.adamw(3e-3, weight_decay=0.01, store=store),
              optax.adamw(3e-3, weight_decay=0.01)),
    "sgd": (lambda store: nsp.optim.sgd(0.05, momentum=0.9, nesterov=True, store=store),
            optax.sgd(0.05, momentum=0.9, nesterov=True)),
    "sgd_plain": (lambda store: nsp.optim.sgd(0.05, store=store), optax.sgd(0.05)),
    "adagrad": (lambda store: nsp.optim.adagrad(0.05, store=store), optax.adagrad(0.05)),
}


@pytest.mark.parametrize("in_place", [False, True], ids=["two-slots", "in-place"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_mlp_memory_tier_follows_optax(name, in_place):
    params, loss = mlp_problem()
    make, ref = OPTIMIZERS[name]
    with nsp.storage.open(tier="memory", page_bytes=PAGE, in_place=in_place) as store:
        assert_same_trajectory(make(store), ref, params, loss)


def test_mlp_file_tier_follows_optax(tmp_path):
    params, loss = mlp_problem()
    make, ref = OPTIMIZERS["adamw"]
    with nsp.storage.open(tmp_path / "store", tier="file", page_bytes=PAGE) as store:
        p, state = assert_same_trajectory(make(store), ref, params, loss)
        assert store.version == 50 and int(state.version) == 50
        # The store's master params are what the model got.
        master = store.layout.unflatten(store.read("param"), p)
        for a, b in zip(jax.tree_util.tree_leaves(master), jax.tree_util.tree_leaves(p)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tiny_gpt_follows_optax():
    cfg = get_config("tiny")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (4, cfg.block_size + 1), 0, cfg.vocab_size)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1])
        return cross_entropy_loss(logits, tokens[:, 1:])

    with nsp.storage.open(tier="memory") as store:
        assert_same_trajectory(nsp.optim.adamw(1e-3, weight_decay=0.01, store=store),
                               optax.adamw(1e-3, weight_decay=0.01), params, loss)


def test_four_device_mesh_equals_one_device():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    params, loss = mlp_problem()
    results = []
    for shards in (1, 4):
        kw = dict(mesh=mesh, axis_name="d") if shards == 4 else {}
        with nsp.storage.open(tier="memory", num_shards=shards, page_bytes=PAGE) as store:
            tx = nsp.optim.adam(3e-3, store=store, **kw)
            p, s = params, tx.init(params)
            step = make_step(tx, loss)
            for _ in range(5):
                p, s, _ = step(p, s)
            results.append(p)
            layout = store.layout
            if shards == 4:
                hlo = step.lower(p, s).compile().as_text()
    # XLA partitions the model's backward pass on the mesh, so gradients can differ in the last bit.
    assert max_rel_err(results[1], results[0]) <= 1e-6
    # Each device's custom call sees only its own shard of the flattened gradient.
    calls = [line for line in hlo.splitlines() if 'custom_call_target="nsp_store_update_dense"' in line]
    assert calls, "the store update is not in the compiled step"
    for line in calls:
        assert f"f32[{layout.shard_size}]" in line and f"f32[{layout.padded_total}]" not in line, line


def test_chain_with_clipping_schedule_and_injected_lr_does_not_recompile():
    params, loss = mlp_problem()
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=5, decay_steps=30)
    with nsp.storage.open(tier="memory", page_bytes=PAGE) as store:
        tx = optax.chain(optax.clip_by_global_norm(0.5), nsp.optim.adamw(schedule, store=store))
        ref = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule))
        assert_same_trajectory(tx, ref, params, loss, steps=30)
    with nsp.storage.open(tier="memory", page_bytes=PAGE) as store:
        tx = optax.inject_hyperparams(nsp.optim.adam, static_args=("store",))(learning_rate=1e-2, store=store)
        ref = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
        step, ref_step = make_step(tx, loss), make_step(ref, loss)
        p, s, rp, rs = params, tx.init(params), params, ref.init(params)
        for i in range(20):
            lr = 1e-2 / (1 + i)
            s.hyperparams["learning_rate"] = jnp.asarray(lr)
            rs.hyperparams["learning_rate"] = jnp.asarray(lr)
            p, s, _ = step(p, s)
            rp, rs, _ = ref_step(rp, rs)
            assert max_rel_err(p, rp) <= 1e-5
        assert step._cache_size() == 1, "changing the learning rate recompiled the step"


def test_frozen_leaves_carry_no_state():
    params, loss = mlp_problem()
    mask = {"w1": True, "b1": False, "w2": True}
    with nsp.storage.open(tier="memory", page_bytes=PAGE) as store:
        tx = optax.masked(nsp.optim.adam(3e-3, store=store), mask)
        ref = optax.masked(optax.adam(3e-3), mask)
        assert store.layout is None
        p, _ = assert_same_trajectory(tx, ref, params, loss, steps=10)
        assert store.layout.total == 8 * 64 + 64  # w1 and w2 only
    labels = {"w1": "train", "b1": "frozen", "w2": "train"}
    with nsp.storage.open(tier="memory", page_bytes=PAGE) as store:
        tx = optax.partition({"train": nsp.optim.adam(3e-3, store=store), "frozen": optax.set_to_zero()}, labels)
        ref = optax.partition({"train": optax.adam(3e-3), "frozen": optax.set_to_zero()}, labels)
        p, _ = assert_same_trajectory(tx, ref, params, loss, steps=10)
        assert store.layout.total == 8 * 64 + 64
        np.testing.assert_array_equal(np.asarray(p["b1"]), 0.0)  # frozen


def test_update_is_replayable_and_stale_state_is_an_error(tmp_path):
    params, loss = mlp_problem()
    with nsp.storage.open(tmp_path / "s", tier="file", page_bytes=PAGE) as store:
        tx = nsp.optim.adam(1e-2, store=store)
        s0 = tx.init(params)
        g = jax.grad(loss)(params)
        u1, s1 = tx.update(g, s0, params)
        u1_again, s1_again = tx.update(g, s0, params)  # the same state again: the same result
        for a, b in zip(jax.tree_util.tree_leaves(u1), jax.tree_util.tree_leaves(u1_again)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        p1 = optax.apply_updates(params, u1)
        _, s2 = tx.update(jax.grad(loss)(p1), s1, p1)
        assert int(s2.version) == 2
        with pytest.raises(Exception, match="no longer holds version 0"):
            jax.block_until_ready(tx.update(g, s0, params))


def _stdlib_text_batches(cfg, steps, batch, seed=0):
    """Byte-level batches of real text: the source of a few Python standard-library modules."""
    import inspect
    import json as json_mod
    import os as os_mod

    text = "".join(inspect.getsource(m) for m in (os_mod, json_mod.decoder, functools)).encode()
    data = np.frombuffer(text, np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, data.size - cfg.block_size - 1, size=(steps, batch))
    return jnp.asarray(np.stack([[data[i:i + cfg.block_size + 1] for i in row] for row in starts]))


def test_topk_with_error_feedback_trains_tiny_gpt():
    cfg = get_config("tiny")
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    steps = 200
    batches = _stdlib_text_batches(cfg, steps + 4, batch=8)
    train, held_out = batches[:steps], batches[steps:]

    def loss(p, tokens):
        return cross_entropy_loss(nnx.merge(graphdef, p)(tokens[:, :-1]), tokens[:, 1:])

    # Dense Adam at its best measured setting (3e-3; 1e-3, 2e-3 and 5e-3 gave 2.431, 2.379 and 2.590) against
    # Top-K 1% with error feedback at the moment decays recommended for it (nsp.optim.compress), with the dense
    # and the lazy store update, and Top-K at dense Adam's settings to show what the recommended ones are worth.
    b1, b2 = nsp.optim.TOPK_ADAM_BETAS
    sparse = {"learning_rate": 5e-3, "b1": b1, "b2": b2}  # Top-K also measured best at a higher learning rate
    runs = {"dense": (None, {"learning_rate": 3e-3}),
            "topk": (nsp.optim.TopK(0.01), sparse),
            "topk_lazy": (nsp.optim.TopK(0.01, lazy=True), sparse),  # only the sent entries move
            "topk_dense_decays": (nsp.optim.TopK(0.01), {"learning_rate": 3e-3})}
    finals = {}
    for name, (compression, hyper) in runs.items():
        with nsp.storage.open(tier="memory") as store:
            tx = nsp.optim.adam(**hyper, store=store, compression=compression)

            @jax.jit
            def step(p, s, tokens, tx=tx):
                g = jax.grad(loss)(p, tokens)
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

            p, s = params, tx.init(params)
            for tokens in train:
                p, s = step(p, s, tokens)
            finals[name] = float(np.mean([loss(p, t) for t in held_out]))
    start = float(np.mean([loss(params, t) for t in held_out]))
    assert finals["dense"] < 0.6 * start, (start, finals)  # it learned something
    # Measured here after 200 steps from scratch: dense 2.377; Top-K 1% at the recommended decays 2.433 (+2.4%)
    # with the dense store update, 2.420 (+1.8%) with the lazy one; at dense Adam's decays 2.754 (+15.9%).
    assert finals["topk"] <= 1.05 * finals["dense"], finals
    assert finals["topk_lazy"] <= 1.05 * finals["dense"], finals
    assert finals["topk"] <= 0.95 * finals["topk_dense_decays"], finals


def test_residual_decay_scales_the_unsent_remainder():
    grads = {"a": jnp.arange(1, 101, dtype=jnp.float32), "b": -jnp.arange(1, 101, dtype=jnp.float32) / 10}
    params = jax.tree_util.tree_map(jnp.zeros_like, grads)
    dropped = np.concatenate([np.arange(1, 101), -np.arange(1, 101) / 10]).astype(np.float32)
    dropped[98:100] = 0.0  # k = 2 of 200: the two largest, a[98] and a[99]
    for decay in (1.0, 0.5, 0.0):
        tx = nsp.optim.topk_compress(0.01, residual_decay=decay)
        state = tx.init(params)
        update = jax.jit(tx.update)
        out, state = update(grads, state, params)
        np.testing.assert_array_equal(np.asarray(out.indices), [98, 99])
        np.testing.assert_allclose(np.asarray(state.residual), decay * dropped, rtol=1e-6)
        # The next step selects from the gradient plus the decayed remainder.
        out, state = update(grads, state, params)
        expect = np.concatenate([np.asarray(grads["a"]), np.asarray(grads["b"])]) + decay * dropped
        top = np.sort(np.argsort(-np.abs(expect), kind="stable")[:2])
        np.testing.assert_array_equal(np.asarray(out.indices), top)
        np.testing.assert_allclose(np.asarray(out.values), expect[top], rtol=1e-6)
    # The nsp.optim aliases pass TopK.residual_decay through.
    with nsp.storage.open(tier="memory", page_bytes=PAGE) as store:
        tx = nsp.optim.sgd(1.0, store=store, compression=nsp.optim.TopK(0.01, residual_decay=0.25))
        _, (topk_state, _) = jax.jit(tx.update)(grads, tx.init(params), params)
        np.testing.assert_allclose(np.asarray(topk_state.residual), 0.25 * dropped, rtol=1e-6)


def test_residual_decay_is_the_same_sharded_over_a_mesh():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    params, loss = mlp_problem()
    results = []
    for kw in ({}, {"mesh": mesh, "axis_name": "d"}):
        tx = nsp.optim.topk_compress(0.05, residual_decay=0.5, num_shards=4, **kw)
        update = jax.jit(tx.update)
        state, p = tx.init(params), params
        for _ in range(3):
            out, state = update(jax.grad(loss)(p), state, p)
            p = jax.tree_util.tree_map(lambda x: x * 0.9, p)
        results.append((out, state))
    (out, state), (mesh_out, mesh_state) = results
    np.testing.assert_array_equal(np.asarray(mesh_out.indices), np.asarray(out.indices))
    np.testing.assert_allclose(np.asarray(mesh_out.values), np.asarray(out.values), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(mesh_state.residual), np.asarray(state.residual), rtol=1e-6)


@pytest.mark.parametrize("decay", [-0.1, 1.5, True, "0.5", float("nan")])
def test_residual_decay_must_be_in_unit_interval(decay):
    with pytest.raises(ValueError, match="residual_decay must be a number in"):
        nsp.optim.topk_compress(0.01, residual_decay=decay)
    with nsp.storage.open(tier="memory") as store, pytest.raises(ValueError, match="residual_decay must be a"):
        nsp.optim.adam(1e-3, store=store, compression=nsp.optim.TopK(0.01, residual_decay=decay))


def test_compressed_updates_reach_only_kept_entries_without_error_feedback():
    params = {"w": jnp.zeros(1000, jnp.float32)}
    grads = {"w": jnp.arange(1000, dtype=jnp.float32) - 500.0}
    with nsp.storage.open(tier="memory", page_bytes=PAGE) as store:
        tx = nsp.optim.sgd(1.0, store=store, compression=nsp.optim.TopK(0.01, error_feedback=False))
        s = tx.init(params)
        u, s = jax.jit(tx.update)(grads, s, params)
        moved = np.flatnonzero(np.asarray(u["w"]))
        # The 10 largest |g| are at 0..4 (|g| = 500..496) and 996..999 (499..496), then a tie at |g| = 495
        # between 5 and 995, which Top-K breaks towards the lower position.
        np.testing.assert_array_equal(moved, [0, 1, 2, 3, 4, 5, 996, 997, 998, 999])
        np.testing.assert_array_equal(np.asarray(u["w"])[moved], -np.asarray(grads["w"])[moved])


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    params, _ = mlp_problem()
    with nsp.storage.open(tmp_path / "s", tier="file", page_bytes=PAGE) as store:
        nsp.optim.adam(1e-3, store=store).init(params)
    meta = (tmp_path / "s" / "nsp_store.json").read_text()
    with nsp.storage.open(tmp_path / "s", tier="file", page_bytes=PAGE) as store:
        with pytest.raises(nsp.storage.StoreError, match="different layout"):
            nsp.optim.adam(1e-3, store=store).init({"w": jnp.zeros(3)})
        with pytest.raises(nsp.storage.StoreError, match="was created for"):
            nsp.optim.sgd(1e-3, store=store).init(params)
        with pytest.raises(ValueError, match="need params"):
            tx = nsp.optim.adam(1e-3, store=store)
            tx.update(params, tx.init(params))
        assert store.version == 1  # that init started the optimizer afresh (version 1); the refused calls wrote nothing
    assert (tmp_path / "s" / "nsp_store.json").read_text() == meta
    with nsp.storage.open(tier="memory") as store:
        with pytest.raises(TypeError, match="only floating-point leaves"):
            nsp.optim.adam(1e-3, store=store).init({"w": jnp.zeros(3), "step": jnp.zeros(1, jnp.int32)})
        assert not store.initialized
        # Under jax.jit, init writes the store through a host callback: it works.
        state = jax.jit(nsp.optim.adam(1e-3, store=store).init)(params)
        assert store.initialized and int(state.version) == store.version == 0


@pytest.mark.parametrize("tier", ["memory", "memory-in-place", "file"])
def test_staleness_one_updates_with_params_one_step_old(tmp_path, tier):
    """With staleness=1 the step returns the previous update's params at once and this update streams in the
    background: the gradient of step t is taken at the params of step t - 2 (bounded staleness)."""
    params, loss = mlp_problem()
    path = None if tier.startswith("memory") else tmp_path / "s"
    with nsp.storage.open(path, tier=tier.split("-")[0], page_bytes=PAGE, in_place=tier.endswith("in-place")) as store:
        tx = nsp.optim.adam(1e-2, store=store, staleness=1)
        step = make_step(tx, loss)
        p, s = params, tx.init(params)
        ref = optax.adam(1e-2)
        master, ref_state = params, ref.init(params)
        history = [params, params]  # master params P_{t-2}, P_{t-1}
        for t in range(1, 16):
            p, s, _ = step(p, s)
            # The model now holds P_{t-1}; the store is computing P_t from g_t = grad at P_{t-2}.
            assert max_rel_err(p, history[-1]) <= 1e-5, f"step {t}"
            g = jax.grad(loss)(history[-2])
            u, ref_state = ref.update(g, ref_state, master)
            master = optax.apply_updates(master, u)
            history = [history[-1], master]
        store.barrier()
        assert store.version == 15
        final = store.layout.unflatten(store.read("param"), params)
        assert max_rel_err(final, master) <= 1e-5
        # The time the steps waited for their background updates is counted (it is what staleness did not hide).
        stats = store.stats()
        assert 0 < stats["wait_ns"] and stats["update_ns"] > 0


def test_staleness_is_zero_or_one():
    with nsp.storage.open(tier="memory") as store:
        with pytest.raises(ValueError, match="staleness must be 0 or 1"):
            tx = nsp.optim.adam(1e-2, store=store, staleness=2)
            params, loss = mlp_problem()
            tx.update(jax.grad(loss)(params), tx.init(params), params)


@pytest.mark.parametrize("shards", [4, 1])
def test_non_finite_gradients_skip_the_step_under_jit(tmp_path, shards):
    """Four shards check the gradient before they update; one checks it inside its update's pass."""
    params, loss = mlp_problem()
    with nsp.storage.open(tmp_path / "s", tier="file", num_shards=shards, page_bytes=PAGE) as store:
        if shards > 1:
            mesh = jax.make_mesh((shards,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
            tx = nsp.optim.adam(1e-2, store=store, mesh=mesh, axis_name="d")
        else:
            tx = nsp.optim.adam(1e-2, store=store)
        ref = optax.adam(1e-2)

        @jax.jit
        def step(p, s, poison):
            g = jax.grad(loss)(p)
            g = jax.tree_util.tree_map(lambda x: x.at[(0,) * x.ndim].multiply(poison), g)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        p, s = params, tx.init(params)
        rp, rs = params, ref.init(params)
        for t, poison in enumerate([1.0, np.nan, 1.0, np.inf, 1.0]):
            p, s = step(p, s, poison)
            if np.isfinite(poison):  # the reference simply never sees the poisoned steps
                u, rs = ref.update(jax.grad(loss)(rp), rs, rp)
                rp = optax.apply_updates(rp, u)
            assert max_rel_err(p, rp) <= 1e-6, f"step {t + 1}"
        assert int(s.count) == int(s.version) == store.version == 3
        assert store.stats()["skipped"] == 2


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_bf16_params_come_back_as_the_rounded_fp32_master(tmp_path, tier):
    """bf16 params on the accelerator, fp32 master in the store: every step's params are the master rounded."""
    params32, loss = mlp_problem()
    store = nsp.storage.open(None if tier == "memory" else tmp_path / "s", tier=tier, page_bytes=PAGE)
    with store:
        tx = nsp.optim.adamw(1e-2, store=store)
        state = tx.init(params32)
        params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params32)
        step = make_step(tx, lambda p: loss(jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), p)))
        for _ in range(5):
            before = params
            params, state, _ = step(params, state)
            master = store.layout.unflatten(jnp.asarray(store.read("param")), params32)
            for b, p, m in zip(*(jax.tree_util.tree_leaves(t) for t in (before, params, master))):
                assert p.dtype == jnp.bfloat16
                # Updates come in the params' dtype (optax's rule), so p + u lands on the rounded master exactly
                # wherever the step's difference is exact in bf16 (Sterbenz), and within a bf16 ulp of the step
                # where a step outgrows its param. Each step re-targets the master: the gap never grows.
                b, got, want = (np.asarray(x, np.float32) for x in (b, p, m.astype(jnp.bfloat16)))
                exact = np.abs(want - b) <= np.minimum(np.abs(b), np.abs(want))
                np.testing.assert_array_equal(got[exact], want[exact])
                assert np.all(np.abs(got - want) <= np.abs(want - b) * 2.0 ** -7)
        assert int(state.version) == store.version == 5
