"""bench/update_kernel.py's protocol (shuffled order, cache reset, pre-touch, warm-up call) and
bench/kernel_sweep.py's paired ratios: what the kernel's speed records rest on."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import cache_reset  # noqa: E402
from kernel_sweep import DS, NSP, PURE_PROBES, TORCH, paired_ratios, ratios  # noqa: E402


def test_paired_ratios_are_the_median_of_each_rounds_ratio():
    times = {NSP: [1.0, 2.0, 3.0], TORCH: [3.3, 1.1, 2.2], DS: [1.2, 2.0, 3.3],
             PURE_PROBES[0]: [0.9, 2.2, 2.7], PURE_PROBES[1]: [1.0, 1.8, 4.0]}
    paired = paired_ratios(times)
    assert paired[TORCH] == pytest.approx(statistics.median([3.3, 0.55, 2.2 / 3]))
    assert paired[DS] == pytest.approx(statistics.median([1.2, 1.0, 1.1]))
    # The best pure probe is chosen within each round: 0.9 (round 1), 1.8 (round 2), 2.7 (round 3).
    assert paired["best pure probe"] == pytest.approx(statistics.median([0.9, 0.9, 0.9]))
    # The ratio of the medians is another number here: the spells landed on different rounds.
    assert ratios({name: statistics.median(ts) for name, ts in times.items()})[TORCH] == pytest.approx(1.1)


def test_a_slow_spell_over_one_round_moves_no_paired_ratio():
    times = {NSP: [1.0, 1.0, 1.0, 1.0, 1.0], TORCH: [1.1] * 5}
    slow = {name: [t * (3.0 if i in (1, 2) else 1.0) for i, t in enumerate(ts)] for name, ts in times.items()}
    assert paired_ratios(slow)[TORCH] == pytest.approx(1.1)


def test_the_cache_reset_reads_a_buffer_of_its_own_size():
    assert cache_reset.llc_mib() >= 1
    reset = cache_reset.CacheReset(3)
    assert reset.buffer.nbytes == 3 << 20
    reset()
    with pytest.raises(ValueError, match="positive size"):
        cache_reset.CacheReset(0)


def test_every_contender_runs_after_its_reset_and_warm_up_call(tmp_path):
    """A small run of the benchmark itself (nsp's variants, optax and the probes; torch and DeepSpeed join where
    installed): it records its protocol, and each contender's warm-up call exists and runs."""
    out = tmp_path / "uk.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "update_kernel.py"), "--size", "256K", "--repeats", "5", "--contenders",
         "nsp,nsp-variants,optax,probes", "--no-crc", "--calls", "1", "--pause", "0", "--cache-reset-mib", "4",
         "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["warm_call"] is True and record["warm_call_params"] > 0
    assert record["cache_reset_mib"] == 4 and record["order"] == "shuffled" and record["pre_touch"] is True
    assert len(record["orders"]) == 5 and len({tuple(o) for o in record["orders"]}) > 1
    assert all(len(ts) == 5 for ts in record["times_s"].values())
    assert {"nsp dense fp32", "nsp bf16 grads", "optax.adam (jit, donated)", PURE_PROBES[0]} <= set(record["times_s"])


def test_the_reset_runs_before_the_warm_up_call():
    from cache_reset import before_call

    calls: list[str] = []
    before_call(lambda: calls.append("reset"), lambda: calls.append("warm"))()
    before_call(None, lambda: calls.append("warm only"))()
    before_call(lambda: calls.append("reset only"), None)()
    before_call(lambda: calls.append("reset"), lambda: calls.append("warm"), lambda: calls.append("touch") or [])()
    assert calls == ["reset", "warm", "warm only", "reset only", "reset", "touch", "warm"]


def test_pre_touch_reads_jax_and_numpy_arrays_and_leaves_donation_in_place():
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jnp.arange(1000, dtype=jnp.float32)
    odd = np.ones(13, np.uint8)  # a size that is no multiple of 8 bytes
    cache_reset.pre_touch([x, odd, np.zeros(0, np.float32)])
    np.testing.assert_array_equal(cache_reset.host_view(x).view(np.float32), np.arange(1000, dtype=np.float32))
    before = x.unsafe_buffer_pointer()

    @functools.partial(jax.jit, donate_argnums=0)
    def inc(a):
        return a + 1

    y = inc(x)
    assert y.unsafe_buffer_pointer() == before, "a pre-touched array must still be donated in place"
    with pytest.raises(TypeError, match="cannot view"):
        cache_reset.host_view("not an array")


def test_kernel_time_counts_each_update_and_the_time_inside_it():
    import jax.numpy as jnp

    from nsp.primitives import fused_update, kernel_time

    n = 1 << 18
    calls0, s0 = kernel_time()
    out = fused_update(jnp.ones(n), jnp.ones(n), jnp.zeros(n), jnp.zeros(n), kind="adam", step=1, lr=1e-3)
    out[0].block_until_ready()
    calls1, s1 = kernel_time()
    assert calls1 == calls0 + 1
    assert s1 > s0
