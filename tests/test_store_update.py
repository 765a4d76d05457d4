"""store_update: the store's update as a side-effecting FFI call inside jit and shard_map."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import nsp.storage as storage
from nsp.primitives import fused_update, store_update, store_update_leaves

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
    with pytest.raises(Exception, match="was closed"):
        jax.block_until_ready(f(g, 2))
    # JAX keeps the failed side-effecting call's runtime token, and raises its error again at every
    # effects_barrier until a later side-effecting computation replaces it (at exit, too): drop it.
    from jax._src import dispatch

    dispatch.runtime_tokens.clear()


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


@pytest.mark.parametrize("tier", ["memory", "file"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_leaves_update_equals_flat_update_and_reuses_the_gradient(tmp_path, tier, dtype):
    """store_update_leaves (gradient as the tree's leaves, params written over them) == the flat store_update."""
    params = params_tree()
    spec = storage.OptimizerSpec("adam")
    stores = [storage.open(None if tier == "memory" else tmp_path / name, tier=tier, num_shards=1, page_bytes=PAGE)
              for name in ("leaves", "flat")]
    for s in stores:
        s.initialize(params, spec)
    leaves_store, flat_store = stores
    layout = leaves_store.layout

    @jax.jit
    def leaves_step(grads, version, t):
        return store_update_leaves(leaves_store, grads, version=version, lr=0.01, step=t)

    @jax.jit
    def flat_step(g, version, t):
        return store_update(flat_store, g, version=version, lr=0.01, step=t, params_bf16=True)

    try:
        for t in range(1, 4):
            g = jnp.asarray(grad_at(t, layout)).astype(dtype)
            grads = [g[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape) for leaf in layout.leaves]
            new, version = leaves_step(grads, t - 1, t)
            ref = flat_step(g, t - 1, t)
            assert int(version) == int(ref.version) == t
            ref_params = ref.params if dtype == jnp.float32 else ref.params_bf16
            for leaf, x in zip(layout.leaves, new):
                assert x.dtype == dtype and x.shape == leaf.shape
                np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)).ravel(),
                                              np.asarray(ref_params[leaf.offset:leaf.offset + leaf.size]
                                                         .astype(jnp.float32)))
        np.testing.assert_array_equal(leaves_store.read("mu"), flat_store.read("mu"))
        np.testing.assert_array_equal(leaves_store.read("param"), flat_store.read("param"))
        assert leaves_store.stats()["shared_in_bytes"] == 3 * layout.padded_total * jnp.dtype(dtype).itemsize

        # A non-finite gradient skips the step: the committed params come back, the version stays. One bad value
        # is enough, wherever it sits: -inf at the very end of the last leaf, NaN inside the first.
        g = jnp.asarray(grad_at(4, layout)).astype(dtype)
        good = [g[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape) for leaf in layout.leaves]
        for which, at, value in ((-1, -1, -jnp.inf), (0, good[0].size // 2, jnp.nan)):
            bad = list(good)
            bad[which] = bad[which].ravel().at[at].set(value).reshape(bad[which].shape)
            new, version = leaves_step(bad, 3, 4)
            assert int(version) == 3 == leaves_store.version
            committed = leaves_store.read("param")
            for leaf, x in zip(layout.leaves, new):
                np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)).ravel(),
                                              np.asarray(jnp.asarray(committed[leaf.offset:leaf.offset + leaf.size])
                                                         .astype(dtype).astype(jnp.float32)))
    finally:
        for s in stores:
            s.close()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_two_slot_memory_store_checks_finiteness_inside_the_update_pass(where):
    """On a two-slot memory store the leaves update checks the gradient inside its own pass (no pass over it
    first): a NaN or Inf met after part of the state was already written to the other slot still skips the step.
    The committed state stays bit-identical, the outputs get its params back, the next good step equals a store
    that never saw the bad one, and the version before the committed one is gone (its slot was partly written)."""
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.standard_normal((700, 500)), jnp.float32),  # several threads' blocks
              "b": jnp.asarray(rng.standard_normal(77), jnp.float32)}
    stores = [storage.open(None, tier="memory", num_shards=1, page_bytes=PAGE) for _ in range(2)]
    for st in stores:
        st.initialize(params, storage.OptimizerSpec("adamw", weight_decay=0.01))
    store, clean = stores
    layout = store.layout

    def leaves_of(g):
        return [jnp.asarray(g[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape)) for leaf in layout.leaves]

    def step_fn(st):
        return jax.jit(lambda grads, version, t: store_update_leaves(st, grads, version=version, lr=0.01, step=t))

    step, clean_step = step_fn(store), step_fn(clean)
    try:
        for t in (1, 2):
            step(leaves_of(grad_at(t, layout)), t - 1, t)
            clean_step(leaves_of(grad_at(t, layout)), t - 1, t)
        before = {s: store.read(s) for s in ("param", "mu", "nu")}
        bad = grad_at(3, layout)
        at = {"first": 0, "middle": layout.leaves[0].size * 3 // 4, "last": layout.total - 1}[where]
        bad[at] = {"first": np.nan, "middle": np.inf, "last": -np.inf}[where]  # the kernel tests each kind
        new, version = step(leaves_of(bad), 2, 3)
        assert int(version) == 2 == store.version
        assert store.stats()["skipped"] == 1 and store.stats()["updates"] == 2
        for s in ("param", "mu", "nu"):
            np.testing.assert_array_equal(store.read(s), before[s])
        for leaf, x in zip(layout.leaves, new):
            np.testing.assert_array_equal(np.asarray(x).ravel(), before["param"][leaf.offset:leaf.offset + leaf.size])
        with pytest.raises(Exception, match="no longer holds version 1"):
            jax.block_until_ready(step(leaves_of(grad_at(2, layout)), 1, 2))
        new, version = step(leaves_of(grad_at(3, layout)), 2, 3)
        clean_new, _ = clean_step(leaves_of(grad_at(3, layout)), 2, 3)
        assert int(version) == 3 == store.version
        for x, y in zip(new, clean_new):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        for s in ("param", "mu", "nu"):
            np.testing.assert_array_equal(store.read(s), clean.read(s))
    finally:
        for st in stores:
            st.close()


def test_leaves_update_rejects_what_it_cannot_take(tmp_path, mesh4):
    params = params_tree()
    with storage.open(None, tier="memory", num_shards=1, page_bytes=PAGE) as store:
        store.initialize(params, storage.OptimizerSpec("adam"))
        leaves = [jnp.zeros(leaf.shape) for leaf in store.layout.leaves]
        with pytest.raises(ValueError, match="1 gradient leaves, the store's layout has 2"):
            store_update_leaves(store, leaves[:1], version=0, lr=0.1, step=1)
        with pytest.raises(TypeError, match="must all be float32 or all bfloat16"):
            store_update_leaves(store, [leaves[0], leaves[1].astype(jnp.bfloat16)], version=0, lr=0.1, step=1)
        with pytest.raises(ValueError, match="has shape"):
            store_update_leaves(store, [leaves[0].T, leaves[1]], version=0, lr=0.1, step=1)
    with storage.open(None, tier="memory", num_shards=4, page_bytes=PAGE) as store:
        store.initialize(params, storage.OptimizerSpec("adam"))
        with pytest.raises(ValueError, match="single-shard"):
            store_update_leaves(store, leaves, version=0, lr=0.1, step=1)


# ---- NSP_ENGINE_CPUS: where the update work runs --------------------------------------------------------------

_ENGINE_CPUS_SCRIPT = r"""
import json, os, sys
import numpy as np
import nsp.storage
from nsp.primitives import engine_cpus, fused_update, get_num_threads

def thread_cpus():
    out = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            out += [line.split()[1] for line in f if line.startswith("Cpus_allowed_list")]
    return out

before = sorted(os.sched_getaffinity(0))
rng = np.random.default_rng(0)
p0 = rng.standard_normal(5000).astype(np.float32)
store = nsp.storage.open(sys.argv[1], tier="file", page_bytes=4096)
store.initialize({"w": p0}, nsp.storage.OptimizerSpec("adam"))
grad = np.zeros(store.layout.padded_total, np.float32)
grad[:5000] = rng.standard_normal(5000)
params = store.update(grad, version=0, lr=0.01, step=1)["params"][:5000]
fused_update(np.ones(1 << 16, np.float32), np.ones(1 << 16, np.float32), kind="sgd", step=1, lr=1.0)
store.close()
json.dump({"engine_cpus": engine_cpus(), "threads": get_num_threads(), "before": before,
           "after": sorted(os.sched_getaffinity(0)), "thread_cpus": thread_cpus(), "params": params.tolist()},
          sys.stdout)
"""


def test_engine_cpus_pin_the_update_work_and_leave_the_caller_as_it_was(tmp_path):
    cpu = max(os.sched_getaffinity(0))
    env = dict(os.environ, NSP_ENGINE_CPUS=str(cpu), NSP_NUM_THREADS="2")  # two kernel threads: one pool worker
    proc = subprocess.run([sys.executable, "-c", _ENGINE_CPUS_SCRIPT, str(tmp_path / "pinned")], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["engine_cpus"] == [cpu] and out["threads"] == 2
    assert out["after"] == out["before"]  # the caller ran the update pinned, then got its own CPUs back
    assert str(cpu) in out["thread_cpus"], "no thread of the process is pinned to the engine CPU (the pool worker)"
    # The same update, unpinned, in this process: pinning moves work, never results.
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(5000).astype(np.float32)
    store = storage.open(tmp_path / "free", tier="file", page_bytes=4096)
    store.initialize({"w": p0}, storage.OptimizerSpec("adam"))
    grad = np.zeros(store.layout.padded_total, np.float32)
    grad[:5000] = rng.standard_normal(5000)
    expected = store.update(grad, version=0, lr=0.01, step=1)["params"][:5000]
    store.close()
    np.testing.assert_array_equal(np.asarray(out["params"], np.float32), expected)


@pytest.mark.parametrize("value, match", [("two", "is not a CPU list"), ("1-", "is not a CPU list"),
                                          ("4096", "is not a CPU list"), ("1000", "may not run on")])
def test_bad_engine_cpus_is_a_clear_error_at_import(value, match):
    env = dict(os.environ, NSP_ENGINE_CPUS=value)
    proc = subprocess.run([sys.executable, "-c", "import nsp.primitives"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "NSP_ENGINE_CPUS" in proc.stderr and match in proc.stderr, proc.stderr
