"""One-slot stores stepped with a staged gradient (``stage_gradients``): the stage file is the redo journal's gradient.

A one-slot store's journal holds a staged gradient by reference, a checksum per page, instead of a copy: the step
syncs the stage file, and holds each window's new params back until the window is recorded. Checked here: the
steps equal a two-slot store's bit for bit (bf16 gradients, clipped as they are read); real processes killed
halfway through the journal's checksums, inside a window, between a record and its renames, and at the commit
leave version t or t+1 whole; the journal stays a few kilobytes where a copy would take the gradient's bytes; a
stage file damaged or removed under an unfinished update is refused by name, never redone wrong.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsp import storage
from nsp.primitives.staged_update import store_update_staged
from nsp.storage import OptimizerSpec, StoreError

PAGE = 4096  # 1024 fp32 elements per page
SPEC = OptimizerSpec("adamw", weight_decay=0.01)
STEPS = 3
CLIP = 20.0  # below the gradients' norm (about 64): every step is clipped as the gradient is read


def make_params():
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((40, 70)).astype(np.float32), "b": rng.standard_normal(1500).astype(np.float32)}


def grads_for(step):
    rng = np.random.default_rng(300 + step)
    return [jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16) for x in jax.tree_util.tree_leaves(make_params())]


def open_store(path, slots):
    kw = {"slots": 1, "redo_window": 2} if slots == 1 else {}
    return storage.open(path, tier="file", num_shards=1, page_bytes=PAGE, **kw)


def run_steps(store, last):
    """Steps the store from its version to `last`, each from the params the store holds (what a resumed run does)."""
    update = jax.jit(lambda g, p, v, t: store_update_staged(store, g, version=v, lr=0.01, step=t, params=p,
                                                            clip_norm=CLIP))
    params = [jnp.asarray(x, jnp.bfloat16) for x in jax.tree_util.tree_leaves(make_params())]
    outs = []
    for t in range(store.version + 1, last + 1):
        new, version = update(grads_for(t), params, t - 1, t)
        assert int(version) == t
        outs.append([np.asarray(x) for x in new])
        params = new
    return outs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Every version's p, m, v and each step's bf16 params, as a two-slot store computes them."""
    path = tmp_path_factory.mktemp("ref") / "store"
    with open_store(path, 2) as store:
        store.initialize(make_params(), SPEC)
        states = [{s: store.read(s) for s in ("param", "mu", "nu")}]
        outs = []
        for t in range(1, STEPS + 1):
            outs += run_steps(store, t)
            states.append({s: store.read(s) for s in ("param", "mu", "nu")})
    return states, outs


def assert_version_whole(store, states, version):
    for state in ("param", "mu", "nu"):
        np.testing.assert_array_equal(store.read(state), states[version][state], err_msg=f"{state} v{version}")


def test_staged_one_slot_steps_equal_two_slot_steps(tmp_path, reference):
    states, outs = reference
    with open_store(tmp_path / "s", 1) as store:
        store.initialize(make_params(), SPEC)
        assert store.layout.pages_per_shard > 2  # several windows per update
        got = run_steps(store, STEPS)
        assert_version_whole(store, states, STEPS)
        assert store.verify()["problems"] == []
    for step_got, step_ref in zip(got, outs, strict=True):
        for x, y in zip(step_got, step_ref, strict=True):
            np.testing.assert_array_equal(x, y)


WORKER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from test_oneslot_staged import open_store, run_steps
    with open_store(Path({path!r}), 1) as store:
        run_steps(store, {steps})
""")


def killed_store(tmp_path, var, at):
    path = tmp_path / "s"
    with open_store(path, 1) as store:
        store.initialize(make_params(), SPEC)
    code = WORKER.format(tests=os.path.dirname(__file__), path=str(path), steps=STEPS)
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **{var: str(at)}), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    return path


# One shard of 5 pages (4300 elements), windows of 2 pages: per step one journal, 3 windows (switches), 15 page
# writes (5 pages x 3 states).
KILLS = [
    ("NSP_DEBUG_KILL_IN_JOURNAL", 2),    # step 2, halfway through the stage file's page checksums
    ("NSP_DEBUG_KILL_AFTER_WRITES", 3),  # step 1, inside the first window
    ("NSP_DEBUG_KILL_AFTER_WRITES", 24),  # step 2, inside the second window: the first one's params are out
    ("NSP_DEBUG_KILL_AT_SWITCH", 2),     # step 1, second window recorded, its renames not done
    ("NSP_DEBUG_KILL_AT_COMMIT", 2),     # step 2, every page in, the manifest not yet
]


@pytest.mark.parametrize("var,at", KILLS)
def test_a_kill_leaves_t_or_t_plus_one_whole(tmp_path, reference, var, at):
    states, _ = reference
    path = killed_store(tmp_path, var, at)
    with open_store(path, 1) as store:  # recovery
        version = store.version
        assert_version_whole(store, states, version)
        assert store.verify()["problems"] == []
        run_steps(store, STEPS)  # and it steps on, bit for bit
        assert_version_whole(store, states, STEPS)


def test_the_journal_holds_page_checksums_not_the_gradient(tmp_path, reference):
    states, _ = reference
    path = killed_store(tmp_path, "NSP_DEBUG_KILL_AT_SWITCH", 4)  # step 2, first window recorded
    shard = path / "shards" / "00000"
    journal = (shard / "redo.journal").stat().st_size
    staged = (shard / "gradient.stage").stat().st_size
    assert staged >= (40 * 70 + 1500) * 2  # the bf16 gradient, in the stage file
    assert journal < 1024, journal  # header, 5 page checksums, one record: no copy of the gradient
    with open_store(path, 1) as store:
        assert store.version == 2
        assert_version_whole(store, states, 2)


def test_a_damaged_stage_file_is_refused_by_name(tmp_path):
    path = killed_store(tmp_path, "NSP_DEBUG_KILL_AT_SWITCH", 4)  # step 2: window 1 recorded, pages 2-4 to redo
    stage = path / "shards" / "00000" / "gradient.stage"
    data = bytearray(stage.read_bytes())
    data[2 * 1024 * 2 + 10] ^= 0x40  # a gradient byte of page 2, which recovery would redo from
    stage.write_bytes(bytes(data))
    with pytest.raises((StoreError, RuntimeError), match="does not match the redo journal .* at page 2"):
        open_store(path, 1)
    stage.unlink()
    with pytest.raises((StoreError, RuntimeError), match="gradient.stage, which holds 0 bytes"):
        open_store(path, 1)


def test_required_bytes_counts_the_stage_file_and_no_journal_copy():
    layout = storage.Layout.from_tree({"w": jax.ShapeDtypeStruct((1024, 1 << 20), jnp.float32)}, num_shards=1)
    n = layout.shard_size
    plain = storage.required_bytes(layout, SPEC, checkpoints=0, slots=1)
    staged = storage.required_bytes(layout, SPEC, checkpoints=0, slots=1, stage_itemsize=2)
    # Staged bf16: the stage file (2 bytes per element) instead of the journal's copy (4 at most), so 14 bytes
    # per parameter with the state's 12, where the unstaged bound is 16.
    assert abs(staged - (plain - 4 * n + 2 * n)) < 1 << 16  # (the journal's page checksums, whole blocks)
    assert 14 * n < staged < 14 * n + 16 * 3 * (5 << 20)  # and one window of scratch pages (16 x 3 states)
    two = storage.required_bytes(layout, SPEC, checkpoints=0)
    assert storage.required_bytes(layout, SPEC, checkpoints=0, stage_itemsize=2) == two + 2 * n  # two slots too
    with pytest.raises(ValueError, match="stage_itemsize must be"):
        storage.required_bytes(layout, SPEC, stage_itemsize=3)
