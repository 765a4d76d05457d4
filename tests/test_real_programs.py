"""Programs written the way optax's and Flax's own examples write them, with ``optax.X(...)`` swapped for
``nsp.optim.X(..., store=...)``: what a user's code passes must mean what it means to optax."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import optax
import pytest

import nsp.optim
import nsp.storage

ALIASES = ["adam", "adamw", "sgd", "adagrad"]


@pytest.mark.parametrize("name", ALIASES)
def test_signature_matches_optax_argument_for_argument(name):
    """optax's parameters come first, in optax's order, with optax's names, kinds and defaults; nsp's own
    (``store``, ``compression``, ...) are keyword-only after them."""
    ours = list(inspect.signature(getattr(nsp.optim, name)).parameters.values())
    theirs = list(inspect.signature(getattr(optax, name)).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == \
        [(p.name, p.kind, p.default) for p in theirs]
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs):])


def _step(tx, params, grads):
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params)
    return optax.apply_updates(params, updates)


def test_adamw_positional_weight_decay_means_what_it_means_to_optax():
    """``adamw(lr, b1, b2, eps, eps_root, mu_dtype, weight_decay)``: the seventh positional argument is the
    weight decay, as in optax (it once was the fifth, where optax has eps_root)."""
    params, grads = {"w": jnp.full((8,), 2.0)}, {"w": jnp.zeros((8,))}
    store = nsp.storage.open(None, tier="memory")
    try:
        got = _step(nsp.optim.adamw(0.1, 0.9, 0.999, 1e-8, 0.0, None, 0.5, store=store), params, grads)
    finally:
        store.close()
    want = _step(optax.adamw(0.1, 0.9, 0.999, 1e-8, 0.0, None, 0.5), params, grads)
    assert float(got["w"][0]) == pytest.approx(float(want["w"][0]), rel=1e-6)
    assert float(got["w"][0]) < 2.0  # the decay acted


@pytest.mark.parametrize("call, match", [
    (lambda s: nsp.optim.adam(1e-3, eps_root=1e-8, store=s), "eps_root"),
    (lambda s: nsp.optim.adam(1e-3, mu_dtype=jnp.bfloat16, store=s), "mu_dtype"),
    (lambda s: nsp.optim.adam(1e-3, nesterov=True, store=s), "nesterov"),
    (lambda s: nsp.optim.adamw(1e-3, mask=lambda p: p, store=s), "mask"),
    (lambda s: nsp.optim.adamw(1e-3, 0.9, 0.999, 1e-8, 1e-6, store=s), "eps_root"),
    (lambda s: nsp.optim.sgd(1e-3, 0.9, False, jnp.bfloat16, store=s), "accumulator_dtype"),
])
def test_arguments_nsp_cannot_honour_fail_naming_them(call, match):
    store = nsp.storage.open(None, tier="memory")
    try:
        with pytest.raises(NotImplementedError, match=match):
            call(store)
    finally:
        store.close()


def test_arguments_at_their_defaults_or_float32_are_accepted():
    store = nsp.storage.open(None, tier="memory")
    try:
        nsp.optim.adam(1e-3, 0.9, 0.999, 1e-8, 0.0, jnp.float32, nesterov=False, store=store)
        nsp.optim.sgd(1e-3, 0.9, True, jnp.float32, store=store)
    finally:
        store.close()


def test_update_without_params_says_why_and_what_to_do():
    """optax's getting-started loop calls ``tx.update(grads, state)``; nsp needs the params and says so."""
    store = nsp.storage.open(None, tier="memory")
    try:
        tx = nsp.optim.adam(1e-3, store=store)
        params = {"w": jnp.ones(3)}
        state = tx.init(params)
        with pytest.raises(ValueError, match=r"tx.update\(grads, state, params\).*fp32 master"):
            tx.update({"w": jnp.ones(3)}, state)
    finally:
        store.close()


def test_partition_sharing_one_store_says_give_each_its_own():
    store = nsp.storage.open(None, tier="memory")
    try:
        tx = optax.partition({"a": nsp.optim.adam(1e-3, store=store), "b": nsp.optim.sgd(1e-2, store=store)},
                             {"x": "a", "y": "b"})
        with pytest.raises(nsp.storage.StoreError, match="its own store"):
            tx.init({"x": jnp.ones(3), "y": jnp.ones(5)})
    finally:
        store.close()
