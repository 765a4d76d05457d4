"""Programs written the way optax's and Flax's own examples write them, with ``optax.X(...)`` swapped for
``nsp.optim.X(..., store=...)``: what a user's code passes must mean what it means to optax."""

from __future__ import annotations

import inspect

import jax

import jax.numpy as jnp
import optax
import pytest

import nsp.optim
import nsp.storage

ALIASES = ["adam", "adamw", "sgd", "adagrad"]


@pytest.mark.parametrize("name", ALIASES)
def test_signature_matches_optax_argument_for_argument(name):
    """optax's parameters come first, in optax's order, with optax's names, kinds and defaults; nsp's own
    (``store``, ``compression``, ...) are keyword-only after them."""
    ours = list(inspect.signature(getattr(nsp.optim, name)).parameters.values())
    theirs = list(inspect.signature(getattr(optax, name)).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == \
        [(p.name, p.kind, p.default) for p in theirs]
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs):])


def _step(tx, params, grads):
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params)
    return optax.apply_updates(params, updates)


def test_adamw_positional_weight_decay_means_what_it_means_to_optax():
    """``adamw(lr, b1, b2, eps, eps_root, mu_dtype, weight_decay)``: the seventh positional argument is the
    weight decay, as in optax (it once was the fifth, where optax has eps_root)."""
    params, grads = {"w": jnp.full((8,), 2.0)}, {"w": jnp.zeros((8,))}
    store = nsp.storage.open(None, tier="memory")
    try:
        got = _step(nsp.optim.adamw(0.1, 0.9, 0.999, 1e-8, 0.0, None, 0.5, store=store), params, grads)
    finally:
        store.close()
    want = _step(optax.adamw(0.1, 0.9, 0.999, 1e-8, 0.0, None, 0.5), params, grads)
    assert float(got["w"][0]) == pytest.approx(float(want["w"][0]), rel=1e-6)
    assert float(got["w"][0]) < 2.0  # the decay acted


@pytest.mark.parametrize("call, match", [
    (lambda s: nsp.optim.adam(1e-3, eps_root=1e-8, store=s), "eps_root"),
    (lambda s: nsp.optim.adam(1e-3, mu_dtype=jnp.bfloat16, store=s), "mu_dtype"),
    (lambda s: nsp.optim.adam(1e-3, nesterov=True, store=s), "nesterov"),
    (lambda s: nsp.optim.adamw(1e-3, mask=lambda p: p, store=s), "mask"),
    (lambda s: nsp.optim.adamw(1e-3, 0.9, 0.999, 1e-8, 1e-6, store=s), "eps_root"),
    (lambda s: nsp.optim.sgd(1e-3, 0.9, False, jnp.bfloat16, store=s), "accumulator_dtype"),
])
def test_arguments_nsp_cannot_honour_fail_naming_them(call, match):
    store = nsp.storage.open(None, tier="memory")
    try:
        with pytest.raises(NotImplementedError, match=match):
            call(store)
    finally:
        store.close()


def test_arguments_at_their_defaults_or_float32_are_accepted():
    store = nsp.storage.open(None, tier="memory")
    try:
        nsp.optim.adam(1e-3, 0.9, 0.999, 1e-8, 0.0, jnp.float32, nesterov=False, store=store)
        nsp.optim.sgd(1e-3, 0.9, True, jnp.float32, store=store)
    finally:
        store.close()


def test_update_without_params_says_why_and_what_to_do():
    """optax's getting-started loop calls ``tx.update(grads, state)``; nsp needs the params and says so."""
    store = nsp.storage.open(None, tier="memory")
    try:
        tx = nsp.optim.adam(1e-3, store=store)
        params = {"w": jnp.ones(3)}
        state = tx.init(params)
        with pytest.raises(ValueError, match=r"tx.update\(grads, state, params\).*fp32 master"):
            tx.update({"w": jnp.ones(3)}, state)
    finally:
        store.close()


def test_partition_sharing_one_store_says_give_each_its_own():
    store = nsp.storage.open(None, tier="memory")
    try:
        tx = optax.partition({"a": nsp.optim.adam(1e-3, store=store), "b": nsp.optim.sgd(1e-2, store=store)},
                             {"x": "a", "y": "b"})
        with pytest.raises(nsp.storage.StoreError, match="its own store"):
            tx.init({"x": jnp.ones(3), "y": jnp.ones(5)})
    finally:
        store.close()


# ---- meshes with Explicit axes (jax.make_mesh's default), as the optax cookbook's sharded recipe writes them ----

def _sharded_run(shape, how, axis_types, staleness=0, steps=3):
    """``steps`` adam steps on replicated params under a mesh of ``shape``: nsp (``how``: "plain" -- a single-shard
    store, the optimizer swapped and nothing else; "mesh" -- the README's way, mesh= and axis_name=, one store shard
    per device of axis "data"; "topk" -- the same with Top-K) and optax; returns (nsp params, optax params,
    store updates)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    names = ("data", "model")[:len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_types,) * len(shape))
    start = {"w": jnp.arange(32.0).reshape(8, 4) / 10, "b": jnp.zeros(4)}
    grad = lambda p: jax.tree_util.tree_map(lambda x: jnp.full_like(x, 0.5) + x / 7, p)  # noqa: E731
    store = nsp.storage.open(None, tier="memory", num_shards=1 if how == "plain" else shape[0])
    kw = {} if how == "plain" else {"mesh": mesh, "axis_name": "data"}
    if how == "topk":
        kw["compression"] = nsp.optim.TopK(0.5)
    tx = nsp.optim.adam(0.1, store=store, staleness=staleness, **kw)

    def step(tx, p, s):
        u, s = tx.update(grad(p), s, p)
        return optax.apply_updates(p, u), s

    try:
        with jax.set_mesh(mesh):
            params = jax.device_put(start, NamedSharding(mesh, P()))
            state = tx.init(params)
            jitted = jax.jit(lambda p, s: step(tx, p, s))
            for _ in range(steps):
                params, state = jitted(params, state)
            params = jax.device_get(params)
        store.barrier()  # a staleness-1 step still running in the background counts once it commits
        updates = store.stats()["updates"]
    finally:
        store.close()
    ref, ostate = start, optax.adam(0.1).init(start)
    for _ in range(steps - staleness):
        ref, ostate = step(optax.adam(0.1), ref, ostate)
    return params, ref, updates


@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
@pytest.mark.parametrize("how", ["plain", "mesh"])
def test_explicit_mesh_matches_optax(shape, how):
    from jax.sharding import AxisType

    got, want, updates = _sharded_run(shape, how, AxisType.Explicit)
    for k in want:
        assert jnp.allclose(got[k], want[k], rtol=1e-5, atol=1e-5), k
    # The store is updated once a step, however many devices hold each shard (a replayed duplicate would count).
    assert updates == 3


def test_explicit_mesh_topk_and_staleness_1_run():
    from jax.sharding import AxisType

    got, _, updates = _sharded_run((2, 2), "topk", AxisType.Explicit)
    auto, _, _ = _sharded_run((2, 2), "topk", AxisType.Auto)
    for k in got:  # the same program on an Auto mesh gives the same bits
        assert jnp.array_equal(got[k], auto[k]), k
    assert updates == 3
    # staleness=1 (never replayable: a duplicated update would fail) on a single-shard store under a 2x2 mesh.
    got, _, updates = _sharded_run((2, 2), "plain", AxisType.Explicit, staleness=1)
    auto, _, _ = _sharded_run((2,), "plain", AxisType.Explicit, staleness=1)
    for k in got:
        assert jnp.array_equal(got[k], auto[k]), k
    assert updates == 3


# ---- init means a fresh state, as in optax -------------------------------------------------------------------

def test_second_init_starts_afresh():
    """The gradient-accumulation example builds two models from one optimizer: the second init must not resume the
    first model's state (the issue's reproduction: w 0.9 after a step from each init, as optax gives)."""
    p, g = {"w": jnp.ones(3)}, {"w": jnp.ones(3)}
    store = nsp.storage.open(None, tier="memory")
    try:
        tx = nsp.optim.sgd(0.1, store=store)
        s = tx.init(p)
        u, s = tx.update(g, s, p)
        assert jnp.allclose(optax.apply_updates(p, u)["w"], 0.9)
        old = s
        s = tx.init(p)
        u, s = tx.update(g, s, p)
        assert jnp.allclose(optax.apply_updates(p, u)["w"], 0.9)
        assert int(s.count) == 1
        # The state from before the second init names a version the store no longer holds: a clear error, and
        # the new state is untouched.
        with pytest.raises(Exception, match="no longer holds version"):
            tx.update(g, old, p)
        u, s = tx.update(g, s, optax.apply_updates(p, u))
        assert int(s.count) == 2
    finally:
        store.close()


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_second_init_of_adam_matches_a_fresh_store(tier, tmp_path):
    """Moments start at zero again: three steps after a second init equal three steps on a new store, bit for bit."""
    params = {"w": jnp.linspace(-1.0, 1.0, 300).reshape(30, 10), "b": jnp.zeros(10)}
    grad = lambda p: jax.tree_util.tree_map(lambda x: x * 0.3 + 0.1, p)  # noqa: E731

    def three_steps(tx, state, p):
        for _ in range(3):
            u, state = tx.update(grad(p), state, p)
            p = optax.apply_updates(p, u)
        return p

    def opened(name):
        return nsp.storage.open(str(tmp_path / name) if tier == "file" else None, tier=tier)

    reused, fresh = opened("a"), opened("b")
    try:
        tx = nsp.optim.adam(1e-2, store=reused)
        three_steps(tx, tx.init(params), params)  # a first run, then init again
        again = three_steps(tx, tx.init(params), params)
        tx2 = nsp.optim.adam(1e-2, store=fresh)
        new = three_steps(tx2, tx2.init(params), params)
    finally:
        reused.close()
        fresh.close()
    for k in params:
        assert jnp.array_equal(again[k], new[k]), k


def test_script_run_twice_on_one_store_directory_starts_afresh_and_resuming_continues(tmp_path):
    """A script run twice against the same store directory: init starts afresh (optax's meaning); resuming is
    the explicit ``nsp.optim.resuming()``."""
    path = str(tmp_path / "store")
    p, g = {"w": jnp.ones(3)}, {"w": jnp.ones(3)}

    def run(resume=False):
        store = nsp.storage.open(path, tier="file")
        try:
            tx = nsp.optim.sgd(0.1, store=store)
            if resume:
                with nsp.optim.resuming():
                    s = tx.init(p)
            else:
                s = tx.init(p)
            u, s = tx.update(g, s, p)
            return float(optax.apply_updates(p, u)["w"][0]), int(store.version)
        finally:
            store.close()

    assert run() == pytest.approx((0.9, 1))
    w, version = run()
    assert w == pytest.approx(0.9) and version == 3  # restarted as version 2, stepped to 3
    w, version = run(resume=True)
    assert version == 4  # resumed the committed version and stepped from it


def test_a_store_smaller_than_a_page_gets_a_page_of_its_size(tmp_path):
    """A few hundred params on the file tier with the default 4 MiB pages: the page shrinks to the shard (in 4 KiB
    steps), so a step moves kilobytes, not megabytes."""
    store = nsp.storage.open(str(tmp_path / "s"), tier="file")
    try:
        tx = nsp.optim.adam(1e-3, store=store)
        params = {"w": jnp.ones(300)}
        state = tx.init(params)
        assert store.layout.page_elems == 1024 and store.page_bytes == 4096
        before = store.stats()
        tx.update(params, state, params)
        after = store.stats()
        moved = after.get("internal_write_bytes", 0) - before.get("internal_write_bytes", 0)
        assert 0 < moved <= 3 * 8192, moved  # three states, a page of 4 KiB each (plus checksums)
    finally:
        store.close()
    reopened = nsp.storage.open(str(tmp_path / "s"), tier="file")  # the store's metadata agrees with its layout
    try:
        assert reopened.layout.page_elems == 1024
    finally:
        reopened.close()


def test_explicit_meshes_of_1_and_8_devices():
    """One device and eight (one axis, and 2x4), in a process of its own with eight host devices."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax.numpy as jnp
        from jax.sharding import AxisType
        import test_real_programs as t
        for shape in [(1,), (8,), (2, 4)]:
            for how in ["plain", "mesh"]:
                got, want, updates = t._sharded_run(shape, how, AxisType.Explicit)
                assert updates == 3, (shape, how, updates)
                for k in want:
                    assert jnp.allclose(got[k], want[k], rtol=1e-5, atol=1e-5), (shape, how, k)
        print("ok")
    """)
    env = dict(__import__("os").environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", code], cwd=__import__("os").path.dirname(__file__), env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
