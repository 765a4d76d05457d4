"""Tests for nsp.primitives.topk: Top-K selection, index order, quality, determinism, round trips and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsp.primitives import topk
from nsp.primitives.topk import kept_count, topk_compress, topk_decompress

METHODS = ("exact", "approx", "threshold", "auto")

# The threshold path without its exact fallback; ``ok`` says whether the sampled candidates were used.
# Jitted once here so that each input shape compiles once (a threshold compile takes a few seconds on 2 cores).
threshold_path = jax.jit(topk._threshold, static_argnums=1)


def numpy_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Reference selection: positions of the k largest |x|, ties to the lower position, sorted ascending."""
    mag = np.abs(np.asarray(x, np.float32).ravel())
    return np.sort(np.argsort(-mag, kind="stable")[:k])


def l2_mass(values, exact_values) -> float:
    """Sum of squares of the kept values over that of the exact top-k's values."""
    kept = np.square(np.asarray(values, np.float64)).sum()
    return float(kept / np.square(np.asarray(exact_values, np.float64)).sum())


@pytest.fixture(scope="module")
def large_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    n = 2**21
    return {
        "gaussian": rng.standard_normal(n, dtype=np.float32),
        "student-t df=2": rng.standard_t(2, n).astype(np.float32),
        # A lognormal/cauchy mix: most entries small, a heavy tail of rare huge ones.
        "lognormal-cauchy": np.where(rng.random(n) < 0.9, rng.lognormal(0, 1, n), rng.standard_cauchy(n))
        .astype(np.float32) * rng.choice([-1, 1], n).astype(np.float32),
    }


# ---------------------------------------------------------------------------------------------------------------
# kept_count


@pytest.mark.parametrize(
    ("size", "kwargs", "expected"),
    [
        (1000, {"ratio": 0.01}, 10),
        (100, {"ratio": 0.07}, 7),  # 0.07 * 100 = 7.000000000000001 must not round up to 8
        (3, {"ratio": 0.5}, 2),  # ceil
        (7, {"ratio": 0.01}, 1),  # at least one
        (5, {"ratio": 1.0}, 5),
        (10, {"k": 3}, 3),
        (10, {"k": 10}, 10),
    ],
)
def test_kept_count(size, kwargs, expected):
    assert kept_count(size, **kwargs) == expected


# ---------------------------------------------------------------------------------------------------------------
# exact selection against numpy


@pytest.mark.parametrize("size", [1, 7, 1000, 100003])
@pytest.mark.parametrize("ratio", [0.01, 0.3, 1.0])
def test_exact_matches_numpy(size, ratio):
    x = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    k = kept_count(size, ratio=ratio)
    expected = numpy_topk(x, k)
    values, indices = topk_compress(x, ratio=ratio, method="exact")
    np.testing.assert_array_equal(np.asarray(indices), expected)
    np.testing.assert_array_equal(np.asarray(values), x[expected])
    jit_values, jit_indices = jax.jit(lambda a: topk_compress(a, ratio=ratio, method="exact"))(x)
    np.testing.assert_array_equal(np.asarray(jit_indices), expected)
    np.testing.assert_array_equal(np.asarray(jit_values), x[expected])


def test_exact_2d_input_selects_over_flat_positions():
    x = np.random.default_rng(2).standard_normal((317, 411)).astype(np.float32)
    values, indices = topk_compress(x, ratio=0.02, method="exact")
    expected = numpy_topk(x, kept_count(x.size, ratio=0.02))
    np.testing.assert_array_equal(np.asarray(indices), expected)
    np.testing.assert_array_equal(np.asarray(values), x.ravel()[expected])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("method", ["exact", "threshold"])
def test_half_precision_matches_numpy_with_ties(dtype, method):
    # 100003 entries in 16-bit floats have many equal magnitudes, so this also checks the tie rule
    # (lower position first) of both paths.
    x = jnp.asarray(np.random.default_rng(3).standard_normal(100003), dtype)
    k = kept_count(x.size, ratio=0.05)
    assert method == "exact" or topk._resolve_method(method, x.size, k, dtype) == "threshold"
    values, indices = jax.jit(lambda a: topk_compress(a, k=k, method=method))(x)
    expected = numpy_topk(np.asarray(x.astype(jnp.float32)), k)
    assert values.dtype == dtype
    np.testing.assert_array_equal(np.asarray(indices), expected)
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), np.asarray(x.astype(jnp.float32))[expected])


# ---------------------------------------------------------------------------------------------------------------
# output contract, for every method


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(1000,), (300, 1000)])
def test_output_contract(method, shape):
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    k = kept_count(x.size, ratio=0.02)  # 6000 of 300000 takes the threshold path's sampled route
    values, indices = topk_compress(x, k=k, method=method)
    assert values.shape == (k,) and indices.shape == (k,)
    assert values.dtype == jnp.float32 and indices.dtype == jnp.int32
    idx = np.asarray(indices)
    assert np.all(np.diff(idx) >= 0), "indices must be non-decreasing"
    assert idx.min() >= 0 and idx.max() < x.size
    np.testing.assert_array_equal(np.asarray(values), x.ravel()[idx])


def test_auto_uses_threshold_only_where_it_pays():
    assert topk._resolve_method("auto", 1000, 10, jnp.float32) == "exact"  # small input
    assert topk._resolve_method("auto", 2**20, 2**20 // 100, jnp.float32) == "auto"  # chosen per platform
    assert topk._resolve_method("threshold", 300000, 6000, jnp.bfloat16) == "threshold"
    assert topk._resolve_method("auto", 2**24, 1000, jnp.float32) == "exact"  # small k: lax.top_k is cheap
    assert topk._resolve_method("auto", 2**20, 2**20 // 2, jnp.float32) == "exact"  # ratio above 1/4
    assert topk._resolve_method("threshold", 2**20, 2**20 // 100, jnp.float64) == "exact"  # >32-bit floats
    assert topk._resolve_method("approx", 2**20, 2**20 // 100, jnp.float32) == "approx"


def _lowered(method: str, platform: str, size: int = 2**20) -> str:
    """StableHLO of ``topk_compress(x, method=...)`` on ``size`` fp32 entries at 1%, lowered for ``platform`` (a
    platform need not be present to lower for it)."""
    x = jax.ShapeDtypeStruct((size,), jnp.float32)
    f = jax.jit(lambda a: topk_compress(a, ratio=0.01, method=method))
    return f.trace(x).lower(lowering_platforms=(platform,)).as_text()


def test_auto_lowers_the_cxx_selection_on_cpu_and_the_exact_one_elsewhere():
    # On an H200 at 16M entries the threshold path measured 0.6x the speed of lax.top_k
    # (bench/results/topk_gpu_16777216.json): below ACCELERATOR_THRESHOLD_MIN_SIZE "auto" is lax.top_k off the CPU.
    # On the CPU it is the C++ selection (no input-sized temporaries). The threshold path orders magnitudes by
    # their float bits (the one bitcast_convert of these programs); the exact path is a lax.top_k and a sort of
    # its indices.
    assert _lowered("threshold", "cpu").count("bitcast_convert") == 1
    assert _lowered("exact", "cpu").count("bitcast_convert") == 0
    auto = _lowered("auto", "cpu")
    assert "nsp_topk_select" in auto and "bitcast_convert" not in auto and "top_k" not in auto
    for platform in ("cuda", "rocm", "tpu"):
        lowered = _lowered("auto", platform)
        assert "bitcast_convert" not in lowered and "nsp_topk_select" not in lowered, platform
        assert lowered.count("stablehlo.sort") == 1 and lowered.count("top_k") == 1, platform
        # From ACCELERATOR_THRESHOLD_MIN_SIZE entries on, lax.top_k is the slower there too.
        big = _lowered("auto", platform, size=topk.ACCELERATOR_THRESHOLD_MIN_SIZE)
        assert big.count("bitcast_convert") == 1, platform


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("data", ["normal", "ties", "zeros"])
def test_cpu_selection_matches_numpy(dtype, data):
    """"auto" on the CPU is the C++ radix select: lax.top_k's set and tie rule (lower position first), in index
    order, over inputs with many equal magnitudes and with fewer nonzeros than k."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(200003).astype(np.float32)
    if data == "ties":
        x = np.round(x * 4)
    elif data == "zeros":
        x[rng.random(x.size) > 0.001] = 0.0
    x = jnp.asarray(x, dtype)
    k = kept_count(x.size, ratio=0.03)
    assert topk._resolve_method("auto", x.size, k, dtype) == "auto"
    values, indices = jax.jit(lambda a: topk_compress(a, k=k, method="auto"))(x)
    expected = numpy_topk(np.asarray(x.astype(jnp.float32)), k)
    assert values.dtype == dtype
    np.testing.assert_array_equal(np.asarray(indices), expected)
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), np.asarray(x.astype(jnp.float32))[expected])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shards, decay", [(1, 1.0), (2, 0.5)])
def test_error_feedback_in_place_matches_the_flat_computation(dtype, shards, decay):
    """``nsp.optim.topk_compress`` on one device runs ``topk_feedback`` on a CPU (add into the residual, select,
    clear, decay, in C++): the same values, indices and residual as the flat computation it replaces, in numpy."""
    from nsp.optim import compress

    rng = np.random.default_rng(0)
    grads = {"a": jnp.asarray(rng.standard_normal((300, 700)), dtype), "b": jnp.asarray(rng.standard_normal(70001), dtype)}
    tx = compress.topk_compress(0.02, num_shards=shards, residual_decay=decay)
    residual = jnp.asarray(rng.standard_normal(tx.init(grads).residual.shape) * 0.1, jnp.float32)
    out, state = jax.jit(tx.update)(grads, compress.TopKState(residual))
    flat = np.asarray(compress.flatten_padded(grads, shards)) + np.asarray(residual)
    size = flat.size // shards
    k = kept_count(size, ratio=0.02)
    values, indices, rest = [], [], []
    for s in range(shards):
        shard = flat[s * size:(s + 1) * size]
        idx = numpy_topk(shard, k)
        values.append(shard[idx])
        indices.append(idx)
        left = shard.copy()
        left[idx] = 0
        rest.append(left * np.float32(decay) if decay != 1.0 else left)
    np.testing.assert_array_equal(np.asarray(out.indices), np.concatenate(indices))
    np.testing.assert_array_equal(np.asarray(out.values), np.concatenate(values))
    np.testing.assert_array_equal(np.asarray(state.residual), np.concatenate(rest))
    # Off the CPU the same transform lowers to the jnp path (no C++ target there).
    lowered = jax.jit(tx.update).trace(grads, compress.TopKState(residual)).lower(lowering_platforms=("cuda",))
    assert "nsp_topk_feedback" not in lowered.as_text()


def test_topk_feedback_rejects_bad_input():
    with pytest.raises(ValueError, match="float32 vector"):
        topk.topk_feedback(jnp.zeros(10, jnp.bfloat16), [jnp.zeros(10)], k=1)
    with pytest.raises(ValueError, match="k must be"):
        topk.topk_feedback(jnp.zeros(10), [jnp.zeros(10)], k=11)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        topk.topk_feedback(jnp.zeros(10), [jnp.zeros(10, jnp.int32)], k=1)


# ---------------------------------------------------------------------------------------------------------------
# quality and determinism of the fast methods on large inputs


@pytest.mark.parametrize("data", ["gaussian", "student-t df=2", "lognormal-cauchy"])
def test_fast_methods_keep_l2_mass(large_inputs, data):
    x = large_inputs[data]
    k = kept_count(x.size, ratio=0.01)
    exact_values, exact_indices = topk_compress(x, k=k, method="exact")
    np.testing.assert_array_equal(np.asarray(exact_indices), numpy_topk(x, k))
    for method in ("approx", "threshold"):
        values, indices = topk_compress(x, k=k, method=method)
        assert np.all(np.diff(np.asarray(indices)) >= 0)
        assert l2_mass(values, exact_values) >= 0.99, method


@pytest.mark.parametrize("data", ["gaussian", "student-t df=2", "lognormal-cauchy"])
def test_threshold_takes_fast_path_and_is_exact(large_inputs, data):
    x = jnp.asarray(large_inputs[data])
    k = kept_count(x.size, ratio=0.01)
    values, indices, ok = threshold_path(x, k)
    assert bool(ok), "the sampled threshold should give between k and 2k candidates on this data"
    exact_values, exact_indices = topk_compress(x, k=k, method="exact")
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(exact_indices))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(exact_values))


def test_threshold_is_deterministic(large_inputs):
    x = large_inputs["student-t df=2"]
    first = topk_compress(x, ratio=0.01, method="threshold")
    again = topk_compress(x, ratio=0.01, method="threshold")
    rejitted = jax.jit(lambda a: topk_compress(a, ratio=0.01, method="threshold"))(x)
    for other in (again, rejitted):
        np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(other[0]))
        np.testing.assert_array_equal(np.asarray(first[1]), np.asarray(other[1]))


# Both fallback tests use one shape and k, so that each jitted function compiles once.
FALLBACK_N, FALLBACK_K = 2**20, 2**20 // 10


def test_threshold_falls_back_when_too_many_candidates():
    # Mostly zeros: the sample sees only zeros, so every entry passes the sampled threshold (more than 2k).
    n, k = FALLBACK_N, FALLBACK_K
    x = np.zeros(n, np.float32)
    x[np.random.default_rng(5).choice(n, 500, replace=False)] = 1.0 + np.arange(500, dtype=np.float32)
    assert not bool(threshold_path(x, k)[2])
    values, indices = topk_compress(x, k=k, method="threshold")
    np.testing.assert_array_equal(np.asarray(indices), numpy_topk(x, k))
    np.testing.assert_array_equal(np.asarray(values), x[numpy_topk(x, k)])


def test_threshold_falls_back_when_too_few_candidates():
    # Large values exactly where the sample looks, smaller ones elsewhere: the sample overestimates the tail,
    # fewer than k entries pass (the sample has fewer than k points), and the result must still be the exact
    # top-k with all k slots filled.
    n, k = FALLBACK_N, FALLBACK_K
    x = np.full(n, 0.5, np.float32) + np.random.default_rng(6).random(n, dtype=np.float32) * 0.1
    x[np.asarray(topk._sample_positions(n, topk._sample_size(n, k)))] = 2.0
    assert not bool(threshold_path(x, k)[2])
    values, indices = topk_compress(x, k=k, method="threshold")
    np.testing.assert_array_equal(np.asarray(indices), numpy_topk(x, k))
    np.testing.assert_array_equal(np.asarray(values), x[numpy_topk(x, k)])


def test_sample_positions_spread_over_columns():
    # A flattened (rows, 256) matrix: a strided sample would hit few columns; the hashed one hits all of them.
    positions = np.asarray(topk._sample_positions(2**20, 65536))
    assert positions.min() >= 0 and positions.max() < 2**20
    assert len(np.unique(positions % 256)) == 256
    assert len(np.unique(positions)) > 0.95 * 65536


# ---------------------------------------------------------------------------------------------------------------
# decompression


@pytest.mark.parametrize("method", ["exact", "threshold"])
def test_decompress_puts_kept_values_in_place(method):
    x = np.random.default_rng(7).standard_normal((300, 1000)).astype(np.float32)
    values, indices = topk_compress(x, ratio=0.02, method=method)
    dense = np.asarray(topk_decompress(values, indices, x.shape))
    assert dense.shape == x.shape
    kept = np.zeros(x.size, bool)
    kept[np.asarray(indices)] = True
    np.testing.assert_array_equal(dense.ravel()[kept], x.ravel()[kept])
    assert np.all(dense.ravel()[~kept] == 0)
    assert kept.sum() == kept_count(x.size, ratio=0.02)


def test_round_trip_at_ratio_one_gives_input_back():
    x = jnp.asarray(np.random.default_rng(8).standard_normal((33, 17)), jnp.bfloat16)
    dense = topk_decompress(*topk_compress(x, ratio=1.0), x.shape)
    assert dense.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(x))


def test_decompress_adds_repeated_indices_and_casts():
    dense = topk_decompress(jnp.array([1.0, 2.0, 0.0]), jnp.array([0, 3, 3]), (2, 2), dtype=jnp.float16)
    assert dense.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(dense), [[1.0, 0.0], [0.0, 2.0]])


@pytest.mark.parametrize(
    ("values", "indices", "error", "match"),
    [
        (jnp.ones((2, 2)), jnp.zeros(4, jnp.int32), ValueError, "1-D"),
        (jnp.ones(3), jnp.zeros(2, jnp.int32), ValueError, "same length"),
        (jnp.ones(2), jnp.zeros(2, jnp.float32), TypeError, "indices must be integers"),
    ],
)
def test_decompress_rejects_bad_input(values, indices, error, match):
    with pytest.raises(error, match=match):
        topk_decompress(values, indices, (4,))


# ---------------------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ratio": 0.1, "k": 3}, ValueError, "exactly one of ratio or k, not both"),
        ({}, ValueError, "exactly one of ratio or k"),
        ({"ratio": 0.0}, ValueError, r"ratio must be in \(0, 1\]"),
        ({"ratio": 1.5}, ValueError, r"ratio must be in \(0, 1\]"),
        ({"k": 11}, ValueError, r"k must be in \[1, size=10\]"),
        ({"k": 0}, ValueError, r"k must be in \[1, size=10\]"),
        ({"k": 2, "method": "fastest"}, ValueError, "unknown method 'fastest'.*'exact'.*'threshold'"),
    ],
)
def test_compress_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        topk_compress(jnp.ones(10), **kwargs)


def test_compress_rejects_integer_input():
    with pytest.raises(TypeError, match="floating-point.*int32"):
        topk_compress(jnp.arange(10, dtype=jnp.int32), k=2)


def test_kept_count_rejects_empty():
    with pytest.raises(ValueError, match="empty"):
        kept_count(0, ratio=0.5)
