"""store_update: the store's update as a side-effecting FFI call inside jit and shard_map."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import nsp.storage as storage
from nsp.primitives import fused_update, store_update

PAGE = 16 * 1024


@pytest.fixture
def mesh4():
    if len(jax.devices()) < 4:
        pytest.fail("these tests need 4 CPU devices (tests/conftest.py sets XLA_FLAGS before JAX starts)")
    return jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


def params_tree():
    rng = np.random.default_rng(0)
    return {"a": jnp.asarray(rng.standard_normal((301, 33)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(77), jnp.float32)}


def grad_at(step, layout):
    g = np.random.default_rng(step).standard_normal(layout.padded_total).astype(np.float32)
    g[layout.total:] = 0
    return g


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_sharded_steps_equal_in_ram_steps_without_gathering(tmp_path, mesh4, tier):
    params = params_tree()
    store = storage.open(None if tier == "memory" else tmp_path / "s", tier=tier, num_shards=4, page_bytes=PAGE)
    with store:
        store.initialize(params, storage.OptimizerSpec("adamw", weight_decay=0.05))
        layout = store.layout
        sharding = NamedSharding(mesh4, P("d"))

        @jax.jit
        def step(g, version, t, lr):
            return store_update(store, g, version=version, lr=lr, step=t, mesh=mesh4, axis_name="d")

        p = layout.flatten(params)
        m = v = jnp.zeros(layout.padded_total)
        version = 0
        for t in range(1, 5):
            g = grad_at(t, layout)
            out = step(jax.device_put(g, sharding), version, t, 0.01 / t)
            p, m, v, _ = fused_update(p, jnp.asarray(g), m, v, kind="adamw", step=t, lr=0.01 / t, weight_decay=0.05)
            np.testing.assert_array_equal(np.asarray(out.params), np.asarray(p))
            assert out.params.sharding.spec == P("d")
            version = int(out.version)
            assert version == t == store.version
        assert step._cache_size() == 1  # lr, step and version are traced
        hlo = step.lower(jax.device_put(grad_at(1, layout), sharding), version, 5, 0.1).compile().as_text()
        assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_one_device_matches_four(tmp_path, mesh4):
    params = params_tree()
    results = []
    for shards in (1, 4):
        with storage.open(tmp_path / f"s{shards}", tier="file", num_shards=shards, page_bytes=PAGE) as store:
            store.initialize(params, storage.OptimizerSpec("adam"))
            layout = store.layout
            kw = dict(mesh=mesh4, axis_name="d") if shards == 4 else {}
            g = grad_at(1, layout)[: layout.padded_total]
            g[layout.total:] = 0
            out = jax.jit(lambda g, store=store, kw=kw: store_update(store, g, version=0, lr=0.01, step=1, **kw))(g)
            results.append(np.asarray(out.params)[: layout.total])
    np.testing.assert_array_equal(results[0], results[1])


def test_compressed_shards(tmp_path, mesh4):
    params = params_tree()
    with storage.open(tmp_path / "s", tier="file", num_shards=4, page_bytes=PAGE) as store:
        store.initialize(params, storage.OptimizerSpec("adam"))
        layout = store.layout
        rng = np.random.default_rng(3)
        k = 50
        idx = np.concatenate([np.sort(rng.choice(layout.shard_size, k, replace=False)) for _ in range(4)])
        vals = rng.standard_normal(4 * k).astype(np.float32)
        dense = np.zeros(layout.padded_total, np.float32)
        for s in range(4):
            dense[s * layout.shard_size + idx[s * k:(s + 1) * k]] = vals[s * k:(s + 1) * k]
        dense[layout.total:] = 0  # (padding positions may be drawn; the store pads with zero params anyway)
        sharding = NamedSharding(mesh4, P("d"))
        out = jax.jit(lambda v, i: store_update(store, values=v, indices=i, version=0, lr=0.01, step=1,
                                                mesh=mesh4, axis_name="d", params_bf16=True))(
            jax.device_put(vals, sharding), jax.device_put(idx.astype(np.int32), sharding))
        z = jnp.zeros(layout.padded_total)
        dense_all = np.zeros(layout.padded_total, np.float32)
        for s in range(4):
            dense_all[s * layout.shard_size + idx[s * k:(s + 1) * k]] = vals[s * k:(s + 1) * k]
        ref = fused_update(layout.flatten(params), jnp.asarray(dense_all), z, z, kind="adam", step=1, lr=0.01)
        np.testing.assert_array_equal(np.asarray(out.params), np.asarray(ref.param))
        np.testing.assert_array_equal(np.asarray(out.params_bf16), np.asarray(ref.param.astype(jnp.bfloat16)))


def test_stale_version_and_closed_store_are_clear_errors(tmp_path):
    params = params_tree()
    store = storage.open(tmp_path / "s", tier="file", num_shards=1, page_bytes=PAGE)
    store.initialize(params, storage.OptimizerSpec("adam"))
    layout = store.layout
    f = jax.jit(lambda g, v: store_update(store, g, version=v, lr=0.01, step=1))
    g = grad_at(1, layout)
    assert int(f(g, 0).version) == 1
    assert int(f(g, 1).version) == 2
    with pytest.raises(Exception, match="no longer holds version 0"):
        jax.block_until_ready(f(g, 0))
    assert store.version == 2
    store.close()
    with pytest.raises(Exception, match="the store was closed"):
        jax.block_until_ready(f(g, 2))


def test_wrong_inputs(tmp_path, mesh4):
    with storage.open(tmp_path / "s", tier="file", num_shards=4, page_bytes=PAGE) as store:
        store.initialize(params_tree(), storage.OptimizerSpec("adam"))
        n = store.layout.padded_total
        with pytest.raises(ValueError, match="padded flat vector"):
            store_update(store, jnp.zeros(n - 1), version=0, lr=0.1, step=1, mesh=mesh4, axis_name="d")
        with pytest.raises(ValueError, match="pass the mesh"):
            store_update(store, jnp.zeros(n), version=0, lr=0.1, step=1)
        with pytest.raises(TypeError, match="float32 or bfloat16"):
            store_update(store, jnp.zeros(n, jnp.int32), version=0, lr=0.1, step=1, mesh=mesh4, axis_name="d")
        mesh2 = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        with pytest.raises(ValueError, match="has 2 devices; the store has 4 shards"):
            store_update(store, jnp.zeros(n), version=0, lr=0.1, step=1, mesh=mesh2, axis_name="d")
        assert store.version == 0
