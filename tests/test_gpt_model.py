"""Tests of the Flax NNX GPT in nsp.models (tiny sizes; fast on a CPU).

Most of the time here is XLA compilation, so the tests share shapes: the tiny model is always called on [2, 64]
tokens (one compiled forward), and model calls go through jit (eager NNX calls compile every primitive apart).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nsp.models import (
    CONFIGS,
    GPT,
    GPTConfig,
    abstract_gpt,
    count_params,
    cross_entropy_loss,
    generate,
    get_config,
)

B, T, V = 2, 64, 256  # tiny: byte vocab, block_size 64

_forward = nnx.jit(lambda model, tokens: model(tokens))
_forward_train = nnx.jit(lambda model, tokens, key: model(tokens, deterministic=False, rngs=key))
_loss = jax.jit(cross_entropy_loss)


@pytest.fixture(scope="module")
def tiny():
    return GPT(get_config("tiny"), rngs=nnx.Rngs(0))


def _tokens(shape=(B, T), seed=0, vocab=V):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


def _all_eqns(jaxpr):
    """Equations of a jaxpr and of the jaxprs nested in its equations (jit, custom_jvp, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _all_eqns(sub)


# ---------------------------------------------------------------------------------------------------------------
# forward pass


def test_forward_shape_and_dtype(tiny):
    logits = _forward(tiny, _tokens())
    assert logits.shape == (B, T, V)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    # a fresh model predicts nearly uniformly: loss close to ln(V)
    assert float(_loss(logits, _tokens(seed=1))) == pytest.approx(np.log(V), rel=0.05)


def test_attention_is_causal(tiny):
    tokens = _tokens()
    t = 37
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % V)
    a, b = _forward(tiny, tokens), _forward(tiny, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :t]), np.asarray(b[:, :t]))
    # the change is visible at t and at every later position, or the check above proves nothing
    assert float(jnp.abs(a[:, t:] - b[:, t:]).max(axis=-1).min()) > 1e-6


def test_gpt2_init_scales(tiny):
    std = lambda v: float(jnp.std(v[...]))
    assert std(tiny.wte.embedding) == pytest.approx(0.02, rel=0.05)
    assert std(tiny.h[0].mlp.c_fc.kernel) == pytest.approx(0.02, rel=0.05)
    # the projections into the residual stream: 0.02 / sqrt(2 * n_layer) = 0.01 for tiny's 2 layers
    assert std(tiny.h[0].mlp.c_proj.kernel) == pytest.approx(0.01, rel=0.05)
    assert std(tiny.h[1].attn.c_proj.kernel) == pytest.approx(0.01, rel=0.05)
    assert float(jnp.abs(tiny.h[0].attn.c_attn.bias[...]).max()) == 0.0
    assert float(jnp.abs(tiny.ln_f.scale[...] - 1).max()) == 0.0


def test_bf16_compute_close_to_fp32(tiny):
    bf16 = GPT(get_config("tiny", dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
    # same parameters as the fp32 model, stored in fp32
    for a, b in zip(jax.tree.leaves(nnx.state(tiny)), jax.tree.leaves(nnx.state(bf16))):
        assert b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = _tokens()
    # the matmuls really run in bf16: 6 per block (qkv, scores, probs @ v, proj, fc, proj) + the output projection
    jaxpr = jax.make_jaxpr(lambda t: bf16(t))(tokens)
    dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 2 * 6 + 1
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    la, lb = _forward(tiny, tokens), _forward(bf16, tokens)
    assert lb.dtype == jnp.float32
    rel = float(jnp.abs(la - lb).max() / jnp.abs(la).max())
    assert 0 < rel < 0.02, rel
    assert float(_loss(lb, tokens)) == pytest.approx(float(_loss(la, tokens)), rel=1e-3)


def _loss_and_grads(model, param_dtype, tokens):
    """Loss and parameter gradients (float32 copies) of a model whose params are cast to param_dtype."""
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(lambda x: x.astype(param_dtype), params)

    def loss(p):
        return cross_entropy_loss(nnx.merge(graphdef, p)(tokens[:, :-1]), tokens[:, 1:])

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), jax.tree.map(lambda g: np.asarray(g, np.float32), grads)


def _worst_rel_err(grads, ref):
    """Largest per-leaf ||grads - ref|| / ||ref|| over two gradient trees of one structure."""
    errs = jax.tree.map(lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b), grads, ref)
    return max(jax.tree.leaves(errs))


@pytest.mark.parametrize(
    "dtype, param_dtype, rtol",
    [
        (jnp.float32, jnp.float32, 1e-5),  # fp32 compute: the same dots (measured: bit-identical)
        (jnp.bfloat16, jnp.float32, 1e-2),  # bf16 compute, fp32 params (optax): measured worst leaf 3e-3
        (jnp.bfloat16, jnp.bfloat16, 1e-2),  # bf16 compute, bf16 params (nsp): measured bit-identical
    ],
)
def test_f32_accum_same_loss_and_gradients(dtype, param_dtype, rtol):
    cfg = get_config("tiny", dtype=dtype)
    base = GPT(cfg, rngs=nnx.Rngs(0))
    accum = GPT(dataclasses.replace(cfg, f32_accum=True), rngs=nnx.Rngs(0))
    # the option changes no parameter (same tree, same init)
    for a, b in zip(jax.tree.leaves(nnx.state(base)), jax.tree.leaves(nnx.state(accum)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = _tokens((B, T + 1), seed=7)
    loss_base, grads_base = _loss_and_grads(base, param_dtype, tokens)
    loss_accum, grads_accum = _loss_and_grads(accum, param_dtype, tokens)
    assert loss_accum == pytest.approx(loss_base, rel=1e-5)
    assert _worst_rel_err(grads_accum, grads_base) <= rtol
    # The check can fail: a transposed weight gradient (the classic hand-written backward bug; attn.c_proj's
    # kernel is square) or one leaf off by 2 * rtol is caught.
    transposed = jax.tree.map(lambda g: g, grads_accum)
    transposed["h"][0]["attn"]["c_proj"]["kernel"] = transposed["h"][0]["attn"]["c_proj"]["kernel"].T
    assert _worst_rel_err(transposed, grads_base) > 0.5
    scaled = jax.tree.map(lambda g: g, grads_accum)
    scaled["h"][1]["mlp"]["c_fc"]["kernel"] = scaled["h"][1]["mlp"]["c_fc"]["kernel"] * (1 + 2 * rtol)
    assert _worst_rel_err(scaled, grads_base) > rtol


def test_f32_accum_runs_bf16_dots_and_needs_fewer_temporaries():
    cfg = get_config("tiny", n_embd=256, n_head=4, block_size=16, dtype=jnp.bfloat16)
    # every Linear matmul is a bf16 x bf16 -> float32 dot (4 per block); the attention dots are left as they are
    model = GPT(dataclasses.replace(cfg, f32_accum=True), rngs=nnx.Rngs(0))
    jaxpr = jax.make_jaxpr(lambda t: model(t))(_tokens((1, 16)))
    dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    accum = [e for e in dots if e.params["preferred_element_type"] == jnp.float32
             and all(v.aval.dtype == jnp.bfloat16 for v in e.invars) and e.invars[1].aval.ndim == 2]
    assert len(dots) == 2 * 6 + 1 and len(accum) == 2 * 4 + 1  # + the tied output projection (already so)
    if jax.default_backend() != "cpu":
        return
    # The reason for the option: with bf16 params, XLA:CPU's step keeps no float32 copies of the weights. Measured
    # here: 4.8 bytes per parameter of temporaries without the option, 2.0 with it (the bf16 gradient).
    temps = {}
    for f32_accum in (False, True):
        graphdef, params = nnx.split(abstract_gpt(dataclasses.replace(cfg, f32_accum=f32_accum)), nnx.Param)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)

        def step(p, tokens):
            g = jax.grad(lambda p: cross_entropy_loss(nnx.merge(graphdef, p)(tokens[:, :-1]), tokens[:, 1:]))(p)
            return jax.tree.map(lambda a, b: a - b, p, g)

        compiled = jax.jit(step, donate_argnums=0).lower(params, jax.ShapeDtypeStruct((1, 17), jnp.int32)).compile()
        temps[f32_accum] = compiled.memory_analysis().temp_size_in_bytes
    n = cfg.num_params()
    assert temps[False] - temps[True] > 1.5 * n, (temps[False] / n, temps[True] / n)


def _rbg(seed):
    return jax.random.key(seed, impl="rbg")


def test_dropout():
    # XLA:CPU takes seconds to compile threefry dropout masks fused into attention; "rbg" keys compile fast.
    m = GPT(get_config("tiny", dropout=0.2, n_layer=1), rngs=nnx.Rngs(_rbg(0)))
    tokens = _tokens()
    np.testing.assert_array_equal(np.asarray(_forward(m, tokens)), np.asarray(_forward(m, tokens)))  # eval mode
    k1, k2 = _rbg(1), _rbg(2)
    a, b = _forward_train(m, tokens, k1), _forward_train(m, tokens, k2)
    assert float(jnp.abs(a - b).max()) > 1e-3
    np.testing.assert_array_equal(np.asarray(a), np.asarray(_forward_train(m, tokens, k1)))  # same key, same mask
    # without a key the model's own streams are used, and they advance from call to call
    train = nnx.jit(lambda model, t: model(t, deterministic=False))
    assert float(jnp.abs(train(m, tokens) - train(m, tokens)).max()) > 1e-3
    # without dropout the model state is exactly its parameters (no RNG state to carry in a pure step)
    plain = abstract_gpt(get_config("tiny"))
    assert len(jax.tree.leaves(nnx.state(plain))) == len(jax.tree.leaves(nnx.state(plain, nnx.Param)))
    assert len(jax.tree.leaves(nnx.state(m))) > len(jax.tree.leaves(nnx.state(m, nnx.Param)))


# ---------------------------------------------------------------------------------------------------------------
# parameter counts and configs


def test_gpt2_124m_param_count_abstract():
    cfg = get_config("gpt2-124m")
    model = abstract_gpt(cfg)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing was allocated
    assert count_params(model) == 124_439_808
    assert cfg.num_params() == 124_439_808
    assert cfg.num_params(non_embedding=True) == 124_439_808 - (50257 + 1024) * 768


@pytest.mark.parametrize("bias", [True, False])
def test_num_params_matches_built_model(tiny, bias):
    cfg = get_config("tiny", bias=bias, vocab_size=100, block_size=40, n_layer=3, n_head=4)
    assert count_params(abstract_gpt(cfg)) == cfg.num_params()
    assert count_params(tiny) == tiny.config.num_params() == 120_576  # a concrete model


def test_config_registry_sizes():
    expected = {"tiny", "small", "gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b"}
    expected |= {f"gpt3-{s}" for s in ("125m", "350m", "760m", "1.3b", "2.7b", "6.7b", "13b", "175b")}
    assert expected <= set(CONFIGS)
    for name, cfg in CONFIGS.items():
        m = re.fullmatch(r"gpt[23]-([\d.]+)([mb])", name)
        if m is None:
            continue
        nominal = float(m.group(1)) * (1e6 if m.group(2) == "m" else 1e9)
        assert cfg.num_params() == pytest.approx(nominal, rel=0.04), name  # gpt2-1.5b: 1.558B
        assert cfg.vocab_size == 50257
        assert cfg.block_size == (1024 if name.startswith("gpt2") else 2048)
        assert cfg.head_dim * cfg.n_head == cfg.n_embd
    assert (CONFIGS["gpt3-175b"].n_layer, CONFIGS["gpt3-175b"].n_embd) == (96, 12288)
    assert 1e6 < CONFIGS["small"].num_params() < 1e7 and CONFIGS["small"].vocab_size == 256
    assert CONFIGS["tiny"].num_params() < 1e6


def test_get_config_overrides_and_dtype_names():
    cfg = get_config("gpt2-124m", vocab_size=256, dtype="bfloat16")
    assert cfg.vocab_size == 256 and cfg.dtype == jnp.bfloat16 and cfg.param_dtype == jnp.float32
    assert CONFIGS["gpt2-124m"].vocab_size == 50257  # the registry is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layer = 3  # type: ignore[misc]
    assert hash(cfg) == hash(get_config("gpt2-124m", vocab_size=256, dtype=jnp.bfloat16))


# ---------------------------------------------------------------------------------------------------------------
# errors


def test_sequence_longer_than_block_size_raises(tiny):
    with pytest.raises(ValueError, match=r"sequence length 65 exceeds block_size 64"):
        tiny(_tokens((1, 65)))


def test_bad_token_arrays_raise(tiny):
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        tiny(_tokens((8,)))
    with pytest.raises(ValueError, match="integers"):
        tiny(jnp.zeros((1, 4), jnp.float32))


def test_unknown_config_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown GPT config 'gpt4'.*tiny.*gpt2-124m.*gpt3-175b"):
        get_config("gpt4")
    with pytest.raises(ValueError, match=r"unknown GPTConfig field.*n_layers"):
        get_config("tiny", n_layers=3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_embd=100, n_head=3), r"n_embd \(100\) must be divisible by n_head \(3\)"),
        (dict(n_layer=0), r"n_layer must be a positive integer"),
        (dict(vocab_size=-5), r"vocab_size must be a positive integer"),
        (dict(block_size=2.5), r"block_size must be a positive integer"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(dtype=jnp.int32), r"dtype must be a floating dtype"),
        (dict(f32_accum="yes"), r"f32_accum must be a bool"),
    ],
)
def test_invalid_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
        get_config("tiny", **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# loss and training


def test_cross_entropy_loss():
    logits = jnp.log(jnp.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    expected = -(np.log(0.5) + np.log(0.8)) / 2
    assert float(_loss(logits, jnp.array([0, 1]))) == pytest.approx(expected, rel=1e-6)
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
    targets = _tokens((2, 5), vocab=7)
    ref = jax.jit(optax.softmax_cross_entropy_with_integer_labels)(logits, targets).mean()
    assert float(_loss(logits, targets)) == pytest.approx(float(ref), rel=1e-6)
    with pytest.raises(ValueError, match="does not match"):
        cross_entropy_loss(logits, targets[:, :4])


def test_adamw_steps_reduce_loss_and_train_tied_output_projection():
    model = GPT(get_config("tiny"), rngs=nnx.Rngs(0))
    names = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert "wte/embedding" in names and not any("head" in n for n in names)  # no separate output matrix

    tx = optax.adamw(3e-3, weight_decay=0.1)
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = tx.init(params)
    data = _tokens((B, T + 1), seed=3, vocab=128)  # ids >= 128 never occur in the input
    x, y = data[:, :-1], data[:, 1:]

    @jax.jit
    def step(params, opt_state, x, y):
        def loss(p):
            return cross_entropy_loss(nnx.merge(graphdef, p)(x, deterministic=False), y)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    wte0 = params["wte"]["embedding"][...]
    losses = []
    for _ in range(20):
        params, opt_state, value = step(params, opt_state, x, y)
        losses.append(float(value))
    assert losses[0] == pytest.approx(np.log(V), rel=0.05)
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses
    # The embedding row of a token absent from the input moved by ~lr per step (weight decay alone would move it
    # by ~1e-6 per step): its only gradient comes through the tied output projection.
    assert float(jnp.abs(params["wte"]["embedding"][...][200] - wte0[200]).max()) > 1e-2
    # the trained parameters go back into the module
    nnx.update(model, params)
    assert float(_loss(_forward(model, x), y)) == pytest.approx(losses[-1], abs=0.5)


# ---------------------------------------------------------------------------------------------------------------
# generation


def test_generate_greedy_matches_model_past_block_size(tiny):
    # 60-token prompts + 8 new tokens cross block_size (64): the context is cropped to the last 64 tokens.
    prompt = _tokens((B, 60), seed=5)
    out = generate(tiny, prompt, 8, temperature=0.0, rng=0)
    assert out.shape == (B, 68) and out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out[:, :60]), np.asarray(prompt))
    first = _forward(tiny, out[:, :64])  # causal: position i - 1 of the first 64 tokens predicts token i <= 64
    for i in range(60, 68):
        logits = first[:, i - 1] if i <= 64 else _forward(tiny, out[:, i - 64 : i])[:, -1]
        np.testing.assert_array_equal(np.asarray(out[:, i]), np.asarray(jnp.argmax(logits, -1)), err_msg=str(i))
    # top_k=1 is greedy whatever the temperature
    np.testing.assert_array_equal(np.asarray(generate(tiny, prompt, 8, top_k=1, temperature=1.5, rng=3)), out)


def test_generate_sampling_is_deterministic_per_rng(tiny):
    prompt = _tokens((B, 5), seed=4)
    out = generate(tiny, prompt, 12, rng=jax.random.key(0))
    assert out.shape == (B, 17) and out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out[:, :5]), np.asarray(prompt))
    assert bool(jnp.all((out >= 0) & (out < V)))
    np.testing.assert_array_equal(np.asarray(generate(tiny, prompt, 12, rng=jax.random.key(0))), np.asarray(out))
    assert not np.array_equal(np.asarray(generate(tiny, prompt, 12, rng=jax.random.key(1))), np.asarray(out))
    # a lower temperature is traced, not compiled in: same shapes, different draw
    assert generate(tiny, prompt, 12, rng=jax.random.key(0), temperature=0.5).shape == (B, 17)
    # 1-D prompts give 1-D results; zero new tokens returns the prompt
    assert generate(tiny, prompt[0], 0, rng=0).shape == (5,)
    np.testing.assert_array_equal(np.asarray(generate(tiny, prompt, 0, rng=0)), np.asarray(prompt))


def test_generate_bad_arguments(tiny):
    with pytest.raises(ValueError, match="top_k"):
        generate(tiny, jnp.array([1, 2]), 3, top_k=0, rng=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(tiny, jnp.array([1, 2]), 3, temperature=-1.0, rng=0)
    with pytest.raises(ValueError, match="T0 >= 1"):
        generate(tiny, jnp.zeros((1, 0), jnp.int32), 3, rng=0)
    with pytest.raises(ValueError, match="integers"):
        generate(tiny, jnp.array([1.0, 2.0]), 3, rng=0)
