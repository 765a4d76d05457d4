"""The params fingerprint's two implementations agree bit for bit: the C++ one the CPU runs and the jnp one every
other platform runs (a state made on one platform checks params on the other), and the C++ updates are the jnp
ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsp.optim import fingerprint as fp


def _values(n, seed):
    """Values that exercise the roundings: normal, tiny (float16 subnormals, float32 denormals), huge (float16
    overflow), signed zeros, sign changes between params and new params."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    x[: n // 8] *= np.float32(1e-6)
    x[n // 8: n // 4] *= np.float32(1e5)
    if n >= 64:
        x[n // 4: n // 4 + 16] = np.float32(1e-40) * np.arange(16, dtype=np.float32)
        x[n // 4 + 16] = -0.0
    return x


LEAF_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _leaves(seed=0):
    shapes = [(300, 7), (70001,), (3,), (1 << 16,)]
    out = [jnp.asarray(_values(int(np.prod(s)), seed + i).reshape(s)).astype(LEAF_DTYPES[i % 3])
           for i, s in enumerate(shapes)]
    out.append(jnp.arange(1000, dtype=jnp.int32))
    out.append(jnp.asarray(np.arange(77) % 3 == 0))
    return out


@pytest.mark.parametrize("cast", [None, *fp.INIT_CASTS], ids=["as-is", "f32", "bf16", "f16"])
def test_hash_cpu_equals_jnp(cast):
    leaves = _leaves()
    cxx = jax.jit(lambda ls: fp._hash_cpu(ls, cast))(leaves)
    ref = jax.jit(lambda ls: jnp.stack([fp._hash_jnp(x, cast) for x in ls]))(leaves)
    np.testing.assert_array_equal(np.asarray(cxx), np.asarray(ref))


def test_hash_sees_every_element():
    x = jnp.asarray(_values(70001, 3)).astype(jnp.bfloat16)
    base = fp.fingerprint([x])
    for i in (0, 65535, 65536, 70000):
        y = x.at[i].set(x[i] + jnp.bfloat16(1.0))
        assert fp.fingerprint([y])[0] != base[0], i
    # Swapping two different elements moves them to other positions: the hash changes too.
    i, j = 5, 70000
    assert x[i] != x[j]
    z = x.at[i].set(x[j]).at[j].set(x[i])
    assert fp.fingerprint([z])[0] != base[0]


@pytest.mark.parametrize("pdtype", LEAF_DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("tdtype", ["f32", "same"])
@pytest.mark.parametrize("wide", [False, True])
def test_updates_cpu_equal_jnp(pdtype, tdtype, wide):
    n = 70001
    p = jnp.asarray(_values(n, 1)).astype(pdtype)
    # New params near the old ones (the usual step), far from them, and across zero.
    t32 = np.asarray(p, np.float32) * np.float32(1.001) + np.float32(1e-3) * _values(n, 2)
    t32[: n // 16] = -t32[: n // 16]
    if wide and pdtype != jnp.float32:
        # XLA:CPU flushes float32 denormals: a new param below float32's smallest normal lands on zero there,
        # where the wide updates' fingerprint expects it (nsp.optim.fingerprint._updates_cpu says so).
        t32 = np.where(np.abs(t32) < np.finfo(np.float32).tiny, np.float32(0), t32)
        # And infinite params (float16 overflow) step to NaN in p + (inf - inf): params a run cannot continue from.
        big = float(jnp.finfo(pdtype).max) / 2
        t32 = np.clip(t32, -big, big)
        p = jnp.asarray(np.clip(np.asarray(p, np.float32), -big, big)).astype(pdtype)
    # Params stepping onto or across zero from far above it (|t| < |p| / 2**16): p + (t - p) cannot land on t in
    # float32 there, and the fingerprint must expect where it does land.
    t32[n // 16: n // 16 + 500] = np.asarray(p, np.float32)[n // 16: n // 16 + 500] * np.float32(-3e-7)
    t = jnp.asarray(t32).astype(jnp.float32 if tdtype == "f32" else pdtype)
    ps, ts = [p, p[:100]], [t, t[:100]]

    u_cxx, h_cxx = jax.jit(lambda ps, ts: fp._updates_cpu(ps, ts, wide))(ps, ts)
    u_ref = [fp.update_in_params_dtype(b, a, wide) for a, b in zip(ps, ts)]
    h_ref = jnp.stack([fp._next_params_jnp(a, b, wide) for a, b in zip(ps, ts)])
    for a, b in zip(u_cxx, u_ref):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(h_cxx), np.asarray(h_ref))
    # And the hash is the one of the params optax.apply_updates gives.
    nxt = [jnp.asarray(a + u).astype(a.dtype) for a, u in zip(ps, u_ref)]
    np.testing.assert_array_equal(np.asarray(h_cxx), np.asarray(fp.fingerprint(nxt)))


def test_wide_updates_of_bf16_params_are_expected_where_they_land():
    """A bf16 param stepping onto or across zero from far above it lands beside its new value (no float32 update
    takes it there exactly): the fingerprint expects the landing, so the next update sees the params it led to.
    Seen in a 4.6B-parameter GPT's third step, where the mismatch made the store adopt the params as changed."""
    p = jnp.asarray([1e-3, 0.5, -3e-2, 1e-3, 2.0, 1.0], jnp.bfloat16)
    t = jnp.asarray([1.2345e-9, 0.25, 7.77e-9, -1e-3, 1e-6, -0.0], jnp.bfloat16)
    for new in (t, t.astype(jnp.float32)):
        updates, expected = jax.jit(lambda p, t: fp.updates_and_expected([p], [t], True))(p, new)
        landed = jnp.asarray(p + updates[0]).astype(p.dtype)  # optax.apply_updates
        assert not np.array_equal(np.asarray(landed), np.asarray(t))  # not t itself
        assert not bool(fp.params_changed(expected, [landed]))
        assert bool(fp.params_changed(expected, [t]))
    # The same through the store's flat vector (the update of a multi-leaf model).
    q = jnp.ones((3,), jnp.bfloat16)
    flat = jnp.concatenate([t, jnp.asarray([1.5, 0.5, 2.0], jnp.bfloat16)])
    updates, expected = jax.jit(lambda ps, f: fp.updates_and_expected_flat(ps, f, [0, 6], True))([p, q], flat)
    landed = [jnp.asarray(a + u).astype(a.dtype) for a, u in zip([p, q], updates)]
    assert not bool(fp.params_changed(expected, landed))


def test_updates_and_expected_tree():
    params = {"a": jnp.ones((4, 5), jnp.bfloat16), "b": jnp.zeros((7,), jnp.float32)}
    new = {"a": jnp.full((4, 5), 1.5, jnp.bfloat16), "b": jnp.full((7,), -0.25, jnp.float32)}
    updates, expected = jax.jit(fp.updates_and_expected)(params, new)
    assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(params)
    np.testing.assert_array_equal(np.asarray(updates["a"], np.float32), 0.5)
    assert expected.shape == (2, fp.WIDTH)
    nxt = jax.tree_util.tree_map(lambda p, u: p + u, params, updates)
    assert not bool(fp.params_changed(expected, nxt))
    assert bool(fp.params_changed(expected, params))


def test_a_step_lowered_for_cuda_calls_no_cpu_only_target():
    """Lowered for a GPU (no GPU needed to lower), a step of an nsp optimizer -- dense and Top-K, bf16 params --
    calls no C++ target but the store update's: the fingerprint and Top-K are jnp there."""
    import optax

    import nsp.optim
    import nsp.storage

    params = {"w": jnp.ones((300, 7), jnp.bfloat16), "b": jnp.zeros((7,), jnp.bfloat16)}
    cpu_only = ("nsp_params_hash", "nsp_next_params_update", "nsp_topk_select",
                "nsp_topk_feedback")
    for kw in ({}, {"compression": nsp.optim.TopK(0.05)}):
        store = nsp.storage.open(None, tier="memory")
        try:
            tx = nsp.optim.adamw(1e-3, store=store, **kw)
            state = tx.init(params)

            def step(p, s):
                u, s = tx.update(jax.tree_util.tree_map(jnp.ones_like, p), s, p)
                return optax.apply_updates(p, u), s

            text = jax.jit(step).trace(params, state).lower(lowering_platforms=("cuda",)).as_text()
            assert not [t for t in cpu_only if t in text], kw
            assert "nsp_store_update" in text
            cpu = jax.jit(step).trace(params, state).lower(lowering_platforms=("cpu",)).as_text()
            assert "nsp_params_hash" in cpu  # and on the CPU the C++ hash is what runs
        finally:
            store.close()
