"""The eager update's recycled result arrays (nsp.storage.out_buffers): a result is reused only once nothing holds
it, and a loop of updates allocates no new result after the first two."""

from __future__ import annotations

import gc

import jax.numpy as jnp
import numpy as np
import pytest

import nsp.storage as storage
from nsp.storage.out_buffers import OutputBuffers


def test_a_buffer_comes_back_only_when_every_holder_is_gone():
    pool = OutputBuffers(keep=2)
    a = pool.take(1000, np.float32)
    addr = a.ctypes.data
    view = a[10:20]
    del a
    gc.collect()
    b = pool.take(1000, np.float32)
    assert b.ctypes.data != addr, "a view still held the first array: its buffer must not be handed out again"
    del view
    gc.collect()
    c = pool.take(1000, np.float32)
    assert c.ctypes.data == addr and pool.reused == 1 and pool.allocated == 2
    assert c.flags.writeable and c.flags.c_contiguous and c.dtype == np.float32 and c.shape == (1000,)
    assert addr % 64 == 0 and b.ctypes.data % 64 == 0  # whole lines: the kernels' streaming stores need them
    other = pool.take(1000, np.uint16)  # another dtype never gets a float32 buffer
    assert other.ctypes.data not in (addr, b.ctypes.data)


def test_a_zero_copy_jax_array_keeps_the_buffer():
    pool = OutputBuffers()
    a = pool.take(4096, np.float32)
    a[:] = 1.5
    x = jnp.asarray(a)  # may alias the host buffer on CPU: then it must keep it
    addr = a.ctypes.data
    del a
    gc.collect()
    b = pool.take(4096, np.float32)
    b[:] = -7.0
    np.testing.assert_array_equal(np.asarray(x), np.full(4096, 1.5, np.float32))
    assert b.ctypes.data != addr or pool.reused == 1


def test_keep_bounds_the_free_list_and_clear_stops_recycling():
    pool = OutputBuffers(keep=1)
    arrays = [pool.take(256, np.float32) for _ in range(3)]
    del arrays
    gc.collect()
    assert pool.held_bytes() == 256 * 4
    pool.clear()
    assert pool.held_bytes() == 0
    a = pool.take(256, np.float32)
    del a
    gc.collect()
    assert pool.held_bytes() == 0
    with pytest.raises(ValueError, match="keep"):
        OutputBuffers(keep=-1)


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_store_update_results_stay_put_while_held_and_are_recycled_after(tmp_path, tier):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((300, 70)), jnp.float32)}
    store = storage.open(None if tier == "memory" else tmp_path / "s", tier=tier, num_shards=2, page_bytes=4096)
    with store:
        store.initialize(params, storage.OptimizerSpec("adam"))
        n = store.layout.padded_total

        def grad(t):
            return np.random.default_rng(t).standard_normal(n).astype(np.float32)

        kept = store.update(grad(1), version=0, lr=1e-2, step=1, bf16_out=True)
        kept_copy = {k: np.array(kept[k]) for k in ("params", "params_bf16")}
        out = None
        for t in range(2, 7):  # the usual loop: each result replaces the one before
            out = store.update(grad(t), version=t - 1, lr=1e-2, step=t)
            np.testing.assert_array_equal(out["params"], store.read("param"))
        # The first result was held all along: no later update wrote into it.
        for k, v in kept_copy.items():
            np.testing.assert_array_equal(np.asarray(kept[k]), v)
        # Five updates, each taking its result before the previous one was dropped: two buffers in turn.
        assert store._outputs.reused >= 3, (store._outputs.reused, store._outputs.allocated)
        assert out["params"].ctypes.data != kept["params"].ctypes.data
