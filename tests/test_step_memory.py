"""The step is lean by construction: its compiled temporaries stay within the forward/backward's own, the gradient
it consumes and 0.3 bytes per parameter (XLA's memory analysis of the compiled step; nothing runs).

Every way a user builds the step is checked: ``nsp train``'s step builder, a plain ``jax.jit`` loop of the user's
own, and ``nnx.Optimizer``; for the memory and file tiers, bf16 and fp32 params, staleness 0 and 1. These guard
against what once slipped through every other test: optax-compatibility machinery (the params fingerprint) that
cost 4-8 bytes per parameter of temporaries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import nsp.optim
import nsp.storage
from nsp.models import GPT
from nsp.models.gpt import GPTConfig
from nsp.train.trainer import loss_fn, make_train_step

#: What the step may hold beyond the forward/backward's temporaries and the gradient (bytes per parameter).
SLACK_PER_PARAM = 0.3

CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=256, dtype=jnp.bfloat16,
                   f32_accum=True)
TOKENS = jnp.zeros((1, CONFIG.block_size + 1), jnp.int32)


@functools.lru_cache(maxsize=None)
def _model(dtype):
    graphdef, params = nnx.split(GPT(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)
    return graphdef, jax.tree_util.tree_map(lambda x: x.astype(dtype), params)


def _n_params(params) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


def _temp(compiled) -> int:
    return compiled.memory_analysis().temp_size_in_bytes


@functools.lru_cache(maxsize=None)
def _bound(dtype) -> tuple[float, int]:
    """(allowed temporaries in bytes, parameter count) for params of ``dtype``."""
    graphdef, params = _model(dtype)
    fwd_bwd = jax.jit(jax.value_and_grad(functools.partial(loss_fn, graphdef))).lower(params, TOKENS).compile()
    n = _n_params(params)
    grad_bytes = n * jnp.dtype(dtype).itemsize
    return _temp(fwd_bwd) + grad_bytes + SLACK_PER_PARAM * n, n


def _store(tier, tmp_path):
    return nsp.storage.open(str(tmp_path / "store") if tier == "file" else None, tier=tier, num_shards=1)


def _check(compiled, dtype, what):
    bound, n = _bound(dtype)
    temp = _temp(compiled)
    assert temp <= bound, (f"{what}: the compiled step holds {temp / n:.2f} bytes per parameter of temporaries, "
                           f"more than forward/backward + gradient + {SLACK_PER_PARAM} ({bound / n:.2f})")


def _optimizer(store, staleness, topk, float32_updates=False):
    kw = {"compression": nsp.optim.TopK(0.01)} if topk else {}
    return nsp.optim.adamw(1e-3, store=store, staleness=staleness, float32_updates=float32_updates, **kw)


@pytest.mark.parametrize("tier", ["memory", "file"])
@pytest.mark.parametrize("staleness,topk,float32_updates", [
    (0, False, False), (1, False, False), (0, True, False), (1, True, False),
    (0, False, True), (0, True, True),  # float32_updates: nsp train --bf16-params's optimizer
], ids=["dense-s0", "dense-s1", "topk-s0", "topk-s1", "dense-s0-f32updates", "topk-s0-f32updates"])
def test_train_step_bf16_params(tier, staleness, topk, float32_updates, tmp_path):
    graphdef, params = _model(jnp.float32)
    store = _store(tier, tmp_path)
    try:
        tx = _optimizer(store, staleness, topk, float32_updates)
        state = tx.init(params)
        _, bf16 = _model(jnp.bfloat16)
        compiled = make_train_step(graphdef, tx)[0].lower(bf16, state, TOKENS).compile()
        _check(compiled, jnp.bfloat16, f"nsp train's step, {tier} tier, staleness {staleness}, bf16 params")
    finally:
        store.close()


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_train_step_fp32_params(tier, tmp_path):
    graphdef, params = _model(jnp.float32)
    store = _store(tier, tmp_path)
    try:
        tx = _optimizer(store, 0, False)
        state = tx.init(params)
        compiled = make_train_step(graphdef, tx)[0].lower(params, state, TOKENS).compile()
        _check(compiled, jnp.float32, f"nsp train's step, {tier} tier, fp32 params")
    finally:
        store.close()


@pytest.mark.parametrize("float32_updates", [False, True])
def test_users_own_loop(float32_updates, tmp_path):
    """A loop written the optax way, with a chain in front (clipping) and bf16 params after init."""
    graphdef, params = _model(jnp.float32)
    store = _store("memory", tmp_path)
    try:
        tx = optax.chain(optax.clip_by_global_norm(1.0),
                         nsp.optim.adamw(1e-3, store=store, float32_updates=float32_updates))
        state = tx.init(params)
        _, bf16 = _model(jnp.bfloat16)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, state, tokens):
            loss, grads = jax.value_and_grad(functools.partial(loss_fn, graphdef))(params, tokens)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        _check(step.lower(bf16, state, TOKENS).compile(), jnp.bfloat16,
               f"a user's jitted loop (float32_updates={float32_updates})")
    finally:
        store.close()


def test_nnx_optimizer(tmp_path):
    """``nnx.Optimizer`` over a bf16 model, its step under ``nnx.jit``."""
    store = _store("memory", tmp_path)
    try:
        model = GPT(CONFIG, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, nsp.optim.adamw(1e-3, store=store), wrt=nnx.Param)
        for path, var in nnx.iter_graph(model):
            if isinstance(var, nnx.Param):
                var.set_value(var.get_value().astype(jnp.bfloat16))

        @nnx.jit(donate_argnums=(0, 1))
        def step(model, optimizer, tokens):
            def loss(model):
                logits = model(tokens[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits.astype(jnp.float32), tokens[:, 1:]).mean()

            value, grads = nnx.value_and_grad(loss)(model)
            optimizer.update(model, grads)
            return value

        compiled = step.lower(model, optimizer, TOKENS).compile()
        _check(compiled, jnp.bfloat16, "nnx.Optimizer's step")
    finally:
        store.close()
