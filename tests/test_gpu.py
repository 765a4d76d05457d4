"""What only a GPU can show (skipped elsewhere; ``bench/gpu_run.sh`` runs this file on a GPU machine)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsp.offload

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU (JAX sees none)")


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.sin(h @ params["w2"]) * x


def _loss(layer, stacked, x):
    for params in stacked:
        x = layer(params, x)
    return jnp.mean(x ** 2)


def test_host_memory_offload_frees_device_memory_with_the_same_gradients():
    width, rows, depth = 512, 8192, 8
    keys = jax.random.split(jax.random.key(0), 2 * depth)
    layers = [{"w1": jax.random.normal(keys[2 * i], (width, 4 * width)) / 32,
               "w2": jax.random.normal(keys[2 * i + 1], (4 * width, width)) / 64} for i in range(depth)]
    x = jax.random.normal(jax.random.key(1), (rows, width))
    host = nsp.offload.HostMemory()
    assert host.moves_data
    plain = jax.jit(jax.value_and_grad(functools.partial(_loss, _mlp)))
    off = jax.jit(jax.value_and_grad(functools.partial(_loss, nsp.offload.offload(_mlp, host))))
    for a, b in zip(jax.tree.leaves(off(layers, x)), jax.tree.leaves(plain(layers, x))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The residuals (per layer: tanh's output, rows x 4 width, and the pre-sin value) leave the device's
    # temporaries: at least half of them, over the layers, must be gone.
    held = plain.lower(layers, x).compile().memory_analysis().temp_size_in_bytes
    held_off = off.lower(layers, x).compile().memory_analysis().temp_size_in_bytes
    per_layer = rows * 5 * width * 4
    assert held - held_off >= depth * per_layer / 2, (held, held_off)
