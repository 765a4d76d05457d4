"""A store's engines outlive the steps dispatched to them, whatever happens to the Python objects.

JAX dispatches jitted steps asynchronously, so a store can be dropped, closed or left to interpreter exit while
its steps are still queued. Each case runs in a subprocess, so that a crash fails its test instead of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import sys
import textwrap

import numpy as np
import pytest

# The user's pattern: a function builds a store and an optimizer, dispatches a few jitted steps and returns the
# params, its last steps possibly still queued; the store dies on return.
_PRELUDE = textwrap.dedent("""
    import gc, json, sys, tempfile
    import jax, jax.numpy as jnp, numpy as np, optax
    import nsp.optim, nsp.storage

    TIER, STALENESS = sys.argv[1], int(sys.argv[2])
    params = {"w": jnp.arange(2080, dtype=jnp.float32) / 2080, "b": jnp.ones((3, 5), jnp.float32)}

    def loss(p):
        return jnp.sum((p["w"] - 0.3) ** 2) + jnp.sum(jnp.sin(p["b"]))

    def open_store(path=None):
        if TIER == "memory":
            return nsp.storage.open(tier="memory")
        return nsp.storage.open(path or tempfile.mkdtemp() + "/store", tier="file")

    def make_step(store):
        tx = nsp.optim.adam(1e-2, store=store, staleness=STALENESS)
        state = tx.init(params)

        @jax.jit
        def step(p, s):
            u, s = tx.update(jax.grad(loss)(p), s, p)
            return optax.apply_updates(p, u), s

        return step, state

    def digest(p):
        return [np.asarray(x).tolist() for x in jax.tree_util.tree_leaves(p)]
""")


def _run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # The child's temporary stores go in a directory removed when it is done (TMPDIR steers its mkdtemp).
    with tempfile.TemporaryDirectory(prefix="nsp-lifetime-") as tmp:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=tmp)
        return subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(script), *args],
                              capture_output=True, text=True, timeout=timeout, env=env)


def _crashed(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("tier", ["memory", "file"])
@pytest.mark.parametrize("staleness", [0, 1])
def test_store_dropped_with_steps_in_flight(tier, staleness):
    proc = _run("""
        kept = []

        def run(keep):
            store = open_store()
            if keep:
                kept.append(store)
            step, s = make_step(store)
            p = params
            for _ in range(3):
                p, s = step(p, s)
            return p  # without keep, the store dies here with its steps still queued

        out = {}
        for mode in ("keep", "drop_gc", "drop"):
            runs = []
            for _ in range(3):
                p = run(keep=mode == "keep")
                if mode == "drop_gc":
                    gc.collect()
                runs.append(digest(p))
            out[mode] = runs
        print("RESULT" + json.dumps(out))
    """, tier, str(staleness))
    assert proc.returncode == 0, _crashed(proc)
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    reference = out["keep"][0]
    for mode in ("keep", "drop_gc", "drop"):
        for got in out[mode]:
            for a, b in zip(got, reference):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=mode)
    # The steps moved the params: the comparison above is not between untouched copies.
    assert not np.array_equal(np.asarray(reference[1]), np.arange(2080) / 2080)
    assert "Error" not in proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize("tier", ["memory", "file"])
@pytest.mark.parametrize("staleness", [0, 1])
def test_store_closed_with_steps_in_flight(tier, staleness):
    proc = _run("""
        def run(close):
            store = open_store()
            step, s = make_step(store)
            p = params
            for _ in range(4):
                p, s = step(p, s)
            if close:
                store.close()  # the steps above may not have run yet
                assert store.version is None
            else:
                store.barrier()
            return digest(p), [int(s.count), int(s.version)]

        print("RESULT" + json.dumps({"closed": run(True), "kept": run(False)}))
    """, tier, str(staleness))
    assert proc.returncode == 0, _crashed(proc)
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["closed"] == out["kept"]


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_step_dispatched_after_close_is_a_clear_error(tier):
    proc = _run("""
        store = open_store()
        step, s = make_step(store)
        p, s = step(params, s)
        jax.block_until_ready(p)
        store.close()
        try:
            p2, s2 = step(p, s)  # compiled before the close, dispatched after it
            jax.block_until_ready(p2)
        except Exception as e:  # noqa: BLE001
            print("ERROR " + type(e).__name__ + ": " + str(e))
        else:
            print("NO ERROR")
        # A step traced after the close fails at trace time.
        try:
            make_step(store)
        except Exception as e:  # noqa: BLE001
            print("TRACE " + type(e).__name__ + ": " + str(e))
    """, tier, "0")
    assert proc.returncode == 0, _crashed(proc)
    assert "NO ERROR" not in proc.stdout
    error = [line for line in proc.stdout.splitlines() if line.startswith("ERROR ")]
    assert error and "was closed" in error[0], proc.stdout
    trace = [line for line in proc.stdout.splitlines() if line.startswith("TRACE ")]
    assert trace and "closed" in trace[0], proc.stdout


@pytest.mark.parametrize("tier", ["memory", "file"])
@pytest.mark.parametrize("staleness", [0, 1])
def test_interpreter_exit_with_steps_in_flight(tier, staleness, tmp_path):
    path = tmp_path / "store"
    proc = _run("""
        store = open_store(sys.argv[3] if TIER == "file" else None)
        step, s = make_step(store)
        p = params
        for _ in range(5):
            p, s = step(p, s)
        print("DISPATCHED", flush=True)
        # exit now: the steps are queued, the store is open
    """, tier, str(staleness), str(path))
    assert proc.returncode == 0, _crashed(proc)
    assert "DISPATCHED" in proc.stdout
    assert proc.stderr.strip() == "", proc.stderr[-4000:]
    if tier == "file":
        # Every dispatched step ran and committed before the process ended.
        check = _run("""
            store = nsp.storage.open(sys.argv[3])
            print("VERSION", store.version)
        """, tier, str(staleness), str(path))
        assert check.returncode == 0, _crashed(check)
        assert "VERSION 5" in check.stdout, check.stdout


def test_close_raises_a_background_update_failure(tmp_path):
    """A staleness-1 update that fails in the background is raised by close(), not dropped."""
    import jax
    import jax.numpy as jnp

    import nsp.storage
    from nsp.primitives import store_update

    store = nsp.storage.open(tmp_path / "store", tier="file")
    store.initialize({"w": jnp.ones(4096, jnp.float32)}, nsp.storage.OptimizerSpec("adam"), staleness=1)
    page = next((store.shard_paths[0] / "slot0" / "mu" / "c").iterdir())
    page.write_bytes(b"\0" * page.stat().st_size)  # the update reads this page and finds it corrupt
    grad = jnp.ones(store.layout.padded_total, jnp.float32)
    # Staleness 1: the call returns at once, the update fails on its background thread.
    res = store_update(store, grad, version=0, lr=1e-3, step=1)
    jax.block_until_ready(res.params)
    with pytest.raises(nsp.storage.StoreError, match="background update failed.*checksum"):
        store.close()
    assert store.version is None  # released all the same
    store.close()  # idempotent, the error is not raised twice
