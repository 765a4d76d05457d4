"""nsp.optim.init_from: the store written from per-leaf init functions, never the whole model in fp32."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nsp.optim
import nsp.storage
from nsp.models import get_config
from nsp.train.layerwise import LayerwiseInit

SHAPES = {"b": (64,), "w": (64, 96), "z": (3, 5)}


def _values(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in sorted(SHAPES.items())}


def _abstract():
    return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}


def _open(tier, tmp_path, name):
    return nsp.storage.open(None if tier == "memory" else tmp_path / name, tier=tier, page_bytes=4096)


def _train(tx, params, state, steps=3):
    for step in range(steps):
        grads = jax.tree.map(lambda p: jnp.sin(p.astype(jnp.float32) * (step + 1)).astype(p.dtype), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_init_from_equals_init_on_the_whole_model_then_cast(tier, tmp_path):
    values = _values()
    order = sorted(values)
    asked = []

    def produce(i):
        asked.append(i)
        return values[order[i]].copy()

    def chain(store):
        return optax.chain(optax.clip_by_global_norm(1.0), nsp.optim.adamw(1e-2, store=store))

    store = _open(tier, tmp_path, "a")
    tx = chain(store)
    params, state = nsp.optim.init_from(tx, _abstract(), produce, dtype=jnp.bfloat16)
    assert asked == [0, 1, 2]
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))

    ref_store = _open(tier, tmp_path, "b")
    ref_tx = chain(ref_store)
    ref = {k: jnp.asarray(v) for k, v in values.items()}
    ref_state = ref_tx.init(ref)
    ref = jax.tree.map(lambda x: x.astype(jnp.bfloat16), ref)
    for k in ref:
        np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(ref[k]))

    params, state = _train(tx, params, state)
    ref, ref_state = _train(ref_tx, ref, ref_state)
    for k in ref:  # the same fp32 master underneath: the same bits after every step
        np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(ref[k]))
    assert store.stats()["params_adopted"] == 0  # the bf16 copy is the master's rounding, not a change
    store.close()
    ref_store.close()


def test_init_from_lets_go_of_each_fp32_leaf_once_its_pages_are_written(tmp_path, monkeypatch):
    # Pages are gathered a chunk at a time; a chunk of one page makes "the model" many chunks long.
    monkeypatch.setattr(nsp.storage.creation, "_INIT_CHUNK_BYTES", 4096)
    values = _values()
    order = sorted(values)
    alive: list[weakref.ref] = []
    held_at_call = []

    def produce(i):
        gc.collect()
        held_at_call.append(sum(ref() is not None for ref in alive))
        leaf = values[order[i]].copy()
        alive.append(weakref.ref(leaf))
        return leaf

    store = _open("file", tmp_path, "s")
    params, _ = nsp.optim.init_from(nsp.optim.adam(1e-3, store=store), _abstract(), produce, dtype=jnp.bfloat16)
    gc.collect()
    # At most the one earlier leaf whose last chunk is being gathered is alive when the next is asked for.
    assert held_at_call == [0, 1, 1]
    assert all(ref() is None for ref in alive)  # nor any after: the step holds only the bf16 copy
    store.close()


def test_init_from_on_a_partition_writes_each_store_from_its_own_leaves(tmp_path):
    values = _values()
    order = sorted(values)
    stores = {"big": _open("file", tmp_path, "big"), "small": _open("memory", tmp_path, "small")}
    labels = {"b": "small", "w": "big", "z": "small"}
    tx = optax.partition({name: nsp.optim.adam(1e-2, store=s) for name, s in stores.items()}, labels)
    params, state = nsp.optim.init_from(tx, _abstract(), lambda i: values[order[i]], dtype=jnp.float32)
    assert [leaf.shape for leaf in stores["big"].layout.leaves] == [(64, 96)]
    assert [leaf.shape for leaf in stores["small"].layout.leaves] == [(64,), (3, 5)]

    ref_stores = {"big": _open("file", tmp_path, "rbig"), "small": _open("memory", tmp_path, "rsmall")}
    ref_tx = optax.partition({name: nsp.optim.adam(1e-2, store=s) for name, s in ref_stores.items()}, labels)
    ref = {k: jnp.asarray(v) for k, v in values.items()}
    ref_state = ref_tx.init(ref)
    params, state = _train(tx, params, state)
    ref, ref_state = _train(ref_tx, ref, ref_state)
    for k in ref:
        np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(ref[k]))
    for s in [*stores.values(), *ref_stores.values()]:
        s.close()


def test_init_from_a_second_time_starts_afresh_like_init(tmp_path):
    values = _values()
    order = sorted(values)
    store = _open("file", tmp_path, "s")
    tx = nsp.optim.adamw(1e-2, store=store)
    params, state = nsp.optim.init_from(tx, _abstract(), lambda i: values[order[i]])
    params, state = _train(tx, params, state)
    params, state = nsp.optim.init_from(tx, _abstract(), lambda i: values[order[i]])
    assert int(state.count) == 0
    for k in values:
        np.testing.assert_array_equal(np.asarray(params[k]), values[k])
    params, state = _train(tx, params, state, steps=1)
    assert int(state.count) == 1
    store.close()


def test_init_from_the_gpt_parts_gives_the_whole_models_params(tmp_path):
    config = get_config("tiny")
    parts = LayerwiseInit(config, seed=3)
    store = _open("memory", tmp_path, "s")
    params, _ = nsp.optim.init_from(nsp.optim.adamw(1e-3, store=store), parts.abstract, parts, dtype=jnp.bfloat16)
    parts.close()
    whole = LayerwiseInit(config, seed=3)
    for i, leaf in enumerate(jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(jnp.asarray(whole(i)).astype(jnp.bfloat16)))
    whole.close()
    store.close()


def test_init_from_says_what_is_wrong(tmp_path):
    store = _open("memory", tmp_path, "s")
    tx = nsp.optim.adam(1e-3, store=store)
    with pytest.raises(ValueError, match=r"produce\(0\) gave shape \(2,\), the params' leaf 0 has \(64,\)"):
        nsp.optim.init_from(tx, _abstract(), lambda i: np.zeros(2, np.float32))
    assert not store.initialized  # nothing committed
    with nsp.optim.resuming(), pytest.raises(ValueError, match="init_from starts a fresh state"):
        nsp.optim.init_from(tx, _abstract(), lambda i: np.zeros(1, np.float32))
    # A wrapper whose init hands the store arrays computed from the params, not the params' leaves.
    doubled = optax.GradientTransformation(lambda p: tx.init(jax.tree.map(lambda x: x * 2, p)), tx.update)
    with pytest.raises(ValueError, match="not the params' leaves themselves"):
        nsp.optim.init_from(doubled, _abstract(), lambda i: None)
    store.close()
