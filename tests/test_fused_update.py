"""fused_update against optax: every kind, dense and compressed gradients, fp32 and bf16, plus bad input."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nsp.primitives import fused_update, get_num_threads, kernel_isa, set_num_threads, uses_mu, uses_nu

STEPS = 20
SIZES = [1, 7, 1_000_003]
# tests/test_kernel_isa.py runs these tests again under each other ISA the CPU has (NSP_KERNEL_ISA), with
# NSP_TEST_QUICK_ORACLE=1: the large sizes shrink to ones that still split across threads and end in a tail.
QUICK = os.environ.get("NSP_TEST_QUICK_ORACLE") == "1"
LARGE, MEDIUM = (140_009, 40_009) if QUICK else (1_000_003, 100_003)
if QUICK:
    SIZES = [1, 7, LARGE]

# (name, fused_update keyword arguments, optax reference, initial nu)
CONFIGS = {
    "adam": (
        dict(kind="adam", b1=0.9, b2=0.999, eps=1e-8),
        lambda learning_rate: optax.adam(learning_rate, 0.9, 0.999, 1e-8),
        0.0,
    ),
    "adam_l2": (
        dict(kind="adam", weight_decay=0.01),
        lambda learning_rate: optax.chain(optax.add_decayed_weights(0.01), optax.adam(learning_rate)),
        0.0,
    ),
    "adamw": (
        dict(kind="adamw", weight_decay=0.0),
        lambda learning_rate: optax.adamw(learning_rate, weight_decay=0.0),
        0.0,
    ),
    "adamw_wd": (
        dict(kind="adamw", b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.05),
        lambda learning_rate: optax.adamw(learning_rate, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.05),
        0.0,
    ),
    "sgd": (dict(kind="sgd"), lambda learning_rate: optax.sgd(learning_rate), None),
    "sgd_momentum": (
        dict(kind="sgd", momentum=0.9),
        lambda learning_rate: optax.sgd(learning_rate, momentum=0.9),
        None,
    ),
    "sgd_nesterov_l2": (
        dict(kind="sgd", momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda learning_rate: optax.chain(
            optax.add_decayed_weights(1e-3), optax.sgd(learning_rate, momentum=0.9, nesterov=True)
        ),
        None,
    ),
    "adagrad": (
        dict(kind="adagrad"),
        lambda learning_rate: optax.adagrad(learning_rate, initial_accumulator_value=0.1),
        0.1,
    ),
}


def lr_at(step: int) -> float:
    """A decaying learning rate: passed as a traced value, so it must not recompile the step."""
    return 0.01 * 0.95**step


def assert_close(actual, expected, what: str, step: int, tol: float = 1e-6, floor: float = 1e-30) -> None:
    """max |actual - expected| <= tol * max(max |expected|, floor): relative to the array's scale.

    ``floor`` keeps a tiny array whose values cancelled to near zero (a 1-element momentum, say) from turning
    one rounding step into a large relative error: it is the scale of the terms that were summed.
    """
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(np.max(np.abs(expected)), floor)
    err = np.max(np.abs(actual - expected)) / scale
    assert err <= tol, f"{what} differs from optax at step {step}: relative error {err:.3g} > {tol}"


def initial_state(size: int, seed: int):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(size), jnp.float32), rng


def random_compressed(rng, size: int, density: float):
    k = max(1, int(size * density))
    idx = np.sort(rng.choice(size, size=k, replace=False)).astype(np.int32)
    return jnp.asarray(rng.standard_normal(k), jnp.float32), jnp.asarray(idx)


def run_against_optax(config: str, size: int, *, compressed: bool = False, grad_dtype=jnp.float32,
                      lazy: bool = False):
    """STEPS of fused_update against optax on the same gradients. ``lazy``: the reference is optax's step with
    every entry whose gradient is zero put back as it was (param and moments), which is what a lazy update
    must produce; the dense gradients then have a third of their entries zeroed."""
    kwargs, make_ref, nu0 = CONFIGS[config]
    kwargs = dict(kwargs, lazy=lazy)
    param, rng = initial_state(size, seed=size)
    mu = jnp.zeros(size, jnp.float32)
    nu = jnp.full(size, nu0 if nu0 is not None else 0.0, jnp.float32)

    @functools.partial(jax.jit, donate_argnums=(0, 2, 3))
    def nsp_step(p, g, m, v, idx, t, lr):
        return fused_update(p, g, m, v, step=t, lr=lr, indices=idx, **kwargs)[:3]

    ref_opt = optax.inject_hyperparams(make_ref)(learning_rate=lr_at(1))
    ref_param = jnp.array(param)  # a copy: param is donated to the nsp step
    ref_state = ref_opt.init(ref_param)
    ref_update = jax.jit(ref_opt.update)
    for t in range(1, STEPS + 1):
        if compressed:
            values, idx = random_compressed(rng, size, 0.01)
            values = values.astype(grad_dtype)
            dense = jnp.zeros(size, jnp.float32).at[idx].add(values.astype(jnp.float32))
            grad = values
        else:
            grad = rng.standard_normal(size)
            if lazy:
                grad[rng.random(size) < 1 / 3] = 0.0
            grad = jnp.asarray(grad, jnp.float32).astype(grad_dtype)
            dense, idx = grad.astype(jnp.float32), None
        param, mu, nu = nsp_step(param, grad, mu, nu, idx, t, lr_at(t))
        ref_state.hyperparams["learning_rate"] = jnp.asarray(lr_at(t))
        old_param, (old_mu, old_nu) = ref_param, _optax_moments(ref_state)
        updates, ref_state = ref_update(dense, ref_state, ref_param)
        ref_param = optax.apply_updates(ref_param, updates)
        if lazy:
            untouched = dense == 0
            ref_param = jnp.where(untouched, old_param, ref_param)
            ref_state = _with_moments(ref_state, *(
                None if new is None else jnp.where(untouched, old, new)
                for old, new in zip((old_mu, old_nu), _optax_moments(ref_state))))
        assert_close(param, ref_param, f"{config} param", t)
        # Compare the moments too where the kind keeps them (optax keeps them in its state tree).
        ref_mu, ref_nu = _optax_moments(ref_state)
        assert (ref_mu is not None) == uses_mu(kwargs["kind"], kwargs.get("momentum", 0.0))
        assert (ref_nu is not None) == uses_nu(kwargs["kind"])
        # Gradients are unit normal, so a momentum sums signed terms of size (1 - b1) = 0.1 (Adam) or 1 (SGD)
        # and may cancel; second moments sum positive terms and cannot.
        if ref_mu is not None:
            assert_close(mu, ref_mu, f"{config} mu", t, floor=1.0 if kwargs["kind"] == "sgd" else 0.1)
        if ref_nu is not None:
            assert_close(nu, ref_nu, f"{config} nu", t)
    assert nsp_step._cache_size() == 1, "a changing learning rate or step must not recompile"


def _optax_moments(state):
    """Finds the first-moment / trace and second-moment / sum-of-squares arrays in an optax state tree."""
    found = {}

    def visit(node):
        if hasattr(node, "_fields"):  # an optax NamedTuple state
            for name, value in node._asdict().items():
                if name in ("mu", "nu", "trace", "sum_of_squares"):
                    found[name] = value
                else:
                    visit(value)
        elif isinstance(node, (tuple, list)):
            for child in node:
                visit(child)
        elif isinstance(node, dict):
            for child in node.values():
                visit(child)

    visit(state)
    mu = found.get("mu", found.get("trace"))
    nu = found.get("nu", found.get("sum_of_squares"))
    return mu, nu


def _with_moments(state, mu, nu):
    """The optax state tree with its first/second-moment arrays (as ``_optax_moments`` finds them) replaced."""
    def rebuild(node):
        if hasattr(node, "_fields"):
            fields = {}
            for name, value in node._asdict().items():
                if name in ("mu", "trace") and mu is not None:
                    fields[name] = mu
                elif name in ("nu", "sum_of_squares") and nu is not None:
                    fields[name] = nu
                else:
                    fields[name] = rebuild(value)
            return type(node)(**fields)
        if isinstance(node, (tuple, list)):
            return type(node)(rebuild(child) for child in node)
        if isinstance(node, dict):
            return {key: rebuild(child) for key, child in node.items()}
        return node

    return rebuild(state)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_dense_matches_optax(config, size):
    run_against_optax(config, size)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_compressed_matches_decompress_then_optax(config):
    run_against_optax(config, LARGE, compressed=True)


@pytest.mark.parametrize("config", ["adam", "adamw_wd", "sgd_momentum", "adagrad"])
def test_bf16_gradients(config):
    run_against_optax(config, MEDIUM, grad_dtype=jnp.bfloat16)


def test_bf16_compressed_values():
    run_against_optax("adamw_wd", MEDIUM, compressed=True, grad_dtype=jnp.bfloat16)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_lazy_compressed_moves_only_the_sent_entries(config):
    run_against_optax(config, MEDIUM, compressed=True, lazy=True)


@pytest.mark.parametrize("config", ["adamw_wd", "sgd_nesterov_l2", "adagrad"])
def test_lazy_dense_keeps_the_zero_gradient_entries(config):
    run_against_optax(config, 4099, lazy=True)


def test_lazy_changes_the_update():
    # The lazy reference above must not coincide with the dense one: at 1% density most entries differ.
    param, rng = initial_state(4099, seed=1)
    values, idx = random_compressed(rng, 4099, 0.01)
    m = jnp.asarray(rng.standard_normal(4099), jnp.float32)
    v = jnp.ones(4099, jnp.float32)
    out = {lazy: fused_update(param, values, m, v, kind="adamw", step=3, lr=0.1, weight_decay=0.1, indices=idx,
                              lazy=lazy) for lazy in (False, True)}
    untouched = np.ones(4099, bool)
    untouched[np.asarray(idx)] = False
    for a, b, old in zip(out[False][:3], out[True][:3], (param, m, v)):
        np.testing.assert_array_equal(np.asarray(b)[untouched], np.asarray(old)[untouched])
        assert np.all(np.asarray(a)[untouched] != np.asarray(old)[untouched])
        np.testing.assert_array_equal(np.asarray(a)[~untouched], np.asarray(b)[~untouched])


@pytest.mark.parametrize("size", [7, 4099])
def test_bf16_output_is_the_rounded_param(size):
    param, rng = initial_state(size, seed=3)
    param = param.at[0].set(jnp.nan) if size > 7 else param
    grad = jnp.asarray(rng.standard_normal(size), jnp.float32)
    out = jax.jit(lambda p, g, m, v: fused_update(p, g, m, v, kind="adam", step=1, lr=1e-2, bf16_out=True))(
        param, grad, jnp.zeros(size), jnp.zeros(size)
    )
    assert out.param_bf16.dtype == jnp.bfloat16 and out.param_bf16.shape == (size,)
    expected = np.asarray(out.param.astype(jnp.bfloat16)).view(np.uint16)
    actual = np.asarray(out.param_bf16).view(np.uint16)
    nan = np.isnan(np.asarray(out.param))
    np.testing.assert_array_equal(actual[~nan], expected[~nan])
    assert np.all(np.isnan(np.asarray(out.param_bf16, np.float32)[nan])), "NaN must stay NaN in the bf16 copy"


def test_bf16_output_rounds_every_kind_of_value():
    # lr = 0 keeps each param as it is, so the bf16 copy is the rounding of the values below: ties to even either
    # way, the largest finite values (one rounds to Inf), denormals, signed zeros, infinities and NaNs. (XLA runs
    # custom calls with denormals flushed, so a denormal param may come out as a zero of its sign; its bf16 copy
    # must then be that zero.)
    import ml_dtypes

    bits = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F808001, 0x7F7FFFFF, 0x7F7F7FFF, 0xFF7FFFFF, 0x00000001,
            0x00400000, 0x007FFFFF, 0x80000001, 0x807FFFFF, 0x00008000, 0x00018000, 0x00000000, 0x80000000,
            0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x3F800000]
    base = np.asarray(bits, np.uint32)
    param = np.concatenate([base, np.roll(base, 5), base[:9]]).view(np.float32)  # vector bodies and a tail
    n = param.size
    out = fused_update(jnp.asarray(param), jnp.ones(n, jnp.float32), kind="sgd", step=1, lr=0.0, bf16_out=True)
    new = np.asarray(out.param)
    denormal = (param.view(np.uint32) & 0x7F800000 == 0) & (param != 0)
    flushed = denormal & (new.view(np.uint32) == param.view(np.uint32) & 0x80000000)
    nan = np.isnan(param)  # the arithmetic makes a signalling NaN quiet
    np.testing.assert_array_equal(np.isnan(new), nan)
    kept = ~flushed & ~nan
    np.testing.assert_array_equal(new.view(np.uint32)[kept], param.view(np.uint32)[kept])
    actual = np.asarray(out.param_bf16).view(np.uint16)
    np.testing.assert_array_equal(actual[~nan], new[~nan].astype(ml_dtypes.bfloat16).view(np.uint16))
    # NaN: its top half made quiet, as every ISA's kernels (and AVX512_BF16's instruction) do
    np.testing.assert_array_equal(actual[nan], (new.view(np.uint32)[nan] >> 16) | 0x40)


def test_first_step_bias_correction():
    # At step 1 the bias-corrected Adam step is lr * g / (|g| + eps): a full lr-sized move per element.
    g = jnp.asarray([0.5, -2.0, 1e-3, 0.0], jnp.float32)
    p = jnp.ones(4, jnp.float32)
    out = fused_update(p, g, jnp.zeros(4), jnp.zeros(4), kind="adam", step=1, lr=0.1, eps=1e-8)
    expected = 1.0 - 0.1 * np.asarray(g) / (np.abs(np.asarray(g)) + 1e-8)
    np.testing.assert_allclose(np.asarray(out.param), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out.mu), 0.1 * np.asarray(g), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out.nu), 0.001 * np.asarray(g) ** 2, rtol=1e-6)


def test_shapes_are_kept_and_unused_state_passes_through():
    p = jnp.ones((3, 5), jnp.float32)
    out = fused_update(p, jnp.ones((3, 5)), None, jnp.zeros((3, 5)), kind="adagrad", step=1, lr=0.1)
    assert out.param.shape == (3, 5) and out.nu.shape == (3, 5) and out.mu is None
    out = fused_update(p, jnp.ones((3, 5)), kind="sgd", step=1, lr=0.5)
    np.testing.assert_allclose(np.asarray(out.param), 0.5)
    assert out.mu is None and out.nu is None


def test_sort_indices_accepts_lax_top_k_order():
    size = 10_000
    param, rng = initial_state(size, seed=5)
    grad = jnp.asarray(rng.standard_normal(size), jnp.float32)
    _, idx = jax.lax.top_k(jnp.abs(grad), 100)
    vals = grad[idx]
    dense = jnp.zeros(size).at[idx].add(vals)
    zeros = jnp.zeros(size)
    a = fused_update(param, vals, zeros, zeros, kind="adam", step=3, lr=0.01, indices=idx, sort_indices=True)
    b = fused_update(param, dense, zeros, zeros, kind="adam", step=3, lr=0.01)
    np.testing.assert_array_equal(np.asarray(a.param), np.asarray(b.param))


def test_thread_count_does_not_change_results():
    size = 1 << 20
    param, rng = initial_state(size, seed=9)
    grad = jnp.asarray(rng.standard_normal(size), jnp.float32)
    zeros = jnp.zeros(size)
    before = get_num_threads()
    try:
        set_num_threads(1)
        one = fused_update(param, grad, zeros, zeros, kind="adamw", step=2, lr=0.01, weight_decay=0.1)
        set_num_threads(3)
        three = fused_update(param, grad, zeros, zeros, kind="adamw", step=2, lr=0.01, weight_decay=0.1)
    finally:
        set_num_threads(before)
    for a, b in zip(one[:3], three[:3]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=">= 1"):
        set_num_threads(0)


def test_vmap_runs_each_member():
    params = jnp.ones((3, 64), jnp.float32)
    grads = jnp.arange(3, dtype=jnp.float32)[:, None] * jnp.ones((3, 64))
    out = jax.vmap(lambda p, g: fused_update(p, g, kind="sgd", step=1, lr=1.0).param)(params, grads)
    np.testing.assert_allclose(np.asarray(out[:, 0]), [1.0, 0.0, -1.0])


_ISA_SCRIPT = r"""
import json, sys
import jax.numpy as jnp, numpy as np
from nsp.primitives import fused_update, kernel_isa
rng = np.random.default_rng(0)
n = 1003
out = {"isa": kernel_isa()}
for kind, kw in [("adam", {}), ("adamw", {"weight_decay": 0.1}), ("sgd", {"momentum": 0.9, "nesterov": True}),
                 ("adagrad", {})]:
  for lazy in (False, True):
    p = jnp.asarray(rng.standard_normal(n), jnp.float32)
    g = rng.standard_normal(n)
    g[rng.random(n) < 1 / 3] = 0.0  # a lazy update keeps these entries
    g = jnp.asarray(g, jnp.float32).astype(jnp.bfloat16)
    m, v = jnp.asarray(rng.standard_normal(n), jnp.float32), jnp.full(n, 0.1)
    r = fused_update(p, g, m, v, kind=kind, step=4, lr=0.01, bf16_out=True, lazy=lazy, **kw)
    rounded = np.asarray(r.param.astype(jnp.bfloat16)).view(np.uint16)
    assert np.array_equal(np.asarray(r.param_bf16).view(np.uint16), rounded), kind
    kept = np.asarray(g) == 0
    assert not lazy or np.array_equal(np.asarray(r.param)[kept], np.asarray(p)[kept]), kind
    out[kind + ("_lazy" if lazy else "")] = np.asarray(r.param).tolist()
json.dump(out, sys.stdout)
"""


def test_portable_kernel_matches_vectorised_kernel():
    results = {}
    for isa in ("portable", "default"):
        env = dict(os.environ)
        if isa == "portable":
            env["NSP_KERNEL_ISA"] = "portable"
        else:
            env.pop("NSP_KERNEL_ISA", None)
        proc = subprocess.run([sys.executable, "-c", _ISA_SCRIPT], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        results[isa] = json.loads(proc.stdout)
    assert results["portable"]["isa"] == "portable"
    assert results["default"]["isa"] == kernel_isa()
    assert len(results["default"]) == 9  # four kinds, dense and lazy, and the ISA
    for kind in sorted(set(results["default"]) - {"isa"}):
        a, b = np.asarray(results["portable"][kind]), np.asarray(results["default"][kind])
        # FMA contraction may differ in the last bit between the two instruction sets.
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.max(np.abs(b)), err_msg=kind)


# ---- bad input: a clear error before the kernel runs ------------------------------------------------------


def _state(n=8):
    return jnp.ones(n, jnp.float32), jnp.ones(n, jnp.float32), jnp.zeros(n), jnp.zeros(n)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(grad=jnp.ones(9)), ValueError, "grad shape"),
        (dict(grad=jnp.ones(8, jnp.int32)), TypeError, "float32 or bfloat16"),
        (dict(param=jnp.ones(8, jnp.bfloat16)), TypeError, "param must be float32"),
        (dict(mu=jnp.zeros(7)), ValueError, "mu shape"),
        (dict(nu=jnp.zeros(8, jnp.float16)), TypeError, "nu must be float32"),
        (dict(mu=None), ValueError, "needs the state 'mu'"),
        (dict(kind="lion"), ValueError, "unknown optimizer kind"),
        (dict(b1=1.0), ValueError, "b1 must be in"),
        (dict(eps=-1.0), ValueError, "eps must be >= 0"),
        (dict(step=0), ValueError, "step must be >= 1"),
        (dict(step=1.5), TypeError, "step must be an integer"),
        (dict(lr=jnp.ones(2)), ValueError, "lr must be a scalar"),
        (dict(grad=jnp.ones(3), indices=jnp.asarray([0, 1, 8], jnp.int32)), ValueError, "index 8 at position 2"),
        (dict(grad=jnp.ones(3), indices=jnp.asarray([0, -1, 2], jnp.int32)), ValueError, "index -1"),
        (dict(grad=jnp.ones(3), indices=jnp.asarray([0, 5, 2], jnp.int32)), ValueError, "sorted ascending"),
        (dict(grad=jnp.ones(3), indices=np.asarray([0, 1, 2], np.int64)), TypeError, "int32"),
        (dict(grad=jnp.ones(2), indices=jnp.asarray([0, 1, 2], jnp.int32)), ValueError, "equal length"),
    ],
)
def test_bad_input_is_rejected_before_the_kernel(change, error, match):
    param, grad, mu, nu = _state()
    args = dict(param=param, grad=grad, mu=mu, nu=nu, kind="adam", step=1, lr=0.1)
    args.update(change)
    with pytest.raises(error, match=match):
        fused_update(**args)


def test_bad_indices_under_jit_are_rejected_by_the_kernel_before_writing():
    param, _, mu, nu = _state()
    f = jax.jit(lambda p, v, i, m, n: fused_update(p, v, m, n, kind="adam", step=1, lr=0.1, indices=i))
    with pytest.raises(Exception, match="index 8 at position 1 is out of range"):
        jax.block_until_ready(f(param, jnp.ones(2), jnp.asarray([3, 8], jnp.int32), mu, nu))
    with pytest.raises(Exception, match="sorted ascending"):
        jax.block_until_ready(f(param, jnp.ones(2), jnp.asarray([3, 1], jnp.int32), mu, nu))
    # Nothing was donated, and nothing was written: the inputs are as they were.
    np.testing.assert_array_equal(np.asarray(param), 1.0)
    np.testing.assert_array_equal(np.asarray(mu), 0.0)


def test_kernel_isa_is_reported():
    assert kernel_isa() in ("avx512", "avx2-fma", "portable")
    forced = os.environ.get("NSP_KERNEL_ISA")
    if forced:
        assert kernel_isa() == forced


def test_eager_loop_reuses_dropped_outputs_and_never_touches_held_arrays():
    """Called eagerly, each step writes into the arrays of the step before last once the loop has dropped them
    (no fresh memory per step); an array the caller still holds is never written; results equal the jitted,
    donated update's."""
    from nsp.primitives import release_eager_buffers

    n = 50_000
    rng = np.random.default_rng(7)
    p0 = jnp.asarray(rng.standard_normal(n, np.float32))
    grads = [jnp.asarray(rng.standard_normal(n, np.float32)) for _ in range(6)]

    @functools.partial(jax.jit, donate_argnums=(0, 2, 3))
    def jitted(p, g, m, v, t):
        return fused_update(p, g, m, v, kind="adam", step=t, lr=1e-2)[:3]

    ref = (p0.copy(), jnp.zeros(n), jnp.zeros(n))
    for t, g in enumerate(grads, 1):
        ref = jitted(*ref[:1], g, *ref[1:], t)

    release_eager_buffers()
    p, m, v = p0, jnp.zeros(n), jnp.zeros(n)
    kept = None
    buffers = []  # each step's output buffers
    for t, g in enumerate(grads, 1):
        p, m, v = fused_update(p, g, m, v, kind="adam", step=t, lr=1e-2)[:3]
        buffers.append({x.unsafe_buffer_pointer() for x in (p, m, v)})
        if t == 2:
            kept = (p, np.asarray(p).copy())  # held by the caller: must never be reused
    for got, want in zip((p, m, v), ref):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(kept[0]), kept[1])
    assert all(kept[0].unsafe_buffer_pointer() not in b for b in buffers[2:])
    # Steps 3, 5 and 6 write into the memory of earlier steps' dropped outputs; step 4 finds two (step 2's
    # param is held) and gets one new array.
    earlier = [set().union(*buffers[:t]) - {kept[0].unsafe_buffer_pointer()} for t in range(len(buffers))]
    for t in (2, 4, 5):
        assert buffers[t] <= earlier[t], t
    assert len(buffers[3] & earlier[3]) == 2
    release_eager_buffers()


@pytest.mark.parametrize("change, message", [
    (lambda h: h.pop("b2"), "hyperparameter 'b2' is missing"),
    (lambda h: h.update(kind=np.float64(0.0)), "'kind' must be an int32"),
    (lambda h: h.update(beta=np.float64(0.5)), "unknown hyperparameter 'beta'"),
])
def test_the_hyperparameter_dictionary_names_a_bad_key(change, message):
    """The C++ side decodes the one hyperparameter dictionary (nsp.spec.hyper_attrs) in one place, and a missing,
    wrong-typed or unknown key is an error naming the key."""
    from nsp import _nsp_ffi
    from nsp.spec import OptimizerSpec

    engine = _nsp_ffi.ShardEngine("memory", "", 1024, 1024, 2, [True, True, True], False)
    hyper = OptimizerSpec("adam").hyper_attrs()
    engine.update(0, 1, 1e-3, 1, hyper, grad=np.ones(1024, np.float32))  # the dictionary as given works
    change(hyper)
    with pytest.raises(ValueError, match=message):
        engine.update(0, 1, 1e-3, 1, hyper, grad=np.ones(1024, np.float32))
